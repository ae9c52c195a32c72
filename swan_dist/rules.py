"""Elementwise rules: the fallback rules (``adamw``, ``sign``, ``sgd``) and the apply step of SWAN's
updates, as module-level kernels over lists of pieces (the optimizer holds groups and state and calls
them, as ``torch/optim/adam.py`` does), and the validation of a param group's options.

Each fallback rule updates its pieces' targets from their target gradients, with state where the
piece's adapter put it (``Piece.slot``): whole tensors of the target's shape, or a span of a packed
tensor's compact state. torch's foreach kernels run a rule over every piece of a kind at once (tensors
on one device and dtype, as their adapter's ``local`` gives them: a DTensor's local shard, so that no
DTensor dispatch runs per op), and on the CPU torch's fused AdamW.
"""

from __future__ import annotations

import inspect
import math
import numbers

import torch
from torch import Tensor
from torch.optim.adam import adam as _adam

# torch's functional AdamW: ``adam(..., decoupled_weight_decay=True)`` from torch 2.7 (whose ``adamw``
# then calls it), ``adamw(...)`` before (torch 2.6 has no such keyword)
if "decoupled_weight_decay" in inspect.signature(_adam).parameters:
    def _adamw_functional(*args, **kwargs) -> None:
        _adam(*args, decoupled_weight_decay=True, **kwargs)
else:  # pragma: no cover - older torch, run by launch/compat.sh
    from torch.optim.adamw import adamw as _adamw_functional

from .adapter import PLAIN, Piece, local_of
from .functional import WhitenConfig

__all__ = ["FALLBACKS", "NONFINITE", "SCALAR_KEYS", "check_group", "check_scalars", "whiten_config",
           "run_fallback", "run_fallbacks", "factors", "apply_one", "apply_many", "apply_stack", "Pending"]

FALLBACKS = ("adamw", "sign", "sgd")
NONFINITE = ("skip", "raise")
# Options a scheduler or a user may change between steps: they never rebuild a plan, and every rank
# must agree on them (checked inside the step's one collective).
SCALAR_KEYS = ("lr", "alpha", "weight_decay", "eps", "betas", "nonfinite")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def whiten_config(group: dict) -> WhitenConfig:
    return WhitenConfig(
        method=group["whitening"], steps=int(group["ns_steps"]), beta=float(group["beta"]),
        grad_norm=group["grad_norm"], dtype=group["whiten_dtype"],
    )


