"""Applying SWAN's updates: ``p ← p·(1 − lr·α·wd) − lr·α·ΔW``, with foreach kernels per stack or per
set of pieces handed back by the exchange (:class:`Pending`).

Which updates apply is decided on the device: each update comes with a bool flag (its gradient was
finite and its owner's update too, the step's agreement held); a flag that is off leaves the parameter
bit for bit unchanged (its update is multiplied by 0 and its decay by 1), with no host read."""

from __future__ import annotations

import torch
from torch import Tensor

from ..collectives import pick

__all__ = ["factors", "apply_one", "apply_many", "apply_stack", "Missed", "Pending", "foreach_scalar"]


def foreach_scalar(value: float, like: Tensor) -> float | Tensor:
    """``value`` as the scalar operand of a foreach multiply on tensors like ``like``: on the CPU a 0-d
    fp32 tensor for fp32 tensors (the same fp32 product, without the per-tensor conversion of a Python
    number, about 3x faster there); a Python float elsewhere."""
    if like.device.type == "cpu" and like.dtype == torch.float32:
        return torch.tensor(value, dtype=torch.float32)
    return value


def factors(group: dict) -> tuple[float | Tensor, float | Tensor | None]:
    """(lr·α, 1 − lr·α·wd) of a SWAN group: ``p ← p·decay − lr·α·ΔW``; the decay ``None`` where there is
    none. Where an option is a tensor (``capturable=True`` keeps ``lr``, ``alpha`` and ``weight_decay`` on the
    device) both are 0-d tensors, computed on the device: the step never reads them on the host."""
    lr, alpha, wd = group["lr"], group["alpha"], group["weight_decay"]
    if isinstance(lr, Tensor) or isinstance(alpha, Tensor) or isinstance(wd, Tensor):
        eff = lr * alpha if isinstance(lr, Tensor) else alpha * lr
        return eff, None if not isinstance(wd, Tensor) and wd == 0 else 1.0 - eff * wd
    eff = float(lr) * float(alpha)
    decay = 1.0 - eff * float(wd)
    return eff, None if decay == 1.0 else decay


def _scale_add(params: list[Tensor], updates: list[Tensor], eff: float | Tensor) -> None:
    """``p ← p − eff·u`` over the lists; with ``eff`` a tensor the updates are scaled in place first."""
    if isinstance(eff, Tensor):
        torch._foreach_mul_(updates, -eff.to(updates[0].device))
        torch._foreach_add_(params, updates)
    else:
        torch._foreach_add_(params, updates, alpha=-eff)


def _decay(params: list[Tensor], decay: float | Tensor) -> None:
    """``p ← p·decay`` over the lists."""
    torch._foreach_mul_(params, decay.to(params[0].device) if isinstance(decay, Tensor)
                        else foreach_scalar(decay, params[0]))


def apply_one(group: dict, param: Tensor, update: Tensor) -> None:
    eff, decay = factors(group)
    if decay is not None:
        _decay([param], decay)
    _scale_add([param], [update.to(param.device, param.dtype)], eff)


def _decay_masked(params: list[Tensor], decay: float | Tensor, ok: Tensor) -> None:
    """``p ← p·decay`` where ``ok``, unchanged elsewhere (one bool per param, on their device). fp32/fp64:
    a multiply by the factor in the parameter's precision (as the unmasked step); narrower dtypes:
    ``p + p·(decay − 1)``, the factor's rounding in that dtype costing a relative 2⁻⁹ of the decay, not of
    the weight."""
    dtype = params[0].dtype
    if isinstance(decay, Tensor):
        decay = decay.to(ok.device)
    if dtype in (torch.float32, torch.float64):
        torch._foreach_mul_(params, list(torch.where(ok, decay, 1.0).to(dtype).unbind(0)))
    else:
        torch._foreach_addcmul_(params, params, list(torch.where(ok, decay - 1.0, 0.0).to(dtype).unbind(0)))


def apply_many(group: dict, params: list[Tensor], updates: list[Tensor], ok: Tensor | None = None) -> None:
    """:func:`apply_one` for many same-device, same-dtype params and updates, with foreach kernels; with
    ``ok`` (a bool per param, on their device) only where it is set. The updates must be finite (the
    engine zeroes what is not) and may be scaled in place."""
    eff, decay = factors(group)
    if ok is not None:
        torch._foreach_mul_(updates, list(ok.to(updates[0].dtype).unbind(0)))
        if decay is not None:
            _decay_masked(params, decay, ok)
    elif decay is not None:
        _decay(params, decay)
    _scale_add(params, updates, eff)


