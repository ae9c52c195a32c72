"""The owner engine at large W (pure, no processes): each rank's exchange, built from only the covers that
rank is part of, equals the one the reference definitions (`Plan.forward_segments`, `backward_segments`,
`cover`) give on every rank, for every kind of layout and both modes; the closed-form `bytes_moved`
equals their sum; the compact `Ranges` reads like the lists it replaces; and planning plus one rank's
exchange for LLaMA-70B's matrices at W = 1,024 stays fast and small (a regression guard)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from swan_dist.functional import WhitenConfig
from swan_dist.exchange import Moves, Slot, Splits, Step
from swan_dist.exchange.schedule import Holders, moves
from swan_dist.plan import Bucket, MatrixSpec, Plan, Ranges, cover, row_shard_ranges
from swan_dist.whitening import swan_exchange, swan_plan

NSDS = WhitenConfig()
NS = WhitenConfig(method="ns", steps=5, beta=0.8)
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ reference definitions
def _reference_moves(plan: Plan, matrices, bucket: Bucket) -> Moves:
    """Whether any rank sends gradients / updates, from every rank's range (the definition)."""
    fwd = bwd = False
    for m in matrices:
        n, computers = plan.specs[m].numel, set(plan.computers(m, bucket))
        fwd = fwd or n > 0 and any(tuple(plan.ranges[c][m]) != (0, n) for c in computers)
        bwd = bwd or any(hi > lo for r, (lo, hi) in enumerate(rg[m] for rg in plan.ranges) if r not in computers)
    return Moves(fwd, bwd)


