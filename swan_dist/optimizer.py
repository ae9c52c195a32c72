"""``swan_dist.SWAN``: the SWAN optimizer as a ``torch.optim.Optimizer``.

Weight matrices chosen by :mod:`swan_dist.selection` are updated with the stateless SWAN direction
(:func:`swan_dist.functional.swan_update`) at lr·α; every other parameter takes the fallback rule at
lr: ``adamw`` (the paper's choice, two state tensors per parameter), or the stateless ``sign``
(Adam with β₁ = β₂ = 0) or ``sgd``, so a whole run can keep zero optimizer state.

Param groups are split on construction into SWAN groups (``use_swan=True``) and fallback groups
(``use_swan=False``) carrying the caller's options; torch lr schedulers scale ``lr`` in all of them.
"""

from __future__ import annotations

import operator
import warnings
import weakref
import zlib
from collections import Counter, defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.adam import adam as _adam_functional

from .adapter import (PLAIN, Form, Member, Piece, adapter_for, adopt, local_of, name_bare_params,
                      optimizer_built, registry_token, repoint, reusable, tensor_key)
from .functional import WhitenConfig, resolve_dtype, swan_update
from .presets import OPTIMIZER_KEYS, load_preset
from .routing import (ROW_MAJOR, Exchange, Layout, MatrixSpec, StepAgreement, build_plan, comm_device,
                      matrices_in, split_rows)
from . import selection as _selection
from .selection import Rule, classify, collapse_name, param_groups, tag_model, tagged_form, tagged_name

__all__ = ["SWAN", "FALLBACKS"]

FALLBACKS = ("adamw", "sign", "sgd")
NONFINITE = ("skip", "raise")

# Hyper-parameters with a meaning independent of any preset. lr has no default without a preset.
_BASE = dict(
    alpha=1.0, whitening="nsds", ns_steps=2, beta=0.4, grad_norm="rms", whiten_dtype="auto",
    weight_decay=0.0, fallback="adamw", betas=(0.9, 0.999), eps=1e-8, nonfinite="skip",
)
assert set(_BASE) | {"lr"} == OPTIMIZER_KEYS

# Largest stack of same-shape gradients whitened in one batched call (bounds transient memory). On the
# CPU, 16 MiB stacks of the `small` model's matrices whitened 15-25 % faster than 1 MiB ones (two threads,
# while a stack of one still ran as a batch of one); 4 MiB gave the same single-process step since
# (84.5 vs 85.2 ms, medians of four alternating runs). Work that is only memory passes (whitening
# "none", applying updates) runs in cache-sized sets instead: 16 MiB made the lean step's 64x64
# matrices 10-30 % slower.
_MAX_BATCH_BYTES = 256 << 20
_CPU_BATCH_BYTES = 16 << 20
_CPU_PASS_BYTES = 1 << 20
# The owner engine's stacks on the CPU. In replicated mode a phase holds a share of every matrix, and
# 4 MiB stacks instead of whole (shape, config) groups made the `small` model's replicated DDP step
# 10-15 % faster at W=2 (176-187 vs 205-224 ms, alternating runs: glibc faults large fresh buffers in
# again each step); owner mode's phases already keep its stacks near that size (no change measured).
_CPU_EXCHANGE_STACK_BYTES = 4 << 20
# Bytes of updates the exchange hands back that are held before they are applied together (on the CPU,
# _CPU_PASS_BYTES): a bound on what they keep alive beyond the exchange's own buffers.
_FLUSH_BYTES = 32 << 20
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _whiten_config(group: dict) -> WhitenConfig:
    return WhitenConfig(
        method=group["whitening"], steps=int(group["ns_steps"]), beta=float(group["beta"]),
        grad_norm=group["grad_norm"], dtype=group["whiten_dtype"],
    )


def _check_group(group: dict) -> None:
    _whiten_config(group)  # raises ValueError naming the bad value
    if group["fallback"] not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {group['fallback']!r}")
    if group["nonfinite"] not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}, got {group['nonfinite']!r}")
    if not isinstance(group.get("split_fused", True), bool):
        raise ValueError(f"split_fused must be True or False, got {group['split_fused']!r}")
    for key in ("lr", "alpha", "weight_decay", "eps"):
        if float(group[key]) < 0:
            raise ValueError(f"{key} must be >= 0, got {group[key]}")
    b1, b2 = group["betas"]
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {group['betas']}")


class _Pending:
    """Updates the exchange hands back one matrix at a time, applied (``p ← p·(1 − lr·α·wd) − lr·α·u``,
    as :meth:`SWAN._apply`) with foreach kernels per (group, device, dtype) once ``limit`` bytes of them
    are held, and at :meth:`flush`. Each piece receives one update per step, so the order is free."""

    def __init__(self, opt: "SWAN", limit: int) -> None:
        self.opt, self.limit, self.held = opt, limit, 0
        self.sets: dict[tuple, tuple[dict, list[Tensor], list[Tensor]]] = {}

    def add(self, group: dict, param: Tensor, u: Tensor) -> None:
        dev, dt = param.device, param.dtype
        if u.dtype != dt or u.device != dev:
            u = u.to(dev, dt)
        found = self.sets.get((id(group), dev, dt))
        if found is None:
            found = self.sets[(id(group), dev, dt)] = (group, [], [])
        found[1].append(param)
        found[2].append(u)
        self.held += u.numel() * u.element_size()
        if self.held >= self.limit:
            self.flush()

    def flush(self) -> None:
        for group, params, updates in self.sets.values():
            self.opt._apply_many(group, params, updates)
        self.sets.clear()
        self.held = 0


