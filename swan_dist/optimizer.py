"""``swan_dist.SWAN``: the SWAN optimizer as a ``torch.optim.Optimizer``.

Weight matrices chosen by :mod:`swan_dist.selection` are updated with the stateless SWAN direction
(:func:`swan_dist.functional.swan_update`) at lr·α; every other parameter takes the fallback rule at
lr: ``adamw`` (the paper's choice, two state tensors per parameter), or the stateless ``sign``
(Adam with β₁ = β₂ = 0) or ``sgd``, so a whole run can keep zero optimizer state.

Param groups are split on construction into SWAN groups (``use_swan=True``) and fallback groups
(``use_swan=False``) carrying the caller's options; torch lr schedulers scale ``lr`` in all of them.

This class holds the groups, the state and the summary; a step is a sequence of rooms (docs/engine.md):
collect this rank's pieces and their records (:mod:`.pieces`), agree with the other ranks
(:mod:`.agreement`), run the fallback rules (:mod:`.rules`), whiten and apply (:mod:`.execute`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import inflight
from .adapter import Form, Member, adapter_for, name_bare_params, optimizer_built
from .agreement import Hashes, StepAgreement, agree, gather_names, nonfinite_update, raise_rank_failure, skipped
from .execute import Plans, explain, whiten_local
from .pieces import Collector, Entry, Origin
from .presets import OPTIMIZER_KEYS, load_preset
from .routing import comm_device
from .rules import FALLBACKS, check_group, check_scalars, run_fallbacks
from .state import export_states, import_states, zero_states
from .selection import Rule, classify, param_groups, tag_model, tagged_form, tagged_name
from .summary import SummaryRow, summary_text, warn_unnamed

__all__ = ["SWAN", "FALLBACKS"]

# Hyper-parameters with a meaning independent of any preset. lr has no default without a preset.
_BASE = dict(
    alpha=1.0, whitening="nsds", ns_steps=2, beta=0.4, grad_norm="rms", whiten_dtype="auto",
    weight_decay=0.0, fallback="adamw", betas=(0.9, 0.999), eps=1e-8, nonfinite="skip", fallback_lr=None,
)
assert set(_BASE) | {"lr"} == OPTIMIZER_KEYS
_MODES = ("auto", "owner", "replicated", "local")


def _as_groups(params: Iterable[Any] | nn.Module, include: list[str], exclude: list[str]) -> list:
    """torch's ``params`` argument as SWAN's groups: a module's parameters classified by module type and
    name; bare tensors that no name reaches (alone, or in groups without names like the Trainer's
    weight-decay groups) named through the framework that owns them, where one does (DeepSpeed building
    the optimizer from its JSON's ``"type": "SWAN"``)."""
    if isinstance(params, nn.Module):
        return param_groups(params, include, exclude)
    params = [{**g, "params": [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])}
              if isinstance(g, dict) else g for g in params]
    bare = [p for p in params if isinstance(p, Tensor)] + [
        p for g in params if isinstance(g, dict) and not g.get("param_names") for p in g["params"]
        if isinstance(p, Tensor)]
    if bare and all(tagged_name(p) is None for p in bare) and (model := name_bare_params(bare)) is not None:
        tag_model(model, include, exclude)
    return params


