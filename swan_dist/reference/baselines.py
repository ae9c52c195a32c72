"""The reference trainer's baseline optimizers, for comparisons with SWAN: torch's AdamW
(:func:`build_adamw`, with its fastest kernel, :func:`adamw_kernel`) and torch's Muon on the matrices
SWAN would whiten with AdamW on the rest (:class:`MuonWithAdamW`, :func:`build_muon`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from swan_dist.adapter import PLAIN
from swan_dist.selection import clean_name

if TYPE_CHECKING:
    from .config import TrainConfig


def _decays(name: str, p: torch.Tensor) -> bool:
    """AdamW's weight-decay rule: matrices other than the token embedding decay; vectors never."""
    return p.ndim >= 2 and not name.startswith("tok_embeddings")


def _adamw_groups(named: Sequence[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups (named, empty ones dropped): weight decay where :func:`_decays`, none elsewhere."""
    decay = [(n, p) for n, p in named if _decays(n, p)]
    rest = [(n, p) for n, p in named if not _decays(n, p)]
    return [{"params": [p for _, p in pairs], "param_names": [n for n, _ in pairs], "weight_decay": wd}
            for pairs, wd in ((decay, weight_decay), (rest, 0.0)) if pairs]


Named = list[tuple[str, nn.Parameter]]


def muon_split(model: nn.Module, cfg: TrainConfig) -> tuple[Named, Named]:
    """``(muon, rest)``: the ``(name, parameter)`` pairs SWAN would whiten for ``cfg`` (swan_dist's own
    selection: :func:`swan_dist.param_groups` tags the model, :func:`swan_dist.classify` decides with the
    ``include``/``exclude`` patterns of ``swan_options``, as SWAN does), and everything else (embeddings,
    output head, norms, biases). A fused projection SWAN whitens per part (Q/K/V) is one matrix to Muon;
    a whitened 3-D stack (MoE experts) is refused: torch's Muon takes 2-D parameters only."""
    import swan_dist

    include, exclude = cfg.swan_options.get("include"), cfg.swan_options.get("exclude")
    (group,) = swan_dist.param_groups(model, include, exclude)
    muon, rest = [], []
    for name, p in zip(group["param_names"], group["params"]):
        rule = swan_dist.classify(name, p, include, exclude)
        if rule.use_swan and p.ndim != 2:
            raise ValueError(f"config optimizer=muon: SWAN would whiten {name} ({rule.reason}) but it is "
                             f"{p.ndim}-D and torch.optim.Muon takes 2-D matrices only; exclude it "
                             "(swan_options.exclude) or use optimizer=swan")  # fmt: skip
        (muon if rule.use_swan else rest).append((name, p))
    return muon, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """A **baseline** for comparisons, not swan_dist's product: torch's ``torch.optim.Muon`` on the 2-D
    matrices SWAN would whiten (:func:`muon_split`), torch's AdamW on the rest (embeddings, output head,
    norms), as Muon is meant to be used.

    Muon's lr is scaled with ``adjust_lr_fn="match_rms_adamw"`` (``0.2 * sqrt(max(A, B))`` per matrix,
    Moonshot's rule as torch documents it), so that its updates have AdamW's RMS and both take the same
    ``lr``: one global lr and one schedule, like SWAN's. Weight decay is decoupled on both.

    One ``torch.optim.Optimizer`` over both: its param groups (each tagged ``"optimizer": "muon"`` or
    ``"adamw"``, with that optimizer's hyper-parameters) and its ``state`` are the ones the inner
    ``Muon`` and ``AdamW`` step on, so an lr scheduler, ``zero_grad``, ``state_dict`` /
    ``load_state_dict``, the trainer's DCP checkpoints and :func:`swan_dist.memory.state_bytes` see a
    plain optimizer. Muon keeps one momentum buffer per matrix, AdamW two moments per tensor."""

    def __init__(
        self,
        muon: Sequence[tuple[str, nn.Parameter]],
        adamw_groups: Sequence[dict[str, Any]],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.95,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
    ) -> None:
        if not muon:
            raise ValueError("optimizer=muon: the model has no matrix SWAN would whiten, so nothing for Muon")
        self._muon = torch.optim.Muon(
            [{"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "optimizer": "muon"}],
            lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._adamw = None
        if adamw_groups:
            self._adamw = torch.optim.AdamW([{**g, "optimizer": "adamw"} for g in adamw_groups], lr=lr, betas=betas,
                                            weight_decay=weight_decay)  # fmt: skip
        inner = [self._muon, *([self._adamw] if self._adamw is not None else [])]
        super().__init__([g for opt in inner for g in opt.param_groups], defaults={})  # the same group dicts

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # load_state_dict replaces this optimizer's groups and state: hand the inner ones the current objects
        for kind, opt in (("muon", self._muon), ("adamw", self._adamw)):
            if opt is not None:
                opt.param_groups = [g for g in self.param_groups if g["optimizer"] == kind]
                opt.state = self.state
                opt.step()
        return loss


def build_muon(cfg: TrainConfig, model: nn.Module, lr: float) -> MuonWithAdamW:
    """The Muon baseline for ``model``: Muon on :func:`muon_split`'s matrices, AdamW (with its weight-decay
    groups) on the rest, both at ``lr``."""
    muon, rest = muon_split(model, cfg)
    return MuonWithAdamW(muon, _adamw_groups(rest, cfg.weight_decay), lr=lr, weight_decay=cfg.weight_decay)


def build_adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The AdamW baseline for ``model``: weight decay where :func:`_decays`, betas (0.9, 0.95), and torch's
    fastest kernel for its tensors (:func:`adamw_kernel`)."""
    params = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if _decays(n, p)]
    no_decay = [p for n, p in params if not _decays(n, p)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **adamw_kernel([p for _, p in params]))


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """torch's fastest AdamW implementation for these tensors, as an AdamW keyword: fused for plain
    tensors, foreach for tensor subclasses such as FSDP2's DTensors (torch's own default on the CPU is
    a loop over tensors, well behind both)."""
    plain = all(type(p) in PLAIN for p in params)
    return {"fused": True} if plain else {"foreach": True}
