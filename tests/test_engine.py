"""The owner-rank engine: the planner (pure) and the exchange on real gloo processes, checked against
single-process SWAN on the same global gradients."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from swan_dist.functional import WhitenConfig, swan_update
from swan_dist.plan import MatrixSpec, cover
from swan_dist.whitening import swan_exchange, swan_plan

NSDS = WhitenConfig()
NS = WhitenConfig(method="ns", steps=5, beta=0.8)

# Rows not divisible by 2, 3 or 4, a matrix smaller than the world, a 1-row matrix, a stack of 3.
SHAPES = [(10, 6), (7, 12), (2, 5), (1, 9), (13, 13), (3, 4, 5), (6, 10)]


def _specs(cfgs=(NSDS, NS)):
    return [MatrixSpec(f"m{i}", s, cfgs[i % len(cfgs)]) for i, s in enumerate(SHAPES)]


def _row_shards(shape, world):
    """FSDP2-style torch.chunk row shards (uneven, possibly empty) as flat ranges."""
    rows, row = shape[0], 1
    for d in shape[1:]:
        row *= d
    per = -(-rows // world)
    return [(min(r * per, rows) * row, min((r + 1) * per, rows) * row) for r in range(world)]


def _random_ranges(numel, world, rng):
    """Arbitrary contiguous cut points (empty pieces included) plus one rank holding everything."""
    cuts = sorted(rng.randint(0, numel) for _ in range(world - 1))
    bounds = [0, *cuts, numel]
    out = [(bounds[r], bounds[r + 1]) for r in range(world)]
    if world > 2:
        out[rng.randrange(world)] = (0, numel)
    return out


# ---------------------------------------------------------------------------------------- planner
def test_cover_prefers_local_and_fills_from_holders():
    spec = MatrixSpec("w", (4, 5), NSDS)
    ranges = [(0, 8), (8, 20), (5, 14)]
    assert cover(ranges, 2, spec) == [(0, 0, 5), (2, 5, 14), (1, 14, 20)]
    with pytest.raises(ValueError, match="no rank holds elements \\[8"):
        cover([(0, 8), (10, 20)], 0, spec)


def test_plan_is_deterministic_balanced_and_bucketed():
    rng = random.Random(0)
    specs = [MatrixSpec(f"m{i}", (rng.choice([64, 128, 256]), rng.choice([64, 256])), NS) for i in range(40)]
    ranges = [[_row_shards(s.shape, 4)[r] for s in specs] for r in range(4)]
    budget = 256 * 256 * 4 * 3  # per owner and bucket: three of the largest matrices
    a = swan_plan(specs, ranges, bucket_bytes=budget)
    b = swan_plan(specs, ranges, bucket_bytes=budget)
    assert [x.owners for x in a.buckets] == [x.owners for x in b.buckets]
    assert len(a.buckets) > 1
    for bucket in a.buckets:
        assert sum(4 * specs[m].numel for m in bucket.matrices) <= 4 * budget
        for r in range(4):
            assert sum(4 * specs[m].numel for m, o in bucket.owners.items() if o == r) <= budget
    assert a.balance() < 1.3, a.balance()
    rep = swan_plan(specs, ranges, mode="replicated")
    assert all(o == -1 for bk in rep.buckets for o in bk.owners.values())


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_moved_is_the_minimum_for_even_shards(world):
    specs = [MatrixSpec(f"m{i}", (8 * world, 16), NSDS) for i in range(6)]
    ranges = [[_row_shards(s.shape, world)[r] for s in specs] for r in range(world)]
    plan = swan_plan(specs, ranges)
    total = sum(4 * s.numel for s in specs)
    assert plan.bytes_moved() == 2 * (world - 1) * total // world


def test_replicated_ranges_send_nothing_towards_owners():
    specs = [MatrixSpec(f"m{i}", (5, 7), NSDS) for i in range(4)]
    plan = swan_plan(specs, [[(0, 35)] * 4 for _ in range(3)])
    fwd = sum(len(plan.forward_segments(b, s, d)) for b in plan.buckets for s in range(3) for d in range(3))
    assert fwd == 0 and plan.bytes_moved() == 4 * 2 * 4 * 35  # each update to the 2 other ranks


def test_plan_rejects_bad_ranges():
    spec = MatrixSpec("w", (4, 5), NSDS)
    with pytest.raises(ValueError, match="invalid range"):
        swan_plan([spec], [[(0, 21)], [(0, 0)]])
    with pytest.raises(ValueError, match="no rank holds"):
        swan_plan([spec], [[(0, 10)], [(12, 20)]])
    with pytest.raises(ValueError, match="mode"):
        swan_plan([spec], [[(0, 20)]], mode="ring")


# ---------------------------------------------------------------------------------------- exchange
def _exchange_worker(rank, world, cases):
    """Each case: (mode, layout, bucket_bytes, Exchange options, skipped matrices, matrices without a
    gradient on rank 0). Returns per case (max error, owners, #buckets, #phases, #all_to_all calls)."""
    out = []
    for mode, layout, bucket_bytes, opts, skip, none0 in cases:
        torch.manual_seed(world)
        specs = _specs()
        fulls = [torch.randn(s.shape) for s in specs]  # same on every rank: the "global gradients"
        rng = random.Random(world)
        all_ranges = [_row_shards(s.shape, world) if layout == "rows" else [(0, s.numel)] * world if layout == "whole"
                      else _random_ranges(s.numel, world, rng) for s in specs]
        ranges = [[all_ranges[m][r] for m in range(len(specs))] for r in range(world)]
        gathered = [None] * world
        dist.all_gather_object(gathered, ranges[rank])
        plan = swan_plan(specs, gathered, mode, bucket_bytes)
        opts = dict(opts)
        sent = opts.pop("dtype", torch.float32)  # the dtype the pieces travel in
        ex = swan_exchange(plan, rank, None, torch.device("cpu"), [sent] * len(specs), **opts)
        calls = []
        a2a = dist.all_to_all_single
        dist.all_to_all_single = lambda *a, **k: calls.append(a[0].numel()) or a2a(*a, **k)
        for m in none0:  # rank 0 has no gradient for it: its piece counts as zeros
            fulls[m].reshape(-1)[slice(*ranges[0][m])] = 0.0
        grads = [None if rank == 0 and m in none0 else fulls[m].reshape(-1)[lo:hi].clone()
                 for m, (lo, hi) in enumerate(ranges[rank])]
        before = [g.clone() if g is not None else None for g in grads]
        got = {}

        def keep(m, u, finite):
            assert u.dtype == (sent if ex.steps[0].moves.updates else torch.float32), u.dtype
            got[m] = u.float() if finite else torch.full_like(u, float("nan"), dtype=torch.float32)

        try:
            ex.run(grads, set(skip), keep)
        finally:
            dist.all_to_all_single = a2a
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(grads, before))  # gradients untouched
        errs = []
        for m, (lo, hi) in enumerate(ranges[rank]):
            ref = swan_update(fulls[m], specs[m].cfg)[0].reshape(-1)[lo:hi]
            if hi > lo and m not in skip:
                errs.append((got[m] - ref).abs().max().item())
            else:
                assert m not in got
        out.append((max(errs, default=0.0), [b.owners for b in plan.buckets], len(plan.buckets), len(ex.steps),
                    len(calls)))
    return out


