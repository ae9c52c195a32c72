"""Who whitens which matrix, and how its pieces move (knows ranks and ranges, not frameworks).

The contract (docs/engine.md): for every managed matrix each rank holds one contiguous range
``[lo, hi)`` of the row-major flattened full tensor (possibly empty, possibly all of it; ranks may
hold the same elements, as under DDP or a replicate mesh dim). From every rank's ranges this module
builds a :class:`Plan`, identical on all ranks:

- buckets and owners: in ``owner`` mode one rank per matrix; each bucket is one exchange in each
  direction and ends at its slowest owner, so matrices are grouped into buckets (not necessarily
  consecutive) and owners to minimise Σ over buckets of the slowest owner's cost on the whitening
  cost model, each owner assembling at most ``bucket_bytes`` of full fp32 matrices per bucket (one
  larger matrix alone) so its transient memory is bounded, then exchanges owners of interchangeable
  matrices so each is computed where it lies; in ``replicated`` mode every rank
  computes every matrix (the paper's "w/o MP"), in buckets of consecutive matrices;
- sources: for each (matrix, computing rank) a disjoint cover of ``[0, numel)`` by ranges of the
  holders, preferring what the computing rank already holds (nothing is sent for it).

:class:`Exchange` runs a plan with ``all_to_all_single`` (uneven splits, contiguous buffers, as gloo
requires), each bucket in phases so that transfers overlap the math (the gradients of phase k+1 and
the updates of phase k-1 travel while phase k is computed).
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from array import array
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Hashable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import inflight
from .functional import WhitenConfig, swan_update, whiten_flops

__all__ = ["Layout", "ROW_MAJOR", "MatrixSpec", "Plan", "Bucket", "Ranges", "build_plan", "row_shard_ranges", "cover", "Exchange", "Segment",
           "swan_compute", "update_canonical", "swan_cost", "split_rows", "matrices_in", "part_shapes"]

Range = tuple[int, int]
Segment = tuple[int, int, int]  # (matrix index, lo, hi)


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


@dataclass(frozen=True)
class MatrixSpec:
    """What every rank must agree on about one managed matrix."""

    key: str
    shape: tuple[int, ...]  # full shape in the paper's orientation (out, in), >= 2-D; leading dims: a stack
    cfg: Hashable  # the per-matrix computation's options (SWAN: a WhitenConfig)
    layout: Layout = ROW_MAJOR  # the canonical order the ranks' ranges number elements in
    split: tuple[int, ...] = ()  # row pattern of a fused matrix computed as separate parts (split_rows)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def cost(self) -> float:
        return swan_cost(self)


def swan_compute(stack: Tensor, cfg: WhitenConfig) -> tuple[Tensor, Tensor]:
    """The default per-matrix computation: SWAN's update of a stack of same-shape gradients, and which of
    them came out finite."""
    return swan_update(stack, cfg)


def swan_cost(spec: MatrixSpec) -> float:
    """The default cost model (FLOPs of SWAN's whitening), for balancing owners."""
    stack = spec.numel // max(1, spec.shape[-2] * spec.shape[-1]) if spec.numel else 0
    return stack * sum(whiten_flops(part, spec.cfg) for part in part_shapes(spec.shape[-2:], spec.split))


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
    parts) are finite; a row that is not is filled with NaN, the flag its holders skip it by."""
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
    return out.masked_fill_(~ok[:, None], float("nan")), ok


class Ranges(Sequence):
    """Every rank's range of every matrix, ``ranges[rank][m] == (lo, hi)``, read-only.

    Stored as one flat ``int64`` array (rank-major, ``lo, hi`` per matrix): 16 bytes per (rank, matrix),
    where lists of tuples of ints take about 120, so that every rank's copy of a plan stays small at large
    W (560 matrices at W = 1,024: 9 MiB, against some 70 MiB of tuples). :meth:`table` is the same memory
    as a ``(world, count, 2)`` tensor, for the planner's vectorised passes."""

    __slots__ = ("world", "count", "flat")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, flat: array, world: int, count: int) -> None:
        if flat.typecode != "q" or len(flat) != 2 * world * count:
            raise ValueError(f"swan_dist: {len(flat)} range bounds for {world} ranks x {count} matrices")
        self.flat, self.world, self.count = flat, world, count

    @classmethod
    def of(cls, ranges: Sequence[Sequence[Range]], count: int | None = None) -> Ranges:
        """``ranges`` (a sequence per rank of ``(lo, hi)`` per matrix) as :class:`Ranges`."""
        if isinstance(ranges, Ranges):
            return ranges
        if count is None:
            count = len(ranges[0]) if len(ranges) else 0
        return cls(array("q", chain.from_iterable(chain.from_iterable(ranges))), len(ranges), count)

    def __len__(self) -> int:
        return self.world

    def __getitem__(self, rank: int | slice) -> RankRanges | list[RankRanges]:
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self.world))]
        if rank < 0:
            rank += self.world
        if not 0 <= rank < self.world:
            raise IndexError(f"rank {rank} out of range for {self.world} ranks")
        return RankRanges(self.flat, 2 * rank * self.count, self.count)

    def __iter__(self) -> Iterator[RankRanges]:
        return (self[r] for r in range(self.world))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranges):
            return (self.world, self.count, self.flat) == (other.world, other.count, other.flat)
        if isinstance(other, Sequence):
            return len(other) == self.world and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"Ranges({self.world} ranks x {self.count} matrices)"

    def at(self, rank: int, m: int) -> Range:
        """``self[rank][m]``, without the row."""
        i = 2 * (rank * self.count + m)
        return self.flat[i], self.flat[i + 1]

    def column(self, m: int) -> tuple[list[int], list[int]]:
        """Matrix ``m``'s ``lo`` and ``hi`` on every rank, in rank order."""
        step = 2 * self.count
        return self.flat[2 * m::step].tolist(), self.flat[2 * m + 1::step].tolist()

    def table(self) -> Tensor:
        """A ``(world, count, 2)`` int64 tensor sharing this memory (not to be written)."""
        if not self.flat:
            return torch.zeros(self.world, self.count, 2, dtype=torch.int64)
        return torch.frombuffer(self.flat, dtype=torch.int64).view(self.world, self.count, 2)