def apply_stack(groups: list[dict], params: list[Tensor], rows: Tensor, ok: Tensor | None = None) -> None:
    """Row j of ``rows`` (finite) is the flat update of ``params[j]`` (of group ``groups[j]``): applied per
    (group, device, dtype) with foreach kernels, the update cast once per stack as :func:`apply_one`
    casts each; with ``ok`` (a bool per row) only the rows where it is set. ``rows`` may be scaled in
    place."""
    sets: dict[tuple, tuple[dict, list[int]]] = {}
    for j, (g, p) in enumerate(zip(groups, params)):
        sets.setdefault((id(g), p.device, p.dtype), (g, []))[1].append(j)
    if ok is not None:  # rows are finite (the compute zeroes what is not): x 1 or x 0, a multiply (a broadcast
        # masked_fill is several times slower on the CPU)
        rows = rows.mul_(ok.to(rows.device, rows.dtype).reshape(-1, *(1,) * (rows.dim() - 1)))
    cast: dict[tuple, Tensor] = {}
    for (_, dev, dt), (g, js) in sets.items():
        u = cast.get((dev, dt))
        if u is None:
            u = cast[(dev, dt)] = rows.to(dev, dt)
        whole = len(js) == len(params)
        mask = None if ok is None else (ok if whole else pick(ok, js)).to(dev)
        eff, decay = factors(g)
        ps = [params[j] for j in js]
        if mask is not None and decay is not None:
            _decay_masked(ps, decay, mask)
        elif decay is not None:
            _decay(ps, decay)
        _scale_add(ps, list(u.unbind(0)) if whole else [u[j] for j in js], eff)


class Missed:
    """The matrices of a step whose update was wanted but came out non-finite, as bool tensors on the
    device: counted without a host read (:meth:`count`), named by reading them (:meth:`names`, asked only
    where a step's status says there were some)."""

    def __init__(self) -> None:
        self.parts: list[tuple[list[str], Tensor]] = []

    def add(self, names: list[str], bad: Tensor) -> None:
        self.parts.append((names, bad.reshape(-1)))

    def count(self, device: torch.device) -> Tensor:
        if not self.parts:
            return torch.zeros((), dtype=torch.int32, device=device)
        return torch.cat([b.to(device) for _, b in self.parts]).sum(dtype=torch.int32)

    def names(self) -> list[str]:
        if not self.parts:
            return []
        bad = torch.cat([b.to(self.parts[0][1].device) for _, b in self.parts]).tolist()
        return list(dict.fromkeys(n for n, b in zip((n for ns, _ in self.parts for n in ns), bad) if b))


class Pending:
    """Updates handed back one piece at a time, applied (as :func:`apply_one`) with foreach kernels per
    (group, device, dtype) once ``limit`` bytes of them are held, and at :meth:`flush`. Each piece
    receives one update per step, so the order is free. Each piece comes with two 0-d bools on the device:
    ``finite`` (its owner's update came out finite) and ``wanted`` (the step applies its matrix: a finite
    gradient, the step's agreement held); it is applied where both are set, and counted in ``missed``
    where it was wanted but not finite. The flags are combined per flush, a few kernels for all pieces."""

    def __init__(self, limit: int, missed: Missed) -> None:
        self.limit, self.held, self.missed = limit, 0, missed
        self.sets: dict[tuple, tuple[dict, list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[str]]] = {}

    def add(self, group: dict, param: Tensor, u: Tensor, name: str, finite: Tensor, wanted: Tensor) -> None:
        dev, dt = param.device, param.dtype
        if u.dtype != dt or u.device != dev:
            u = u.to(dev, dt)
        found = self.sets.get((id(group), dev, dt))
        if found is None:
            found = self.sets[(id(group), dev, dt)] = (group, [], [], [], [], [])
        for xs, x in zip(found[1:], (param, u, finite, wanted, name)):
            xs.append(x)
        self.held += u.numel() * u.element_size()
        if self.held >= self.limit:
            self.flush()

    def flush(self) -> None:
        for group, params, updates, finite, wanted, names in self.sets.values():
            dev = params[0].device
            finite, wanted = torch.stack(finite).to(dev), torch.stack(wanted).to(dev)
            self.missed.add(names, wanted & ~finite)
            apply_many(group, params, updates, finite & wanted)
        self.sets.clear()
        self.held = 0