# (mode, layout, bucket_bytes, Exchange options, skip, no gradient on rank 0)
CASES = [
    ("owner", "rows", 1 << 30, {}, (), ()),
    ("owner", "random", 200, {}, (), ()),
    ("replicated", "random", 600, {}, (), ()),
    # phases of ~100 bytes per owner (several per bucket), every matrix alone in its stack
    ("owner", "rows", 1 << 30, dict(phase_bytes=100, stack_bytes=1), (), ()),
    ("owner", "random", 1 << 30, dict(phase_bytes=150, stack_bytes=1), (1, 4), (0, 5)),
    ("replicated", "random", 1 << 30, dict(phase_bytes=150, stack_bytes=1 << 30), (2,), (4,)),
    ("owner", "random", 300, dict(stack_bytes=1 << 30), (0, 6), (3,)),
    # every rank holds everything (DDP): owners receive nothing (no forward collective), every update
    # goes back; in replicated mode nothing moves and no collective is issued, one phase per bucket
    ("owner", "whole", 1 << 30, dict(phase_bytes=100), (), ()),
    ("replicated", "whole", 1 << 30, dict(phase_bytes=100), (), ()),
    # gradient and update pieces sent in bf16: within bf16's rounding of the fp32 update (below)
    ("owner", "random", 200, dict(dtype=torch.bfloat16), (1,), (0,)),
]
BF16_UPDATE = 2 ** -6  # an update (RMS 1) from gradients and sent back in bf16 (2^-8 each way), against fp32


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_matches_single_process_swan(world):
    """Uneven row shards, arbitrary cut points with empty and overlapping pieces, whole matrices on every
    rank (DDP), NS and NSDS, several buckets and several phases per bucket, stacks of one matrix and of
    whole groups, skipped matrices and missing gradients; owner and replicated modes; identical plans,
    phases and collectives on every rank; gradients never written."""
    res = run_distributed(_exchange_worker, world, CASES)
    for c, case in enumerate(CASES):
        per_rank = [r[c] for r in res]
        bf16 = case[3].get("dtype") == torch.bfloat16
        assert max(r[0] for r in per_rank) < (BF16_UPDATE if bf16 else 1e-5), (case, per_rank)
        if bf16:
            assert max(r[0] for r in per_rank) > 1e-5, per_rank  # it rounded
        assert all(r[1] == per_rank[0][1] for r in per_rank), case
        assert all(r[3] == per_rank[0][3] for r in per_rank), case  # the same phases everywhere
        if case[2] < 1000:
            assert per_rank[0][2] > 1, case
        assert all(r[4] == per_rank[0][4] for r in per_rank), case  # the same collectives everywhere
        if case[:2] == ("replicated", "whole"):
            assert per_rank[0][3] == per_rank[0][2] and per_rank[0][4] == 0, (case, per_rank[0])
        elif case[3].get("phase_bytes"):
            assert per_rank[0][3] > per_rank[0][2], case
        if case[:2] == ("owner", "whole"):
            assert per_rank[0][4] == per_rank[0][3], (case, per_rank[0])  # one (backward) per phase


