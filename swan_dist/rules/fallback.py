"""The fallback rules (``adamw``, ``sign``, ``sgd``) as module-level kernels over lists of pieces (the
optimizer holds groups and state and calls them, as ``torch/optim/adam.py`` does).

Each rule updates its pieces' targets from their target gradients, with state where the piece's adapter
put it (``Piece.slot``): whole tensors of the target's shape, or a span of a packed tensor's compact
state. torch's foreach kernels run a rule over every piece of a kind at once (tensors on one device and
dtype, as their adapter's ``local`` gives them: a DTensor's local shard, so that no DTensor dispatch runs
per op), and on the CPU torch's fused AdamW.
"""

from __future__ import annotations

import inspect

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

from ..adapter import PLAIN, Piece, local_of
from .apply import foreach_scalar

__all__ = ["run_fallback", "run_fallbacks"]

_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


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
            torch._foreach_mul_(targets, foreach_scalar(1.0 - lr * wd, targets[0]))
        if not sign:
            torch._foreach_add_(targets, grads, alpha=-lr)
            continue
        budget = _SIGN_CPU_BYTES if grads[0].device.type == "cpu" else _SIGN_BYTES
        for ts, gs in _chunks(targets, grads, budget):  # the signs made at most ``budget`` bytes at a time
            torch._foreach_add_(ts, torch._foreach_sign(gs), alpha=-lr)


# The sign rule's signs are new tensors: made and applied in chunks of at most this many bytes (the bounds
# of the whitening's stacks, swan_dist/whitening.py), a gradient larger than that in flat slices.
_SIGN_CPU_BYTES = 16 << 20
_SIGN_BYTES = 256 << 20


def _chunks(targets: list[Tensor], grads: list[Tensor], budget: int):
    """``(targets, grads)`` lists, in order, whose gradients hold at most ``budget`` bytes together (or one
    tensor that cannot be sliced); a contiguous gradient larger than ``budget`` comes as flat slices of it
    and its target. Elementwise rules give the same result per element however the tensors are cut."""
    ts: list[Tensor] = []
    gs: list[Tensor] = []
    held = 0
    for t, g in zip(targets, grads):
        size = g.numel() * g.element_size()
        if size > budget and t.shape == g.shape and t.is_contiguous() and g.is_contiguous():
            step = max(1, budget // g.element_size())
            tf, gf = t.view(-1), g.view(-1)
            parts = [(tf[a: a + step], gf[a: a + step]) for a in range(0, g.numel(), step)]
        else:
            parts = [(t, g)]
        for pt, pg in parts:
            size = pg.numel() * pg.element_size()
            if ts and held + size > budget:
                yield ts, gs
                ts, gs, held = [], [], 0
            ts.append(pt)
            gs.append(pg)
            held += size
    if ts:
        yield ts, gs


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

