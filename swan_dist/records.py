"""The named records of a step: one :class:`Record` per logical parameter (what the engine computes
with), its :class:`Descriptor` (what every rank must agree on), an :class:`Entry` (a parameter in one
step: group, this rank's piece, record) and the agreed :class:`GradCode` of each.

A :class:`swan_dist.adapter.Piece` is the adapter's answer for one step: its range ``[lo, hi)`` and
views of the tensor and gradient (plus the adapter's own numbering: stored shape, layout, fused split).
A :class:`Record` is the logical matrix in the paper's orientation (transposed or stacked as its
:class:`~swan_dist.adapter.Form` says, fused parts split unless the group says ``split_fused=False``),
its dtype, its rule and the group options that shape the computation. It is built once per parameter
and reused while the adapter's numbering and those options stay the same; scalar options (``lr``,
``alpha``, ...) are not in it, so a scheduler changes no record and no plan.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from . import selection as _selection
from .adapter import Form, Piece, adapter_for
from .functional import WhitenConfig
from .layout import Layout
from .rules import whiten_config

__all__ = ["Record", "Descriptor", "Entry", "GradCode", "Origin", "STRUCTURE_KEYS", "group_options", "make_record"]

# Group options a record depends on: they change the computation's shape, dtype or rule, and so the plan.
STRUCTURE_KEYS = ("use_swan", "fallback", "whitening", "ns_steps", "beta", "grad_norm", "whiten_dtype",
                  "split_fused")


class GradCode(enum.IntEnum):
    """A parameter's gradient this step, per rank; the agreed code is the maximum over ranks."""

    NONE = 0  # no gradient here
    FINITE = 1
    NONFINITE = 2  # NaN/Inf
    PARTIAL = 3  # a SWAN matrix held only in part where every matrix must be whole (local mode)


@dataclass(frozen=True)
class Descriptor:
    """What every rank must agree on about one parameter (or, named ``<engine>``, the engine's settings):
    its part of the structure hash, compared field by field when the hashes differ."""

    name: str
    shape: tuple[int, ...]
    layout: tuple  # (col_splits, transposed, lead_splits, row_splits, fused split)
    dtype: str
    options: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Record:
    """One logical parameter as the engine sees it (immutable; see the module docstring). A SWAN matrix's
    record is what the planner and the exchange plan with (a :class:`~swan_dist.plan.Matrix`)."""

    name: str
    shape: tuple[int, ...]  # SWAN: the matrix (stack) in the paper's orientation; fallback: as stored
    layout: Layout  # the canonical order the adapter's ranges number the stored elements in
    split: tuple[int, ...]  # a fused matrix's row pattern, each part whitened alone (layout.split_rows)
    dtype: torch.dtype
    use_swan: bool
    options: tuple[tuple[str, str], ...]  # STRUCTURE_KEYS of its group, as compared between ranks
    cfg: WhitenConfig | None = field(default=None, compare=False)

    @property
    def key(self) -> str:  # the planner's name for it (a plan.Matrix)
        return self.name

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def descriptor(self) -> Descriptor:
        lay = self.layout
        return Descriptor(self.name, self.shape,
                          (lay.col_splits, lay.transposed, lay.lead_splits, lay.row_splits, self.split),
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
