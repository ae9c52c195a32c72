"""The step engine over any set of entries (swan_dist.engine.run_step through SWAN.step_entries): stepping
the model one block at a time (the same blocks on every rank, each with its own memo: agreement, plans)
gives the weights the whole step gives, under DDP and FSDP2 (uneven shards) at W = 2 and 4, with an lr
schedule; and a fault injected on one rank inside a block's step is every rank's error, as in the whole
step."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import swan_dist.rules.fallback as fallback
import swan_dist.whitening as whitening
from swan_dist import SWAN

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    """An embedding and a head (fallback), and blocks of matrices whose row counts the ranks cannot share
    evenly (5, 7, 9 rows)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 9)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(9, 7, bias=False), nn.Linear(7, 5), nn.Linear(5, 9))
                                    for _ in range(3))
        self.head = nn.Linear(9, 11)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _wrapped(kind, world):
    torch.manual_seed(0)
    model = Net()
    if kind == "ddp":
        return model, nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def _blocks(model):
    """The sets stepped one at a time: each block's parameters, then the rest (embedding, head)."""
    sets = [list(b.parameters()) for b in model.blocks]
    seen = {id(p) for s in sets for p in s}
    return sets + [[p for p in model.parameters() if id(p) not in seen]]


def _local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _train(kind, world, rank, by_block, steps=3):
    model, wrapped = _wrapped(kind, world)
    opt = SWAN(model, preset="swan_ddagger", lr=0.02, weight_decay=0.1, verbose=False, bucket_mb=0.0005)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    whitened = 0
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * t + rank)
        wrapped(torch.randint(0, 11, (3, 5), generator=g)).float().pow(2).mean().backward()
        if by_block:
            for k, params in enumerate(_blocks(model)):
                entries, failure = opt.collect_entries(params)
                assert len(entries) == len(params) and failure is None
                whitened += opt.step_entries(entries, failure, memo=k).whitened
        else:
            opt.step()
        sched.step()
        opt.zero_grad()
    if steps and not by_block:  # every piece that is a tensor's own (local) storage was kept for reuse,
        # DTensors (FSDP2) included; empty local shards are asked again
        kept = len(opt._collector.reuse)
        assert kept == sum(1 for p in model.parameters() if _local(p).numel()), (kept, kind)
    return {n: _local(p) for n, p in model.named_parameters()}, opt.whitened_matrices, whitened


def _equal_worker(rank, world, kind):
    whole, n_whole, _ = _train(kind, world, rank, by_block=False)
    blocks, n_blocks, counted = _train(kind, world, rank, by_block=True)
    err = max((whole[n] - blocks[n]).abs().max().item() if whole[n].numel() else 0.0 for n in whole)
    moved = all(not torch.equal(blocks[n], v) for n, v in _train(kind, world, rank, False, steps=0)[0].items()
                if v.numel())
    return err, n_whole, n_blocks, counted, moved


@pytest.mark.parametrize("kind, world", [("ddp", 2), ("ddp", 4), ("fsdp2", 2), ("fsdp2", 4)])
def test_stepping_block_by_block_equals_the_whole_step(kind, world):
    results = run_distributed(_equal_worker, world, kind)
    assert sum(r[1] for r in results) == sum(r[2] for r in results) == sum(r[3] for r in results) == 3 * 9
    for err, _, _, _, moved in results:
        assert err < 1e-6 and moved, (kind, world, err, moved)


def _fault_worker(rank, world, kind, fault):
    model, wrapped = _wrapped(kind, world)
    opt = SWAN(model, preset="swan_ddagger", lr=0.02, verbose=False, bucket_mb=0.0005)
    wrapped(torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(rank))).float().pow(2).mean().backward()
    module, name = (whitening, "swan_update") if fault == "whiten" else (fallback, "run_fallback")
    original, calls = getattr(module, name), []

    def boom(*a, **k):
        calls.append(1)
        raise ValueError(f"injected {fault}")

    sets = _blocks(model)
    params = sets[0] + sets[1] + sets[-1]  # six matrices (every rank owns some) and the fallback's tensors
    if rank == world - 1:
        setattr(module, name, boom)
    try:
        entries, failure = opt.collect_entries(params)
        opt.step_entries(entries, failure, memo="part")
        err = None
    except Exception as e:  # noqa: BLE001 - what the test checks
        err = (type(e).__name__, str(e))
    finally:
        setattr(module, name, original)
    plan = opt.plans_for("part").last.plan
    owners = {plan.specs[m].key: o for b in plan.buckets for m, o in b.owners.items()}
    return err, len(calls), owners


@pytest.mark.parametrize("kind, world", [("ddp", 2), ("fsdp2", 4)])
@pytest.mark.parametrize("fault", ["whiten", "fallback"])
def test_a_fault_inside_a_block_step_is_every_ranks_error(kind, world, fault):
    results = run_distributed(_fault_worker, world, kind, fault)
    last = world - 1
    for rank, (err, calls, owners) in enumerate(results):
        if fault == "whiten" and last not in owners.values():
            pytest.fail(f"rank {last} owns nothing in the block: {owners}")
        assert (calls > 0) == (rank == last), (rank, calls)  # the patch ran where it was set, only there
        assert err is not None and err[0] == "ValueError" and f"injected {fault}" in err[1], (rank, err)
        if rank != last:
            assert f"on rank {last}" in err[1], err
