"""Applying SWAN's updates: ``p ← p·(1 − lr·α·wd) − lr·α·ΔW``, with foreach kernels per stack or per
set of pieces handed back by the exchange (:class:`Pending`)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["factors", "apply_one", "apply_many", "apply_stack", "Pending", "foreach_scalar"]


def foreach_scalar(value: float, like: Tensor) -> float | Tensor:
    """``value`` as the scalar operand of a foreach multiply on tensors like ``like``: on the CPU a 0-d
    fp32 tensor for fp32 tensors (the same fp32 product, without the per-tensor conversion of a Python
    number, about 3x faster there); a Python float elsewhere."""
    if like.device.type == "cpu" and like.dtype == torch.float32:
        return torch.tensor(value, dtype=torch.float32)
    return value



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
        torch._foreach_mul_(params, foreach_scalar(decay, params[0]))
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
    receives one update per step, so the order is free. A piece whose owner's update was not finite (its
    flag; an owner that failed flags all it owed) is not applied: its name goes to ``nonfinite``."""

    def __init__(self, limit: int, nonfinite: list[str]) -> None:
        self.limit, self.held, self.nonfinite = limit, 0, nonfinite
        self.sets: dict[tuple, tuple[dict, list[Tensor], list[Tensor]]] = {}

    def add(self, group: dict, param: Tensor, u: Tensor, name: str, finite: bool) -> None:
        if not finite:
            self.nonfinite.append(name)
            return
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
            apply_many(group, params, updates)
        self.sets.clear()
        self.held = 0
