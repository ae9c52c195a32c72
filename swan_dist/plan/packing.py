"""Packing matrices into buckets and giving each its owner (owner mode), or consecutive buckets
(replicated mode): the planner's policy, on per-matrix costs and bytes alone.

A bucket is a synchronisation point: its exchange waits for its slowest owner. A plan's cost on the
cost model is therefore Σ over buckets of the slowest owner's load, and within a bucket the owners are
interchangeable: planning first cuts the matrices into buckets of at most ``world`` *cells* (one
owner's share of a bucket, with *byte room* for at most ``cell_bytes`` of full fp32 matrices, or one
larger matrix alone: :func:`has_room`), then gives each cell a rank, preferring ranks that already hold
its matrices.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .ranges import Ranges

__all__ = ["Bucket", "EVERY_RANK", "owner_buckets", "replicated_buckets", "has_room", "add_bytes"]

EVERY_RANK = -1  # a bucket's "owner" of a matrix every rank computes (replicated mode)
Cells = list[list[int]]  # one bucket: its owners' shares, each a list of matrices


@dataclass
class Bucket:
    """One exchange each way: its matrices, and who computes each."""

    matrices: list[int]
    owners: dict[int, int]  # matrix -> owner rank, or EVERY_RANK


def has_room(used: int, n: int, cell_bytes: int) -> bool:
    """The byte room rule: whether a cell holding ``used`` bytes of full matrices takes one of ``n`` bytes
    (within ``cell_bytes``; a larger matrix only into an empty cell, which it then fills)."""
    return used + n <= cell_bytes if n <= cell_bytes else used == 0


def add_bytes(used: int, n: int, cell_bytes: int) -> int:
    """A cell's bytes once a matrix of ``n`` bytes is in it (:func:`has_room` said yes): a matrix larger than
    ``cell_bytes`` leaves it full."""
    return used + n if n <= cell_bytes else cell_bytes + 1


def replicated_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Replicated mode: consecutive matrices, up to ``bucket_bytes`` each (a larger one alone)."""
    out: list[Bucket] = []
    current: list[int] = []
    size = 0
    for m, n in enumerate(nbytes):
        if current and size + n > bucket_bytes:
            out.append(Bucket(current, {k: EVERY_RANK for k in current}))
            current, size = [], 0
        current.append(m)
        size += n
    if current:
        out.append(Bucket(current, {k: EVERY_RANK for k in current}))
    return out


def owner_buckets(costs: Sequence[float], nbytes: Sequence[int], ranges: Ranges, bucket_bytes: int) -> list[Bucket]:
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
    used: int = 0  # bytes of full fp32 matrices (add_bytes)
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
    levels: list[_Level] = []
    for m in sorted(ms, key=lambda m: (-costs[m], -nbytes[m], m)):
        c, n = costs[m], nbytes[m]
        best = None
        for k, level in enumerate(levels):
            for load, used in level.states:
                if not has_room(used, n, cell_bytes):
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
        cell.used = add_bytes(cell.used, n, cell_bytes)
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
                if has_room(used[i], nbytes[m], cell_bytes):
                    break
                full.append((load[i], i))
            else:
                return None
            load[i] += costs[m]
            used[i] = add_bytes(used[i], nbytes[m], cell_bytes)
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
            room = [i for i in range(k) if has_room(used[i], nbytes[m], cell_bytes)]
            if not room:
                return None
            i = min(room, key=lambda i: (load[i], i))
            load[i] += costs[m]
            used[i] = add_bytes(used[i], nbytes[m], cell_bytes)
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
