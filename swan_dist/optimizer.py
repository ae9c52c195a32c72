"""``swan_dist.SWAN``: the SWAN optimizer as a ``torch.optim.Optimizer``.

Weight matrices chosen by :mod:`swan_dist.selection` are updated with the stateless SWAN direction
(:func:`swan_dist.functional.swan_update`) at lr·α; every other parameter takes the fallback rule at
lr: ``adamw`` (the paper's choice, two state tensors per parameter), or the stateless ``sign``
(Adam with β₁ = β₂ = 0) or ``sgd``, so a whole run can keep zero optimizer state.

Param groups are split on construction into SWAN groups (``use_swan=True``) and fallback groups
(``use_swan=False``) carrying the caller's options; torch lr schedulers scale ``lr`` in all of them.

This class holds the groups, the state and the summary; a step collects this rank's entries
(:mod:`.collect`) and hands them to the engine (:func:`swan_dist.engine.run_step`: agree, fallback rules,
whiten, apply; docs/engine.md), through its base :class:`~swan_dist.engine_side.EngineSide`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .adapter import Form, name_bare_params, optimizer_built
from .collect import Collector
from .engine import EngineMemo
from .engine_side import EngineSide
from .in_backward import InBackward, check_in_backward
from .defaults import adamw_group_decay, check_engine, rank0, resolve
from .records import Origin
from .groups import Classified, as_numbers, on_device, split_group
from .rules import FALLBACKS
from .selection import param_groups, tag_model, tagged_name
from .state import export_states, import_states, zero_states
from .steps import StepBook, group_rates
from .summary import StepRecord, SummaryRow, log_info, summary_text, warn_unnamed

__all__ = ["SWAN", "FALLBACKS", "StepRecord"]

def _as_groups(params: Iterable[Any] | nn.Module, include: list[str], exclude: list[str],
               model: nn.Module | None = None) -> list:
    """torch's ``params`` argument as SWAN's groups: a module's parameters classified by module type and
    name; bare tensors (alone, or in groups without names like an AdamW port's or the Trainer's
    weight-decay groups) named by identity against ``model`` (``SWAN(..., model=)``), else, where no name
    reaches them, through the framework that owns them, where one does (DeepSpeed building the optimizer
    from its JSON's ``"type": "SWAN"``)."""
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"swan_dist: model= is the nn.Module the parameters belong to, got {type(model).__name__}")
    if isinstance(params, nn.Module):
        if model is not None and model is not params:
            raise ValueError("swan_dist: SWAN(module, model=other) names two models; give the module alone, "
                             "SWAN(module), or its parameters with model=module")
        return param_groups(params, include, exclude)
    params = [{**g, "params": [g["params"]] if isinstance(g["params"], Tensor) else
               g["params"] if isinstance(g["params"], set) else list(g["params"])}  # a set: refused as torch does
              if isinstance(g, dict) else g for g in params]
    bare = [p for p in params if isinstance(p, Tensor)] + [
        p for g in params if isinstance(g, dict) and not g.get("param_names") for p in g["params"]
        if isinstance(p, Tensor)]
    if model is not None:  # the caller's model: its module types and names, whatever tags the tensors had
        tag_model(model, include, exclude)
    elif bare and all(tagged_name(p) is None for p in bare) and (found := name_bare_params(bare)) is not None:
        tag_model(found, include, exclude)
    return params


def _refuse_as_torch(params: Any, maximize: bool) -> None:
    """A tensor as ``params`` (torch's Optimizer: not an iterable of parameters), and ``maximize=True``."""
    if isinstance(params, Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        f"but got {torch.typename(params)}")
    if maximize is not False:
        raise ValueError(
            "swan_dist: SWAN has no maximize=True: its update is odd in the gradient (GradNorm, whitening and "
            "rescale, and each fallback rule, AdamW's included, turn a negated gradient into the exactly "
            "negated update), so maximizing f is minimizing -f: call (-f).backward() and step as usual")


