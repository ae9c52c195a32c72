"""Every rank's range of every matrix (:class:`Ranges`), and what they say about each matrix
(:class:`Holding`: who holds some or all of it, whether the ranges tile it, whether some element is
held by no rank), computed in one vectorised pass."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import chain
from typing import Iterator, Sequence

import torch
from torch import Tensor

from ..layout import Range

__all__ = ["Ranges", "RankRanges", "Holding", "holding_of", "checked_ranges"]


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
class Holding:
    """Per matrix, what every rank's range says about it (one vectorised pass over all ranges)."""

    holders: list[int]  # ranks holding some of it
    whole: list[int]  # ranks holding all of it
    tiles: list[bool]  # the holders' ranges are pairwise disjoint (FSDP, ZeRO): each element has one source
    holes: list[bool]  # some element is held by no rank


def holding_of(ranges: Ranges, numels: Sequence[int]) -> Holding:
    """:class:`Holding` from the ranges sorted by start per matrix (the empty ones last)."""
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
    return Holding(holders.tolist(), whole.tolist(), tiles.tolist(), holes.tolist())




def checked_ranges(specs: Sequence, numels: Sequence[int], ranges: Sequence[Sequence[Range]]) -> Ranges:
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