def test_transient_bound_follows_the_exchange_dtype():
    """The buffers a step adds are the bytes sent and received: half under a bf16 exchange; the fp32
    stacks and the whitening workspace do not change."""
    specs = _specs()
    ranges = [[_row_shards(s.shape, 4)[r] for s in specs] for r in range(4)]
    plan = swan_plan(specs, ranges, "owner", 1 << 30)
    fp32, bf16 = (swan_exchange(plan, 0, None, torch.device("cpu"), [d] * len(specs)).transient_bound()
                  for d in (torch.float32, torch.bfloat16))
    assert fp32["grad_buffers"] > 0 and fp32["update_buffers"] > 0, fp32
    assert 2 * bf16["grad_buffers"] == fp32["grad_buffers"] and 2 * bf16["update_buffers"] == fp32["update_buffers"]
    assert bf16["matrices"] == fp32["matrices"] and bf16["workspace"] == fp32["workspace"]


def test_exchange_dtype_rule_and_its_check():
    """``auto``: bf16 where the owner whitens in bf16 (NSDS on CUDA), else the parameter's dtype (NS; the
    CPU, pinned to fp32 whitening in the tests); explicit choices on any device; anything else refused
    naming the key."""
    from swan_dist import SWAN
    from swan_dist.whitening import exchange_dtype_of

    cuda, cpu, f32, bf16 = torch.device("cuda"), torch.device("cpu"), torch.float32, torch.bfloat16
    assert exchange_dtype_of("auto", NSDS, f32, cuda) == bf16
    assert exchange_dtype_of("auto", NS, f32, cuda) == f32 and exchange_dtype_of("auto", NS, torch.float16, cuda) == torch.float16
    assert exchange_dtype_of("auto", NSDS, f32, cpu) == f32
    assert exchange_dtype_of("auto", WhitenConfig(dtype="bfloat16"), f32, cpu) == bf16
    for device in (cpu, cuda):
        assert exchange_dtype_of("bf16", NS, f32, device) == bf16 and exchange_dtype_of("fp32", NSDS, bf16, device) == f32
        assert exchange_dtype_of("param", NSDS, f32, device) == f32
    with pytest.raises(ValueError, match="exchange_dtype"):
        SWAN(torch.nn.Linear(4, 4), verbose=False, exchange_dtype="fp16")