def _reference_step(plan: Plan, rank: int, b: Bucket, stack_bytes, dtypes) -> Step:
    """One rank's step from the segments every pair of ranks exchanges (O(W^2) covers per rank)."""
    w = plan.world
    send = [plan.forward_segments(b, rank, d) for d in range(w)]
    recv = [plan.forward_segments(b, s, rank) for s in range(w)]
    bsend = [plan.backward_segments(b, rank, d) for d in range(w)]
    brecv = [plan.backward_segments(b, s, rank) for s in range(w)]
    size = lambda segs: sum(hi - lo for _, lo, hi in segs)  # noqa: E731

    def at(per_rank, flags=False):  # each rank's segments, then (updates) one finite flag per segment
        out, offset = {}, 0
        for segs in per_rank:
            flag = offset + size(segs)
            for m, lo, hi in segs:
                out.setdefault(m, []).append(Slot(lo, hi, offset, flag if flags else -1))
                offset, flag = offset + hi - lo, flag + 1
            offset += len(segs) if flags else 0
        return out

    mine = [m for m in b.matrices if plan.computes(rank, m, b)]
    own = {m: [(lo, hi) for r, lo, hi in cover([rg[m] for rg in plan.ranges], rank, plan.specs[m]) if r == rank]
           for m in mine}
    groups = {}
    for m in mine:
        spec = plan.specs[m]
        groups.setdefault((spec.shape, spec.cfg, spec.split), []).append(m)
    stacks = []
    for ms in groups.values():
        per = len(ms) if not stack_bytes else max(1, stack_bytes // max(1, 4 * plan.specs[ms[0]].numel))
        stacks += [ms[i:i + per] for i in range(0, len(ms), per)]
    ds = {dtypes[m] for m in b.matrices}
    return Step(list(b.matrices), Splits([size(s) for s in send], [size(s) for s in recv]),
                [seg for segs in send for seg in segs], at(recv),
                Splits([size(s) + len(s) for s in bsend], [size(s) + len(s) for s in brecv]),
                at(bsend, True), at(brecv, True), own, stacks,
                ds.pop() if len(ds) == 1 else torch.float32, _reference_moves(plan, b.matrices, b))


# ---------------------------------------------------------------------------------------- layouts
def _random(specs, world, rng):
    """Some ranks tile each matrix at random cut points (empty pieces included); every other rank holds
    an arbitrary range: overlapping, whole, or empty anywhere (inside another rank's piece too)."""
    out = [[(0, 0)] * len(specs) for _ in range(world)]
    for m, s in enumerate(specs):
        tilers = rng.sample(range(world), rng.randint(1, world))
        cuts = sorted(rng.randint(0, s.numel) for _ in range(len(tilers) - 1))
        bounds = [0, *cuts, s.numel]
        for i, r in enumerate(tilers):
            out[r][m] = (bounds[i], bounds[i + 1])
        for r in set(range(world)) - set(tilers):
            lo = rng.randint(0, s.numel)
            out[r][m] = rng.choice([(lo, rng.randint(lo, s.numel)), (lo, lo), (0, s.numel)])
    return out


def _layout(kind, specs, world, rng):
    if kind == "rows":
        return row_shard_ranges(specs, world)
    if kind == "whole":  # DDP: every rank holds everything
        return [[(0, s.numel) for s in specs] for _ in range(world)]
    if kind == "hsdp":  # shard groups of 2 ranks, replicated across them
        return [row_shard_ranges(specs, 2)[r % 2] for r in range(world)] if world > 1 else row_shard_ranges(specs, 1)
    if kind == "zero":  # each matrix whole on one rank, nothing elsewhere
        return [[(0, s.numel) if m % world == r else (0, 0) for m, s in enumerate(specs)] for r in range(world)]
    return _random(specs, world, rng)


def _specs(rng, count=14):
    shapes = [(10, 6), (7, 12), (2, 5), (1, 9), (13, 13), (3, 4, 5), (6, 10), (24, 8), (0, 4)]
    return [MatrixSpec(f"m{i}", rng.choice(shapes), rng.choice([NS, NSDS])) for i in range(count)]


# ------------------------------------------------------------------------------------------- tests
def test_holders_cover_equals_cover_for_every_rank_and_source():
    """The bisection cover (whole, and one source's pieces) is `cover` exactly, on random layouts."""
    rng = random.Random(0)
    for _ in range(400):
        world = rng.choice([1, 2, 3, 5, 8, 13])
        spec = MatrixSpec("w", (rng.choice([1, 2, 5, 12]), rng.choice([1, 3, 7])), NS)
        col = [rg[0] for rg in _random([spec], world, rng)]
        holders = Holders(spec.numel, [lo for lo, _ in col], [hi for _, hi in col])
        for dst in range(world):
            want = cover(col, dst, spec)
            assert holders.cover(dst, col[dst]) == want, (col, dst)
            for src in range(world):
                assert holders.cover(dst, col[dst], src) == [p for p in want if p[0] == src], (col, dst, src)


@pytest.mark.parametrize("kind", ["rows", "random", "whole", "hsdp", "zero"])
@pytest.mark.parametrize("mode", ["owner", "replicated"])
def test_every_ranks_steps_equal_the_reference(kind, mode):
    """Splits, packing and unpacking orders, offsets, own ranges, stacks, dtypes and which collectives are
    issued: equal to the reference on every rank, for W in {1, 2, 3, 5, 8}, several bucket sizes, phases
    and stack sizes."""
    rng = random.Random(f"{kind}-{mode}")
    for world in (1, 2, 3, 5, 8):
        for bucket_bytes, opts in [(1 << 30, {}), (600, dict(phase_bytes=150, stack_bytes=1)),
                                   (200, dict(phase_bytes=100, stack_bytes=1 << 30))]:
            specs = _specs(rng)
            dtypes = [rng.choice([torch.float32, torch.bfloat16]) for _ in specs]
            plan = swan_plan(specs, _layout(kind, specs, world, rng), mode, bucket_bytes)
            owners = {m: o for b in plan.buckets for m, o in b.owners.items()}
            assert plan.bytes_moved(2) == 2 * sum(
                hi - lo for b in plan.buckets for s in range(world) for d in range(world)
                for _, lo, hi in plan.forward_segments(b, s, d) + plan.backward_segments(b, s, d))
            for rank in range(world):
                ex = swan_exchange(plan, rank, None, CPU, dtypes, **opts)
                for b in plan.buckets:
                    assert moves(plan, b.matrices, b) == _reference_moves(plan, b.matrices, b)
                assert sorted(m for st in ex.steps for m in st.matrices) == list(range(len(specs)))
                for st in ex.steps:
                    want = _reference_step(plan, rank, Bucket(st.matrices, owners), opts.get("stack_bytes"), dtypes)
                    assert st == want, (world, bucket_bytes, rank, st.matrices)
                    for got, ref in [(st.grads_in, want.grads_in), (st.updates_out, want.updates_out),
                                     (st.updates_in, want.updates_in), (st.own, want.own)]:
                        assert list(got.items()) == list(ref.items())  # the same order too


def test_peers_agree_at_w_64():
    """At W = 64 (row shards, owner mode; the reference is too slow here): what each rank sends each peer
    is, segment for segment, what that peer expects from it, both ways."""
    world, rng = 64, random.Random(1)
    specs = [MatrixSpec(f"l{i}.{j}", s, NSDS) for i in range(8)
             for j, s in enumerate([(64, 64)] * 4 + [(172, 64), (64, 172), (172, 64)])]
    plan = swan_plan(specs, _random(specs, world, rng), bucket_bytes=4 * 172 * 64 * 2)
    steps = [swan_exchange(plan, r, None, CPU, [torch.float32] * len(specs)).steps for r in range(world)]

    def by_peer(splits, segs):
        out, i = [], 0
        for n in splits:
            taken = []
            while n:
                m, lo, hi = segs[i]
                taken.append((m, lo, hi))
                n, i = n - (hi - lo), i + 1
            out.append(taken)
        return out

    def received(at, splits, flags=False):  # update buffers: one flag per segment after each peer's segments
        flat = sorted((off, m, lo, hi) for m, segs in at.items() for lo, hi, off, _ in segs)
        segs = [(m, lo, hi) for _, m, lo, hi in flat]
        if not flags:
            return by_peer(splits, segs)
        out, i = [], 0
        for n in splits:
            taken = []
            while n:
                taken.append(segs[i])
                n, i = n - (segs[i][2] - segs[i][1]) - 1, i + 1
            out.append(taken)
        return out

    for k in range(len(steps[0])):
        sent = [by_peer(steps[r][k].grads.send, steps[r][k].grads_out) for r in range(world)]
        got = [received(steps[r][k].grads_in, steps[r][k].grads.recv) for r in range(world)]
        back = [received(steps[r][k].updates_out, steps[r][k].updates.send, True) for r in range(world)]
        back_got = [received(steps[r][k].updates_in, steps[r][k].updates.recv, True) for r in range(world)]
        for s in range(world):
            for d in range(world):
                assert sent[s][d] == got[d][s] and back[s][d] == back_got[d][s], (k, s, d)


def test_ranges_read_like_lists():
    lists = [[(0, 3), (2, 2)], [(3, 6), (0, 4)], [(0, 6), (1, 4)]]
    r = Ranges.of(lists)
    assert len(r) == 3 and r == lists and r[1] == lists[1] and r[-1][0] == (0, 6) and r[0][-1] == (2, 2)
    assert [list(row) for row in r] == lists and r[1:] == lists[1:] and r.column(1) == ([2, 0, 1], [2, 4, 4])
    assert tuple(r[2][1]) == (1, 4) and r.table().shape == (3, 2, 2) and Ranges.of(r) is r
    with pytest.raises(IndexError):
        r[3]
    with pytest.raises(IndexError):
        r[0][2]
    spec = MatrixSpec("w", (2, 3), NS)
    plan = swan_plan([spec, MatrixSpec("v", (2, 2), NS)], lists)
    assert plan.ranges == lists and plan.ranges[1][0] == (3, 6)
    assert Plan(plan.specs, lists, plan.buckets, plan.mode, plan.costs) == plan  # lists are converted


@pytest.mark.timeout(120)
def test_llama_70b_at_w_1024_is_fast_and_small():
    """560 matrices of LLaMA-70B's shapes, FSDP2 row shards, W = 1,024: planning plus one rank's exchange
    within a generous bound (about 1 s on a laptop core; was minutes), ranges at 16 bytes per (rank, matrix)."""
    shapes = [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192), (8192, 28672)]
    specs = [MatrixSpec(f"l{i}.{j}", s, NSDS) for i in range(80) for j, s in enumerate(shapes)]
    world = 1024
    ranges = row_shard_ranges(specs, world)
    start = time.perf_counter()
    plan = swan_plan(specs, ranges)
    ex = swan_exchange(plan, 517, None, CPU, [torch.bfloat16] * len(specs))
    elapsed = time.perf_counter() - start
    assert elapsed < 10, elapsed
    assert plan.ranges == ranges and plan.ranges.flat.itemsize * len(plan.ranges.flat) == 16 * world * len(specs)
    sent = sum(sum(st.grads.send) + sum(st.updates.send) - sum(len(v) for v in st.updates_out.values())
               for st in ex.steps)  # elements, without the updates' finite flags
    mine = [m for b in plan.buckets for m, o in b.owners.items() if o == 517]
    held = lambda r, m: ranges[r][m][1] - ranges[r][m][0]  # noqa: E731
    # the minimum: its piece of every matrix it does not own to the owner, and each holder's piece of its own
    assert sent == sum(held(517, m) for m in range(len(specs)) if m not in mine) + sum(
        held(r, m) for m in mine for r in range(world) if r != 517)
