"""SWAN on real multi-process gloo with DDP and FSDP2: equal to single-process SWAN on the same global
gradients, same collective path on every rank for bad input and misconfiguration, and
torch.distributed.checkpoint round trips across world sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import check_exchange_dtypes, exchange_bytes, exchange_dtype_runs, run_distributed
from swan_dist import SWAN

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    """Rows not divisible by 2, 3 or 4; a 2-row matrix (smaller than the world); untied head."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 7, bias=False)
        self.narrow = nn.Linear(7, 2)
        self.mid = nn.Linear(2, 9, bias=False)
        self.output = nn.Linear(9, 11, bias=False)

    def forward(self, x):
        h = self.tok_embeddings(x)
        h = torch.tanh(self.down(torch.relu(self.up(h))))
        return self.output(self.mid(self.narrow(h)))


def _global_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _reference(step_grads, opts, steps, start_state=None):
    """Single-process SWAN on the same global gradients."""
    torch.manual_seed(0)
    ref = Net()
    if start_state is not None:
        ref.load_state_dict(start_state)
    opt = SWAN(ref, verbose=False, **opts)
    for t in steps:
        grads = step_grads(ref, t)
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        opt.step()
    return ref


def _shard_fsdp2(model: nn.Module, world: int, hsdp: bool = False):
    """FSDP2 on a 1-D mesh, or with ``hsdp`` on a 2-D (replicate, shard) mesh of 2 x world/2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = (2, world // 2) if hsdp else (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    for m in (model.up, model.down, model.narrow, model.mid, model.output):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def _set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(grads[n], p.device_mesh, p.placements)
        else:
            p.grad = grads[n].clone()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


# the fallback rules (AdamW, sign, sgd; with weight decay) run on the DTensors' local shards: compared
# with plain tensors here
OPTS = [dict(preset="swan_ddagger", lr=0.05, weight_decay=0.05),
        dict(preset="swan_dagger", lr=0.05, weight_decay=0.1, ns_steps=4, fallback="sign"),
        dict(preset="swan_ddagger", lr=0.05, weight_decay=0.1, fallback="sgd")]


def _fsdp2_worker(rank, world, mode, hsdp=False):
    out = []
    for opts in OPTS:
        torch.manual_seed(0)
        model = Net()
        _shard_fsdp2(model, world, hsdp)
        opt = SWAN(model, verbose=rank == 0, mode=mode, bucket_mb=0.0001, **opts)
        for t in range(3):
            _set_grads(model, _global_grads(model, t))
            opt.step()
        ref = _reference(_global_grads, opts, range(3))
        got = _full(model)
        err = max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        plan = None if opt.exchange is None else [b.owners for b in opt.exchange.plan.buckets]
        out.append((err, plan, opt.whitened_matrices))
    if world in (2, 4) and mode == "auto":
        out.append(exchange_dtype_runs(lambda xd: _fsdp2_exchange(world, hsdp, xd)))
    return out


def _fsdp2_exchange(world, hsdp, exchange_dtype):
    """This rank's weights after 3 steps with the owner exchange sending ``exchange_dtype``."""
    torch.manual_seed(0)
    model = Net()
    _shard_fsdp2(model, world, hsdp)
    opt = SWAN(model, verbose=False, bucket_mb=0.0001, exchange_dtype=exchange_dtype, **OPTS[0])
    for t in range(3):
        _set_grads(model, _global_grads(model, t))
        opt.step()
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}, exchange_bytes(opt)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fsdp2_equals_single_process(world):
    """NSDS and NS (with weight decay) presets; uneven and empty shards; several buckets where W < 4."""
    res = run_distributed(_fsdp2_worker, world, "auto")
    for c in range(len(OPTS)):
        per_rank = [r[c] for r in res]
        assert max(r[0] for r in per_rank) < 2e-5, per_rank
        assert all(r[1] == per_rank[0][1] for r in per_rank)  # the same plan on every rank
        assert sum(r[2] for r in per_rank) == 3 * 4  # each of the 4 matrices whitened once per step
        if world > 1:  # every matrix is above bucket_mb: a bucket holds one per owner, W side by side
            buckets = per_rank[0][1]
            assert len(buckets) >= -(-4 // world), buckets  # several where W < 4
            assert all(len(set(b.values())) == len(b) for b in buckets), buckets
    if world in (2, 4):  # exchange_dtype: bf16 within its bound of fp32, half the bytes; "param" as fp32
        check_exchange_dtypes([r[-1] for r in res], OPTS[0]["lr"], 3)


def test_fsdp2_hsdp_2d_mesh_equals_single_process():
    """(Replicate, Shard(0)) placements: replicas hold the same rows; nothing is sent twice to an owner."""
    res = run_distributed(_fsdp2_worker, 4, "auto", True)
    for c in range(len(OPTS)):
        assert max(r[c][0] for r in res) < 2e-5
        assert all(r[c][1] == res[0][c][1] for r in res)
        assert sum(r[c][2] for r in res) == 3 * 4
    check_exchange_dtypes([r[-1] for r in res], OPTS[0]["lr"], 3)
    for rank, replica in ((0, 2), (1, 3)):  # an owner applies its update rounded as its replicas receive it
        for n, w in res[rank][-1]["bf16"][0].items():
            assert torch.equal(w, res[replica][-1]["bf16"][0][n]), n


def test_fsdp2_replicated_mode_equals_owner_mode():
    res = run_distributed(_fsdp2_worker, 3, "replicated")
    for c in range(len(OPTS)):
        assert max(r[c][0] for r in res) < 2e-5
        assert sum(r[c][2] for r in res) == 3 * 3 * 4  # every rank whitens every matrix


def _batches(step: int, world: int) -> torch.Tensor:
    """Each rank's micro-batch of tokens at ``step``, stacked: (world, 3, 5)."""
    return torch.randint(0, 11, (world, 3, 5), generator=torch.Generator().manual_seed(500 + step))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def _ddp_worker(rank, world, mode):
    """DDP's reducer makes the gradients (each rank its own micro-batch, averaged by DDP); the reference
    is one process on the whole batch, whose mean loss has the same gradient."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    init = [p.detach().clone() for p in model.module.parameters()]
    opt = SWAN(model.module, verbose=False, mode=mode, preset="swan_ddagger", lr=0.05)
    torch.manual_seed(0)
    ref = Net()
    ref_opt = SWAN(ref, verbose=False, mode="local", preset="swan_ddagger", lr=0.05)
    for t in range(3):
        batches = _batches(t, world)
        opt.zero_grad()
        _loss(model, batches[rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, batches.reshape(-1, 5)).backward()
        ref_opt.step()
    err = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(model.module.parameters(), ref.parameters()))
    moved = min((p.detach() - q).abs().max().item() for p, q in zip(model.module.parameters(), init))
    return err, opt.whitened_matrices, moved


@pytest.mark.parametrize("mode", ["owner", "replicated", "local"])
def test_ddp_modes_equal_single_process(mode):
    res = run_distributed(_ddp_worker, 2, mode)
    assert max(r[0] for r in res) < 2e-5 and min(r[2] for r in res) > 1e-3, res
    assert sum(r[1] for r in res) == (3 * 4 if mode == "owner" else 2 * 3 * 4)


def _mismatch_worker(rank, world):
    torch.manual_seed(0)
    model = Net()
    _shard_fsdp2(model, world)
    opt = SWAN(model, verbose=False, beta=0.5 if rank == 1 else 0.4)
    _set_grads(model, _global_grads(model, 0))
    opt.step()


def _count_mismatch_worker(rank, world):
    torch.manual_seed(0)
    model = Net()
    named = [(n, p) for n, p in model.named_parameters() if not (rank == 1 and n == "up.bias")]
    opt = SWAN(named, verbose=False)
    _set_grads(model, _global_grads(model, 0))
    opt.step()


def test_mismatched_config_raises_on_every_rank():
    res = run_distributed(_mismatch_worker, 3, raw=True)
    assert all(r[0] == "error" and r[2] == "ValueError" for r in res), res
    assert all("'beta'" in r[3] and "rank 1" in r[3] for r in res), res[0][3]
    res = run_distributed(_count_mismatch_worker, 2, raw=True)  # different parameter lists: no hang
    assert all(r[0] == "error" and r[2] == "ValueError" and "rank 1" in r[3] for r in res), res


def _bad_input_worker(rank, world):
    torch.manual_seed(0)
    model = Net()
    _shard_fsdp2(model, world)
    opt = SWAN(model, verbose=False, preset="swan_ddagger", lr=0.05)
    before = _full(model)
    grads = _global_grads(model, 0)
    grads["up.weight"][9, 0] = float("nan")  # the last row lives on the last rank only
    grads["down.weight"].zero_()
    _set_grads(model, grads)
    model.mid.weight.grad = None  # no gradient on any rank: not updated
    if rank == 0:
        model.narrow.weight.grad = None  # a missing local piece counts as zeros
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    after = _full(model)
    ref_grads = dict(grads)
    ref_grads["narrow.weight"] = grads["narrow.weight"].clone()
    ref_grads["narrow.weight"][: -(-2 // world)] = 0  # rank 0's rows
    ref = _reference(lambda m, t: {n: g for n, g in ref_grads.items()}, dict(preset="swan_ddagger", lr=0.05), [0])
    with torch.no_grad():
        ref.mid.weight.copy_(before["mid.weight"])  # the reference had a gradient there
    return {
        "up_unchanged": torch.equal(after["up.weight"], before["up.weight"]),
        "down_unchanged": torch.equal(after["down.weight"], before["down.weight"]),
        "mid_unchanged": torch.equal(after["mid.weight"], before["mid.weight"]),
        "narrow_err": (after["narrow.weight"] - ref.narrow.weight.detach()).abs().max().item(),
        "finite": all(torch.isfinite(v).all().item() for v in after.values()),
        "warned": any("up.weight" in str(w.message) for w in caught),
        "skips": dict(opt.nonfinite_skips),
    }


def test_nan_zero_and_missing_grads_take_the_same_path_on_every_rank():
    res = run_distributed(_bad_input_worker, 3)
    for r in res:
        assert r["up_unchanged"] and r["down_unchanged"] and r["mid_unchanged"] and r["finite"], r
        assert r["narrow_err"] < 2e-5 and r["warned"] and r["skips"] == {"up.weight": 1}, r


def _dcp_worker(rank, world, ckpt, phase):
    """phase 'save': steps 0-1, save, steps 2-3. phase 'load': load, steps 2-3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = Net()
    _shard_fsdp2(model, world)
    opt = SWAN(model, verbose=False, preset="swan_ddagger", lr=0.05)
    steps = range(2, 4)
    if phase == "save":
        for t in range(2):
            _set_grads(model, _global_grads(model, t))
            opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        swan = ("up.weight", "down.weight", "narrow.weight", "mid.weight")
        swan_state = {k: v for k, v in osd["state"].items() if k in swan}
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        swan_state = None
    for t in steps:
        _set_grads(model, _global_grads(model, t))
        opt.step()
    return _full(model), swan_state


def test_dcp_checkpoint_saved_at_2_resumes_identically_at_1_and_4(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_dcp_worker, 2, ckpt, "save")
    final, swan_state = saved[0]
    assert swan_state == {k: {} for k in ("up.weight", "down.weight", "narrow.weight", "mid.weight")}  # empty
    for world in (1, 4):
        resumed = run_distributed(_dcp_worker, world, ckpt, "load")
        for n, v in final.items():
            assert torch.allclose(resumed[0][0][n], v, atol=2e-6), (world, n)


# FSDP1: tests/test_fsdp1.py


def test_local_mode_on_shards_raises_on_every_rank():
    """A 2-row matrix at W=3: rank 0 holds it whole, the others hold nothing; all ranks still raise."""
    res = run_distributed(_fsdp2_worker, 3, "local", raw=True)
    assert all(r[0] == "error" and r[2] == "ValueError" and "mode='local'" in r[3] for r in res), res
