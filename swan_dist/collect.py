"""Collecting this rank's :class:`~swan_dist.records.Entry` per logical parameter for a step.

A tensor packing several parameters gives one entry each; a group whose tensors a framework replaced is
adopted through the adapters. A piece that is the tensor itself (:func:`swan_dist.adapter.reusable`:
a plain tensor, or a DTensor's local shard) is kept for the next step, which reuses it (and its record)
while the tensor is in the same group under the same adapter registry with the same local storage,
shape, strides and dtype and the group's structure options are unchanged, re-pointing only its gradient
views (FSDP2 makes a new gradient DTensor every backward); anything else asks the adapter again, and
finds its record in the cache while the adapter's numbering is unchanged.

The collector's inputs are explicit (:class:`Holdings`): the optimizer owns them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .adapter import Adapter, Form, Piece, adapter_for, adopt, registry_token, repoint, reusable, tensor_key
from .records import Entry, Origin, Record, group_options, make_record
from .selection import tagged_name

__all__ = ["Collector", "Holdings", "param_name"]


@dataclass
class Holdings:
    """What an optimizer was given, as the collector reads and updates it: its param groups and state,
    per group the (name, tensor) it was given (:class:`Origin`, held weakly), the tensors packing several
    parameters (their rule each) and the SWAN matrices' forms by name."""

    groups: list[dict]
    state: dict
    origin: list[list[Origin]]
    packed: dict[Tensor, tuple[bool, ...]]
    forms: dict[str, Form]


class _Kept(NamedTuple):
    """A piece kept for reuse and what it was valid for."""

    group: dict
    registry: object
    adapter: Adapter
    key: tuple
    piece: Piece
    record: Record


def param_name(group: dict, i: int, p: Tensor) -> str:
    names = group.get("param_names")
    return names[i] if names else tagged_name(p) or f"<param {i} of shape {list(p.shape)}>"


def _dense(p: Tensor, name: str) -> None:
    if p.grad is not None and p.grad.layout is not torch.strided:
        raise ValueError(
            f"swan_dist: {name!r} has a {p.grad.layout} gradient; SWAN and its fallback rules take dense "
            "gradients: build the module with sparse=False (e.g. nn.Embedding(..., sparse=False)), or "
            "give that parameter to an optimizer for sparse gradients (torch.optim.SparseAdam)")


