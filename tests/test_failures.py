"""One rank's fault is every rank's clear error, within seconds, and damages no weight: under DDP, FSDP2,
FSDP1, tensor parallelism and DeepSpeed ZeRO-2 (real forward/backward, gloo), a fault injected on the last rank while the others run normally:
an adapter raising while pieces are listed, the fallback rule raising, the owner's whitening raising, an
owner out of memory, a NaN made inside the whitening, a NaN lr from a scheduler. Every rank must end the
step with the expected error (the failing rank its own, the others one naming it), and matrices the
failing rank owned keep their weights on every rank."""

import time
import warnings

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import swan_dist.collect as collect
import swan_dist.functional as F
import swan_dist.rules.fallback as fallback
import swan_dist.whitening as whitening
from swan_dist import SWAN

pytestmark = pytest.mark.timeout(420)

FAULTS = ("adapter", "fallback", "whiten", "oom", "nan_output", "nan_lr")


class Net(nn.Module):
    """Eight matrices (every rank of four owns some), an embedding and a head on the fallback."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 12)
        self.a = nn.Linear(12, 20, bias=False)
        self.b = nn.Linear(20, 12, bias=False)
        self.blocks = nn.ModuleList(nn.Linear(12, 12, bias=False) for _ in range(6))
        self.head = nn.Linear(12, 16)

    def forward(self, x):
        h = self.b(torch.relu(self.a(self.embed(x))))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def _wrap(kind, world):
    torch.manual_seed(0)
    model = Net()
    if kind == "ddp":
        return model, nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in (model.a, model.b, *model.blocks):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    if kind == "tp":  # a column-parallel then a row-parallel Linear over the whole world; the rest replicated
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(model, init_device_mesh("cpu", (world,)), {"a": ColwiseParallel(), "b": RowwiseParallel()})
        return model, model
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        return wrapped, wrapped
    return model, None  # deepspeed: the engine is built with the optimizer (_build)


def _build(kind, world, model, wrapped):
    """(the module, what runs forward/backward, SWAN, what steps: SWAN or DeepSpeed's engine)."""
    if kind != "deepspeed":
        opt = SWAN(model, preset="swan_ddagger", lr=0.01, verbose=False, bucket_mb=0.001)
        return model, wrapped, opt, opt
    import deepspeed

    import swan_dist

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "SWAN", "params": {"preset": "swan_ddagger", "lr": 0.01, "verbose": False,
                                                       "bucket_mb": 0.001}},
              "zero_optimization": {"stage": 2}}
    swan_dist.tag_model(model)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine.module, engine, optimizer if isinstance(optimizer, SWAN) else optimizer.optimizer, engine


def _backward(wrapped, rank, t):
    g = torch.Generator().manual_seed(10 * t + rank)
    x = torch.randint(0, 16, (4, 6), generator=g)
    loss = wrapped(x).float().pow(2).mean()
    wrapped.backward(loss) if hasattr(wrapped, "backward") else loss.backward()


def _local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _inject(fault, monkey, calls):
    """Patch the module global that the fault replaces; ``calls`` counts the calls each patch took, so a
    moved name cannot make the test pass without injecting anything."""
    def boom(kind):
        def raise_(*a, **k):
            calls.append(fault)
            if kind is torch.OutOfMemoryError:
                raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
            raise kind(f"injected {fault}")
        return raise_

    if fault == "adapter":  # asked for pieces, or for a group whose tensors a framework replaced
        for name in ("adapter_for", "adopt"):
            monkey.append((collect, name, getattr(collect, name)))
            setattr(collect, name, boom(KeyError))
    elif fault == "fallback":
        monkey.append((fallback, "run_fallback", fallback.run_fallback))
        fallback.run_fallback = boom(RuntimeError)
    elif fault in ("whiten", "oom"):
        monkey.append((whitening, "swan_update", whitening.swan_update))
        whitening.swan_update = boom(ValueError if fault == "whiten" else torch.OutOfMemoryError)
    elif fault == "nan_output":
        for name in ("whiten", "_whitener"):
            orig = getattr(F, name)
            monkey.append((F, name, orig))

            def nan(*a, _o=orig, **k):
                calls.append(fault)
                return _o(*a, **k) * float("nan")
            setattr(F, name, nan)