def _defaults(preset: str | None, explicit: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(the preset's name, the groups' defaults): the base values, the preset's, the explicit arguments
    given (not None), checked."""
    defaults: dict[str, Any] = dict(_BASE)
    name = None
    if preset is not None:
        p = load_preset(preset)
        name = p["name"]
        defaults.update(p["optimizer"])
    defaults.update({k: v for k, v in explicit.items() if v is not None})
    if "lr" not in defaults:
        raise ValueError("SWAN: lr is required when no preset is given")
    defaults["betas"] = _pair(defaults["betas"])
    check_group(defaults)
    return name, defaults


def _pair(betas: Any) -> Any:
    """A list of two betas as the tuple torch's own optimizers keep (anything else is left to validation)."""
    return tuple(betas) if isinstance(betas, list) else betas


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _world(group: dist.ProcessGroup | None) -> tuple[int, dist.ProcessGroup | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, None
    return dist.get_world_size(group), group


def _mode(mode: str, world: int) -> str:
    """``auto``: owner mode when distributed, local otherwise."""
    return ("owner" if world > 1 else "local") if mode == "auto" else mode


def _exchange_device(pieces: list, group: dist.ProcessGroup | None) -> torch.device:
    """The exchange's device, from the group's real backend and the devices the pieces are on."""
    devices = list(dict.fromkeys(pc.param.device for pc in pieces))
    current = {"cuda": torch.cuda.current_device()} if torch.cuda.is_available() else {}
    return comm_device(str(dist.get_backend(group)), devices, current)


class SWAN(torch.optim.Optimizer):
    """SWAN: SGD with Whitening And Normalization (arXiv 2412.13148).

    Args:
        params: an ``nn.Module`` (parameters classified by module type and name), ``named_parameters()``,
            bare tensors, or param-group dicts. A group may set ``use_swan`` to force its rule and any
            hyper-parameter below.
        lr: global learning rate; SWAN matrices use ``lr * alpha``, fallback parameters ``lr`` (or
            ``fallback_lr``: the fallback group's starting lr, set apart; schedulers scale it from there).
        preset: ``swan_0``, ``swan_dagger``, ``swan_ddagger`` (default) or a YAML path; ``None`` for
            no preset (then ``lr`` is required). Explicit arguments override the preset.
        alpha: scale on the lr of SWAN-managed matrices.
        whitening: ``nsds`` | ``ns`` | ``none``; ``ns_steps`` and ``beta`` as in the paper's Alg. 2.
        grad_norm: ``rms`` (paper eq. 1) | ``mean`` (mean-centred) | ``none``.
        whiten_dtype: ``auto`` (bf16 NSDS on CUDA and on CPUs with native bf16, fp32 otherwise) | ``float32`` | ``bfloat16`` | ``float64``.
        weight_decay: decoupled, ``p ← p·(1 − lr_eff·wd)`` for every parameter.
        fallback: rule for parameters SWAN does not whiten: ``adamw`` | ``sign`` | ``sgd``.
        betas, eps: of the ``adamw`` fallback.
        nonfinite: ``skip`` (a parameter whose gradient has NaN/Inf is left untouched this step,
            fallback state included, and a warning names it) or ``raise`` (``FloatingPointError``
            naming the parameters, raised before anything is modified).
        include, exclude: regular expressions on parameter names forcing SWAN / the fallback.
        mode: where matrices are whitened when ``torch.distributed`` runs with world size > 1:
            ``owner`` (w/ MP: each matrix once, on one rank; the default, ``auto``), ``replicated``
            (every rank whitens every matrix: the paper's w/o MP) or ``local`` (each rank whitens what
            it holds; only for whole, replicated matrices).
        bucket_mb: bound, in MB of full fp32 matrices, of one exchange bucket (the owner's transient memory).
        process_group: the group the matrices are sharded/replicated over (default: world); with
            tensor parallelism, the whole TP x DP mesh.
        strict: raise ``ValueError`` (instead of a warning) when SWAN would whiten 2-D tensors it cannot
            name (bare ``model.parameters()``: embeddings and the output head would be whitened), or
            ends up whitening none of the 2-D tensors it was given.
        split_fused: whiten a fused projection recognised from its module type (Q, K, V of GPT-2's
            ``c_attn``, GPT-NeoX's ``query_key_value``, Phi-3's ``qkv_proj``; gate, up of a ``gate_up_proj``,
            per MoE expert too; Megatron's ``linear_qkv``/``linear_fc1``) as its separate matrices
            (``True``, the default) or whole (``False``); also a param-group option. Orientation (a weight
            stored ``(in, out)`` is whitened as its transpose) does not depend on it.
        verbose: print the start-up summary (rank 0 only).
    """

    def __init__(
        self,
        params: Iterable[Any] | nn.Module,
        lr: float | None = None,
        preset: str | None = "swan_ddagger",
        *,
        alpha: float | None = None,
        whitening: str | None = None,
        ns_steps: int | None = None,
        beta: float | None = None,
        grad_norm: str | None = None,
        whiten_dtype: str | None = None,
        weight_decay: float | None = None,
        fallback: str | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        nonfinite: str | None = None,
        fallback_lr: float | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        mode: str = "auto",
        bucket_mb: float = 256.0,
        process_group: dist.ProcessGroup | None = None,
        strict: bool = False,
        verbose: bool = True,
        split_fused: bool = True,
    ) -> None:
        self.preset, defaults = _defaults(preset, dict(
            lr=lr, alpha=alpha, whitening=whitening, ns_steps=ns_steps, beta=beta, grad_norm=grad_norm,
            whiten_dtype=whiten_dtype, weight_decay=weight_decay, fallback=fallback, betas=betas,
            eps=eps, nonfinite=nonfinite, fallback_lr=fallback_lr, split_fused=split_fused))
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < float("inf"):
            raise ValueError(f"swan_dist: bucket_mb must be a positive number of MB, got {bucket_mb!r}")
        self.mode, self.bucket_mb, self.process_group = mode, float(bucket_mb), process_group
        self._plans = Plans()  # exchanges cached per layout; never state
        self._include, self._exclude = list(include or ()), list(exclude or ())
        self._rows: list[SummaryRow] = []  # for the summary, not state
        self._forms: dict[str, Form] = {}  # SWAN matrix name -> orientation / fused split / stack (its record's)
        self._origin: list[list[Origin]] = []  # per group: the (name, parameter) it was given, held weakly
        self._packed: dict[Tensor, tuple[bool, ...]] = {}  # a tensor packing several parameters -> use_swan each
        self._agreement = StepAgreement()
        self._collector = Collector()  # pieces kept for reuse and the records, from step to step
        self._hashes = Hashes()
        self.nonfinite_skips: Counter[str] = Counter()
        self.whitened_matrices = 0  # matrices whitened so far (SWAN work done, for accounting)
        super().__init__(_as_groups(params, self._include, self._exclude), defaults)
        optimizer_built(self)
        warn_unnamed(self._rows, strict)
        if verbose and _rank0():
            print(self.summary(), flush=True)

    # torch's Optimizer pickles only defaults/state/param_groups; keep our settings too. The plan is
    # rebuilt on the next step; a process group cannot be copied (a copy uses the default group
    # until ``process_group`` is set again).
    _PICKLED = ("preset", "mode", "bucket_mb", "_include", "_exclude", "_rows", "_origin", "nonfinite_skips",
                "whitened_matrices", "_packed", "_forms")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._PICKLED})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # unpickling: absent, so defaults; torch's load_state_dict also calls this: keep what is set
        for key, make in (("process_group", lambda: None), ("_plans", Plans), ("_collector", Collector),
                          ("_hashes", Hashes), ("_forms", dict), ("_agreement", StepAgreement)):
            if key not in self.__dict__:
                self.__dict__[key] = make()
        origin = self.__dict__.get("_origin")
        if origin and any(isinstance(o, tuple) for g in origin for o in g):  # pickled (name, tensor) pairs
            self._origin = [[o if isinstance(o, Origin) else Origin(*o) for o in g] for g in origin]

    # ------------------------------------------------------------------ groups and summary
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Classify each parameter and add one SWAN and/or one fallback group with the same options."""
        group = dict(param_group)
        raw = group.pop("params")
        raw = [raw] if isinstance(raw, Tensor) else list(raw)
        names = group.pop("param_names", None)
        if raw and isinstance(raw[0], tuple):
            names, raw = [n for n, _ in raw], [p for _, p in raw]
        forced = group.pop("use_swan", None)
        for key, value in self.defaults.items():
            group.setdefault(key, value)
        group["betas"] = _pair(group["betas"])
        check_group(group)
        split: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
        for i, p in enumerate(raw):
            name = names[i] if names is not None else tagged_name(p)
            label = name if name is not None else f"<unnamed {len(self._rows)}>"
            if p.is_complex():
                raise ValueError(
                    f"swan_dist: {label!r} is complex ({p.dtype}); SWAN and its fallback rules update real tensors: "
                    "store it as a real parameter (torch.view_as_real) or give it to another optimizer")
            adapter = adapter_for(p)
            adapter.check(p, label)  # layouts no adapter supports are refused here, on every rank alike
            members = adapter.members(p, name)
            if len(members) > 1 or members[0].holder is not p:  # a tensor packing several parameters (an FSDP1
                # FlatParameter): each gets its rule; the tensor sits in the fallback group, whose rule keeps
                # state for its fallback members only
                self._packed[p] = tuple(self._rule(m.name, m.name, m, forced, group) for m in members)
                use = False
            else:
                use = self._rule(name, label, members[0], forced, group)
            split[use][0].append(p)
            split[use][1].append(label)
        for use in (True, False):
            ps, ns = split[use]
            if ps or (not raw and use):
                g = {**group, "params": ps, "use_swan": use}
                if not use and group["fallback_lr"] is not None:
                    g["lr"] = group["fallback_lr"]
                if names is not None:
                    g["param_names"] = ns
                super().add_param_group(g)
                self._origin.append([Origin(n, q) for n, q in zip(ns, ps)])

    def _rule(self, name: str | None, label: str, p: Member, forced: bool | None, group: dict) -> bool:
        """Rule of one logical parameter, recorded for the summary; True for SWAN."""
        shape = p.shape
        if forced is not None:
            rule = Rule(bool(forced), f"param group use_swan={bool(forced)}")
            if rule.use_swan and len(shape) < 2:
                raise ValueError(f"param group use_swan=True but {name or 'a parameter'} is {len(shape)}-D")
        else:
            rule = classify(name, p, self._include, self._exclude)
        split_fused = bool(group.get("split_fused", True))
        if rule.use_swan and p.parts:
            rule = Rule(True, f"{rule.reason}; " + (f"whitened as {p.parts}" if split_fused else
                                                     f"fused {p.parts} whitened whole (split_fused=False)"))
        form = tagged_form(p)
        if rule.use_swan and form is not None:
            if form.transposed or form.split or form.stack:
                self._forms[label] = form
            words = form.describe(split_fused)
            if words:
                rule = Rule(True, words if rule.reason == form.what else f"{rule.reason}; {words}")
        self._rows.append(SummaryRow(label, shape, "SWAN" if rule.use_swan else f"fallback:{group['fallback']}", rule))
        return rule.use_swan

    def summary(self) -> str:
        """Which parameters get SWAN and which the fallback rule, and why (layers collapsed to ``*``)."""
        return summary_text(self.preset, self._rows, self.param_groups, self._packed)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, every parameter's entry in its framework's layout (:func:`.state.export_states`)."""
        return export_states(super().state_dict(), self.param_groups, self._packed)

    def init_state(self) -> None:
        """Create, as a first step would, the state of every tensor whose rule keeps some (the AdamW
        fallback's moments); SWAN matrices and stateless rules get none. For frameworks that allocate
        state before loading a checkpoint into it (Megatron's ``init_state_fn``)."""
        zero_states(self.state, self.param_groups, self._packed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then each tensor's state back from its framework's layout (:func:`.state.import_states`)."""
        super().load_state_dict(state_dict)
        import_states(self.state, self.param_groups, self._packed)

    # ------------------------------------------------------------------ step
    # The step's bookkeeping is O(1) collectives and host syncs and little Python per parameter: pieces
    # that are a tensor itself are reused while the tensor keeps its storage (only the gradient views are
    # re-pointed), records and the structure/layout hashes are recomputed only when a piece or a group's
    # structure options changed, the scalar options travel as one hash inside the agreement's one
    # all_reduce, the finite checks are one foreach reduction per device and dtype, same-shape matrices
    # are GradNorm'ed, rescaled and applied as one stack, the fallback rules run torch's foreach (or, on
    # the CPU, fused) kernels.
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world, group = _world(self.process_group)
        entries: list[Entry] = []
        try:
            try:
                for g in self.param_groups:  # a scheduler or the user may have set them since
                    check_scalars(g)
                entries, failure = self._collector.collect(self, group), None
            except Exception as e:  # noqa: BLE001 - tell every rank, then all raise (no peer waits alone)
                if world == 1:
                    raise
                entries, failure = [], e
            self._step(entries, failure, world, group)
        finally:
            self._collector.release(entries)
            self._hashes.clear()
        return loss

    def _step(self, entries: list[Entry], failure: Exception | None, world: int, group) -> None:
        pieces = [e.piece for e in entries]
        device = _exchange_device(pieces, self.process_group) if world > 1 else None
        flags, key = agree(self, entries, failure, world, group, device)
        skip = skipped(entries, flags, self.nonfinite_skips)
        nonfinite: list[str] = []
        try:
            late = self._update(entries, skip, key, world, group, device, nonfinite)
        except Exception as e:  # noqa: BLE001 - e.g. the fallback rule out of memory on this rank only
            if world == 1:
                raise
            late = e
        if world == 1:
            if late is not None:
                raise late
        else:  # any rank's late failure or non-finite update reaches every rank at one more all_reduce
            status = torch.tensor([late is not None, bool(nonfinite)], dtype=torch.int32, device=device)
            before = inflight.counts(status)
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
            inflight.settle([status], before)
            failed, bad = status.tolist()
            if failed:
                raise_rank_failure(explain(late, self.bucket_mb), group)
            if bad:
                nonfinite = gather_names(nonfinite, group)
        if nonfinite:
            nonfinite_update(entries, nonfinite, self.nonfinite_skips)

    def _update(self, entries: list[Entry], skip: set[int], key: tuple | None, world: int, group,
                device: torch.device | None, nonfinite: list[str]) -> BaseException | None:
        """The fallback rules, then SWAN's matrices whitened and applied; returns what failed here at W > 1
        (the fallback, or the exchange, whose collectives all ran regardless); names of matrices whose
        update was not finite go to ``nonfinite``."""
        swan = [i for i, e in enumerate(entries) if e.record.use_swan]
        failure = None
        try:
            run_fallbacks(self.state, self.param_groups, entries, skip)
        except Exception as e:  # noqa: BLE001 - announced after the exchange, whose collectives must still run
            if world == 1:
                raise
            failure = e
        if world == 1 or _mode(self.mode, world) == "local":
            mine = [entries[i] for i in swan if i not in skip and entries[i].piece.grad is not None]
            if failure is None:
                self.whitened_matrices += whiten_local(mine, nonfinite)
            return failure
        if not swan:  # the agreed structure covers the entries: every rank returns here or none does
            return failure
        mine = [entries[i] for i in swan]
        plan = self._plans.get(key, mine, _mode(self.mode, world), self.bucket_mb, group, device)
        whitened, late = self._plans.run(plan, mine, {m for m, i in enumerate(swan) if i in skip}, device,
                                         nonfinite)
        self.whitened_matrices += whitened
        return failure or late

    # ------------------------------------------------------------------ distributed bookkeeping
    @property
    def exchange(self):
        """The :class:`~swan_dist.routing.Exchange` the last distributed step ran (its ``plan``: owners,
        buckets, ranges); ``None`` before one, or without ``torch.distributed``. Plans are cached per
        layout and are never state."""
        return self._plans.last