class SWAN(EngineSide, torch.optim.Optimizer):
    """SWAN: SGD with Whitening And Normalization (arXiv 2412.13148).

    Args:
        params: an ``nn.Module`` (parameters classified by module type and name), ``named_parameters()``,
            bare tensors, or param-group dicts. A group may set ``use_swan`` to force its rule and any
            hyper-parameter below.
        lr: global learning rate; SWAN matrices use ``lr * alpha``, fallback parameters ``lr`` (or
            ``fallback_lr``: the fallback group's starting lr, set apart; schedulers scale it from there).
            Coming from a tuned AdamW, give ``adamw_lr`` instead. Built with ``lr * alpha`` below 2e-5 (an
            AdamW-sized ``lr``, under 4e-4 with alpha 0.05) SWAN warns once, naming ``adamw_lr``.
        adamw_lr: a tuned AdamW's lr η, converted by the lr convention (:func:`swan_dist.from_adamw`;
            docs/convergence.md, "The lr convention"): matrices at ``lr * alpha = 0.2 η``, the fallback at
            ``4 η`` (with alpha 0.05: ``lr = 4 η``, the fallback tied). With it, ``weight_decay`` (the
            argument's and param groups') is AdamW's too (SWAN applies 5x it; ``betas`` and ``eps`` carry over
            as they are). ``"auto"`` or ``"learning_rate"`` (the one a DeepSpeed JSON under the Trainer can hold): the
            ``learning_rate`` of the transformers Trainer building the optimizer. Giving ``lr`` or
            ``fallback_lr`` as well raises ``ValueError`` naming both.
        preset: ``swan_0``, ``swan_dagger``, ``swan_ddagger`` (default) or a YAML path; ``None`` for
            no preset: then ``lr`` is required and every other value is the base one, which is none of the
            paper's variants: SWAN‡'s whitening (``nsds``, 2 steps, β 0.4, ``whiten_dtype="auto"``,
            ``grad_norm="rms"``) with SWAN-0's ``alpha=1`` (matrices at ``lr`` itself), ``weight_decay=0``,
            the ``adamw`` fallback with betas (0.9, 0.999) and eps 1e-8, ``nonfinite="skip"``; no
            schedule. Explicit arguments override the preset.
        alpha: scale on the lr of SWAN-managed matrices.
        whitening: ``nsds`` | ``ns`` | ``none``; ``ns_steps`` and ``beta`` as in the paper's Alg. 2.
        grad_norm: ``rms`` (paper eq. 1) | ``mean`` (mean-centred) | ``none``.
        whiten_dtype: ``auto`` (bf16 NSDS on CUDA and on CPUs with native bf16, fp32 otherwise) | ``float32`` | ``bfloat16`` | ``float64``.
        weight_decay: decoupled, ``p ← p·(1 − lr_eff·wd)`` for every parameter.
        fallback: rule for parameters SWAN does not whiten: ``adamw`` | ``sign`` | ``sgd``.
        betas, eps: of the ``adamw`` fallback.
        nonfinite: ``skip`` (a parameter whose gradient has NaN/Inf is left untouched this step,
            fallback state included, and a warning names it), ``skip_step`` (the whole step is left out on
            every rank, as GradScaler and DeepSpeed skip a step: no parameter or state moves) or ``raise``
            (``FloatingPointError`` naming the parameters; nothing is updated). Decided on the device: in
            one process the warning and :attr:`nonfinite_skips` follow once the step's counts reach the host
            (at once on the CPU; :meth:`poll_reports` waits for them); ``raise`` reads them every step.
        include, exclude: regular expressions on parameter names forcing SWAN / the fallback.
        mode: where matrices are whitened when ``torch.distributed`` runs with world size > 1:
            ``owner`` (w/ MP: each matrix once, on one rank; the default, ``auto``), ``replicated``
            (every rank whitens every matrix: the paper's w/o MP) or ``local`` (each rank whitens what
            it holds; only for whole, replicated matrices).
        bucket_mb: bound, in MB of full fp32 matrices, of one exchange bucket (the owner's transient memory).
        exchange_dtype: the dtype gradient and update pieces travel in between a matrix's holders and its owner
            (W > 1, owner and replicated modes): ``auto`` (bf16 where the matrix is whitened in bf16, SWAN‡ on
            GPUs: what a finer dtype carries is dropped by the owner; else the parameter's dtype), ``bf16``,
            ``fp32`` or ``param`` (the parameter's dtype). Updates are applied in the parameter's dtype.
        process_group: the group the matrices are sharded/replicated over (default: world); with
            tensor parallelism, the whole TP x DP mesh.
        model: the ``nn.Module`` the parameters belong to, where ``params`` are bare tensors or param groups
            without names (an AdamW port's decay / no-decay groups): each tensor is named by identity against
            ``model.named_parameters()`` and classified by its module type (:func:`swan_dist.tag_model`), so
            embeddings and the output head take the fallback rule; the groups keep their options.
        strict: raise ``ValueError`` (instead of a warning) when SWAN would whiten 2-D tensors it cannot
            name (bare ``model.parameters()`` or groups without names and no ``model=``: embeddings and the
            output head would be whitened), or ends up whitening none of the 2-D tensors it was given.
        split_fused: whiten a fused projection recognised from its module type (Q, K, V of GPT-2's
            ``c_attn``, GPT-NeoX's ``query_key_value``, Phi-3's ``qkv_proj``; gate, up of a ``gate_up_proj``,
            per MoE expert too; Megatron's ``linear_qkv``/``linear_fc1``) as its separate matrices
            (``True``, the default) or whole (``False``); also a param-group option. Orientation (a weight
            stored ``(in, out)`` is whitened as its transpose) does not depend on it.
        verbose: log the start-up summary (rank 0 only) at INFO on the ``swan_dist`` logger; where logging
            was never configured (no handler anywhere), it is printed to stdout.
        step_in_backward: update each matrix and each fallback tensor during backward, as soon as its
            gradient is ready, and free that gradient (the paper's per-layer update: a step never holds
            every gradient). Updates happen in a backward between ``zero_grad()`` and ``step()``; ``step()``
            steps what backward left. One process, or FSDP2 / HSDP (pass the model: each FSDP module's
            parameters are stepped once reduced). Refused under DDP, DeepSpeed, FSDP1 and Megatron; global
            gradient clipping and pipeline parallelism cannot follow it (docs/optimizer.md).
        capturable: keep each param group's ``lr``, ``alpha``, ``weight_decay``, ``eps`` and both ``betas`` as
            0-d fp32 tensors on its parameters' device (torch.optim's name and meaning): an lr scheduler fills
            ``lr`` in place (torch's ``LRScheduler`` does for a tensor lr; fill the others in place too,
            ``g["weight_decay"].fill_(v)``), the step reads no option on the host and sends nothing from it, so a
            steady step in one process can be captured in a CUDA graph and replayed (docs/optimizer.md,
            "Capturing the step"). The AdamW fallback then runs in foreach ops (torch's fused kernel takes
            betas, eps and weight decay as numbers), as torch's capturable AdamW does.
        maximize: accepted as ``False`` only. Left out on purpose, as torch's ``Muon`` leaves it out: SWAN's
            update, and each fallback rule's, is exactly odd in the gradient, so ``(-loss).backward()``
            maximizes ``loss`` with the very updates a ``maximize=True`` would make, at no cost to every
            other step (docs/optimizer.md, "Maximizing").
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
        adamw_lr: float | str | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        mode: str = "auto",
        bucket_mb: float = 256.0,
        exchange_dtype: str = "auto",
        process_group: dist.ProcessGroup | None = None,
        strict: bool = False,
        verbose: bool = True,
        split_fused: bool = True,
        step_in_backward: bool = False,
        model: nn.Module | None = None,
        capturable: bool = False,
        maximize: bool = False,
    ) -> None:
        _refuse_as_torch(params, maximize)
        self.preset, defaults = resolve(preset, dict(
            lr=lr, alpha=alpha, whitening=whitening, ns_steps=ns_steps, beta=beta, grad_norm=grad_norm,
            whiten_dtype=whiten_dtype, weight_decay=weight_decay, fallback=fallback, betas=betas,
            eps=eps, nonfinite=nonfinite, fallback_lr=fallback_lr, split_fused=split_fused), adamw_lr)
        if adamw_lr is not None and not isinstance(params, nn.Module):
            params = adamw_group_decay(params)
        check_engine(mode, bucket_mb, capturable, exchange_dtype)
        self.exchange_dtype = exchange_dtype
        self.capturable = capturable  # each group's lr a 0-d tensor on its parameters' device
        self.mode, self.bucket_mb, self.process_group = mode, float(bucket_mb), process_group
        self._memos: dict[object, EngineMemo] = {}  # per set of entries stepped: agreement, hashes, plans
        self._include, self._exclude = list(include or ()), list(exclude or ())
        self._rows: list[SummaryRow] = []  # for the summary, not state
        self._forms: dict[str, Form] = {}  # SWAN matrix name -> orientation / fused split / stack (its record's)
        self._origin: list[list[Origin]] = []  # per group: the (name, parameter) it was given, held weakly
        self._packed: dict[Tensor, tuple[bool, ...]] = {}  # a tensor packing several parameters -> use_swan each
        self._collector = Collector()  # pieces kept for reuse and the records, from step to step
        self._book = StepBook()  # what the steps did: counts, the last step, reports on their way
        super().__init__(_as_groups(params, self._include, self._exclude, model), defaults)
        optimizer_built(self)
        self._in_backward: InBackward | None = None
        if step_in_backward:
            units = check_in_backward([p for g in self.param_groups for p in g["params"]],
                                      params if isinstance(params, nn.Module) else model)
            self._in_backward = InBackward(self, units)
        warn_unnamed(self._rows, strict, model is not None)
        if verbose and rank0():
            log_info(self.summary())  # the "swan_dist" logger, or stdout where logging is not configured

    # torch's Optimizer pickles only defaults/state/param_groups; keep our settings too. The plan is
    # rebuilt on the next step; a process group cannot be copied (a copy uses the default group
    # until ``process_group`` is set again).
    _PICKLED = ("preset", "mode", "bucket_mb", "exchange_dtype", "_include", "_exclude", "_rows", "_origin", "_book", "_packed",
                "_forms", "capturable")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in self._PICKLED})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.defaults.pop("differentiable", None)  # torch's adds it for its own step; SWAN's has no such option
        # unpickling: absent, so defaults; torch's load_state_dict also calls this: keep what is set
        for key, make in (("process_group", lambda: None), ("_memos", dict), ("_collector", Collector),
                          ("_forms", dict), ("_in_backward", lambda: None), ("_book", StepBook),
                          ("capturable", lambda: False), ("exchange_dtype", lambda: "auto")):
            if key not in self.__dict__:
                self.__dict__[key] = make()
        origin = self.__dict__.get("_origin")
        if origin and any(isinstance(o, tuple) for g in origin for o in g):  # pickled (name, tensor) pairs
            self._origin = [[o if isinstance(o, Origin) else Origin(*o) for o in g] for g in origin]

    # ------------------------------------------------------------------ groups and summary
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Classify each parameter and add one SWAN and/or one fallback group with the same options
        (:func:`swan_dist.groups.split_group`)."""
        seen = Classified(self._include, self._exclude, self._rows, self._forms, self._packed)
        for group, origin in split_group(param_group, self.defaults, seen, self.capturable):
            super().add_param_group(group)
            self._origin.append(origin)

    def summary(self) -> str:
        """Which parameters get SWAN and which the fallback rule, and why (layers collapsed to ``*``)."""
        return summary_text(self.preset, self._rows, self.param_groups, self._packed)

    @property
    def packs_parameters(self) -> bool:
        """Whether a tensor of its groups packs several parameters (FSDP1 FlatParameters, ``use_orig_params=False``)."""
        return bool(self._packed)

    def group_labels(self) -> list[list[str]]:
        """Each param group's labels, one per tensor of ``group["params"]``: the parameter name it was given under
        (``<unnamed i>`` where none reached SWAN)."""
        return [[o.name for o in origin] for origin in self._origin]

    def given_tensors(self) -> list[Tensor]:
        """The tensors the param groups were given, in group order, where they are still alive (a framework that
        replaced them, e.g. with its fp32 shards, may have freed them; SWAN holds them weakly)."""
        return [p for origin in self._origin for _, p in origin if p is not None]

    def given_labels(self) -> list[str]:
        """The labels of the parameters in the order SWAN was given them (the summary's rows)."""
        return [r.name for r in self._rows]

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, every parameter's entry in its framework's layout (:func:`.state.export_states`)."""
        return export_states(super().state_dict(), self.param_groups, self._packed)

    def init_state(self) -> None:
        """Create, as a first step would, the state of every tensor whose rule keeps some (the AdamW
        fallback's moments); SWAN matrices and stateless rules get none. For frameworks that allocate
        state before loading a checkpoint into it (Megatron's ``init_state_fn``)."""
        zero_states(self.state, self.param_groups, self._packed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then each tensor's state back from its framework's layout (:func:`.state.import_states`).

        Also takes the state dict of a torch ``AdamW`` (or ``Adam``) over the same parameters, to switch a
        run to SWAN: the fallback parameters keep their moments (``exp_avg``, ``exp_avg_sq``, ``step``), the
        matrices SWAN whitens drop theirs, and the param groups keep SWAN's hyper-parameters
        (:func:`swan_dist.state_from_adamw`, which says how parameters are matched)."""
        from .switch import is_adamw_state_dict, state_from_adamw

        if is_adamw_state_dict(state_dict):
            state_dict = state_from_adamw(self, state_dict)
        super().load_state_dict(state_dict)
        import_states(self.state, self.param_groups, self._packed)
        for g in self.param_groups:  # options saved either way: where this run keeps them
            g.update(on_device(g, g["params"]) if self.capturable else as_numbers(g))

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            rest = None if self._in_backward is None else self._in_backward.finish()
            if rest is None:
                self.step_entries(*self.collect_entries(), memo=self._part())
            elif rest:  # what backward left (the same on every rank)
                self.step_entries(*self.collect_entries(rest), memo="rest")
        finally:  # a step that raised is recorded too
            self._end_step()
        return loss

    def _end_step(self) -> None:
        """Close the step under way as :attr:`last_step` (:func:`swan_dist.steps.group_rates`)."""
        self._book.end_step(group_rates(self.param_groups, self._origin, self._packed))

    @property
    def last_step(self) -> StepRecord | None:
        """What the last :meth:`step` did (:class:`swan_dist.StepRecord`: ``step``, ``whitened``, ``skipped``,
        ``nonfinite``, ``update_rms``, ``fallback_lr``), for a logger: ``log(opt.last_step._asdict())``;
        ``None`` before the first step. The step itself reads nothing on the host for it: in one process
        the names of what it skipped arrive with the step's counts, copied without waiting; reading this
        waits for them where they have not landed (a host read, made when asked)."""
        return self._book.last_record()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; with ``step_in_backward=True`` the next backward updates the parameters."""
        super().zero_grad(set_to_none)
        if self._in_backward is not None:
            self._in_backward.arm()
