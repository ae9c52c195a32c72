"""Collecting this rank's pieces for a step, and the one immutable :class:`Record` per logical parameter.

A :class:`swan_dist.adapter.Piece` is the adapter's answer for one step: its range ``[lo, hi)`` and
views of the tensor and gradient (plus the adapter's own numbering: stored shape, layout, fused split).
A :class:`Record` is what the engine computes with: the logical matrix in the paper's orientation
(transposed or stacked as its :class:`~swan_dist.adapter.Form` says, fused parts split unless the group
says ``split_fused=False``), its dtype, its rule and the group options that shape the computation. It
is built once per parameter and reused while the adapter's numbering and those options stay the same;
scalar options (``lr``, ``alpha``, ...) are not in it, so a scheduler changes no record and no plan.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from . import selection as _selection
from .adapter import Form, Piece, adapter_for, adopt, registry_token, repoint, reusable, tensor_key
from .functional import WhitenConfig
from .routing import Layout
from .rules import whiten_config
from .selection import tagged_name

__all__ = ["Origin", "Record", "Entry", "Collector", "STRUCTURE_KEYS"]

# Group options a record depends on: they change the computation's shape, dtype or rule, and so the plan.
STRUCTURE_KEYS = ("use_swan", "fallback", "whitening", "ns_steps", "beta", "grad_norm", "whiten_dtype",
                  "split_fused")


@dataclass(frozen=True)
class Record:
    """One logical parameter as the engine sees it (immutable; see the module docstring)."""

    name: str
    shape: tuple[int, ...]  # SWAN: the matrix (stack) in the paper's orientation; fallback: as stored
    layout: Layout  # the canonical order the adapter's ranges number the stored elements in
    split: tuple[int, ...]  # a fused matrix's row pattern, each part whitened alone (routing.split_rows)
    dtype: torch.dtype
    use_swan: bool
    options: tuple[tuple[str, str], ...]  # STRUCTURE_KEYS of its group, as compared between ranks
    cfg: WhitenConfig | None = field(default=None, compare=False)

    @property
    def descriptor(self) -> tuple:
        """What every rank must agree on about this parameter (its part of the structure hash)."""
        lay = self.layout
        return (self.name, self.shape, (lay.col_splits, lay.transposed, lay.lead_splits, lay.row_splits, self.split),
                str(self.dtype), self.options)


def group_options(group: dict) -> tuple[tuple[str, str], ...]:
    return tuple((k, repr(group.get(k))) for k in STRUCTURE_KEYS)


def make_record(pc: Piece, group: dict, form: Form | None, options: tuple) -> Record:
    """The record of an adapter's piece under its group's options and its module's :class:`Form`."""
    shape, layout, split = tuple(pc.shape), pc.layout, tuple(pc.split)
    use = bool(group["use_swan"])
    if use and form is not None:
        if form.stack and len(shape) == 2:  # (E·r, c) rows of E matrices: the stack (E, r, c)
            shape = (form.stack, shape[0] // form.stack, shape[1])
        if form.transposed and not layout.transposed:
            layout = dataclasses.replace(layout, transposed=True)
            shape = (*shape[:-2], shape[-1], shape[-2])
        if form.split:
            split = form.split
    if use and not group.get("split_fused", True):
        split = ()
    return Record(pc.name, shape, layout, split, pc.param.dtype, use, options,
                  whiten_config(group) if use else None)


class Entry(NamedTuple):
    """One logical parameter in one step: its param group, this rank's piece, its record."""

    group: dict
    piece: Piece
    record: Record


class Origin:
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


class _Kept(NamedTuple):
    """A piece kept for reuse and what it was valid for."""

    group: dict
    registry: object
    key: tuple
    piece: Piece
    record: Record


def param_name(group: dict, i: int, p: Tensor) -> str:
    names = group.get("param_names")
    return names[i] if names else tagged_name(p) or f"<param {i} of shape {list(p.shape)}>"


class Collector:
    """This rank's :class:`Entry` per logical parameter, each step. A tensor packing several parameters
    gives one entry each; a group whose tensors a framework replaced is adopted through the adapters.

    A piece that is the tensor itself (:func:`swan_dist.adapter.reusable`) is kept for the next step,
    which reuses it (and its record) while the tensor is in the same group under the same adapter
    registry with the same storage, shape, strides and dtype and the group's structure options are
    unchanged, re-pointing only its gradient views; anything else asks the adapter again, and finds its
    record in the cache while the adapter's numbering is unchanged."""

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

    def collect(self, opt, pg) -> list[Entry]:
        entries: list[Entry] = []
        registry = registry_token()
        reuse, kept = self.reuse, {}
        self.reuse = kept  # tensors no longer in a group are dropped
        forms = opt._forms
        for gi, g in enumerate(opt.param_groups):
            opts = group_options(g)
            origin, params = opt._origin[gi], g["params"]
            if len(origin) != len(params) or not all(map(operator.is_, params, (o.ref() for o in origin))):
                found, one_to_one = adopt([tuple(o) for o in origin], params, g["use_swan"], gi, pg,
                                          [o.shape for o in origin])
                if one_to_one:  # the new tensors stand for the old for good
                    self.adopt_tensors(opt, gi, params)
                entries += [Entry(g, pc, self.record(pc, g, forms, opts)) for pc in found]
                continue
            swan_g = swan_opts = None  # this group's options, for a packed tensor's SWAN members
            for i, p in enumerate(params):
                hit = reuse.get(id(p))
                if (hit is not None and hit.group is g and hit.registry is registry and hit.piece.target is p
                        and hit.record.options == opts and hit.key == tensor_key(p) and repoint(hit.piece, p)):
                    kept[id(p)] = hit
                    entries.append(Entry(g, hit.piece, hit.record))
                    continue
                rules = opt._packed.get(p)
                adapter = adapter_for(p)
                name = param_name(g, i, p)
                if p.grad is not None and p.grad.layout is not torch.strided:
                    raise ValueError(
                        f"swan_dist: {name!r} has a {p.grad.layout} gradient; SWAN and its fallback rules take dense "
                        "gradients: build the module with sparse=False (e.g. nn.Embedding(..., sparse=False)), or "
                        "give that parameter to an optimizer for sparse gradients (torch.optim.SparseAdam)")
                found = adapter.pieces(p, name, rules or (g["use_swan"],))
                if rules is None:
                    rec = self.record(found[0], g, forms, opts)
                    entries.append(Entry(g, found[0], rec))
                    if reusable(adapter, p, found):
                        kept[id(p)] = _Kept(g, registry, tensor_key(p), found[0], rec)
                    continue
                if swan_g is None:
                    swan_g = {**g, "use_swan": True}
                    swan_opts = group_options(swan_g)
                for use, pc in zip(rules, found):
                    sg, so = (swan_g, swan_opts) if use else (g, opts)
                    entries.append(Entry(sg, pc, self.record(pc, sg, forms, so)))
        return entries

    def adopt_tensors(self, opt, gi: int, params: list[Tensor]) -> None:
        """Group ``gi``'s tensors were replaced one for one (same logical shapes): each new tensor takes its
        original's name, rule tags and fallback state (state key moved: a tensor shaped and typed like the
        new one; other state is refused, naming the parameter), and nothing here refers to the original."""
        records = []
        for o, new in zip(opt._origin[gi], params):
            old = o.ref()
            if old is not None and old is not new:
                opt._packed.pop(old, None)
                self.reuse.pop(id(old), None)
                st = opt.state.pop(old, None)
                if st and not opt.state.get(new):
                    like = type(new.detach())
                    bad = [k for k, v in st.items() if isinstance(v, Tensor) and k != "step"
                           and (type(v.detach()) is not like or v.shape != new.shape or v.device != new.device)]
                    if bad:
                        raise ValueError(
                            f"swan_dist: {o.name!r} has optimizer state {bad} shaped like the tensor it was given "
                            f"({type(old.detach()).__name__} {list(old.shape)}), which a framework replaced by a "
                            f"{like.__name__} {list(new.shape)} on {new.device}; load the optimizer state after the "
                            "framework prepares the model (e.g. accelerator.load_state after accelerator.prepare)")
                    opt.state[new] = st
            for key, value in o.tags.items():
                if getattr(new, key, None) is None:
                    setattr(new, key, value)
            records.append(Origin(o.name, new, o.shape, o.tags))
        opt._origin[gi] = records

    def release(self, entries: list[Entry]) -> None:
        """After a step no piece kept here holds a gradient: it is freed when the caller drops it."""
        for hit in self.reuse.values():
            hit.piece.grad = hit.piece.target_grad = None
        for e in entries:
            e.piece.grad = e.piece.target_grad = None