class RankRanges(Sequence):
    """One rank's row of :class:`Ranges`: ``row[m] == (lo, hi)``."""

    __slots__ = ("flat", "start", "count")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, flat: array, start: int, count: int) -> None:
        self.flat, self.start, self.count = flat, start, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, m: int | slice) -> Range | list[Range]:
        if isinstance(m, slice):
            return [self[i] for i in range(*m.indices(self.count))]
        if m < 0:
            m += self.count
        if not 0 <= m < self.count:
            raise IndexError(f"matrix {m} out of range for {self.count} matrices")
        i = self.start + 2 * m
        return self.flat[i], self.flat[i + 1]

    def __iter__(self) -> Iterator[Range]:
        bounds = iter(self.flat[self.start: self.start + 2 * self.count])
        return zip(bounds, bounds)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence):
            return len(other) == self.count and all(tuple(a) == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(frozen=True)
class _Holding:
    """Per matrix, what every rank's range says about it (one vectorised pass over all ranges)."""

    holders: list[int]  # ranks holding some of it
    whole: list[int]  # ranks holding all of it
    tiles: list[bool]  # the holders' ranges are pairwise disjoint (FSDP, ZeRO): each element has one source
    holes: list[bool]  # some element is held by no rank


def _holding_of(ranges: Ranges, numels: Sequence[int]) -> _Holding:
    """:class:`_Holding` from the ranges sorted by start per matrix (the empty ones last)."""
    t = ranges.table()
    lo, hi = t[..., 0].T, t[..., 1].T  # (matrix, rank)
    n = torch.tensor(list(numels), dtype=torch.int64).reshape(-1, 1)
    held = hi > lo
    holders, whole = held.sum(1), ((lo == 0) & (hi == n)).sum(1)
    if ranges.world == 0:
        tiles, holes = torch.ones(len(numels), dtype=torch.bool), n[:, 0] > 0
    else:
        start, order = torch.where(held, lo, torch.iinfo(torch.int64).max).sort(dim=1, stable=True)
        held = held.gather(1, order)
        end = torch.where(held, hi.gather(1, order), 0)
        reach = end.cummax(dim=1).values  # the furthest end among the ranges starting so far
        before = torch.cat([torch.zeros_like(reach[:, :1]), reach[:, :-1]], dim=1)
        holes = (held & (start > before)).any(1) | (reach[:, -1] < n[:, 0])
        tiles = ~(held[:, 1:] & (start[:, 1:] < end[:, :-1])).any(1)
    return _Holding(holders.tolist(), whole.tolist(), tiles.tolist(), holes.tolist())


@dataclass
class Bucket:
    matrices: list[int]
    owners: dict[int, int]  # matrix -> owner rank; -1 = every rank computes it (replicated)


@dataclass
class Plan:
    specs: list[MatrixSpec]
    ranges: Ranges  # ranges[rank][matrix] == (lo, hi); a list of lists of pairs is converted
    buckets: list[Bucket]
    mode: str
    costs: list[float]  # per matrix, the cost model's estimate

    def __post_init__(self) -> None:
        self.ranges = Ranges.of(self.ranges, len(self.specs))

    @property
    def world(self) -> int:
        return len(self.ranges)

    @functools.cached_property
    def _holding(self) -> _Holding:
        return _holding_of(self.ranges, [s.numel for s in self.specs])

    def computes(self, rank: int, m: int, bucket: Bucket) -> bool:
        o = bucket.owners[m]
        return o == -1 or o == rank

    def computers(self, m: int, bucket: Bucket) -> list[int]:
        o = bucket.owners[m]
        return list(range(self.world)) if o == -1 else [o]

    def owner_costs(self) -> list[list[float]]:
        """Per bucket, the whitening cost each rank carries."""
        out = []
        for b in self.buckets:
            load = [0.0] * self.world
            for m in b.matrices:
                for c in self.computers(m, b):
                    load[c] += self.costs[m]
            out.append(load)
        return out

    def balance(self) -> float:
        """Σ_buckets max(load) / Σ_buckets mean(load): 1.0 is perfect (a bucket ends at its slowest owner)."""
        loads = self.owner_costs()
        mx = sum(max(b) for b in loads)
        mean = sum(sum(b) / len(b) for b in loads)
        return mx / mean if mean else 1.0

    def slowest(self) -> float:
        """Σ over buckets of the slowest rank's cost: the step's whitening time on the cost model."""
        return sum(max(b) for b in self.owner_costs())

    def bounds(self) -> tuple[float, float]:
        """Lower bounds on :meth:`slowest` in owner mode: per bucket as cut, Σ_b max(cost(b)/W, largest
        matrix of b); for the whole model unbucketed, max(total/W, largest matrix)."""
        per_bucket = sum(max(sum(self.costs[m] for m in b.matrices) / self.world,
                             max(self.costs[m] for m in b.matrices)) for b in self.buckets if b.matrices)
        whole = max(sum(self.costs) / self.world, max(self.costs, default=0.0)) if self.world else 0.0
        return per_bucket, whole

    # ---------------------------------------------------------------- per-rank schedules
    def forward_segments(self, bucket: Bucket, src: int, dst: int) -> list[Segment]:
        """Gradient segments ``src`` sends to ``dst`` in this bucket, in packing order."""
        out = []
        if src == dst:
            return out
        for m in bucket.matrices:
            if self.computes(dst, m, bucket):
                out += [(m, lo, hi) for r, lo, hi in cover([rg[m] for rg in self.ranges], dst, self.specs[m]) if r == src]
        return out

    def backward_segments(self, bucket: Bucket, src: int, dst: int) -> list[Segment]:
        """Update segments the owner ``src`` sends to holder ``dst`` (which does not compute them)."""
        out = []
        if src == dst:
            return out
        for m in bucket.matrices:
            if bucket.owners[m] == src and not self.computes(dst, m, bucket):
                lo, hi = self.ranges[dst][m]
                if hi > lo:
                    out.append((m, lo, hi))
        return out

    def bytes_moved(self, elem_bytes: int = 4) -> int:
        """Total bytes sent by all ranks in one step (both directions), the sum of every
        :meth:`forward_segments` and :meth:`backward_segments` in closed form: a computing rank takes what
        it holds from itself (:func:`cover`), so it receives every other element, and an owner sends each
        other holder its piece."""
        t = self.ranges.table()
        held = t[..., 1] - t[..., 0]  # (rank, matrix)
        total_held = held.sum(0).tolist()
        total = 0
        for b in self.buckets:
            for m in b.matrices:
                n, o = self.specs[m].numel, b.owners[m]
                if o == -1:
                    total += self.world * n - total_held[m]
                else:
                    lo, hi = self.ranges.at(o, m)
                    total += n - (hi - lo) + total_held[m] - (hi - lo)
        return total * elem_bytes


def row_shard_ranges(specs: Sequence[MatrixSpec], world: int) -> list[list[Range]]:
    """Every rank's range of every matrix under FSDP2's ``torch.chunk`` along dim 0: rank r holds rows
    ``[r * ceil(m / W), ...)`` (an expert stack: whole experts), empty past the end. The layout the
    planner's tests and benchmarks use."""
    out = [[(0, 0)] * len(specs) for _ in range(world)]
    for m, s in enumerate(specs):
        row, per = math.prod(s.shape[1:]), -(-s.shape[0] // world)
        for r in range(world):
            out[r][m] = (min(r * per, s.shape[0]) * row, min((r + 1) * per, s.shape[0]) * row)
    return out


def cover(ranges: Sequence[Range], dst: int, spec: MatrixSpec) -> list[tuple[int, int, int]]:
    """A disjoint cover of ``[0, numel)`` by ``(rank, lo, hi)`` pieces of the holders' ranges, taking
    everything ``dst`` holds from ``dst`` itself and otherwise the holder whose range reaches
    furthest (lowest rank on ties). Raises if some elements are held by no rank."""
    n = spec.numel
    own_lo, own_hi = ranges[dst]
    out, pos = [], 0
    while pos < n:
        if own_lo <= pos < own_hi:
            out.append((dst, pos, own_hi))
            pos = own_hi
            continue
        best = max(
            ((hi, -r) for r, (lo, hi) in enumerate(ranges) if lo <= pos < hi),
            default=None,
        )
        if best is None:
            raise ValueError(
                f"swan_dist: no rank holds elements [{pos}, ...) of {spec.key!r} (shape {list(spec.shape)}); "
                "the ranks' pieces must cover the whole matrix"
            )
        end = best[0] if not (pos < own_lo < best[0]) else own_lo
        out.append((-best[1], pos, end))
        pos = end
    return out


def build_plan(
    specs: Sequence[MatrixSpec],
    ranges: Sequence[Sequence[Range]],
    mode: str = "owner",
    bucket_bytes: int = 256 << 20,
    cost: Callable[[MatrixSpec], float] = swan_cost,
) -> Plan:
    """Deterministic plan from the matrices and every rank's ranges (same input → same plan)."""
    if mode not in ("owner", "replicated"):
        raise ValueError(f"mode must be 'owner' or 'replicated', got {mode!r}")
    numels = [s.numel for s in specs]
    plan = Plan(list(specs), _checked_ranges(specs, numels, ranges), [], mode, [float(cost(s)) for s in specs])
    for m, hole in enumerate(plan._holding.holes):  # every matrix must be fully held by someone
        if hole:
            lo, hi = plan.ranges.column(m)
            cover(list(zip(lo, hi)), 0, specs[m])  # raises, naming the first hole
    nbytes = [4 * n for n in numels]
    if mode == "replicated":  # every rank computes every matrix: consecutive matrices, `bucket_bytes` each
        current: list[int] = []
        size = 0
        for m in range(len(specs)):
            if current and size + nbytes[m] > bucket_bytes:
                plan.buckets.append(Bucket(current, {k: -1 for k in current}))
                current, size = [], 0
            current.append(m)
            size += nbytes[m]
        if current:
            plan.buckets.append(Bucket(current, {k: -1 for k in current}))
    else:
        plan.buckets = _owner_buckets(plan.costs, nbytes, plan.ranges, bucket_bytes)
    return plan


def _checked_ranges(specs: Sequence[MatrixSpec], numels: Sequence[int], ranges: Sequence[Sequence[Range]]) -> Ranges:
    """``ranges`` as :class:`Ranges`, each ``0 <= lo <= hi <= numel``, checked in one vectorised pass; the
    first offending rank and matrix named otherwise."""
    table = None
    if all(len(rg) == len(specs) for rg in ranges):
        try:
            table = Ranges.of(ranges, len(specs))
        except (TypeError, ValueError, OverflowError):
            table = None
    if table is not None:
        t = table.table()
        lo, hi = t[..., 0], t[..., 1]
        if bool(((0 <= lo) & (lo <= hi) & (hi <= torch.tensor(list(numels), dtype=torch.int64))).all()):
            return table
    for r, rg in enumerate(ranges):
        if len(rg) != len(specs):
            raise ValueError(f"swan_dist: rank {r} reports {len(rg)} matrices, expected {len(specs)}")
        for spec, n, (lo, hi) in zip(specs, numels, rg):
            if not 0 <= lo <= hi <= n:
                raise ValueError(f"swan_dist: rank {r} holds invalid range [{lo}, {hi}) of {spec.key!r} ({n} elements)")
    raise TypeError("swan_dist: every rank's ranges must be (lo, hi) pairs of ints, one per matrix")


# ------------------------------------------------------------------------------- owner planning
# A bucket is a synchronisation point: its exchange waits for its slowest owner. A plan's cost on the
# cost model is therefore Σ over buckets of the slowest owner's load, and within a bucket the owners
# are interchangeable: planning first cuts the matrices into buckets of at most `world` *cells* (one
# owner's share of a bucket, at most `bucket_bytes` of full fp32 matrices, or one larger matrix alone),
# then gives each cell a rank, preferring ranks that already hold its matrices.
Cells = list[list[int]]  # one bucket: its owners' shares, each a list of matrices


def _owner_buckets(costs: Sequence[float], nbytes: Sequence[int], ranges: Ranges, bucket_bytes: int) -> list[Bucket]:
    world = len(ranges)
    cap = world * bucket_bytes  # a bucket's full matrices in all; a larger matrix gets a bucket alone
    ms = [m for m in range(len(costs)) if nbytes[m] <= cap]
    alone = [m for m in range(len(costs)) if nbytes[m] > cap]
    # Three constructions, the cheapest on the cost model kept (the first on ties): the first two are
    # exact on repeated-layer models and each is weak where the other is strong on irregular mixes; the
    # third is the earlier planner (consecutive buckets), so no plan is worse than it was.
    candidates = [_fill_levels(ms, costs, nbytes, world, bucket_bytes),
                  _split_owner_lists(ms, costs, nbytes, world, bucket_bytes),
                  _consecutive(ms, costs, nbytes, world, bucket_bytes)]
    cut = min((c for c in candidates if c is not None), key=lambda bs: (_slowest(bs, costs), len(bs)))
    t = ranges.table()
    held = (t[..., 1] - t[..., 0]).T.contiguous()  # held[m][r]: elements of m rank r holds
    out, total = [], [0.0] * world
    loads = torch.zeros(world, dtype=torch.float64)  # `total` as a tensor, the same floats
    for cells in cut:
        owners: dict[int, int] = {}
        free = torch.ones(world, dtype=torch.bool)
        for cell in sorted(cells, key=lambda c: (-sum(costs[m] for m in c), min(c))):
            # the rank already holding most of it, then the least loaded so far, then the lowest
            r = _pick(held[cell[0]] if len(cell) == 1 else held[cell].sum(0), loads, free)
            free[r] = False
            total[r] += sum(costs[m] for m in cell)
            loads[r] = total[r]
            owners.update((m, r) for m in cell)
        owners = _holders_first({m: owners[m] for m in sorted(owners)}, costs, nbytes, held)
        out.append(Bucket(sorted(owners), owners))
    for m in alone:
        out.append(Bucket([m], {m: _pick(held[m], torch.zeros(world, dtype=torch.float64), None)}))
    return out


def _holders_first(owners: dict[int, int], costs: Sequence[float], nbytes: Sequence[int], held: Tensor
                   ) -> dict[int, int]:
    """One bucket's owners with interchangeable matrices (the same cost and bytes: every owner keeps its
    load and byte room) exchanged so that each is computed where most of it already lies. Greedy on
    elements held, largest first (ties: lower matrix, then lower rank), kept only where it moves fewer
    elements than the owners given. Matters where shards hold whole matrices (a distributed optimizer's
    or ZeRO's flat ranges, experts on their own ranks); row shards hold the same of each, and pass."""
    groups: dict[tuple[float, int], list[int]] = {}
    for m in owners:
        groups.setdefault((costs[m], nbytes[m]), []).append(m)
    out = dict(owners)
    for ms in groups.values():
        ranks = sorted({owners[m] for m in ms})
        if len(ranks) < 2:
            continue
        h = held[torch.tensor(ms)][:, torch.tensor(ranks)]  # (matrix, rank): elements held
        if bool((h.amax(1) == h.amin(1)).all()):
            continue
        col = {r: j for j, r in enumerate(ranks)}
        room = [0] * len(ranks)
        for m in ms:
            room[col[owners[m]]] += 1
        mine: dict[int, int] = {}
        for k in torch.argsort(-h.flatten(), stable=True).tolist():
            i, j = divmod(k, len(ranks))
            if ms[i] in mine or not room[j]:
                continue
            mine[ms[i]] = ranks[j]
            room[j] -= 1
            if len(mine) == len(ms):
                break
        gained = sum(int(h[i, col[mine[m]]]) - int(h[i, col[owners[m]]]) for i, m in enumerate(ms))
        if gained > 0:
            out.update(mine)
    return out


def _pick(score: Tensor, load: Tensor, free: Tensor | None) -> int:
    """The rank (among ``free``) with the highest score, then the lowest load, then the lowest index:
    ``max(free, key=lambda r: (score[r], -load[r], -r))`` over tensors of all ranks."""
    if free is not None:
        score = score.masked_fill(~free, -1)  # scores (elements held) are >= 0
    best = score == score.max()
    load = load.masked_fill(~best, math.inf)
    return int(torch.nonzero(load == load.min())[0, 0])


def _slowest(buckets: Sequence[Cells], costs: Sequence[float]) -> float:
    return sum(max(sum(costs[m] for m in cell) for cell in cells) for cells in buckets)


@dataclass
class _Cell:
    """One owner's share of a bucket being filled."""

    load: float = 0.0
    used: int = 0  # bytes of full fp32 matrices; cell_bytes + 1 once a larger matrix sits alone in it
    matrices: list[int] = field(default_factory=list)


@dataclass
class _Level:
    """A bucket being filled: its highest cell, its cells, and the ids of its cells by (load, used)
    state (cells in the same state are interchangeable)."""

    height: float
    cells: list[_Cell]
    states: dict[tuple[float, int], list[int]]


def _fill_levels(ms: Sequence[int], costs: Sequence[float], nbytes: Sequence[int], world: int,
                 cell_bytes: int) -> list[Cells]:
    """Largest cost first, each matrix into the cell where it raises Σ over buckets of the bucket's
    highest cell least (not at all where it fits under that height), the least loaded such cell with
    byte room; a new bucket only where no cell has byte room. With one bucket this is LPT."""
    full = cell_bytes + 1  # the bytes of a cell holding one matrix above `cell_bytes`: it takes no more
    levels: list[_Level] = []
    for m in sorted(ms, key=lambda m: (-costs[m], -nbytes[m], m)):
        c, n = costs[m], nbytes[m]
        best = None
        for k, level in enumerate(levels):
            for load, used in level.states:
                if (used + n > cell_bytes) if n <= cell_bytes else used:
                    continue
                key = (max(0.0, load + c - level.height), load, k, -used)
                if best is None or key < best[0]:
                    best = (key, k, (load, used))
        if best is None:
            levels.append(_Level(0.0, [_Cell() for _ in range(world)], {(0.0, 0): list(range(world))}))
            k, state = len(levels) - 1, (0.0, 0)
        else:
            _, k, state = best
        level = levels[k]
        ids = level.states[state]
        cid = ids.pop(0)
        if not ids:
            del level.states[state]
        cell = level.cells[cid]
        cell.load += c
        cell.used = cell.used + n if n <= cell_bytes else full
        cell.matrices.append(m)
        level.height = max(level.height, cell.load)
        ids = level.states.setdefault((cell.load, cell.used), [])
        ids.insert(bisect.bisect(ids, cid), cid)
    return [[cell.matrices for cell in level.cells if cell.matrices] for level in levels]


def _consecutive(ms: Sequence[int], costs: Sequence[float], nbytes: Sequence[int], world: int,
                 cell_bytes: int) -> list[Cells] | None:
    """Consecutive matrices up to ``world * cell_bytes`` per bucket, LPT inside each bucket onto the
    cells with byte room; ``None`` where some matrix finds no room."""
    groups: list[list[int]] = []
    size = 0
    for m in ms:
        n = min(nbytes[m], cell_bytes)  # a larger matrix fills one cell
        if not groups or size + n > world * cell_bytes:
            groups.append([])
            size = 0
        groups[-1].append(m)
        size += n
    out: list[Cells] = []
    for group in groups:
        load, used, cells = [0.0] * world, [0] * world, [[] for _ in range(world)]
        heap = [(0.0, i) for i in range(world)]  # (load, cell): the least loaded cell first
        for m in sorted(group, key=lambda m: (-costs[m], m)):
            full = []  # cells without room for m, popped past on the way to the first with room
            while heap:
                _, i = heapq.heappop(heap)
                if used[i] + nbytes[m] <= cell_bytes if nbytes[m] <= cell_bytes else not cells[i]:
                    break
                full.append((load[i], i))
            else:
                return None
            load[i] += costs[m]
            used[i] += nbytes[m] if nbytes[m] <= cell_bytes else cell_bytes + 1
            cells[i].append(m)
            for entry in (*full, (load[i], i)):
                heapq.heappush(heap, entry)
        out.append([c for c in cells if c])
    return out


def _split_owner_lists(ms: Sequence[int], costs: Sequence[float], nbytes: Sequence[int], world: int,
                       cell_bytes: int, extra: int = 3, tries: int = 12) -> list[Cells] | None:
    """Owners by LPT over all matrices at once; each owner's matrices cut into K cells of balanced cost
    (LPT into K cells with byte room), K the smallest count every owner fits into, or up to ``extra``
    more where cheaper; bucket k takes every owner's k-th highest cell. ``None`` where no K among the
    first ``tries`` from the byte lower bound fits every owner."""
    heap = [(0.0, r) for r in range(world)]
    lists: list[list[int]] = [[] for _ in range(world)]
    for m in sorted(ms, key=lambda m: (-costs[m], -nbytes[m], m)):
        load, r = heapq.heappop(heap)
        lists[r].append(m)
        heapq.heappush(heap, (load + costs[m], r))

    def cut(own: list[int], k: int) -> list[list[int]] | None:
        load, used, cells = [0.0] * k, [0] * k, [[] for _ in range(k)]
        for m in own:
            if nbytes[m] > cell_bytes:
                room = [i for i in range(k) if not cells[i]]
            else:
                room = [i for i in range(k) if used[i] + nbytes[m] <= cell_bytes]
            if not room:
                return None
            i = min(room, key=lambda i: (load[i], i))
            load[i] += costs[m]
            used[i] = used[i] + nbytes[m] if nbytes[m] <= cell_bytes else cell_bytes + 1
            cells[i].append(m)
        return [c for _, c in sorted(((load[i], cells[i]) for i in range(k) if cells[i]), key=lambda t: (-t[0], min(t[1])))]

    k = max([1] + [sum(nbytes[m] > cell_bytes for m in own) + -(-sum(nbytes[m] for m in own if nbytes[m] <= cell_bytes) // cell_bytes)
                   for own in lists])
    best, fitted = None, 0
    for k in range(k, k + tries):
        if fitted > extra:
            break
        per_owner = [cut(own, k) for own in lists]
        if any(c is None for c in per_owner):
            continue
        fitted += 1
        buckets: list[Cells] = []
        for i in range(max(len(c) for c in per_owner)):
            buckets.append([own[i] for own in per_owner if i < len(own)])  # every owner's i-th cell
        if best is None or _slowest(buckets, costs) < _slowest(best, costs):
            best = buckets
    return best


# A bucket runs in phases of about this many bytes of full fp32 matrices per owner, at most MAX_PHASES
# of them, so that its transfers overlap the math (see Exchange). Each phase is one collective each way:
# a few MiB keep gloo's per-call cost small against the transfer it hides.
PHASE_BYTES = 4 << 20
MAX_PHASES = 4


@dataclass
class _Step:
    """One exchange each way on this rank: a bucket, or one phase of it."""

    matrices: list[int]
    fwd: tuple[list[int], list[int]]  # elements sent to / received from each rank
    fwd_send: list[Segment]  # what this rank sends, in packing order
    recv_at: dict[int, list[tuple[int, int, int]]]  # matrix -> (lo, hi, offset in the received buffer)
    bwd: tuple[list[int], list[int]]
    send_at: dict[int, list[tuple[int, int, int]]]  # matrix -> (lo, hi, offset in the update send buffer)
    bwd_recv: list[Segment]  # the update pieces this rank receives, in order
    own: dict[int, list[Range]]  # per matrix this rank computes: the ranges it takes from itself
    stacks: list[list[int]]  # the matrices this rank computes, in stacks of one (shape, config, split)
    dtype: torch.dtype  # the communication dtype
    moves: tuple[bool, bool]  # whether any rank sends gradients / updates (else no rank issues that collective)


class _Holders:
    """Who holds one matrix, arranged so that :func:`cover` for any rank costs about its pieces, not W
    per position: the holders' nonempty ranges sorted by start with the furthest-reaching one over each
    prefix (the best source at a position is one bisection away), and the *base* cover, the one of a
    rank holding nothing. A rank's cover is the base one but around its own range: it follows the base
    up to the base position at or before its range's start and rejoins it at the first base position
    at or after its range's end. Of ranks holding the same range only the lowest is ever a source, so
    replicas (HSDP, DDP) count once. Ranges that tile the matrix are their own base cover."""

    def __init__(self, n: int, los: Sequence[int], his: Sequence[int], tiles: bool = False) -> None:
        self.reach: list[tuple[int, int]] | None = None  # per prefix of `starts`: max (hi, -rank); None for tiles
        if tiles:
            self.base_rank = sorted((r for r in range(len(los)) if his[r] > los[r]), key=los.__getitem__)
            self.base = [los[r] for r in self.base_rank] + [n]
        else:
            lowest = dict(zip(zip(reversed(los), reversed(his)), range(len(los) - 1, -1, -1)))  # range -> lowest rank
            order = sorted((lo, r, hi) for (lo, hi), r in lowest.items() if hi > lo)
            self.starts, self.reach, best = [lo for lo, _, _ in order], [], (-1, 0)
            for _, r, hi in order:
                best = max(best, (hi, -r))
                self.reach.append(best)
            self.base, self.base_rank, pos = [0], [], 0  # base positions q_0 = 0 < ... < q_K = n; piece k's rank
            while pos < n:
                pos, r = self.best(pos)
                self.base.append(pos)
                self.base_rank.append(r)
        self._pieces_of: dict[int, list[int]] = {}

    def best(self, pos: int) -> tuple[int, int]:
        """``(hi, rank)`` of the holder of ``pos`` whose range reaches furthest (lowest rank on ties)."""
        if self.reach is None:  # tiles: the one range holding pos
            k = bisect.bisect_right(self.base, pos) - 1
            if 0 <= k < len(self.base_rank):
                return self.base[k + 1], self.base_rank[k]
        else:
            i = bisect.bisect_right(self.starts, pos) - 1
            if i >= 0 and self.reach[i][0] > pos:
                return self.reach[i][0], -self.reach[i][1]
        raise ValueError(f"swan_dist: no rank holds element {pos}")

    def _base_index(self, pos: int) -> int:
        """The base position ``pos`` is (its index), or -1."""
        k = bisect.bisect_left(self.base, pos)
        return k if k < len(self.base) and self.base[k] == pos else -1

    def _base_pieces(self, start: int, stop: int, src: int | None) -> list[tuple[int, int, int]]:
        """Base pieces ``start <= k < stop`` as ``(rank, lo, hi)``, only ``src``'s where given."""
        if src is None:
            ks: Sequence[int] = range(start, stop)
        else:
            if src not in self._pieces_of:
                self._pieces_of[src] = [k for k, r in enumerate(self.base_rank) if r == src]
            mine = self._pieces_of[src]
            ks = mine[bisect.bisect_left(mine, start): bisect.bisect_left(mine, stop)]
        return [(self.base_rank[k], self.base[k], self.base[k + 1]) for k in ks]

    def cover(self, dst: int, own: Range, src: int | None = None) -> list[tuple[int, int, int]]:
        """``cover(ranges, dst, spec)`` for ``dst`` holding ``own``; only the pieces from ``src`` where given.
        Between the two base positions around ``own`` it walks as :func:`cover` does."""
        a, b = own
        k = bisect.bisect_right(self.base, a) - 1
        out = self._base_pieces(0, k, src)
        pos = self.base[k]
        while True:
            if pos >= b and (k := self._base_index(pos)) >= 0:  # past own, back on the base cover
                return out + self._base_pieces(k, len(self.base) - 1, src)
            if a <= pos < b:
                if src is None or src == dst:
                    out.append((dst, pos, b))
                pos = b
                continue
            hi, r = self.best(pos)
            end = a if pos < a < hi else hi
            if src is None or src == r:
                out.append((r, pos, end))
            pos = end


class _Sources:
    """The covers one rank's exchange needs, from the plan's ranges: the whole cover of each matrix it
    computes, and its own pieces of the covers of the matrices others compute. Ranges that tile a matrix
    (FSDP, ZeRO) need no search for the latter: a holder's piece of any cover is its whole range."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.tiles = plan._holding.tiles
        self._last: tuple[int, _Holders] | None = None  # the matrix asked about last (a step asks matrix by matrix)

    def holders(self, m: int) -> _Holders:
        if self._last is None or self._last[0] != m:
            self._last = (m, _Holders(self.plan.specs[m].numel, *self.plan.ranges.column(m), self.tiles[m]))
        return self._last[1]

    def cover(self, m: int, dst: int) -> list[tuple[int, int, int]]:
        """``cover`` of matrix ``m`` for ``dst``: ``(rank, lo, hi)`` pieces in order."""
        return self.holders(m).cover(dst, self.plan.ranges.at(dst, m))

    def sent(self, m: int, dst: int, own: Range | None = None) -> list[Segment]:
        """This rank's pieces of the cover of matrix ``m`` for ``dst``, another rank (holding ``own``)."""
        a, b = self.plan.ranges.at(dst, m) if own is None else own
        if not self.tiles[m]:
            return [(m, lo, hi) for _, lo, hi in self.holders(m).cover(dst, (a, b), self.rank)]
        lo, hi = self.plan.ranges.at(self.rank, m)
        if hi <= lo:
            return []
        # the only holder of its elements; cut only where dst's empty range sits inside it (see cover)
        return [(m, lo, a), (m, a, hi)] if a == b and lo < a < hi else [(m, lo, hi)]

    def sent_to_each(self, m: int) -> list[tuple[int, list[Segment]]]:
        """``(dst, sent(m, dst))`` for every other rank ``dst`` this rank sends some of ``m`` (replicated
        mode: every rank computes every matrix). What this rank sends depends on ``dst`` only through
        ``dst``'s range, so each distinct range is worked out once (replicas, DDP)."""
        los, his = self.plan.ranges.column(m)
        lo, hi = los[self.rank], his[self.rank]
        if self.tiles[m]:
            if hi <= lo:
                return []
            whole = [(m, lo, hi)]
            return [(dst, [(m, lo, a), (m, a, hi)] if a == b and lo < a < hi else whole)
                    for dst, (a, b) in enumerate(zip(los, his)) if dst != self.rank]
        out, known = [], {}
        for dst, own in enumerate(zip(los, his)):
            if dst != self.rank:
                if own not in known:
                    known[own] = self.sent(m, dst, own)
                if known[own]:
                    out.append((dst, known[own]))
        return out

    def holding(self, m: int) -> list[int]:
        """The ranks holding some of matrix ``m``, in rank order."""
        lo, hi = self.plan.ranges.column(m)
        return [r for r, (a, b) in enumerate(zip(lo, hi)) if b > a]


class _Transfer:
    """A started all_to_all: ``wait()`` waits, drops the work handle and hands the buffers to
    :func:`.inflight.settle` (the process group's thread may still reference them)."""

    def __init__(self, work, tensors: tuple[Tensor, Tensor], before: list[int]) -> None:
        self.work, self.tensors, self.before = work, tensors, before

    def wait(self) -> None:
        self.work.wait()
        self.work = None
        inflight.settle(self.tensors, self.before)
        self.tensors = ()


class Exchange:
    """Runs a :class:`Plan` on this rank: gradients to owners, the per-matrix computation, updates back.

    ``grads[m]`` is this rank's flat gradient piece of matrix m (``hi - lo`` elements in the matrix's
    canonical order, on any device; ``None`` counts as zeros), ``skip`` the matrices nobody computes
    this step (decided identically on every rank). ``compute(stack, cfg)`` maps a stack of same-shape
    full gradients to their updates and which of them are finite (SWAN's by default; it must not write
    into ``stack``, which may be a view of a local gradient); a non-finite update travels as NaN. ``on_update(m, piece)`` receives this rank's flat piece of each
    computed update, on ``device`` (the communication device); nothing writes into the pieces until
    :meth:`run` returns. Every rank issues the same collectives in the same order whatever its data.

    Each bucket runs as one or more *phases*, each one exchange each way: every computing rank's
    matrices of the bucket cut by cost into parts (``phase_bytes`` of full fp32 matrices per owner and
    phase, at most ``max_phases``; the first and last parts half the size of the others), phase p taking
    every rank's p-th part. Phase p+1's gradients travel while phase p is computed and phase p's updates
    return while phase p+1 is, so only the first phase's gradients and the last phase's updates are
    waited for. Phases are cut from the plan alone, identically on every rank, and change neither
    owners nor bytes.

    Each element of a full gradient is copied once, into the stack it is whitened in: what this rank
    holds straight from its gradient (while the phase's gradients travel), the rest from the receive
    buffer; a matrix alone in its stack that this rank holds whole, contiguous and in fp32 (DDP) is
    whitened from its gradient itself. Each update piece a peer needs is written once, straight into the
    send buffer. A collective that moves nothing on any rank (gradients towards owners under DDP;
    everything in replicated mode under DDP) is not issued. A stack is a phase's whole (shape, config)
    group, or at most ``stack_bytes`` of full fp32 matrices of it (one larger matrix alone): a bound on
    the buffers each whitening call allocates afresh.
    """

    def __init__(self, plan: Plan, rank: int, group: dist.ProcessGroup | None, device: torch.device,
                 dtypes: Sequence[torch.dtype],
                 compute: Callable[[Tensor, Hashable], tuple[Tensor, Tensor]] = swan_compute,
                 phase_bytes: int | None = PHASE_BYTES, max_phases: int = MAX_PHASES,
                 stack_bytes: int | None = None) -> None:
        self.plan, self.rank, self.group, self.device = plan, rank, group, device
        self.dtypes, self.compute = list(dtypes), compute
        self.bytes_sent = 0  # by this rank, both directions, since construction
        self.failure: BaseException | None = None  # what failed here in the last run (see run)
        self._mine = list(plan.ranges[rank])  # this rank's (lo, hi) per matrix
        sources = _Sources(plan, rank)
        self._steps = [self._step(Bucket(ms, b.owners), stack_bytes, sources)
                       for b in plan.buckets for ms in self._phases(b, phase_bytes, max_phases)]

    def _phases(self, bucket: Bucket, phase_bytes: int | None, max_phases: int) -> list[list[int]]:
        """The bucket's matrices cut into phases (bucket order within each), from the plan alone: each
        computing rank's matrices cut by cumulative cost, the first and the last phase half as large as
        the others (their transfers, gradients in before the first and updates out after the last, are
        the ones nothing overlaps)."""
        plan = self.plan
        per_rank: dict[int, list[int]] = {}
        for m in bucket.matrices:  # replicated mode (-1): every rank computes the same list
            per_rank.setdefault(bucket.owners[m], []).append(m)
        most = max((sum(4 * plan.specs[m].numel for m in ms) for ms in per_rank.values()), default=0)
        count = 1 if not phase_bytes else max(1, min(max_phases, round(most / phase_bytes)))
        if count == 1 or not any(self._moves(bucket.matrices, bucket)):
            return [list(bucket.matrices)]
        weights = [1.0] * count if count < 3 else [0.5] + [1.0] * (count - 2) + [0.5]
        ends = [sum(weights[:p + 1]) / sum(weights) for p in range(count)]
        part: dict[int, int] = {}
        for ms in per_rank.values():
            costs = [plan.costs[m] for m in ms]
            total, before = sum(costs), 0.0
            for j, (m, c) in enumerate(zip(ms, costs)):
                mid = (before + c / 2) / total if total > 0 else (j + 0.5) / len(ms)
                part[m] = next((p for p, e in enumerate(ends) if mid < e), count - 1)
                before += c
        phases = [[m for m in bucket.matrices if part[m] == p] for p in range(count)]
        return [p for p in phases if p]

    def _moves(self, matrices: Sequence[int], bucket: Bucket) -> tuple[bool, bool]:
        """Whether any rank sends anything (gradients, updates) for these matrices: where nothing moves in
        a direction on any rank (DDP in replicated mode), no rank issues that collective. Gradients move
        unless every computing rank holds the whole matrix; updates move where an owner is not the only
        holder."""
        plan, held, fwd, bwd = self.plan, self.plan._holding, False, False
        for m in matrices:
            n, o = plan.specs[m].numel, bucket.owners[m]
            if o == -1:
                fwd = fwd or n > 0 and held.whole[m] < plan.world
            else:
                lo, hi = plan.ranges.at(o, m)
                fwd = fwd or n > 0 and (lo, hi) != (0, n)
                bwd = bwd or held.holders[m] > (hi > lo)
            if fwd and bwd:
                break
        return fwd, bwd

    def _step(self, b: Bucket, stack_bytes: int | None, sources: _Sources) -> _Step:
        """This rank's part of one exchange each way, built from the covers it is part of (the segments
        :meth:`Plan.forward_segments` and :meth:`Plan.backward_segments` define, without asking them for
        every pair of ranks): per peer, segments in bucket order, each matrix's in cover order."""
        plan, rank, w = self.plan, self.rank, self.plan.world
        send: list[list[Segment]] = [[] for _ in range(w)]  # gradients to each rank
        recv: list[list[Segment]] = [[] for _ in range(w)]  # gradients from each rank
        bsend: list[list[Segment]] = [[] for _ in range(w)]  # updates to each rank
        brecv: list[list[Segment]] = [[] for _ in range(w)]  # updates from each rank
        own: dict[int, list[Range]] = {}
        for m in b.matrices:
            o = b.owners[m]
            if o in (-1, rank):
                own[m] = []
                for r, lo, hi in sources.cover(m, rank):
                    if r == rank:
                        own[m].append((lo, hi))
                    else:
                        recv[r].append((m, lo, hi))
            if o == -1:
                for d, segs in sources.sent_to_each(m):
                    send[d] += segs
            elif o != rank:
                send[o] += sources.sent(m, o)
                lo, hi = self._mine[m]
                if hi > lo:
                    brecv[o].append((m, lo, hi))
            else:
                for d in sources.holding(m):
                    if d != rank:
                        bsend[d].append((m, *plan.ranges.at(d, m)))
        size = lambda segs: sum(hi - lo for _, lo, hi in segs) if segs else 0  # noqa: E731

        def at(per_rank: list[list[Segment]]) -> dict[int, list[tuple[int, int, int]]]:
            out: dict[int, list[tuple[int, int, int]]] = {}
            offset = 0
            for segs in per_rank:
                for m, lo, hi in segs:
                    out.setdefault(m, []).append((lo, hi, offset))
                    offset += hi - lo
            return out

        groups: dict[tuple, list[int]] = {}
        for m in own:
            spec = plan.specs[m]
            groups.setdefault((spec.shape, spec.cfg, spec.split), []).append(m)
        stacks = []
        for ms in groups.values():
            per = len(ms) if not stack_bytes else max(1, stack_bytes // max(1, 4 * plan.specs[ms[0]].numel))
            stacks += [ms[i:i + per] for i in range(0, len(ms), per)]
        ds = {self.dtypes[m] for m in b.matrices}
        return _Step(list(b.matrices), ([size(s) for s in send], [size(s) for s in recv]),
                     [seg for segs in send for seg in segs], at(recv),
                     ([size(s) for s in bsend], [size(s) for s in brecv]),
                     at(bsend), [seg for segs in brecv for seg in segs], own, stacks,
                     ds.pop() if len(ds) == 1 else torch.float32, self._moves(b.matrices, b))

    def _start(self, pieces: list[Tensor] | Tensor, splits: tuple[list[int], list[int]], dtype: torch.dtype,
               moves: bool = True):
        """Start the all_to_all of ``pieces`` (packed by destination into one buffer, one copy) or of a
        packed buffer; returns ``(transfer, received buffer)``, ``transfer`` None where no rank sends anything."""
        if not moves:
            return None, torch.empty(0, dtype=dtype, device=self.device)
        if isinstance(pieces, Tensor):
            inp = pieces
        elif not pieces:
            inp = torch.empty(0, dtype=dtype, device=self.device)
        elif len(pieces) == 1 and pieces[0].dtype == dtype and pieces[0].device == self.device:
            inp = pieces[0].contiguous()  # nothing writes into gradients during the step
        else:
            inp = torch.cat([p.to(self.device, dtype) for p in pieces])  # .to: no copy where it is already so
        in_splits, out_splits = splits
        out = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        self.bytes_sent += inp.numel() * inp.element_size()
        before = inflight.counts(inp, out)
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        return _Transfer(work, (inp, out), before), out

    def run(self, grads: Sequence[Tensor | None], skip: set[int], on_update: Callable[[int, Tensor], None]) -> int:
        """One step; returns the number of matrices this rank whitened.

        An exception raised here while assembling, computing or handing back updates (an owner out of
        memory, a failing ``on_update``) is kept in :attr:`failure`, not raised: this rank then computes
        and hands back nothing more, fills what it owed its peers with NaN (the flag they skip those
        updates by) and still issues every collective of the step, so that no peer waits for it; the
        caller announces the failure to every rank."""
        my = self._mine
        self.failure: BaseException | None = None

        def grad_piece(m: int, lo: int, hi: int) -> Tensor:
            g = grads[m]
            if g is None or m in skip:
                return torch.zeros(hi - lo, dtype=self.dtypes[m], device=self.device)
            return g[lo - my[m][0]: hi - my[m][0]]

        def start_forward(k: int):
            st = self._steps[k]
            return self._start([grad_piece(*seg) for seg in st.fwd_send], st.fwd, st.dtype, st.moves[0])

        whitened = 0
        pending_fwd = start_forward(0) if self._steps else None
        pending_bwd = None
        for k, st in enumerate(self._steps):
            work, recv = pending_fwd
            pending_fwd = start_forward(k + 1) if k + 1 < len(self._steps) else None
            send, done = self._phase(st, work, recv, grads, skip, on_update)
            whitened += done
            bwd = self._start(send, st.bwd, st.dtype, st.moves[1])
            if pending_bwd is not None:
                self._finish_backward(*pending_bwd, skip, on_update)
            pending_bwd = (*bwd, st.bwd_recv)
        if pending_bwd is not None:
            self._finish_backward(*pending_bwd, skip, on_update)
        return whitened

    def _phase(self, st: _Step, work, recv: Tensor, grads: Sequence[Tensor | None], skip: set[int],
               on_update: Callable[[int, Tensor], None]) -> tuple[Tensor, int]:
        """One phase's computation on this rank: its stacks assembled (what it holds while the gradients
        travel, then the received rest), computed, its own pieces handed to ``on_update`` and its peers'
        written into the returned send buffer; and the number of matrices whitened."""
        my, whitened, stacks = self._mine, 0, []
        try:
            if self.failure is None:
                stacks = [(ms, self._own_part(st, ms, grads)) for ms in
                          ([m for m in ms if m not in skip] for ms in st.stacks) if ms]
        except Exception as e:  # noqa: BLE001 - kept for the caller; the collectives go on
            self.failure = e
        if work is not None:
            work.wait()
        send = torch.empty(sum(st.bwd[0]), dtype=st.dtype, device=self.device)
        try:
            for ms, stack in stacks if self.failure is None else ():
                for row, m in zip(stack, ms):  # the received rest
                    for lo, hi, off in st.recv_at.get(m, ()):
                        row[lo:hi].copy_(recv[off: off + hi - lo])
                whitened += len(ms) * matrices_in(self.plan.specs[ms[0]].shape, self.plan.specs[ms[0]].split)
                for m, u in zip(ms, self._compute(ms, stack)):
                    lo, hi = my[m]
                    if hi > lo:
                        on_update(m, u[lo:hi])
                    for lo, hi, off in st.send_at.get(m, ()):
                        send[off: off + hi - lo].copy_(u[lo:hi])
        except Exception as e:  # noqa: BLE001
            self.failure = e
        if self.failure is not None:
            send.fill_(float("nan"))
        for m in skip:  # skipped matrices keep their (zero-filled) place
            for lo, hi, off in st.send_at.get(m, ()):
                send[off: off + hi - lo].zero_()
        return send, whitened

    def _own_part(self, st: _Step, ms: list[int], grads: Sequence[Tensor | None]) -> Tensor:
        """The stack ``(len(ms), numel)`` of the full fp32 gradients of ``ms`` in canonical order, with
        what this rank holds written from its gradients (the rest comes from the received buffer); a
        matrix alone that this rank holds whole, contiguous and in fp32: a view of its gradient."""
        numel = self.plan.specs[ms[0]].numel
        my = self._mine
        if len(ms) == 1:
            g = grads[ms[0]]
            if (g is not None and st.own[ms[0]] == [(0, numel)] and g.dtype == torch.float32
                    and g.device == self.device and g.is_contiguous()):
                return g.view(1, numel)
        stack = torch.empty(len(ms), numel, dtype=torch.float32, device=self.device)
        for row, m in zip(stack, ms):
            g, base = grads[m], my[m][0]
            for lo, hi in st.own[m]:
                if g is None:
                    row[lo:hi].zero_()
                else:
                    row[lo:hi].copy_(g[lo - base: hi - base])
        return stack

    def _compute(self, ms: list[int], stack: Tensor) -> Tensor:
        """Flat canonical-order updates (one row each) of one stack of same (shape, config, split) matrices;
        a row that came out non-finite is NaN (:func:`update_canonical`)."""
        specs = [self.plan.specs[m] for m in ms]
        return update_canonical(stack, [s.layout for s in specs], specs[0].shape, specs[0].split,
                                lambda x: self.compute(x, specs[0].cfg))[0]

    def _finish_backward(self, work, recv: Tensor, segs: list[Segment], skip: set[int],
                         on_update: Callable[[int, Tensor], None]) -> None:
        if work is not None:
            work.wait()
        if self.failure is not None:  # this rank hands back nothing more
            return
        offset = 0
        try:
            for m, lo, hi in segs:
                if m not in skip:
                    on_update(m, recv[offset: offset + hi - lo])
                offset += hi - lo
        except Exception as e:  # noqa: BLE001 - kept for the caller
            self.failure = e


# Device types each backend runs all_to_all / all_gather on. gloo's all_to_all is CPU-only, so a
# gloo group moves CUDA pieces to the CPU; "undefined" is ``init_process_group()`` without a backend,
# whose per-device backends torch creates lazily from its default map (cpu: gloo, cuda: nccl, ...).
_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",), "mpi": ("cpu",), "ucc": ("cpu", "cuda"),
                    "xccl": ("xpu",), "hccl": ("npu",)}


def served_devices(backend: str) -> tuple[str, ...]:
    """The device types a process group's backend string serves, in preference order: ``"nccl"``,
    ``"gloo"``, combined ``"cuda:nccl,cpu:gloo"``, or ``"undefined"``."""
    backend = str(backend).lower()
    if backend == "undefined":
        return tuple(dict.fromkeys(dist.Backend.default_device_backend_map))
    out: list[str] = []
    for part in backend.split(","):
        dev, _, name = part.strip().rpartition(":")
        out += [dev] if dev else list(_BACKEND_DEVICES.get(name, ()))
    if not out:
        raise ValueError(f"swan_dist: process-group backend {backend!r} is unknown; pass SWAN(process_group=...) with a "
                         f"group of a known backend ({', '.join(_BACKEND_DEVICES)})")
    return tuple(dict.fromkeys(out))


def comm_device(backend: str, tensor_devices: Sequence[torch.device], current: dict[str, int] | None = None) -> torch.device:
    """Where the exchange's buffers (and so the owners' math and the step's collectives) live, decided
    from what every rank sees alike, so that all ranks use the same backend for the same collective: the
    first accelerator type the group serves that is available here (``current``: the current index per
    available accelerator type), at the index of this rank's pieces on it, else the current one
    (CPU-offloaded pieces move there and back); otherwise the CPU where the group serves it."""
    served = served_devices(backend)
    current = current or {}
    for t in served:
        if t != "cpu" and t in current:
            index = next((d.index for d in tensor_devices if d.type == t and d.index is not None), current[t])
            return torch.device(t, index)
    if "cpu" in served:
        return torch.device("cpu")
    return torch.device(served[0], 0)
