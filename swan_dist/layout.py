"""The canonical order of a matrix's elements, and the round trip from that order to the matrix and back.

A rank's piece of a matrix is one contiguous range ``[lo, hi)`` of the matrix's elements numbered in a
canonical order every rank computes from the :class:`Layout` (plain row-major, column blocks of a
tensor-parallel split, a stored ``(in, out)`` weight, a grid of expert cells). This module knows shapes
and orders, not ranks nor frameworks: adapters import it to describe their pieces, the exchange and the
local path to put matrices back together (:func:`update_canonical`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["Layout", "ROW_MAJOR", "Range", "part_shapes", "matrices_in", "split_rows", "update_canonical"]

Range = tuple[int, int]



@dataclass(frozen=True)
class Layout:
    """The canonical order in which a matrix's elements are numbered for the exchange.

    Numbered on the *stored* tensor: the matrix's shape, or with ``transposed`` its last two dims
    swapped (a weight stored ``(..., in, out)``, e.g. Transformers' ``Conv1D`` or transposed MoE
    experts, whose matrix in the paper's orientation ``(..., out, in)`` is the stored one transposed).
    The stored tensor's last dim is cut into column blocks ``[0, c_1), [c_1, c_2), ..., [c_k, n)``
    (``col_splits`` = ``(c_1, ..., c_k)``), numbered block after block, each block in row-major order over
    all other dims. ``()`` is plain row-major order of the stored tensor. A tensor-parallel column split
    (``Shard(1)``, a row-parallel layer) makes each rank's block, and any row range of it, one contiguous
    range of this order, and so does any row range of the stored tensor (an FSDP2 ``Shard(0)``);
    the owner maps the assembled buffer back with :meth:`to_full` (SWAN is equivariant to row and
    column permutations but not to transposition, so blocks are put back along columns and a stored
    ``(in, out)`` tensor is transposed).

    A stack of matrices ``(E, rows, cols)`` split two ways, its experts into blocks (expert parallelism:
    ``Shard(0)``) and each expert's rows (FSDP over the rows: ``Shard(1)``), is numbered as a grid:
    ``lead_splits`` and ``row_splits`` cut its first two dims (``(e_1, ..., e_j)``, ``(r_1, ..., r_i)``), and
    the cells (expert block, row block, column block) are numbered one after another, each in row-major
    order ``(expert, row, column)``, so that every cell, the box one rank holds, is one contiguous range in
    its own memory order. The owner puts the cells back with :meth:`to_full`.
    """

    col_splits: tuple[int, ...] = ()
    transposed: bool = False
    lead_splits: tuple[int, ...] = ()
    row_splits: tuple[int, ...] = ()

    @property
    def plain(self) -> bool:
        """Whether the canonical order is the matrix's own row-major order (a flat view is the matrix)."""
        return not self.col_splits and not self.transposed and not self.lead_splits

    def stored(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The stored tensor's shape for the matrix's ``shape``."""
        shape = tuple(shape)
        return (*shape[:-2], shape[-1], shape[-2]) if self.transposed else shape

    def _blocks(self, n: int) -> list[tuple[int, int]]:
        bounds = (0, *self.col_splits, n)
        return list(zip(bounds[:-1], bounds[1:]))

    def _cells(self, stored: Sequence[int]) -> list[tuple[slice, slice, slice]]:
        """The cells of a stack split as a grid (``lead_splits``), in canonical order."""
        cuts = [(0, *self.lead_splits, stored[0]), (0, *self.row_splits, stored[1]), (0, *self.col_splits, stored[2])]
        spans = [[slice(a, b) for a, b in zip(c[:-1], c[1:])] for c in cuts]
        return [(e, r, c) for e in spans[0] for r in spans[1] for c in spans[2]]

    def to_full(self, flat: Tensor, shape: Sequence[int]) -> Tensor:
        """The matrix (``shape``, the paper's orientation) whose canonical-order elements are ``flat``."""
        stored = self.stored(shape)
        if self.lead_splits:
            full, off = flat.new_empty(stored), 0
            for cell in self._cells(stored):
                box = full[cell]
                box.copy_(flat[off: off + box.numel()].view(box.shape))
                off += box.numel()
        elif not self.col_splits:
            full = flat.view(*stored)
        else:
            lead, parts, off = tuple(stored[:-1]), [], 0
            rows = math.prod(lead)
            for a, b in self._blocks(stored[-1]):
                parts.append(flat[off: off + rows * (b - a)].view(*lead, b - a))
                off += rows * (b - a)
            full = torch.cat(parts, dim=-1)
        return full.transpose(-1, -2) if self.transposed else full

    def from_full(self, full: Tensor) -> Tensor:
        """Inverse of :meth:`to_full`: the matrix's elements in canonical order, flat."""
        if self.transposed:
            full = full.transpose(-1, -2)
        if self.lead_splits:
            return torch.cat([full[cell].reshape(-1) for cell in self._cells(full.shape)])
        if not self.col_splits:
            return full.reshape(-1)
        return torch.cat([full[..., a:b].reshape(-1) for a, b in self._blocks(full.shape[-1])])

    def box_range(self, shape: Sequence[int], start: Sequence[int], size: Sequence[int]) -> Range | None:
        """The canonical range of the box ``start[d] <= i_d < start[d] + size[d]`` of the *stored* tensor
        (``shape``: the stored shape; a DTensor's local shard), or ``None`` where the box is not one
        contiguous range of this order."""
        if 0 in size:
            return (0, 0)
        if self.lead_splits:
            return self._cell_range(shape, start, size)
        blocks = self._blocks(shape[-1])
        if (start[-1], start[-1] + size[-1]) not in blocks:
            return None
        width = size[-1]
        dims = [*shape[:-1], width]
        box_start, box_size = [*start[:-1], 0], [*size[:-1], width]
        # contiguous iff every dim before the last one it does not cover whole is a single index
        not_whole = [d for d in range(len(dims)) if box_size[d] != dims[d]]
        if not_whole and any(box_size[d] != 1 for d in range(not_whole[-1])):
            return None
        strides = [math.prod(dims[d + 1:]) for d in range(len(dims))]
        lo = math.prod(shape[:-1]) * start[-1] + sum(s * t for s, t in zip(box_start, strides))
        return (lo, lo + math.prod(box_size))

    def _cell_range(self, shape: Sequence[int], start: Sequence[int], size: Sequence[int]) -> Range | None:
        """:meth:`box_range` of a stack split as a grid: the box must be one of its cells."""
        if len(shape) != 3:
            return None
        box, off = tuple(slice(a, a + n) for a, n in zip(start, size)), 0
        for cell in self._cells(shape):
            n = math.prod(c.stop - c.start for c in cell)
            if cell == box:
                return (off, off + n)
            off += n
        return None


ROW_MAJOR = Layout()


def _periods(rows: int, split: Sequence[int]) -> int:
    period = sum(split)
    if not split or min(split) <= 0 or rows % period:
        raise ValueError(f"swan_dist: row split {tuple(split)} does not tile {rows} rows")
    return rows // period


def part_shapes(shape: Sequence[int], split: Sequence[int]) -> list[tuple[int, int]]:
    """The matrices a fused ``(rows, cols)`` matrix with row pattern ``split`` is computed as."""
    rows, cols = shape[-2], shape[-1]
    if not split:
        return [(rows, cols)]
    k = _periods(rows, split)
    return [(k * s, cols) for s in split]


def matrices_in(shape: Sequence[int], split: Sequence[int]) -> int:
    """How many matrices SWAN whitens for one tensor: each of a 3-D stack's E, each row part of a split."""
    return max(1, torch.Size(shape[:-2]).numel()) * max(1, len(split))


def split_rows(stack: Tensor, split: Sequence[int], compute: Callable[[Tensor], Tensor]) -> Tensor:
    """``compute`` applied to each part of a stack of fused matrices, the result reassembled in place
    of the parts. ``split = (s_1, ..., s_j)``: the rows repeat a period of ``j`` blocks of those sizes,
    and part i gathers block i of every period, in order (Megatron's QKV interleaved per query group:
    ``(q, k, v)`` rows per group; a tensor-parallel SwiGLU ``fc1``: ``(gate_r, up_r)`` per rank). Each
    part is a matrix of its own for SWAN (GradNorm and whitening see only its rows)."""
    if not split:
        return compute(stack)
    *lead, rows, cols = stack.shape
    k = _periods(rows, split)
    view = stack.reshape(*lead, k, sum(split), cols)
    out = torch.empty_like(view)
    a = 0
    for s in split:
        part = view[..., a:a + s, :].reshape(*lead, k * s, cols)
        out[..., a:a + s, :] = compute(part).reshape(*lead, k, s, cols).to(out.dtype)
        a += s
    return out.reshape(stack.shape)


def update_canonical(rows: Tensor, layouts: Sequence[Layout], shape: Sequence[int], split: Sequence[int],
                     compute: Callable[[Tensor], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Updates of ``len(rows)`` same-shape matrices from their gradients, both as rows of flat elements in
    each matrix's canonical order (``layouts``): to the matrices (column blocks put back, transposed),
    ``compute`` over the stack (fused parts apart, :func:`split_rows`), back to canonical order. Row-major
    matrices are views both ways. The one round trip of the local and the exchanged paths.

    ``compute(stack)`` returns the updates and which matrices came out finite (``swan_update``). Returns
    the rows of updates and a bool per row: whether all of that row's matrices (a stack's, a fused one's
    parts) are finite (the flag that travels with the row's pieces)."""
    k = rows.shape[0]
    plain = [lay.plain for lay in layouts]
    full = rows.view(k, *shape)
    if not all(plain):
        full = torch.stack([f if p else lay.to_full(r, shape) for f, p, lay, r in zip(full, plain, layouts, rows)])
    oks: list[Tensor] = []

    def part(x: Tensor) -> Tensor:
        u, ok = compute(x)
        oks.append(ok.reshape(k, -1).all(1))
        return u

    upd = split_rows(full, split, part)
    ok = oks[0] if len(oks) == 1 else torch.stack(oks).all(0)
    out = upd.reshape(k, -1) if all(plain) else torch.stack(
        [u.reshape(-1) if p else lay.from_full(u) for p, lay, u in zip(plain, layouts, upd)])
    return out, ok

