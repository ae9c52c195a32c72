"""A caller's param group as SWAN's groups (what ``SWAN.add_param_group`` does).

Each parameter is classified (SWAN or the fallback rule, and why: :func:`~swan_dist.selection.rule_of`)
and recorded for the summary; the group is split into one SWAN group (``use_swan=True``) and/or one
fallback group (``use_swan=False``), each with the caller's options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from .adapter import Form, Member, adapter_for
from .defaults import pair
from .records import Origin
from .rules import check_group
from .selection import rule_of, tagged_name
from .summary import SummaryRow

__all__ = ["Classified", "split_group", "on_device", "as_numbers", "ON_DEVICE"]

ON_DEVICE = ("lr", "alpha", "weight_decay", "eps")  # with each of ``betas``: 0-d tensors by capturable=True


@dataclass
class Classified:
    """What the classification of the optimizer's parameters recorded, group after group."""

    include: list[str]
    exclude: list[str]
    rows: list[SummaryRow] = field(default_factory=list)  # for the summary, not state
    forms: dict[str, Form] = field(default_factory=dict)  # SWAN matrix name -> orientation / fused split / stack
    packed: dict[Tensor, tuple[bool, ...]] = field(default_factory=dict)  # a tensor packing several parameters -> use_swan each

    def rule(self, name: str | None, label: str, p: Member, forced: bool | None, group: dict) -> bool:
        """Rule of one logical parameter, recorded for the summary; True for SWAN."""
        rule, form = rule_of(name, p, forced, bool(group.get("split_fused", True)), self.include, self.exclude)
        if form is not None:
            self.forms[label] = form
        self.rows.append(SummaryRow(label, p.shape, "SWAN" if rule.use_swan else f"fallback:{group['fallback']}", rule))
        return rule.use_swan


def _each_option(group: dict[str, Any], f: Callable[[Any], Any]) -> dict[str, Any]:
    """``f`` of each option of :data:`ON_DEVICE` and of each beta, as a group update."""
    return {**{key: f(group[key]) for key in ON_DEVICE}, "betas": tuple(f(b) for b in group["betas"])}


def on_device(group: dict[str, Any], params: list) -> dict[str, Any]:
    """A group's options of :data:`ON_DEVICE` and its ``betas`` as the 0-d fp32 tensors ``capturable=True``
    keeps on ``params``' device (the CPU without any): made once, then updated in place (torch's
    LRScheduler fills a tensor lr); a tensor already there is kept as it is."""
    device = params[0].device if params else torch.device("cpu")

    def held(value: Any) -> Tensor:
        if isinstance(value, Tensor):
            return value if value.device == device and value.dim() == 0 else value.detach().reshape(()).to(device, torch.float32)
        return torch.tensor(float(value), dtype=torch.float32, device=device)
    return _each_option(group, held)


def as_numbers(group: dict[str, Any]) -> dict[str, Any]:
    """The options :func:`on_device` keeps as tensors, as numbers: where an ordinary optimizer loads a
    ``capturable=True`` checkpoint (read once, at load), so that its AdamW fallback runs torch's fused kernel."""
    return _each_option(group, lambda value: float(value) if isinstance(value, Tensor) else value)


def _tensors_and_names(raw: Any, names: list | None) -> tuple[list[Tensor], list | None]:
    """A group's ``params`` (a tensor, or an ordered iterable of tensors or of ``(name, tensor)`` pairs) as
    (tensors, names or None), refused as torch's ``Optimizer.add_param_group`` refuses it."""
    if isinstance(raw, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    raw = [raw] if isinstance(raw, Tensor) else list(raw)
    pairs = [isinstance(p, tuple) for p in raw]
    if any(pairs):
        if not all(pairs):
            raise ValueError("all optimizer params should be with/without names. Some param names are missing")
        names, raw = [n for n, _ in raw], [p for _, p in raw]
    for p in raw:
        if not isinstance(p, Tensor):
            raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {torch.typename(p)}")
        if not (p.is_leaf or p.retains_grad):
            raise ValueError("can't optimize a non-leaf Tensor")
    return raw, names


def split_group(param_group: dict[str, Any], defaults: dict[str, Any], seen: Classified,
                capturable: bool) -> list[tuple[dict[str, Any], list[Origin]]]:
    """``param_group`` (its options completed from ``defaults`` and checked) as SWAN's groups, each with the
    ``(name, parameter)`` pairs it was given; its parameters classified into ``seen``."""
    group = dict(param_group)
    raw, names = _tensors_and_names(group.pop("params"), group.pop("param_names", None))
    forced = group.pop("use_swan", None)
    for key, value in defaults.items():
        group.setdefault(key, value)
    group["betas"] = pair(group["betas"])
    check_group(group)
    split: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
    for i, p in enumerate(raw):
        name = names[i] if names is not None else tagged_name(p)
        label = name if name is not None else f"<unnamed {len(seen.rows)}>"
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
            seen.packed[p] = tuple(seen.rule(m.name, m.name, m, forced, group) for m in members)
            use = False
        else:
            use = seen.rule(name, label, members[0], forced, group)
        split[use][0].append(p)
        split[use][1].append(label)
    out = []
    for use in (True, False):
        ps, ns = split[use]
        if ps or (not raw and use):
            g = {**group, "params": ps, "use_swan": use}
            if not use and group["fallback_lr"] is not None:
                g["lr"] = group["fallback_lr"]
            if capturable:
                g.update(on_device(g, ps))
            if names is not None:
                g["param_names"] = ns
            out.append((g, [Origin(n, q) for n, q in zip(ns, ps)]))
    return out