class Collector:
    """This rank's entries, each step (see the module docstring)."""

    def __init__(self) -> None:
        self.reuse: dict[int, _Kept] = {}  # id(tensor) -> kept piece (keyed by id: a tensor's hash is a Python call)
        self.records: dict[tuple, Record] = {}

    def record(self, pc: Piece, group: dict, forms: dict[str, Form], options: tuple) -> Record:
        key = (pc.name, pc.shape, pc.layout, pc.split, pc.param.dtype, options)
        rec = self.records.get(key)
        if rec is None:
            if len(self.records) >= 1 << 16:  # layouts that keep changing: do not grow without bound
                self.records.clear()
            rec = self.records[key] = make_record(pc, group, forms.get(pc.name) if forms else None, options)
        return rec

    def collect(self, held: Holdings, pg, only: set[int] | None = None) -> list[Entry]:
        """Every entry of ``held``'s groups, or those of the tensors whose ids are in ``only``."""
        entries: list[Entry] = []
        registry = registry_token()
        reuse = self.reuse
        kept = {} if only is None else {k: v for k, v in reuse.items() if k not in only}
        self.reuse = kept  # tensors no longer in a group are dropped
        listed = set()
        for gi, g in enumerate(held.groups):
            if id(g["params"]) in listed:  # a group listed twice in param_groups (torch's load_state_dict
                continue  # makes the copies new dicts over the same list): its tensors step once
            listed.add(id(g["params"]))
            opts = group_options(g)
            origin, params = held.origin[gi], g["params"]
            if only is not None and not any(id(p) in only for p in params):
                continue
            if len(origin) != len(params) or not all(map(operator.is_, params, (o.ref() for o in origin))):
                found, one_to_one = adopt([tuple(o) for o in origin], params, g["use_swan"], gi, pg,
                                          [o.shape for o in origin])
                if one_to_one:  # the new tensors stand for the old for good
                    self.adopt_tensors(held, gi, params)
                entries += [Entry(g, pc, self.record(pc, g, held.forms, opts)) for pc in found]
                continue
            for i, p in enumerate(params):
                if only is not None and id(p) not in only:
                    continue
                hit = reuse.get(id(p))
                if (hit is not None and hit.group is g and hit.registry is registry and hit.piece.target is p
                        and hit.record.options == opts and hit.key == tensor_key(hit.adapter, p)
                        and repoint(hit.adapter, hit.piece, p)):
                    kept[id(p)] = hit
                    entries.append(Entry(g, hit.piece, hit.record))
                else:
                    entries += self._ask(held, g, i, p, opts, registry, kept)
        return entries

    def _ask(self, held: Holdings, g: dict, i: int, p: Tensor, opts: tuple, registry, kept: dict) -> list[Entry]:
        """The adapter's pieces of tensor ``p`` (``i``-th of group ``g``), kept for reuse where they can be."""
        rules = held.packed.get(p)
        adapter = adapter_for(p)
        name = param_name(g, i, p)
        _dense(p, name)
        found = adapter.pieces(p, name, rules or (g["use_swan"],))
        if rules is None:
            rec = self.record(found[0], g, held.forms, opts)
            if reusable(adapter, p, found):
                kept[id(p)] = _Kept(g, registry, adapter, tensor_key(adapter, p), found[0], rec)
            return [Entry(g, found[0], rec)]
        swan_g = {**g, "use_swan": True}  # a packed tensor's SWAN members: this group's options, SWAN's rule
        swan_opts = group_options(swan_g)
        out = []
        for use, pc in zip(rules, found):
            sg, so = (swan_g, swan_opts) if use else (g, opts)
            out.append(Entry(sg, pc, self.record(pc, sg, held.forms, so)))
        return out

    def adopt_tensors(self, held: Holdings, gi: int, params: list[Tensor]) -> None:
        """Group ``gi``'s tensors were replaced one for one (same logical shapes): each new tensor takes its
        original's name, rule tags and fallback state (state key moved: a tensor shaped and typed like the
        new one; other state is refused, naming the parameter), and nothing here refers to the original."""
        records = []
        for o, new in zip(held.origin[gi], params):
            old = o.ref()
            if old is not None and old is not new:
                held.packed.pop(old, None)
                self.reuse.pop(id(old), None)
                st = held.state.pop(old, None)
                if st and not held.state.get(new):
                    _check_moved_state(o.name, old, new, st)
                    held.state[new] = st
            for key, value in o.tags.items():
                if getattr(new, key, None) is None:
                    setattr(new, key, value)
            records.append(Origin(o.name, new, o.shape, o.tags))
        held.origin[gi] = records

    def release(self, entries: list[Entry], everything: bool = True) -> None:
        """After a step no piece of it (``everything``: no piece kept here) holds a gradient: it is freed
        when the caller drops it."""
        for hit in self.reuse.values() if everything else ():
            hit.piece.grad = hit.piece.target_grad = None
        for e in entries:
            e.piece.grad = e.piece.target_grad = None


def _check_moved_state(name: str, old: Tensor, new: Tensor, st: dict) -> None:
    like = type(new.detach())
    bad = [k for k, v in st.items() if isinstance(v, Tensor) and k != "step"
           and (type(v.detach()) is not like or v.shape != new.shape or v.device != new.device)]
    if bad:
        raise ValueError(
            f"swan_dist: {name!r} has optimizer state {bad} shaped like the tensor it was given "
            f"({type(old.detach()).__name__} {list(old.shape)}), which a framework replaced by a "
            f"{like.__name__} {list(new.shape)} on {new.device}; load the optimizer state after the "
            "framework prepares the model (e.g. accelerator.load_state after accelerator.prepare)")