def _scalar(value: float, like: Tensor) -> float | Tensor:
    """``value`` as the scalar operand of a foreach multiply on tensors like ``like``: on the CPU a 0-d
    fp32 tensor for fp32 tensors (the same fp32 product, without the per-tensor conversion of a Python
    number, about 3x faster there); a Python float elsewhere."""
    if like.device.type == "cpu" and like.dtype == torch.float32:
        return torch.tensor(value, dtype=torch.float32)
    return value


class _Origin:
    """A tensor a param group was given: its name, logical shape and rule tags, and only a *weak* reference
    to it. A framework that replaces a group's tensors (Accelerate's FSDP2 preparation puts the sharded
    DTensors in ``param_groups`` and drops the full-size originals) frees them: the optimizer must not keep
    them alive. Unpacks as ``(name, tensor)``, the tensor ``None`` once nothing else holds it."""

    __slots__ = ("name", "shape", "tags", "ref")
    TAGS = _selection.TAG_ATTRS  # the tags tag_model leaves on a tensor

    def __init__(self, name: str, tensor: Tensor, shape: tuple[int, ...] | None = None,
                 tags: dict | None = None) -> None:
        self.name = name
        self.shape = tuple(adapter_for(tensor).shape(tensor)) if shape is None else tuple(shape)
        self.tags = {k: getattr(tensor, k) for k in self.TAGS if hasattr(tensor, k)} if tags is None else tags
        self.ref = weakref.ref(tensor)

    def __iter__(self):
        return iter((self.name, self.ref()))

    def __getstate__(self) -> tuple:  # pickled with the tensor (shared with param_groups in the same pickle)
        return self.name, self.shape, self.tags, self.ref()

    def __setstate__(self, state: tuple) -> None:
        self.name, self.shape, self.tags, tensor = state
        self.ref = (lambda: None) if tensor is None else weakref.ref(tensor)


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class SWAN(torch.optim.Optimizer):
    """SWAN: SGD with Whitening And Normalization (arXiv 2412.13148).

    Args:
        params: an ``nn.Module`` (parameters classified by module type and name), ``named_parameters()``,
            bare tensors, or param-group dicts. A group may set ``use_swan`` to force its rule and any
            hyper-parameter below.
        lr: global learning rate; SWAN matrices use ``lr * alpha``, fallback parameters ``lr``.
        preset: ``swan_0``, ``swan_dagger``, ``swan_ddagger`` (default) or a YAML path; ``None`` for
            no preset (then ``lr`` is required). Explicit arguments override the preset.
        alpha: scale on the lr of SWAN-managed matrices.
        whitening: ``nsds`` | ``ns`` | ``none``; ``ns_steps`` and ``beta`` as in the paper's Alg. 2.
        grad_norm: ``rms`` (paper eq. 1) | ``mean`` (mean-centred) | ``none``.
        whiten_dtype: ``auto`` (bf16 NSDS on CUDA, fp32 otherwise) | ``float32`` | ``bfloat16`` | ``float64``.
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
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        mode: str = "auto",
        bucket_mb: float = 256.0,
        process_group: dist.ProcessGroup | None = None,
        strict: bool = False,
        verbose: bool = True,
        split_fused: bool = True,
    ) -> None:
        defaults: dict[str, Any] = dict(_BASE)
        self.preset = None
        if preset is not None:
            p = load_preset(preset)
            self.preset = p["name"]
            defaults.update(p["optimizer"])
        explicit = dict(
            lr=lr, alpha=alpha, whitening=whitening, ns_steps=ns_steps, beta=beta, grad_norm=grad_norm,
            whiten_dtype=whiten_dtype, weight_decay=weight_decay, fallback=fallback, betas=betas,
            eps=eps, nonfinite=nonfinite,
        )
        defaults.update({k: v for k, v in explicit.items() if v is not None})
        if "lr" not in defaults:
            raise ValueError("SWAN: lr is required when no preset is given")
        defaults["betas"] = tuple(defaults["betas"])
        defaults["split_fused"] = split_fused
        _check_group(defaults)
        if mode not in ("auto", "owner", "replicated", "local"):
            raise ValueError(f"mode must be 'auto', 'owner', 'replicated' or 'local', got {mode!r}")
        self.mode, self.bucket_mb, self.process_group = mode, float(bucket_mb), process_group
        self._plan: Exchange | None = None  # the last plan run; plans are cached per layout, never state
        self._plans: dict[tuple, Exchange] = {}
        self._include, self._exclude = list(include or ()), list(exclude or ())
        self._rows: list[tuple[str, tuple[int, ...], str, Rule]] = []  # for the summary, not state
        self._forms: dict[str, Form] = {}  # SWAN matrix name -> orientation / fused split (see _orient)
        self._origin: list[list[_Origin]] = []  # per group: the (name, parameter) it was given, held weakly
        self._packed: dict[Tensor, tuple[bool, ...]] = {}  # a tensor packing several parameters -> use_swan each
        self._agreement = StepAgreement()
        self._reuse: dict[int, tuple] = {}  # id(tensor) -> (group, registry, tensor_key, piece): see _entries
        self._hashes: tuple | None = None  # what the last config/layout hashes were computed from, and them
        self.nonfinite_skips: Counter[str] = Counter()
        self.whitened_matrices = 0  # matrices whitened so far (SWAN work done, for accounting)
        if isinstance(params, nn.Module):
            params = param_groups(params, self._include, self._exclude)
        else:
            params = [{**g, "params": [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])}
                      if isinstance(g, dict) else g for g in params]
            # bare tensors, alone or in groups without names (Trainer's weight-decay groups)
            bare = [p for p in params if isinstance(p, Tensor)] + [
                p for g in params if isinstance(g, dict) and not g.get("param_names") for p in g["params"]
                if isinstance(p, Tensor)]
            if bare and all(tagged_name(p) is None for p in bare) and (model := name_bare_params(bare)) is not None:
                tag_model(model, self._include, self._exclude)  # e.g. built by DeepSpeed from "type": "SWAN"
        super().__init__(params, defaults)
        optimizer_built(self)
        self._warn_unnamed(strict)
        if verbose and _rank0():
            print(self.summary(), flush=True)

    def _warn_unnamed(self, strict: bool) -> None:
        """No silent whitening of what SWAN cannot name, nor a model with nothing whitened: decided from
        shapes and names every rank sees alike, before any collective."""
        unnamed = [label for label, shape, _, rule in self._rows if rule.use_swan and rule.reason.startswith("2-D tensor, name unknown")]
        chosen = ("param group", "matches exclude", "matches include")  # the user's own choice: no warning
        matrices = [row for row in self._rows if len(row[1]) == 2 and not row[3].reason.startswith(chosen)]
        msg = None
        if unnamed:
            msg = (f"swan_dist.SWAN was given {len(unnamed)} 2-D tensors without names (e.g. {unnamed[:3]}) and whitens "
                   "them all, embeddings and output head included. Pass the model, SWAN(model), or "
                   "model.named_parameters(), or call swan_dist.tag_model(model) first")
        elif matrices and not any(row[3].use_swan for row in matrices):
            msg = (f"swan_dist.SWAN whitens none of the {len(matrices)} 2-D tensors it was given (e.g. "
                   f"{[(r[0], list(r[1]), r[3].reason) for r in matrices[:3]]}); pass the model that owns them, SWAN(model)")
        if msg is None:
            return
        if strict:
            raise ValueError(msg + " (strict=True)")
        warnings.warn(msg + "; strict=True makes this an error", UserWarning, stacklevel=3)

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
        for key, default in (("process_group", None), ("_plan", None), ("_plans", {}), ("_reuse", {}),
                             ("_hashes", None), ("_forms", {})):
            self.__dict__.setdefault(key, default)
        self.__dict__.setdefault("_agreement", StepAgreement())
        origin = self.__dict__.get("_origin")
        if origin and any(isinstance(o, tuple) for g in origin for o in g):  # pickled (name, tensor) pairs
            self._origin = [[o if isinstance(o, _Origin) else _Origin(*o) for o in g] for g in origin]

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
        group["betas"] = tuple(group["betas"])
        _check_group(group)
        split: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
        for i, p in enumerate(raw):
            name = names[i] if names is not None else tagged_name(p)
            label = name if name is not None else f"<unnamed {len(self._rows)}>"
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
                if names is not None:
                    g["param_names"] = ns
                super().add_param_group(g)
                self._origin.append([_Origin(n, q) for n, q in zip(ns, ps)])

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
        self._rows.append((label, shape, "SWAN" if rule.use_swan else f"fallback:{group['fallback']}", rule))
        return rule.use_swan

    def summary(self) -> str:
        """Which parameters get SWAN and which the fallback rule, and why (layers collapsed to ``*``)."""
        rows: Counter = Counter()
        numel: defaultdict = defaultdict(int)
        for name, shape, rule_name, rule in self._rows:
            key = (rule_name, collapse_name(name), shape, rule.reason)
            rows[key] += 1
            numel[rule_name] += int(torch.Size(shape).numel())
        n_swan = sum(c for k, c in rows.items() if k[0] == "SWAN")
        head = [
            f"swan_dist.SWAN (preset={self.preset}): {n_swan} matrices whitened by SWAN, "
            f"{len(self._rows) - n_swan} tensors on the fallback rule",
        ]
        for g in self.param_groups:
            if g["use_swan"] or any(any(self._packed.get(p, ())) for p in g["params"]):
                if g["params"]:
                    dev = g["params"][0].device
                    where = f"dtype={str(resolve_dtype(_whiten_config(g), dev)).replace('torch.', '')} on {dev.type}"
                else:  # DeepSpeed ZeRO-3 empties the groups it partitions: the device is not known here
                    where = f"dtype={g['whiten_dtype']} (parameters partitioned by the framework)"
                head.append(
                    f"  SWAN group: {g['whitening']} steps={g['ns_steps']} beta={g['beta']} "
                    f"grad_norm={g['grad_norm']} {where}, lr={g['lr']} x alpha={g['alpha']}"
                )
        head += [f"  {rule}: {n:,} parameters" for rule, n in sorted(numel.items())]
        width = max((len(k[1]) for k in rows), default=10)
        body = [
            f"  {r:<16} {n:<{width}} x{c:<3} {str(list(s)):<14} {why}"
            for (r, n, s, why), c in sorted(rows.items(), key=lambda kv: (kv[0][0] != "SWAN", kv[0][1]))
        ]
        return "\n".join(head + body)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus an empty entry for every parameter without state (SWAN matrices,
        stateless fallbacks): zero bytes, but ``torch.distributed.checkpoint.set_state_dict`` in strict
        mode requires an entry for every trainable parameter. Each adapter then shows its tensors' state
        in the layout its framework's checkpoint code expects (``Adapter.export_state``)."""
        sd = super().state_dict()
        for g in sd["param_groups"]:
            for i in g["params"]:
                sd["state"].setdefault(i, {})
        stateful = {id(p) for g in self.param_groups if not g["use_swan"] and g["fallback"] == "adamw"
                    for p in g["params"]}
        i = 0
        for g in self.param_groups:
            for p in g["params"]:
                rules = self._packed.get(p, (g["use_swan"],))
                sd["state"][i] = adapter_for(p).export_state(p, sd["state"][i], rules, stateful)
                i += 1
        return sd

    def init_state(self) -> None:
        """Create, as a first step would, the state of every tensor whose rule keeps some (the AdamW
        fallback's moments); SWAN matrices and stateless rules get none. For frameworks that allocate
        state before loading a checkpoint into it (Megatron's ``init_state_fn``)."""
        for g in self.param_groups:
            if g["use_swan"] or g["fallback"] != "adamw":
                continue
            for p in g["params"]:
                st = self.state[p]
                if not st and p not in self._packed:  # a packed tensor's compact state starts at its first step
                    st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then each tensor's state back from its framework's layout (``Adapter.import_state``);
        stateless parameters keep none."""
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            for p in g["params"]:
                rules = self._packed.get(p)
                if rules is None and (g["use_swan"] or g["fallback"] != "adamw"):
                    self.state.pop(p, None)
                elif self.state.get(p):
                    self.state[p] = adapter_for(p).import_state(p, self.state[p], rules or (g["use_swan"],))
                else:  # an empty entry would only keep the tensor alive (e.g. after a framework replaced it)
                    self.state.pop(p, None)

    # ------------------------------------------------------------------ step
    # The step's bookkeeping is O(1) collectives and host syncs and little Python per parameter: pieces
    # that are a tensor itself are reused while the tensor keeps its storage (only the gradient views are
    # re-pointed), the finite checks are one foreach reduction per device and dtype, the configuration
    # and layout hashes are recomputed only when a piece, a group's options or the groups changed, same
    # shape matrices are GradNorm'ed, rescaled and applied as one stack, the fallback rules run torch's
    # foreach (or, on the CPU, fused) kernels.
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        world, group = self._world()
        entries: list[tuple[dict, Piece]] = []
        try:
            try:
                entries, failure = self._orient(self._entries(group)), None
            except (ValueError, TypeError) as e:  # a layout check failed here: tell every rank, then all raise
                if world == 1:
                    raise
                entries, failure = [], e
            self._step(entries, failure, world, group)
        finally:
            self._release(entries)
        return loss

    def _step(self, entries: list, failure: Exception | None, world: int, group) -> None:
        pieces = [pc for _, pc in entries]
        local = world == 1 or self._mode(world) == "local"
        device = self._comm_device(pieces) if world > 1 else None
        codes = self._grad_codes(pieces, device)
        if local:  # code 3: a SWAN matrix this rank holds only part of, which local mode cannot whiten
            part = [i for i, (g, pc) in enumerate(entries) if g["use_swan"] and not pc.whole]
            if part:
                codes[torch.tensor(part, device=codes.device)] = 3
        layout_key = None
        if world > 1:
            cfg_hash, layout_hash = self._hashes_of(entries, pieces)
            status, flags = self._agreement(codes, cfg_hash, layout_hash, group, failure is not None)
            if status == "failed":
                self._raise_rank_failure(failure, group)
            if status == "mismatch":
                self._raise_config_mismatch(entries, group)
            layout_key = (cfg_hash, self._agreement.layouts)
        else:
            flags = codes.tolist()
        sharded = [entries[i][1].name for i, c in enumerate(flags) if c == 3]
        if sharded:  # decided from agreed codes: every rank raises
            raise ValueError(
                f"swan_dist: {sharded[:4]} are sharded; mode='local' needs whole matrices on every rank "
                "(use mode='owner' or 'replicated')"
            )
        bad = [i for i, c in enumerate(flags) if c == 2]
        if bad:
            names = [entries[i][1].name for i in bad]
            if any(entries[i][0]["nonfinite"] == "raise" for i in bad):
                raise FloatingPointError(
                    f"SWAN: non-finite gradient in {names[:8]}{' ...' if len(names) > 8 else ''}; "
                    "no parameter was updated"
                )
            self.nonfinite_skips.update(names)
            warnings.warn(f"SWAN: non-finite gradient, update skipped for {names[:8]}", RuntimeWarning)
        skip = {i for i, c in enumerate(flags) if c != 1}  # non-finite anywhere, or no gradient anywhere
        todo: dict[int, list[Piece]] = defaultdict(list)  # fallback pieces per group, in group order
        swan: list[int] = []
        for i, (g, pc) in enumerate(entries):
            if g["use_swan"]:
                swan.append(i)
            elif pc.target_grad is not None and i not in skip:
                todo[id(g)].append(pc)
        for g in self.param_groups:
            if todo.get(id(g)):
                getattr(self, f"_fallback_{g['fallback']}")(g, todo[id(g)])
        if local:
            self._swan_local(entries, [i for i in swan if i not in skip and pieces[i].grad is not None])
        elif swan:  # the agreed config hash covers the entries: every rank takes this branch or none does
            self._swan_distributed(entries, swan, skip, layout_key, group, device)

    def _entries(self, group) -> list[tuple[dict, Piece]]:
        """(param group, this rank's piece) per logical parameter. A tensor packing several parameters
        gives one entry each; a group whose tensors a framework replaced is adopted through the adapters.

        A piece that is the tensor itself (:func:`swan_dist.adapter.reusable`) is kept for the next step,
        which reuses it while the tensor is in the same group under the same adapter registry with the
        same storage, shape, strides and dtype, re-pointing only its gradient views; anything else asks
        the adapter again."""
        entries: list[tuple[dict, Piece]] = []
        registry = registry_token()
        reuse, kept = self._reuse, {}
        self._reuse = kept  # tensors no longer in a group are dropped
        for gi, g in enumerate(self.param_groups):
            origin, params = self._origin[gi], g["params"]
            if len(origin) != len(params) or not all(map(operator.is_, params, (o.ref() for o in origin))):
                found, one_to_one = adopt([tuple(o) for o in origin], params, g["use_swan"], gi, group,
                                          [o.shape for o in origin])
                if one_to_one:  # the new tensors stand for the old for good
                    self._adopt_tensors(gi, params)
                entries += [(g, pc) for pc in found]
                continue
            swan_g = None  # this group's options, for a packed tensor's SWAN members
            for i, p in enumerate(params):
                hit = reuse.get(id(p))  # (keyed by id: a tensor's hash is a Python call; the piece holds p)
                if (hit is not None and hit[0] is g and hit[1] is registry and hit[3].target is p
                        and hit[2] == tensor_key(p) and repoint(hit[3], p)):
                    kept[id(p)] = hit
                    entries.append((g, hit[3]))
                    continue
                name = self._name(g, i, p)
                rules = self._packed.get(p)
                adapter = adapter_for(p)
                found = adapter.pieces(p, name, rules or (g["use_swan"],))
                if rules is None:
                    entries.append((g, found[0]))
                    if reusable(adapter, p, found):
                        kept[id(p)] = (g, registry, tensor_key(p), found[0])
                else:
                    if swan_g is None:
                        swan_g = {**g, "use_swan": True}
                    entries += [(swan_g if use else g, pc) for use, pc in zip(rules, found)]
        return entries

    def _orient(self, entries: list[tuple[dict, Piece]]) -> list[tuple[dict, Piece]]:
        """Each SWAN piece in the paper's orientation, with its fused parts: a matrix whose :class:`Form`
        (recognised from its module type when the optimizer was built, kept by name) says it is stored
        ``(..., in, out)`` gets the transposed canonical order (``Layout.transposed``: the adapter's ranges,
        numbered on the stored tensor, are unchanged) and its logical shape ``(..., out, in)``; its row
        pattern ``split`` unless the group says ``split_fused=False`` (then no piece is split); a 2-D
        tensor stacking ``stack`` matrices along its rows, the 3-D stack. In place and idempotent (pieces
        kept from step to step are seen again)."""
        forms = self._forms
        if not forms and all(g.get("split_fused", True) for g in self.param_groups):
            return entries  # nothing recognised, nothing to unsplit: the adapters' pieces as they are
        for g, pc in entries:
            if not g["use_swan"]:
                continue
            form = forms.get(pc.name) if forms else None
            if form is not None:
                if form.stack and len(pc.shape) == 2:  # (E·r, c) rows of E matrices: the stack (E, r, c)
                    pc.shape = (form.stack, pc.shape[0] // form.stack, pc.shape[1])
                if form.transposed and not pc.layout.transposed:
                    pc.layout = Layout(pc.layout.col_splits, True)
                    pc.shape = (*pc.shape[:-2], pc.shape[-1], pc.shape[-2])
                if form.split and pc.split != form.split:
                    pc.split = form.split
            if pc.split and not g.get("split_fused", True):
                pc.split = ()
        return entries

    def _adopt_tensors(self, gi: int, params: list[Tensor]) -> None:
        """Group ``gi``'s tensors were replaced one for one (same logical shapes): each new tensor takes its
        original's name, rule tags and fallback state (state key moved: a tensor shaped and typed like the
        new one; other state is refused, naming the parameter), and nothing here refers to the original."""
        records = []
        for o, new in zip(self._origin[gi], params):
            old = o.ref()
            if old is not None and old is not new:
                self._packed.pop(old, None)
                self._reuse.pop(id(old), None)
                st = self.state.pop(old, None)
                if st and not self.state.get(new):
                    like = type(new.detach())
                    bad = [k for k, v in st.items() if isinstance(v, Tensor) and k != "step"
                           and (type(v.detach()) is not like or v.shape != new.shape or v.device != new.device)]
                    if bad:
                        raise ValueError(
                            f"swan_dist: {o.name!r} has optimizer state {bad} shaped like the tensor it was given "
                            f"({type(old.detach()).__name__} {list(old.shape)}), which a framework replaced by a "
                            f"{like.__name__} {list(new.shape)} on {new.device}; load the optimizer state after the "
                            "framework prepares the model (e.g. accelerator.load_state after accelerator.prepare)")
                    self.state[new] = st
            for key, value in o.tags.items():
                if getattr(new, key, None) is None:
                    setattr(new, key, value)
            records.append(_Origin(o.name, new, o.shape, o.tags))
        self._origin[gi] = records

    def _release(self, entries: list) -> None:
        """After a step no piece the optimizer holds (kept for reuse, or remembered by :meth:`_hashes_of`)
        holds a gradient: it is freed when the caller drops it."""
        for hit in self._reuse.values():
            hit[3].grad = hit[3].target_grad = None
        for _, pc in entries:
            pc.grad = pc.target_grad = None

    @staticmethod
    def _name(group: dict, i: int, p: Tensor) -> str:
        names = group.get("param_names")
        return names[i] if names else tagged_name(p) or f"<param {i} of shape {list(p.shape)}>"

    @staticmethod
    def _named(group: dict) -> list[tuple[Tensor, str]]:
        return [(p, SWAN._name(group, i, p)) for i, p in enumerate(group["params"])]

    @staticmethod
    def _grad_codes(pieces: list[Piece], device: torch.device | None) -> Tensor:
        """Per piece: 0 no local gradient, 1 finite, 2 NaN/Inf, as an int32 tensor on ``device`` (the
        communication device; the CPU without one), computed without a device sync: one foreach
        reduction per device and dtype (:meth:`_finite`)."""
        out = torch.zeros(len(pieces), dtype=torch.int32, device=device or "cpu")
        by_kind: defaultdict = defaultdict(list)
        for i, pc in enumerate(pieces):
            g = pc.grad
            if g is not None:
                by_kind[(g.device, g.dtype, g.layout is torch.strided and g.numel() > 0)].append((i, g))
        for (dev, _, foreach), items in by_kind.items():
            grads = [g for _, g in items]
            # empty or sparse gradients: one check each
            finite = SWAN._finite(grads) if foreach else torch.stack([g.isfinite().all() for g in grads])
            codes = 2 - finite.to(out.device, torch.int32)
            if len(items) == len(pieces):
                return codes
            out[torch.tensor([i for i, _ in items], device=out.device)] = codes
        return out

    @staticmethod
    def _finite(grads: list[Tensor]) -> Tensor:
        """Whether each gradient (strided, non-empty, all on one device with one dtype) is all finite, as
        a bool tensor on that device. On an accelerator: one foreach max-abs reduction, which NaN and Inf
        survive and finite values never overflow; no host sync. On the CPU (where max-abs reductions are
        several times slower and a host read costs nothing): one foreach 2-norm, each norm that is not
        finite (NaN/Inf, or finite entries beyond ~1e19 whose squares overflow) checked again exactly."""
        if grads[0].device.type != "cpu":
            return torch.stack(torch._foreach_norm(grads, float("inf"))).isfinite()
        finite = torch.stack(torch._foreach_norm(grads, 2)).isfinite()
        if not bool(finite.all()):
            for j in (~finite).nonzero().flatten().tolist():
                finite[j] = grads[j].isfinite().all()
        return finite

    # ------------------------------------------------------------------ SWAN matrices
    @staticmethod
    def _factors(group: dict) -> tuple[float, float]:
        """(lr·α, 1 − lr·α·wd) of a SWAN group: ``p ← p·decay − lr·α·ΔW``."""
        lr = float(group["lr"]) * float(group["alpha"])
        return lr, 1.0 - lr * float(group["weight_decay"])

    def _apply(self, group: dict, param: Tensor, update: Tensor) -> None:
        lr, decay = self._factors(group)
        if decay != 1.0:
            param.mul_(decay)
        param.add_(update.to(param.device, param.dtype), alpha=-lr)

    def _apply_many(self, group: dict, params: list[Tensor], updates: list[Tensor]) -> None:
        """:meth:`_apply` for many same-device, same-dtype params and updates, with foreach kernels."""
        lr, decay = self._factors(group)
        if decay != 1.0:
            torch._foreach_mul_(params, _scalar(decay, params[0]))
        torch._foreach_add_(params, updates, alpha=-lr)

    def _swan_local(self, entries: list, todo: list[int]) -> None:
        """Every matrix whole on this rank: whiten here, batched over same shape and config, the updates
        applied per stack with foreach kernels."""
        batches: defaultdict = defaultdict(list)
        cfgs: dict[int, WhitenConfig] = {}
        for i in todo:
            g, pc = entries[i]
            if pc.grad.is_sparse:
                raise RuntimeError("SWAN does not support sparse gradients")
            cfg = cfgs.get(id(g))
            if cfg is None:
                cfg = cfgs[id(g)] = _whiten_config(g)
            batches[(pc.shape, pc.grad.dtype, pc.grad.device, cfg, pc.split)].append(i)
        for (shape, _, _, cfg, split), idx in batches.items():
            numel = torch.Size(shape).numel()
            cpu_bound = _CPU_PASS_BYTES if cfg.method == "none" else _CPU_BATCH_BYTES
            bound = cpu_bound if entries[idx[0]][1].grad.device.type == "cpu" else _MAX_BATCH_BYTES
            per = max(1, bound // max(1, 4 * numel))
            for k in range(0, len(idx), per):
                chunk = [entries[i] for i in idx[k : k + per]]
                plain = all(pc.layout is ROW_MAJOR or pc.layout.plain for _, pc in chunk)
                if plain:  # row-major: the flat gradients are the matrices' elements in order
                    stack = torch.stack([pc.grad for _, pc in chunk]).view(len(chunk), *shape)
                else:
                    stack = torch.stack([pc.layout.to_full(pc.grad, shape) for _, pc in chunk])
                upd = split_rows(stack, split, lambda x: swan_update(x, cfg)[0])
                if plain:
                    self._apply_stack(chunk, upd.reshape(len(chunk), numel))
                else:
                    for (g, pc), u in zip(chunk, upd):
                        self._apply(g, pc.param, pc.layout.from_full(u))
                self.whitened_matrices += len(chunk) * matrices_in(shape, split)

    def _apply_stack(self, chunk: list, rows: Tensor) -> None:
        """Row j of ``rows`` is the flat update of ``chunk[j]``'s piece: applied per (group, device, dtype)
        with foreach kernels, the update cast once per stack as :meth:`_apply` casts each."""
        sets: dict[tuple, tuple[dict, list[int]]] = {}
        for j, (g, pc) in enumerate(chunk):
            sets.setdefault((id(g), pc.param.device, pc.param.dtype), (g, []))[1].append(j)
        cast: dict[tuple, Tensor] = {}
        for (_, dev, dt), (g, js) in sets.items():
            u = cast.get((dev, dt))
            if u is None:
                u = cast[(dev, dt)] = rows.to(dev, dt)
            self._apply_many(g, [chunk[j][1].param for j in js], list(u.unbind(0)) if len(js) == len(chunk)
                             else [u[j] for j in js])

    def _swan_distributed(self, entries, swan, skip, layout_key, group, device) -> None:
        """Owner / replicated engine: whiten each matrix on its owner(s), updates back to the holders.
        Plans are cached per (config, layouts): ZeRO-3 steps each sub-group alone, each with its plan."""
        pieces = [entries[i][1] for i in swan]
        self._plan = self._plans.get(layout_key)
        if self._plan is None or self._plan.device != device:
            specs = [MatrixSpec(pc.name, pc.shape, _whiten_config(entries[i][0]), pc.layout, pc.split)
                     for i, pc in zip(swan, pieces)]
            ranges: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(ranges, [(pc.lo, pc.hi) for pc in pieces], group=group)
            plan = build_plan(specs, ranges, self._mode(len(ranges)), int(self.bucket_mb * 2**20))
            self._plan = Exchange(plan, dist.get_rank(group), group, device, [pc.param.dtype for pc in pieces],
                                  stack_bytes=_CPU_EXCHANGE_STACK_BYTES if device.type == "cpu" else None)
            if len(self._plans) >= 64:  # layouts that keep changing (re-sharding): do not grow without bound
                self._plans.clear()
            self._plans[layout_key] = self._plan
        local_skip = {m for m, i in enumerate(swan) if i in skip}
        pending = _Pending(self, _CPU_PASS_BYTES if device.type == "cpu" else _FLUSH_BYTES)

        def on_update(m: int, u: Tensor) -> None:
            pending.add(entries[swan[m]][0], pieces[m].param, u)

        self.whitened_matrices += self._plan.run([pc.grad for pc in pieces], local_skip, on_update)
        pending.flush()

    # ------------------------------------------------------------------ distributed bookkeeping
    def _world(self) -> tuple[int, dist.ProcessGroup | None]:
        if not (dist.is_available() and dist.is_initialized()):
            return 1, None
        return dist.get_world_size(self.process_group), self.process_group

    def _mode(self, world: int) -> str:
        if self.mode == "auto":
            return "owner" if world > 1 else "local"
        return self.mode

    def _comm_device(self, pieces: list[Piece]) -> torch.device:
        """The exchange's device, from the group's real backend and the devices the pieces are on."""
        devices = list(dict.fromkeys(pc.param.device for pc in pieces))
        current = {"cuda": torch.cuda.current_device()} if torch.cuda.is_available() else {}
        return comm_device(str(dist.get_backend(self.process_group)), devices, current)

    def _descriptors(self, entries: list) -> list[tuple]:
        """What every rank must agree on, per parameter (name, shape, layout, dtype, rule, hyper-parameters)."""
        keys = sorted(OPTIMIZER_KEYS) + ["use_swan", "split_fused"]
        return [
            (pc.name, pc.shape, (pc.layout.col_splits, pc.layout.transposed, pc.split), str(pc.param.dtype),
             tuple((k, repr(g.get(k))) for k in keys))
            for g, pc in entries
        ] + [("<engine>", self.mode, self.bucket_mb)]

    def _config_hash(self, entries: list) -> int:
        return zlib.crc32(repr(self._descriptors(entries)).encode())

    @staticmethod
    def _layout_hash(pieces: list[Piece]) -> int:
        return zlib.crc32(repr([(pc.lo, pc.hi) for pc in pieces]).encode())

    def _hashes_of(self, entries: list, pieces: list[Piece]) -> tuple[int, int]:
        """(:meth:`_config_hash`, :meth:`_layout_hash`), recomputed only when what they read may differ
        from the last step: another piece object in some place (pieces are immutable but for their
        gradient views), another group for some entry, or some group's options."""
        keys = sorted(OPTIMIZER_KEYS) + ["use_swan", "split_fused"]
        where: dict[int, int] = {}
        groups: list[tuple] = []
        owner = []
        for g, _ in entries:
            k = where.get(id(g))
            if k is None:
                k = where[id(g)] = len(groups)
                groups.append(tuple(repr(g.get(key)) for key in keys))
            owner.append(k)
        token = (groups, owner, self.mode, self.bucket_mb)
        last = self._hashes
        if (last is not None and last[0] == token and len(last[1]) == len(pieces)
                and all(map(operator.is_, last[1], pieces))):
            return last[2]
        hashes = self._config_hash(entries), self._layout_hash(pieces)
        self._hashes = (token, pieces, hashes)
        return hashes

    @staticmethod
    def _raise_rank_failure(failure: Exception | None, group) -> None:
        """Every rank calls this together: the first failing rank's error, raised on all."""
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, None if failure is None else (type(failure).__name__, str(failure)), group=group)
        rank, (kind, msg) = next((r, f) for r, f in enumerate(everyone) if f is not None)
        if failure is not None and rank == dist.get_rank(group):
            raise failure
        raise (TypeError if kind == "TypeError" else ValueError)(f"swan_dist: on rank {rank}: {msg}")

    def _raise_config_mismatch(self, entries: list, group) -> None:
        """Every rank calls this together (same gathered flags) and raises the same error."""
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self._descriptors(entries), group=group)
        ref = everyone[0]
        for rank, desc in enumerate(everyone):
            if len(desc) != len(ref):
                raise ValueError(f"swan_dist: rank {rank} has {len(desc) - 1} parameters, rank 0 has {len(ref) - 1}")
            for a, b in zip(ref, desc):
                if a != b:
                    diff = [k for (k, va), (_, vb) in zip(a[4], b[4]) if va != vb] if len(a) == 5 and len(b) == 5 else []
                    what = f"key(s) {diff}" if diff else f"{a[1:4]} vs {b[1:4]}"
                    raise ValueError(
                        f"swan_dist: optimizer config differs between rank 0 and rank {rank} for parameter "
                        f"{a[0]!r} vs {b[0]!r}: {what}"
                    )
        raise ValueError("swan_dist: optimizer config differs between ranks")

    # ------------------------------------------------------------------ fallback rules
    # Each updates its pieces' targets from their target gradients, with state where the piece's
    # adapter put it (``Piece.slot``): whole tensors of the target's shape, or a span of a packed
    # tensor's compact state. torch's foreach kernels run them over every piece of a kind at once
    # (tensors on one device and dtype, as their adapter's ``local`` gives them: a DTensor's local shard,
    # so that no DTensor dispatch runs per op), and on the CPU torch's fused AdamW.
    @staticmethod
    def _kinds(pieces: list[Piece]) -> list[list[Piece]]:
        """Pieces in lists a foreach kernel takes at once: same target type, device and dtype, and same
        gradient dtype, in order."""
        kinds: dict[tuple, list[Piece]] = {}
        for pc in pieces:
            t, g = pc.target, pc.target_grad
            kinds.setdefault((type(t), t.device, t.dtype, type(g), g.dtype), []).append(pc)
        return list(kinds.values())

    def _fallback_adamw(self, group: dict, pieces: list[Piece]) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for pc in pieces:
            s = pc.slot
            st = self.state[s.key]
            if s.index is None:
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(pc.target, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(pc.target, memory_format=torch.preserve_format)
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
                steps.append(st["step"])
                continue
            if not st:
                st.update(step=torch.zeros(s.counts), exp_avg=s.key.new_zeros(s.size), exp_avg_sq=s.key.new_zeros(s.size))
            exp_avgs.append(st["exp_avg"][s.a:s.b])
            exp_avg_sqs.append(st["exp_avg_sq"][s.a:s.b])
            steps.append(st["step"][s.index])
        b1, b2 = group["betas"]
        at = {id(pc): j for j, pc in enumerate(pieces)}
        for kind in self._kinds(pieces):
            js = [at[id(pc)] for pc in kind]
            targets, grads, m, v = local_of(kind[0].target, [pc.target for pc in kind],
                                            [pc.target_grad for pc in kind], [exp_avgs[j] for j in js],
                                            [exp_avg_sqs[j] for j in js])
            st = [steps[j] for j in js]
            _adam_functional(
                targets, grads, m, v, [], st, decoupled_weight_decay=True, amsgrad=False, beta1=b1, beta2=b2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                **({"fused": True} if self._fusable(targets, grads, m, v, st) else {"foreach": True}),
            )

    @staticmethod
    def _fusable(targets: list[Tensor], grads: list[Tensor], *states: list[Tensor]) -> bool:
        """torch's fused AdamW takes these: plain contiguous CPU tensors of one floating dtype, fp32 step
        counters on the same device. On accelerators the step counters live on the CPU (as torch's own
        non-fused AdamW keeps them, and as checkpoints hold them), which the fused kernel does not take:
        foreach there."""
        t0 = targets[0]
        if type(t0) not in PLAIN or t0.device.type != "cpu" or t0.dtype not in _FUSED_DTYPES:
            return False
        dtype = t0.dtype
        for t, g, m, v, s in zip(targets, grads, *states):
            if (type(g) not in PLAIN or g.dtype != dtype or m.dtype != dtype or v.dtype != dtype
                    or not isinstance(s, Tensor) or s.device.type != "cpu" or s.dtype != torch.float32
                    or not (t.is_contiguous() and g.is_contiguous() and m.is_contiguous() and v.is_contiguous())):
                return False
        return True

    def _fallback_sign(self, group: dict, pieces: list[Piece]) -> None:
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        for kind in self._kinds(pieces):
            targets, grads = local_of(kind[0].target, [pc.target for pc in kind], [pc.target_grad for pc in kind])
            if type(targets[0]) not in PLAIN or type(grads[0]) not in PLAIN:  # (a subclass: one at a time)
                for t, g in zip(targets, grads):
                    if wd:
                        t.mul_(1.0 - lr * wd)
                    t.add_(g.sign(), alpha=-lr)
                continue
            if wd:
                torch._foreach_mul_(targets, _scalar(1.0 - lr * wd, targets[0]))
            torch._foreach_add_(targets, torch._foreach_sign(grads), alpha=-lr)

    def _fallback_sgd(self, group: dict, pieces: list[Piece]) -> None:
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        for kind in self._kinds(pieces):
            targets, grads = local_of(kind[0].target, [pc.target for pc in kind], [pc.target_grad for pc in kind])
            if type(targets[0]) not in PLAIN or type(grads[0]) not in PLAIN:
                for t, g in zip(targets, grads):
                    if wd:
                        t.mul_(1.0 - lr * wd)
                    t.add_(g, alpha=-lr)
                continue
            if wd:
                torch._foreach_mul_(targets, _scalar(1.0 - lr * wd, targets[0]))
            torch._foreach_add_(targets, grads, alpha=-lr)