def _real(group: dict, key: str, low: float = 0.0, high: float = math.inf, open_high: bool = False) -> None:
    value = group[key]
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)) or (
            isinstance(value, Tensor) and (value.numel() != 1 or value.is_complex())):
        raise TypeError(f"swan_dist: {key} must be a real number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or v < low or v > high or (open_high and v >= high):
        bound = f"[{low}, {high})" if open_high else f"[{low}, {high}]" if math.isfinite(high) else f">= {low}"
        raise ValueError(f"swan_dist: {key} must be finite and {bound}, got {value!r}")


def check_scalars(group: dict) -> None:
    """Raise ``ValueError``/``TypeError`` naming the key if a scalar option is not a finite number in its
    range (lr, alpha, weight_decay, eps >= 0; each beta in [0, 1)), or ``nonfinite`` is unknown. Cheap:
    called for every group at every step, before anything is updated (a scheduler may set them)."""
    for key in ("lr", "alpha", "weight_decay", "eps"):
        _real(group, key)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"swan_dist: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _real({f"betas[{i}]": b}, f"betas[{i}]", 0.0, 1.0, open_high=True)
    if group["nonfinite"] not in NONFINITE:
        raise ValueError(f"swan_dist: nonfinite must be one of {NONFINITE}, got {group['nonfinite']!r}")


def check_group(group: dict) -> None:
    """Every option of a param group, at construction (the scalars again at every step)."""
    if isinstance(group["ns_steps"], bool) or not isinstance(group["ns_steps"], numbers.Integral):
        raise TypeError(f"swan_dist: ns_steps must be an int, got {group['ns_steps']!r}")
    _real(group, "beta")
    whiten_config(group)  # raises ValueError naming the bad value
    if group.get("fallback_lr") is not None:
        _real(group, "fallback_lr")
    if group["fallback"] not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {group['fallback']!r}")
    if not isinstance(group.get("split_fused", True), bool):
        raise ValueError(f"split_fused must be True or False, got {group['split_fused']!r}")
    check_scalars(group)


def _scalar(value: float, like: Tensor) -> float | Tensor:
    """``value`` as the scalar operand of a foreach multiply on tensors like ``like``: on the CPU a 0-d
    fp32 tensor for fp32 tensors (the same fp32 product, without the per-tensor conversion of a Python
    number, about 3x faster there); a Python float elsewhere."""
    if like.device.type == "cpu" and like.dtype == torch.float32:
        return torch.tensor(value, dtype=torch.float32)
    return value


# ------------------------------------------------------------------------------------ fallback rules
def _kinds(pieces: list[Piece]) -> list[list[Piece]]:
    """Pieces in lists a foreach kernel takes at once: same target type, device and dtype, and same
    gradient dtype, in order."""
    kinds: dict[tuple, list[Piece]] = {}
    for pc in pieces:
        t, g = pc.target, pc.target_grad
        kinds.setdefault((type(t), t.device, t.dtype, type(g), g.dtype), []).append(pc)
    return list(kinds.values())


def _adamw_state(state: dict, pc: Piece) -> tuple[Tensor, Tensor, Tensor]:
    """(exp_avg, exp_avg_sq, step) of a piece, created zero on first use."""
    s = pc.slot
    st = state[s.key]
    if s.index is None:
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(pc.target, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(pc.target, memory_format=torch.preserve_format)
        return st["exp_avg"], st["exp_avg_sq"], st["step"]
    if not st:
        st.update(step=torch.zeros(s.counts), exp_avg=s.key.new_zeros(s.size), exp_avg_sq=s.key.new_zeros(s.size))
    return st["exp_avg"][s.a:s.b], st["exp_avg_sq"][s.a:s.b], st["step"][s.index]


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


def _adamw(state: dict, group: dict, pieces: list[Piece]) -> None:
    b1, b2 = group["betas"]
    for kind in _kinds(pieces):
        m, v, st = zip(*(_adamw_state(state, pc) for pc in kind))
        targets, grads, m, v = local_of(kind[0].target, [pc.target for pc in kind],
                                        [pc.target_grad for pc in kind], m, v)
        st = list(st)
        _adamw_functional(
            targets, grads, m, v, [], st, amsgrad=False, beta1=b1, beta2=b2,
            lr=float(group["lr"]), weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
            maximize=False, **({"fused": True} if _fusable(targets, grads, m, v, st) else {"foreach": True}),
        )


def _stateless(group: dict, pieces: list[Piece], sign: bool) -> None:
    """``t ← t·(1 − lr·wd) − lr·d`` with ``d`` the gradient's sign (``sign``) or the gradient (``sgd``)."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    for kind in _kinds(pieces):
        targets, grads = local_of(kind[0].target, [pc.target for pc in kind], [pc.target_grad for pc in kind])
        if type(targets[0]) not in PLAIN or type(grads[0]) not in PLAIN:  # (a subclass: one at a time)
            for t, g in zip(targets, grads):
                if wd:
                    t.mul_(1.0 - lr * wd)
                t.add_(g.sign() if sign else g, alpha=-lr)
            continue
        if wd:
            torch._foreach_mul_(targets, _scalar(1.0 - lr * wd, targets[0]))
        torch._foreach_add_(targets, torch._foreach_sign(grads) if sign else grads, alpha=-lr)


def run_fallbacks(state: dict, groups: list[dict], entries: list, skip: set[int]) -> None:
    """Every group's fallback rule over its entries that have a gradient here and are not skipped."""
    todo: dict[int, list[Piece]] = {}  # fallback pieces per group, in group order
    for i, e in enumerate(entries):
        if not e.record.use_swan and e.piece.target_grad is not None and i not in skip:
            todo.setdefault(id(e.group), []).append(e.piece)
    for g in groups:
        if todo.get(id(g)):
            run_fallback(state, g, todo[id(g)])


def run_fallback(state: dict, group: dict, pieces: list[Piece]) -> None:
    """The group's fallback rule over its pieces (each with a gradient); AdamW keeps its state in ``state``."""
    rule = group["fallback"]
    if rule == "adamw":
        _adamw(state, group, pieces)
    else:
        _stateless(group, pieces, sign=rule == "sign")


# ------------------------------------------------------------------------------ applying SWAN updates
def factors(group: dict) -> tuple[float, float]:
    """(lr·α, 1 − lr·α·wd) of a SWAN group: ``p ← p·decay − lr·α·ΔW``."""
    lr = float(group["lr"]) * float(group["alpha"])
    return lr, 1.0 - lr * float(group["weight_decay"])


def apply_one(group: dict, param: Tensor, update: Tensor) -> None:
    lr, decay = factors(group)
    if decay != 1.0:
        param.mul_(decay)
    param.add_(update.to(param.device, param.dtype), alpha=-lr)


def apply_many(group: dict, params: list[Tensor], updates: list[Tensor]) -> None:
    """:func:`apply_one` for many same-device, same-dtype params and updates, with foreach kernels."""
    lr, decay = factors(group)
    if decay != 1.0:
        torch._foreach_mul_(params, _scalar(decay, params[0]))
    torch._foreach_add_(params, updates, alpha=-lr)


def apply_stack(groups: list[dict], params: list[Tensor], rows: Tensor) -> None:
    """Row j of ``rows`` is the flat update of ``params[j]`` (of group ``groups[j]``): applied per
    (group, device, dtype) with foreach kernels, the update cast once per stack as :func:`apply_one`
    casts each."""
    sets: dict[tuple, tuple[dict, list[int]]] = {}
    for j, (g, p) in enumerate(zip(groups, params)):
        sets.setdefault((id(g), p.device, p.dtype), (g, []))[1].append(j)
    cast: dict[tuple, Tensor] = {}
    for (_, dev, dt), (g, js) in sets.items():
        u = cast.get((dev, dt))
        if u is None:
            u = cast[(dev, dt)] = rows.to(dev, dt)
        apply_many(g, [params[j] for j in js], list(u.unbind(0)) if len(js) == len(params) else [u[j] for j in js])


class Pending:
    """Updates handed back one piece at a time, applied (as :func:`apply_one`) with foreach kernels per
    (group, device, dtype) once ``limit`` bytes of them are held, and at :meth:`flush`. Each piece
    receives one update per step, so the order is free. A piece whose update is not finite (an owner
    flags a non-finite update, or the ones it could not compute, with NaN) is not applied: its name goes
    to ``nonfinite`` (one foreach norm and one host read per flush)."""

    def __init__(self, limit: int, nonfinite: list[str]) -> None:
        self.limit, self.held, self.nonfinite = limit, 0, nonfinite
        self.sets: dict[tuple, tuple[dict, list[Tensor], list[Tensor], list[str]]] = {}

    def add(self, group: dict, param: Tensor, u: Tensor, name: str) -> None:
        dev, dt = param.device, param.dtype
        if u.dtype != dt or u.device != dev:
            u = u.to(dev, dt)
        found = self.sets.get((id(group), dev, dt))
        if found is None:
            found = self.sets[(id(group), dev, dt)] = (group, [], [], [])
        found[1].append(param)
        found[2].append(u)
        found[3].append(name)
        self.held += u.numel() * u.element_size()
        if self.held >= self.limit:
            self.flush()

    def flush(self) -> None:
        for group, params, updates, names in self.sets.values():
            sized = [j for j, u in enumerate(updates) if u.numel()]
            if sized:
                norms = torch.stack(torch._foreach_norm([updates[j] for j in sized], 2))
                if not bool(norms.isfinite().all()):
                    bad = {sized[j] for j in (~norms.isfinite()).nonzero().flatten().tolist()}
                    self.nonfinite += [names[j] for j in sorted(bad)]
                    params = [p for j, p in enumerate(params) if j not in bad]
                    updates = [u for j, u in enumerate(updates) if j not in bad]
            if params:
                apply_many(group, params, updates)
        self.sets.clear()
        self.held = 0
