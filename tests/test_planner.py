"""The owner planner (pure, no processes): balance against lower bounds, byte bounds, every matrix once,
oversize matrices, locality and determinism."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from swan_dist.functional import WhitenConfig
from swan_dist.plan import MatrixSpec, row_shard_ranges
from swan_dist.whitening import swan_plan

NSDS = WhitenConfig()
NS = WhitenConfig(method="ns", steps=5, beta=0.8)


_row_ranges = row_shard_ranges


def _llama_like(cfg, layers=32, dim=64, ffn=172):
    """LLaMA's per-layer matrices (4 attention dim x dim, 3 MLP ffn x dim / dim x ffn), scaled down."""
    shapes = [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn), (ffn, dim)]
    return [MatrixSpec(f"l{i}.{j}", s, cfg) for i in range(layers) for j, s in enumerate(shapes)]


def _mix(seed, n=120):
    rng = random.Random(seed)
    return [MatrixSpec(f"m{i}", (rng.choice([16, 32, 48, 64, 96]), rng.choice([32, 64, 128])), rng.choice([NS, NSDS]))
            for i in range(n)]


def _check_invariants(plan, specs, bucket_bytes):
    world = plan.world
    planned = sorted(m for b in plan.buckets for m in b.matrices)
    assert planned == list(range(len(specs)))  # every matrix exactly once
    for b in plan.buckets:
        assert b.matrices and sorted(b.owners) == sorted(b.matrices)
        assert all(0 <= r < world for r in b.owners.values())
        nbytes = [4 * specs[m].numel for m in b.matrices]
        # the bucket's bound: W owners' shares, a matrix above bucket_bytes filling its owner's share
        assert len(b.matrices) == 1 or sum(min(n, bucket_bytes) for n in nbytes) <= world * bucket_bytes
        for r in range(world):  # each owner: at most bucket_bytes of full matrices, or one larger matrix alone
            mine = [m for m in b.matrices if b.owners[m] == r]
            assert len(mine) <= 1 or sum(4 * specs[m].numel for m in mine) <= bucket_bytes, (r, mine)
    per_bucket, whole = plan.bounds()
    assert plan.slowest() >= per_bucket * (1 - 1e-12) and plan.slowest() >= whole * (1 - 1e-12)


# -------------------------------------------------------------------------------------- balance
@pytest.mark.parametrize("cfg", [NS, NSDS], ids=["ns", "nsds"])
@pytest.mark.parametrize("world", [4, 8])
def test_llama_like_layers_within_5_percent_of_both_bounds(cfg, world):
    """Several byte-bounded buckets (three MLP matrices per owner and bucket): Σ over buckets of the
    slowest owner within 1.05x of the per-bucket bound and of the whole-model bound (the previous
    planner, consecutive buckets balanced one by one, reached 1.07-1.16 of the latter here and put
    more than `bucket_bytes` on some owners)."""
    specs = _llama_like(cfg)
    bucket_bytes = 3 * 4 * 172 * 64
    plan = swan_plan(specs, _row_ranges(specs, world), bucket_bytes=bucket_bytes)
    _check_invariants(plan, specs, bucket_bytes)
    assert len(plan.buckets) > 1
    per_bucket, whole = plan.bounds()
    assert plan.slowest() <= 1.05 * per_bucket, plan.slowest() / per_bucket
    assert plan.slowest() <= 1.05 * whole, plan.slowest() / whole


@pytest.mark.parametrize("seed,world", [(0, 8), (2, 8), (8, 8), (2, 4), (4, 4)])
def test_irregular_mix_within_5_percent_of_both_bounds(seed, world):
    specs = _mix(seed)
    bucket_bytes = 4 * 4 * 96 * 128
    plan = swan_plan(specs, _row_ranges(specs, world), bucket_bytes=bucket_bytes)
    _check_invariants(plan, specs, bucket_bytes)
    assert len(plan.buckets) > 1
    per_bucket, whole = plan.bounds()
    assert plan.slowest() <= 1.05 * per_bucket, plan.slowest() / per_bucket
    assert plan.slowest() <= 1.05 * whole, plan.slowest() / whole


def test_fewer_matrices_than_ranks_one_owner_each():
    specs = _llama_like(NS, layers=2)
    plan = swan_plan(specs, _row_ranges(specs, 64))
    assert len(plan.buckets) == 1 and len(set(plan.buckets[0].owners.values())) == len(specs)
    assert plan.slowest() == max(plan.costs) == plan.bounds()[1]


# ------------------------------------------------------------------------------ bounds and invariants
@pytest.mark.parametrize("seed", range(12))
def test_every_matrix_once_and_byte_bounds_on_random_inputs(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 5, 8, 16])
    specs = [MatrixSpec(f"m{i}", tuple(rng.choice([1, 3, 8, 16, 40]) for _ in range(rng.choice([2, 2, 3]))),
                        rng.choice([NS, NSDS])) for i in range(rng.randint(0, 60))]
    bucket_bytes = rng.choice([16, 400, 2000, 10**6])
    plan = swan_plan(specs, _row_ranges(specs, world), bucket_bytes=bucket_bytes)
    _check_invariants(plan, specs, bucket_bytes)


