"""The plan: who computes which matrix, in which bucket, from every rank's ranges (knows ranks and
ranges, not frameworks nor SWAN: the per-matrix cost is passed in).

- buckets and owners (:mod:`.packing`): in ``owner`` mode one rank per matrix; each bucket is one
  exchange in each direction and ends at its slowest owner, so matrices are grouped into buckets (not
  necessarily consecutive) and owners to minimise Σ over buckets of the slowest owner's cost, each owner
  assembling at most ``bucket_bytes`` of full fp32 matrices per bucket (one larger matrix alone); in
  ``replicated`` mode every rank computes every matrix (the paper's "w/o MP"), in buckets of
  consecutive matrices;
- sources (:func:`cover`): for each (matrix, computing rank) a disjoint cover of ``[0, numel)`` by
  ranges of the holders, preferring what the computing rank already holds (nothing is sent for it).

The plan is identical on every rank: same inputs, same float operations.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence

from ..layout import ROW_MAJOR, Layout, Range
from .packing import EVERY_RANK, Bucket, owner_buckets, replicated_buckets
from .ranges import Holding, Ranges, checked_ranges, holding_of

__all__ = ["Matrix", "MatrixSpec", "Bucket", "Plan", "Segment", "build_plan", "cover", "row_shard_ranges"]

Segment = tuple[int, int, int]  # (matrix index, lo, hi)


class Matrix(Protocol):
    """What the planner and the exchange need of a matrix (a :class:`MatrixSpec`, or the engine's record)."""

    key: str  # its name, for errors
    shape: tuple[int, ...]  # full shape in the paper's orientation (out, in); leading dims: a stack
    cfg: Hashable  # the per-matrix computation's options: matrices of one (shape, cfg, split) are stacked
    layout: Layout  # the canonical order the ranks' ranges number elements in
    split: tuple[int, ...]  # row pattern of a fused matrix computed as separate parts

    @property
    def numel(self) -> int: ...


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


@dataclass
class Plan:
    """Buckets and owners for ``specs`` given every rank's ``ranges``; identical on every rank."""

    specs: list[Matrix]
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
    def holding(self) -> Holding:
        return holding_of(self.ranges, [s.numel for s in self.specs])

    def computes(self, rank: int, m: int, bucket: Bucket) -> bool:
        o = bucket.owners[m]
        return o == EVERY_RANK or o == rank

    def computers(self, m: int, bucket: Bucket) -> list[int]:
        o = bucket.owners[m]
        return list(range(self.world)) if o == EVERY_RANK else [o]

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
                if o == EVERY_RANK:
                    total += self.world * n - total_held[m]
                else:
                    lo, hi = self.ranges.at(o, m)
                    total += n - (hi - lo) + total_held[m] - (hi - lo)
        return total * elem_bytes


def row_shard_ranges(specs: Sequence[Matrix], world: int) -> list[list[Range]]:
    """Every rank's range of every matrix under FSDP2's ``torch.chunk`` along dim 0: rank r holds rows
    ``[r * ceil(m / W), ...)`` (an expert stack: whole experts), empty past the end. The layout the
    planner's tests and benchmarks use."""
    out = [[(0, 0)] * len(specs) for _ in range(world)]
    for m, s in enumerate(specs):
        row, per = math.prod(s.shape[1:]), -(-s.shape[0] // world)
        for r in range(world):
            out[r][m] = (min(r * per, s.shape[0]) * row, min((r + 1) * per, s.shape[0]) * row)
    return out


def cover(ranges: Sequence[Range], dst: int, spec: Matrix) -> list[tuple[int, int, int]]:
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
    specs: Sequence[Matrix],
    ranges: Sequence[Sequence[Range]],
    mode: str = "owner",
    bucket_bytes: int = 256 << 20,
    *,
    cost: Callable[[Matrix], float],
) -> Plan:
    """Deterministic plan from the matrices and every rank's ranges (same input → same plan); ``cost`` is
    the per-matrix cost model the owners are balanced on (SWAN's: :func:`swan_dist.whitening.swan_cost`)."""
    if mode not in ("owner", "replicated"):
        raise ValueError(f"mode must be 'owner' or 'replicated', got {mode!r}")
    numels = [s.numel for s in specs]
    plan = Plan(list(specs), checked_ranges(specs, numels, ranges), [], mode, [float(cost(s)) for s in specs])
    for m, hole in enumerate(plan.holding.holes):  # every matrix must be fully held by someone
        if hole:
            lo, hi = plan.ranges.column(m)
            cover(list(zip(lo, hi)), 0, specs[m])  # raises, naming the first hole
    nbytes = [4 * n for n in numels]
    if mode == "replicated":  # every rank computes every matrix: consecutive matrices, `bucket_bytes` each
        plan.buckets = replicated_buckets(nbytes, bucket_bytes)
    else:
        plan.buckets = owner_buckets(plan.costs, nbytes, plan.ranges, bucket_bytes)
    return plan

