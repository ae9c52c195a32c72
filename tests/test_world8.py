"""Eight real ranks (gloo on loopback): FSDP2 on a 1-D mesh, HSDP on a 2 x 4 (replicate, shard) mesh with
the exchange over the world and inside each replica's shard group, and FSDP2 + TP on a 4 x 2 (dp, tp)
mesh, each equal to single-process SWAN on the same global gradients. One process launch serves every
case. DeepSpeed ZeRO-3 and Megatron TP=2 x DP=4 at W=8 sit with their integration's other tests
(tests/test_deepspeed.py, tests/test_megatron_core.py).

The tiny ``Net``'s matrices have 10, 7, 2 and 9 rows: at W=8 FSDP2's ``torch.chunk`` row shards are
uneven, the 2-row matrix leaves six ranks empty, and with four matrices at least four ranks own none."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import test_distributed_optimizer as D
import test_tensor_parallel as T
from dist_utils import run_distributed
from swan_dist import SWAN

pytestmark = pytest.mark.timeout(600)
WORLD = 8
STEPS = 3


def _peers(opt: SWAN) -> tuple[set[int], int]:
    """The global ranks this rank sent gradient or update bytes to in its exchange, and how many bytes
    of a step's splits went to another rank."""
    ex = opt.exchange
    ranks = dist.get_process_group_ranks(ex.group or dist.group.WORLD)
    me = dist.get_rank()
    peers = {ranks[d] for st in ex.steps for splits in (st.grads.send, st.updates.send) for d, n in enumerate(splits) if n}
    return peers - {me}, ex.bytes_sent


def _fsdp2_case(rank: int, hsdp: bool, exchange: str) -> list[dict]:
    """Every fallback rule of D.OPTS, STEPS steps each: the error against one process, the plan, the
    whitening count and the exchange's peers."""
    out = []
    for opts in D.OPTS:
        torch.manual_seed(0)
        model = D.Net()
        mesh = D._shard_fsdp2(model, WORLD, hsdp)
        group = mesh["shard"].get_group() if exchange == "shard group" else None
        opt = SWAN(model, verbose=False, bucket_mb=0.0001, process_group=group, **opts)
        for t in range(STEPS):
            D._set_grads(model, D._global_grads(model, t))
            opt.step()
        ref = D._reference(D._global_grads, opts, range(STEPS))
        got = D._full(model)
        peers, sent = _peers(opt)
        out.append(dict(err=max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()),
                        plan=[b.owners for b in opt.exchange.plan.buckets], whitened=opt.whitened_matrices,
                        peers=peers, sent=sent, owned=sum(o == opt.exchange.rank for b in opt.exchange.plan.buckets
                                                           for o in b.owners)))
    return out


def _worker(rank, world):
    return {"fsdp2": _fsdp2_case(rank, False, "world"),
            "hsdp, world": _fsdp2_case(rank, True, "world"),
            "hsdp, shard group": _fsdp2_case(rank, True, "shard group"),
            "fsdp2+tp 4x2": T._tp_worker(rank, world, 4)}


_DONE: dict = {}


def _results() -> dict[str, list]:
    """{case: [rank results]} from the one launch of 8 processes."""
    if not _DONE:
        per_rank = run_distributed(_worker, WORLD, timeout=540)
        _DONE.update({case: [r[case] for r in per_rank] for case in per_rank[0]})
    return _DONE


@pytest.mark.parametrize("case", ["fsdp2", "hsdp, world"])
def test_w8_fsdp2_and_hsdp_over_the_world_equal_single_process(case):
    """Each matrix is whitened once per step over all 8 ranks; the same plan on every rank; ranks that
    own nothing exist and still receive their shards' updates."""
    res = _results()[case]
    for c in range(len(D.OPTS)):
        per_rank = [r[c] for r in res]
        assert max(r["err"] for r in per_rank) < 2e-5, (case, c, [r["err"] for r in per_rank])
        assert all(r["plan"] == per_rank[0]["plan"] for r in per_rank)
        assert sum(r["whitened"] for r in per_rank) == STEPS * 4
        assert sum(r["owned"] == 0 for r in per_rank) >= WORLD - 4


def test_w8_hsdp_exchange_inside_the_shard_group_sends_nothing_across_replicas():
    """``process_group=mesh["shard"].get_group()``: each replica group of 4 whitens every matrix once per
    step, and no gradient or update byte leaves it; the exchange over the world, for contrast, sends
    across replicas (one owner per matrix for all 8 ranks)."""
    shard = _results()["hsdp, shard group"]
    for c in range(len(D.OPTS)):
        per_rank = [r[c] for r in shard]
        assert max(r["err"] for r in per_rank) < 2e-5, [r["err"] for r in per_rank]
        assert sum(r["whitened"] for r in per_rank) == 2 * STEPS * 4  # once per replica group
        for rank, r in enumerate(per_rank):
            replica = set(range(4)) if rank < 4 else set(range(4, 8))
            assert r["peers"] and r["peers"] <= replica, (rank, r["peers"])
        assert per_rank[0]["plan"] == per_rank[4]["plan"]  # the two groups plan alike
    world = _results()["hsdp, world"]
    crossing = [r[0]["peers"] - (set(range(4)) if rank < 4 else set(range(4, 8))) for rank, r in enumerate(world)]
    assert any(crossing)


def test_w8_fsdp2_plus_tp_4x2_equals_single_process():
    res = _results()["fsdp2+tp 4x2"]
    for r in res:
        assert r["err"] < 2e-5 and r["moved"] > 1e-3, r
        assert r["real"]["loss"] < 1e-5 and r["real"]["err"] < 5e-5 and r["real"]["moved"] > 1e-3, r["real"]
        assert r["plan"] == res[0]["plan"]
    assert res[0]["placements"]["layers.0.feed_forward.w1.weight"] .startswith("(_StridedShard(dim=0")
    assert sum(r["whitened"] for r in res) == (T.STEPS + 1) * T.MATRICES
