"""This rank's schedule of a plan's exchange: per bucket phase, what it sends and receives each way and
where every segment sits in the buffers (:class:`Step`), built from only the covers this rank is part
of (:class:`Sources`, :class:`Holders`), so that one rank's schedule at W = 1,024 costs about its own
pieces, not W² covers.

Each bucket runs as one or more *phases*, each one exchange each way: every computing rank's matrices
of the bucket cut by cost into parts (``phase_bytes`` of full fp32 matrices per owner and phase, at
most ``max_phases``; the first and last parts half the size of the others), phase p taking every rank's
p-th part. Phases are cut from the plan alone, identically on every rank, and change neither owners
nor bytes.

An update buffer carries, per peer, the update segments and then one *finite flag* per segment (1 where
the owner's update of that matrix is finite; 0 or NaN otherwise, NaN where the owner failed and filled
all it owed with NaN), so a receiver knows what to apply without looking at the values.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..layout import Range
from ..plan import EVERY_RANK, Bucket, Plan, Segment

__all__ = ["Step", "Splits", "Moves", "Slot", "Holders", "Sources", "build_steps", "PHASE_BYTES", "MAX_PHASES"]

# A bucket runs in phases of about this many bytes of full fp32 matrices per owner, at most MAX_PHASES
# of them, so that its transfers overlap the math. Each phase is one collective each way: a few MiB
# keep gloo's per-call cost small against the transfer it hides.
PHASE_BYTES = 4 << 20
MAX_PHASES = 4


class Splits(NamedTuple):
    """Elements one ``all_to_all_single`` sends to / receives from each rank."""

    send: list[int]
    recv: list[int]


class Moves(NamedTuple):
    """Whether any rank sends gradients / updates in a phase (else no rank issues that collective)."""

    grads: bool
    updates: bool


class Slot(NamedTuple):
    """Where elements ``[lo, hi)`` of a matrix sit in a buffer: at ``offset``; in an update buffer its
    finite flag at ``flag``."""

    lo: int
    hi: int
    offset: int
    flag: int = -1


@dataclass
class Step:
    """One exchange each way on this rank: a bucket, or one phase of it."""

    matrices: list[int]
    grads: Splits  # gradient elements to / from each rank
    grads_out: list[Segment]  # what this rank sends, in packing order
    grads_in: dict[int, list[Slot]]  # matrix -> where its pieces from peers sit in the received buffer
    updates: Splits  # update elements (and flags) to / from each rank
    updates_out: dict[int, list[Slot]]  # matrix -> where peers' pieces of its update go in the send buffer
    updates_in: dict[int, list[Slot]]  # matrix -> where this rank's piece of its update sits when received
    own: dict[int, list[Range]]  # per matrix this rank computes: the ranges it takes from itself
    stacks: list[list[int]]  # the matrices this rank computes, in stacks of one (shape, config, split)
    dtype: torch.dtype  # the communication dtype
    moves: Moves


class Holders:
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


class Sources:
    """The covers one rank's exchange needs, from the plan's ranges: the whole cover of each matrix it
    computes, and its own pieces of the covers of the matrices others compute. Ranges that tile a matrix
    (FSDP, ZeRO) need no search for the latter: a holder's piece of any cover is its whole range."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.tiles = plan.holding.tiles
        self._last: tuple[int, Holders] | None = None  # the matrix asked about last (a step asks matrix by matrix)

    def holders(self, m: int) -> Holders:
        if self._last is None or self._last[0] != m:
            self._last = (m, Holders(self.plan.specs[m].numel, *self.plan.ranges.column(m), self.tiles[m]))
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


def build_steps(plan: Plan, rank: int, dtypes: Sequence[torch.dtype], stack_bytes: int | None = None,
                phase_bytes: int | None = PHASE_BYTES, max_phases: int = MAX_PHASES) -> list[Step]:
    """This rank's steps of ``plan``: every bucket's phases in order."""
    sources = Sources(plan, rank)
    return [_step(plan, rank, dtypes, Bucket(ms, b.owners), stack_bytes, sources)
            for b in plan.buckets for ms in _phases(plan, b, phase_bytes, max_phases)]


def _phases(plan: Plan, bucket: Bucket, phase_bytes: int | None, max_phases: int) -> list[list[int]]:
    """The bucket's matrices cut into phases (bucket order within each), from the plan alone: each
    computing rank's matrices cut by cumulative cost, the first and the last phase half as large as the
    others (their transfers, gradients in before the first and updates out after the last, are the ones
    nothing overlaps)."""
    per_rank: dict[int, list[int]] = {}
    for m in bucket.matrices:  # replicated mode (EVERY_RANK): every rank computes the same list
        per_rank.setdefault(bucket.owners[m], []).append(m)
    most = max((sum(4 * plan.specs[m].numel for m in ms) for ms in per_rank.values()), default=0)
    count = 1 if not phase_bytes else max(1, min(max_phases, round(most / phase_bytes)))
    if count == 1 or not any(moves(plan, bucket.matrices, bucket)):
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