def _worker(rank, world, kind):
    out = {}
    last = world - 1
    data_rank = (lambda r: 0) if kind == "tp" else (lambda r: r)  # TP ranks see the same batch
    for fault in FAULTS:
        owner_model, wrapped, opt, stepper = _build(kind, world, *_wrap(kind, world))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: float("nan") if fault == "nan_lr" and rank == last and t >= 1 else 1.0)
        _backward(wrapped, data_rank(rank), 0)
        stepper.step()
        sched.step()
        stepper.zero_grad()
        owners = {} if opt.exchange is None else {
            opt.exchange.plan.specs[m].key: b.owners[m] for b in opt.exchange.plan.buckets for m in b.matrices}
        _backward(wrapped, data_rank(rank), 1)
        before = {n: _local(p) for n, p in owner_model.named_parameters()}
        monkey, calls = [], []
        if rank == last:
            _inject(fault, monkey, calls)
            opt._collector.reuse.clear()  # the adapter is asked again
        t0 = time.perf_counter()
        err, warned = None, []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stepper.step()
            warned = [str(w.message) for w in caught if "non-finite" in str(w.message)]
        except Exception as e:  # noqa: BLE001 - what the test checks
            err = (type(e).__name__, str(e))
        finally:
            for mod, name, orig in monkey:
                setattr(mod, name, orig)
        elapsed = time.perf_counter() - t0
        unchanged = {n for n, p in owner_model.named_parameters() if torch.equal(_local(p), before[n])}
        out[fault] = dict(err=err, warned=warned, elapsed=elapsed, unchanged=unchanged, owners=owners,
                          skips=dict(opt.nonfinite_skips), names=set(before), injected=len(calls))
    return out


EXPECT = {  # fault -> (error type on the failing rank, on the others, words in the message)
    "adapter": ("KeyError", "RuntimeError", "injected adapter"),
    "fallback": ("RuntimeError", "RuntimeError", "injected fallback"),
    "whiten": ("ValueError", "ValueError", "injected whiten"),
    "oom": ("OutOfMemoryError", "OutOfMemoryError", "bucket_mb"),
    "nan_lr": ("ValueError", "ValueError", "lr"),
}


@pytest.mark.parametrize("kind, world", [("ddp", 2), ("ddp", 4), ("fsdp2", 2), ("fsdp2", 4), ("fsdp1", 2), ("fsdp1", 4),
                                         ("tp", 2), ("tp", 4), ("deepspeed", 2), ("deepspeed", 4)])
def test_one_rank_fault_is_every_ranks_error(kind, world):
    results = run_distributed(_worker, world, kind, timeout=400)
    last = world - 1
    for rank, out in enumerate(results):
        for fault in ("adapter", "fallback", "whiten", "oom", "nan_output"):  # each patch ran where it was set
            assert (out[fault]["injected"] > 0) == (rank == last), (kind, rank, fault, out[fault]["injected"])
        for fault, (mine, others, words) in EXPECT.items():
            r = out[fault]
            assert r["err"] is not None, (kind, rank, fault)
            name, msg = r["err"]
            assert name == (mine if rank == last else others) and words in msg, (kind, rank, fault, r["err"])
            if rank != last:
                assert f"on rank {last}" in msg, (kind, rank, fault, msg)
            assert r["elapsed"] < 30, (kind, rank, fault, r["elapsed"])
        for fault in ("adapter", "nan_lr"):  # failed before anything was updated
            if kind != "deepspeed":  # (its module's weights are copied from its masters after a step)
                assert out[fault]["unchanged"] == out[fault]["names"], (kind, rank, fault)
        for fault in ("whiten", "oom", "nan_output"):  # what the failing rank owned keeps its weights everywhere
            owned = {n for n, o in out[fault]["owners"].items() if o == last}
            if kind not in ("fsdp1", "deepspeed"):  # (their weights are views/copies of flat buffers)
                assert owned <= out[fault]["unchanged"], (kind, rank, fault, owned, out[fault]["unchanged"])
        nan = out["nan_output"]
        owned = sorted(n for n, o in nan["owners"].items() if o == last)
        assert nan["err"] is None and owned and nan["warned"], (kind, rank, nan)
        assert set(nan["skips"]) == set(owned), (kind, rank, nan["skips"], owned)


def _decision_worker(rank, world, env_key):
    import os

    if rank == world - 1:  # this process would decide otherwise: bf16 whitening (CPU detection), or compile
        os.environ[env_key] = "1" if env_key == "SWAN_DIST_CPU_BF16" else "0"
    else:
        os.environ[env_key] = "0" if env_key == "SWAN_DIST_CPU_BF16" else "1"
    model, wrapped = _wrap("ddp", world)
    opt = SWAN(model, preset="swan_ddagger", lr=0.01, verbose=False)
    _backward(wrapped, rank, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        opt.step()
        return None, True
    except ValueError as e:
        return str(e), all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("env_key, setting", [("SWAN_DIST_CPU_BF16", "whiten_dtype (resolved)"),
                                              ("SWAN_DIST_COMPILE", "compile")])
def test_a_per_process_decision_that_differs_raises_on_every_rank(env_key, setting):
    """whiten_dtype="auto" and the compile choice are decided per process; replicas that decided apart
    would drift silently: every rank raises before anything changes, naming the setting."""
    for err, unchanged in run_distributed(_decision_worker, 2, env_key, timeout=120):
        assert err is not None and setting in err and unchanged, err