def test_matrices_larger_than_the_bound():
    """Above `bucket_bytes`: alone on its owner in its bucket (others may work beside it); above
    W x `bucket_bytes` (a bucket's bound): a bucket of its own."""
    world, bucket_bytes = 4, 1000
    small = [MatrixSpec(f"s{i}", (5, 5), NS) for i in range(20)]  # 100 B
    big = [MatrixSpec(f"b{i}", (20, 20), NS) for i in range(3)]  # 1600 B: > bucket_bytes, <= 4 x bucket_bytes
    huge = [MatrixSpec("h", (40, 40), NS)]  # 6400 B > 4 x bucket_bytes
    specs = small[:7] + big[:1] + huge + small[7:] + big[1:]
    plan = swan_plan(specs, _row_ranges(specs, world), bucket_bytes=bucket_bytes)
    _check_invariants(plan, specs, bucket_bytes)
    h = specs.index(huge[0])
    assert [b.matrices for b in plan.buckets if h in b.matrices] == [[h]]
    for b in plan.buckets:
        for m in b.matrices:
            if specs[m].key.startswith("b"):
                assert [k for k in b.matrices if b.owners[k] == b.owners[m]] == [m]
    assert any(len(b.matrices) > 1 and any(specs[m].key.startswith("b") for m in b.matrices) for b in plan.buckets)



@pytest.mark.parametrize("world", [4, 8])
def test_every_owner_whitens_a_matrix_above_the_bound_in_the_same_bucket(world):
    """LLaMA-70B's case scaled down: the MLP matrices exceed `bucket_bytes`, so each sits alone on its
    owner, but W of them share a bucket (one per owner): the critical path meets the whole-model bound
    (3.4x it at W=8 when such a matrix counted in full against the bucket's W x `bucket_bytes`)."""
    specs = _llama_like(NSDS, layers=8, dim=64, ffn=224)  # MLP 224 x 64 fp32: 57 KiB; attention 16 KiB
    bucket_bytes = 4 * 64 * 64  # one attention matrix per owner and bucket
    plan = swan_plan(specs, _row_ranges(specs, world), bucket_bytes=bucket_bytes)
    _check_invariants(plan, specs, bucket_bytes)
    per_bucket, whole = plan.bounds()
    assert plan.slowest() <= 1.05 * whole, plan.slowest() / whole
    big = [m for m, s in enumerate(specs) if 4 * s.numel > bucket_bytes]
    assert max(sum(m in big for m in b.matrices) for b in plan.buckets) == world

# -------------------------------------------------------------------------------------- locality
def test_owner_is_a_rank_holding_the_matrix_when_it_costs_nothing():
    """ZeRO-like flat partitions (each matrix wholly on one rank): the owners are the holders, nothing
    moves towards them."""
    world = 4
    specs = [MatrixSpec(f"m{i}", (6, 6), NS) for i in range(world)]
    ranges = [[(0, 36) if m == (r + 1) % world else (0, 0) for m in range(world)] for r in range(world)]
    plan = swan_plan(specs, ranges)
    assert plan.buckets[0].owners == {m: (m - 1) % world for m in range(world)}
    assert sum(len(plan.forward_segments(b, s, d)) for b in plan.buckets for s in range(world) for d in range(world)) == 0


@pytest.mark.parametrize("world, per_rank", [(2, 4), (3, 2), (4, 3)])
def test_equal_matrices_held_whole_are_computed_where_they_lie(world, per_rank):
    """A distributed optimizer's contiguous shards: rank r holds matrices r*k .. r*k+k-1 whole, all of one
    shape. A balanced plan can give each rank k of them; with owners exchanged among interchangeable
    matrices it gives each rank its own, and no element moves (without the exchange half of them moved)."""
    n = world * per_rank
    specs = [MatrixSpec(f"m{i}", (8, 8), NS) for i in range(n)]
    ranges = [[(0, 64) if m // per_rank == r else (0, 0) for m in range(n)] for r in range(world)]
    plan = swan_plan(specs, ranges)
    owners = {m: o for b in plan.buckets for m, o in b.owners.items()}
    assert owners == {m: m // per_rank for m in range(n)}
    assert plan.bytes_moved() == 0
    loads = [sum(plan.costs[m] for m, o in owners.items() if o == r) for r in range(world)]
    assert max(loads) == min(loads)  # still balanced


def test_holders_first_keeps_loads_and_takes_only_a_gain():
    """Owners are exchanged only among matrices of equal cost and bytes, and only where fewer elements move."""
    from swan_dist.plan.packing import _holders_first

    costs, nbytes = [1.0, 1.0, 2.0, 2.0], [4, 4, 8, 8]
    held = torch.tensor([[0, 9], [9, 0], [5, 5], [5, 5]])  # held[m][r]
    assert _holders_first({0: 0, 1: 1, 2: 0, 3: 1}, costs, nbytes, held) == {0: 1, 1: 0, 2: 0, 3: 1}
    assert _holders_first({0: 1, 1: 0, 2: 1, 3: 0}, costs, nbytes, held) == {0: 1, 1: 0, 2: 1, 3: 0}
    assert _holders_first({0: 0, 1: 0, 2: 0, 3: 1}, costs, nbytes, held) == {0: 0, 1: 0, 2: 0, 3: 1}  # one rank


# ----------------------------------------------------------------------------------- determinism
_PLAN_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from test_planner import _mix, _row_ranges
from swan_dist.whitening import swan_plan
specs = _mix(3, 90)
plan = swan_plan(specs, _row_ranges(specs, 5), bucket_bytes=4 * 96 * 128 * 3)
print(json.dumps([sorted(b.owners.items()) for b in plan.buckets]))
"""


def test_plan_is_identical_across_processes_and_hash_seeds():
    specs = _mix(3, 90)
    a = swan_plan(specs, _row_ranges(specs, 5), bucket_bytes=4 * 96 * 128 * 3)
    b = swan_plan(list(specs), [list(r) for r in _row_ranges(specs, 5)], bucket_bytes=4 * 96 * 128 * 3)
    here = [sorted(x.owners.items()) for x in a.buckets]
    assert here == [sorted(x.owners.items()) for x in b.buckets]
    script = _PLAN_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(out.stdout) == [[list(p) for p in bk] for bk in here]