def moves(plan: Plan, matrices: Sequence[int], bucket: Bucket) -> Moves:
    """Whether any rank sends anything (gradients, updates) for these matrices: where nothing moves in a
    direction on any rank (DDP in replicated mode), no rank issues that collective. Gradients move unless
    every computing rank holds the whole matrix; updates move where an owner is not the only holder."""
    held, fwd, bwd = plan.holding, False, False
    for m in matrices:
        n, o = plan.specs[m].numel, bucket.owners[m]
        if o == EVERY_RANK:
            fwd = fwd or n > 0 and held.whole[m] < plan.world
        else:
            lo, hi = plan.ranges.at(o, m)
            fwd = fwd or n > 0 and (lo, hi) != (0, n)
            bwd = bwd or held.holders[m] > (hi > lo)
        if fwd and bwd:
            break
    return Moves(fwd, bwd)


def _size(segs: list[Segment]) -> int:
    return sum(hi - lo for _, lo, hi in segs)


def place(per_rank: list[list[Segment]], flags: bool = False) -> dict[int, list[Slot]]:
    """Where each segment sits in a buffer packed rank after rank (each rank's segments in order, then,
    with ``flags``, one flag per segment): ``matrix -> [Slot]``."""
    out: dict[int, list[Slot]] = {}
    offset = 0
    for segs in per_rank:
        first_flag = offset + _size(segs)
        for j, (m, lo, hi) in enumerate(segs):
            out.setdefault(m, []).append(Slot(lo, hi, offset, first_flag + j if flags else -1))
            offset += hi - lo
        if flags:
            offset += len(segs)
    return out


def stacks_of(plan: Plan, mine: Sequence[int], stack_bytes: int | None) -> list[list[int]]:
    """The matrices a rank computes in a phase, in stacks of one (shape, config, split), each at most
    ``stack_bytes`` of full fp32 matrices (one larger matrix alone)."""
    groups: dict[tuple, list[int]] = {}
    for m in mine:
        spec = plan.specs[m]
        groups.setdefault((spec.shape, spec.cfg, spec.split), []).append(m)
    stacks = []
    for ms in groups.values():
        per = len(ms) if not stack_bytes else max(1, stack_bytes // max(1, 4 * plan.specs[ms[0]].numel))
        stacks += [ms[i:i + per] for i in range(0, len(ms), per)]
    return stacks


def _step(plan: Plan, rank: int, dtypes: Sequence[torch.dtype], b: Bucket, stack_bytes: int | None,
          sources: Sources) -> Step:
    """This rank's part of one exchange each way, built from the covers it is part of (the segments
    :meth:`Plan.forward_segments` and :meth:`Plan.backward_segments` define, without asking them for every
    pair of ranks): per peer, segments in bucket order, each matrix's in cover order."""
    w = plan.world
    send: list[list[Segment]] = [[] for _ in range(w)]  # gradients to each rank
    recv: list[list[Segment]] = [[] for _ in range(w)]  # gradients from each rank
    bsend: list[list[Segment]] = [[] for _ in range(w)]  # updates to each rank
    brecv: list[list[Segment]] = [[] for _ in range(w)]  # updates from each rank
    own: dict[int, list[Range]] = {}
    for m in b.matrices:
        o = b.owners[m]
        if o in (EVERY_RANK, rank):
            own[m] = []
            for r, lo, hi in sources.cover(m, rank):
                if r == rank:
                    own[m].append((lo, hi))
                else:
                    recv[r].append((m, lo, hi))
        if o == EVERY_RANK:
            for d, segs in sources.sent_to_each(m):
                send[d] += segs
        elif o != rank:
            send[o] += sources.sent(m, o)
            lo, hi = plan.ranges.at(rank, m)
            if hi > lo:
                brecv[o].append((m, lo, hi))
        else:
            for d in sources.holding(m):
                if d != rank:
                    bsend[d].append((m, *plan.ranges.at(d, m)))
    ds = {dtypes[m] for m in b.matrices}
    return Step(list(b.matrices), Splits([_size(s) for s in send], [_size(s) for s in recv]),
                [seg for segs in send for seg in segs], place(recv),
                Splits([_size(s) + len(s) for s in bsend], [_size(s) + len(s) for s in brecv]),
                place(bsend, flags=True), place(brecv, flags=True), own, stacks_of(plan, list(own), stack_bytes),
                ds.pop() if len(ds) == 1 else torch.float32, moves(plan, b.matrices, b))
