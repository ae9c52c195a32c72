"""SWAN(model, step_in_backward=True): every parameter is updated during backward, once its gradient is
ready, and its gradient freed; the weights equal the ordinary step's on the same data under an lr
schedule (one process, FSDP2 and HSDP with uneven shards, each with activation checkpointing too, FSDP2
gradient accumulation); updates happen only between zero_grad() and step(); what cannot follow is refused
naming what to do; a fault inside a unit's step is every rank's error."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint

from swan_dist import SWAN

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self, ckpt=False):
        super().__init__()
        self.ckpt = ckpt
        self.embed = nn.Embedding(11, 9)
        self.blocks = nn.ModuleList(  # four matrices per block (every rank of four owns one), uneven rows
            nn.Sequential(nn.Linear(9, 7, bias=False), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(),
                          nn.Linear(5, 7, bias=False), nn.Tanh(), nn.Linear(7, 9)) for _ in range(3))
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(9, 11, bias=False)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + (checkpoint(block, h, use_reentrant=False) if self.ckpt else block(h))
        return self.head(self.norm(h))


def _local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _fsdp(model, world, hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _run(in_backward, rank=0, world=1, layout="one", steps=3, micro=1, ckpt=False):
    """Weights after ``steps`` steps, and per step whether every weight had moved and every gradient was
    gone before step() was called."""
    torch.manual_seed(0)
    model = Net(ckpt)
    if layout != "one":
        model = _fsdp(model, world, hsdp=layout == "hsdp")
    opt = SWAN(model, preset="swan_ddagger", lr=0.02, weight_decay=0.1, verbose=False, bucket_mb=0.0005,
               step_in_backward=in_backward)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    early = []
    for t in range(steps):
        opt.zero_grad()
        before = {n: _local(p) for n, p in model.named_parameters()}
        for k in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(k == micro - 1)
            g = torch.Generator().manual_seed(100 * t + 10 * k + rank)
            model(torch.randint(0, 11, (3, 5), generator=g)).float().pow(2).mean().backward()
        moved = all(not torch.equal(_local(p), before[n]) for n, p in model.named_parameters() if _local(p).numel())
        gone = all(p.grad is None for p in model.parameters())
        early.append((moved, gone))
        opt.step()
        sched.step()
    return {n: _local(p) for n, p in model.named_parameters()}, early


def _compare(rank=0, world=1, layout="one", micro=1, ckpt=False):
    want, early_want = _run(False, rank, world, layout, micro=micro, ckpt=ckpt)
    got, early = _run(True, rank, world, layout, micro=micro, ckpt=ckpt)
    err = max((want[n] - got[n]).abs().max().item() for n in want if want[n].numel())
    return err, early, early_want


@pytest.mark.parametrize("ckpt, batch_bytes", [(False, None), (True, None), (False, 1)])
def test_one_process_equals_the_ordinary_step(ckpt, batch_bytes, monkeypatch):
    """Stepped at the end of backward (the default bound holds this model's gradients) or one parameter
    at a time, as each gradient is ready (a bound of one byte)."""
    import swan_dist.in_backward

    if batch_bytes is not None:
        monkeypatch.setattr(swan_dist.in_backward, "_BATCH_BYTES", batch_bytes)
    err, early, early_want = _compare(ckpt=ckpt)
    assert err < 1e-6, err
    assert early == [(True, True)] * 3  # updated, gradients freed, before step()
    assert early_want == [(False, False)] * 3  # the ordinary step: nothing before step()


def test_updates_only_between_zero_grad_and_step():
    torch.manual_seed(0)
    model = Net()
    opt = SWAN(model, lr=0.02, verbose=False, step_in_backward=True)
    x = torch.randint(0, 11, (3, 5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(x).pow(2).mean().backward()  # no zero_grad() yet: an ordinary backward, then an ordinary step
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.warns(RuntimeWarning, match=r"the ordinary way: no zero_grad\(\)"):
        opt.step()
    after_step = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(not torch.equal(after_step[n], before[n]) for n in before)
    model(x).pow(2).mean().backward()  # after step(), before zero_grad(): an evaluation backward
    assert all(torch.equal(p, after_step[n]) for n, p in model.named_parameters())
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="step_in_backward"):
        model(x).pow(2).mean().backward()  # a second backward before step()


def test_a_dropped_optimizer_is_freed_with_its_hooks():
    import gc
    import weakref

    torch.manual_seed(0)
    model = Net()
    opt = SWAN(model, lr=0.02, verbose=False, step_in_backward=True)
    x = torch.randint(0, 11, (3, 5))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None  # the parameters' hooks did not keep it (nor, through it, the parameters) alive
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # its hooks were removed
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(x).pow(2).mean().backward()  # a backward after it is gone updates nothing
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def _module(name):
    """The FSDP module of a parameter of :class:`Net` (each block, and the root's embedding, norm, head)."""
    return "block " + name.split(".")[1] if name.startswith("blocks.") else "root"


def _dist_worker(rank, world, layout, micro):
    """Each FSDP module stepped alone (a batch bound of one byte) and the default (this model's modules
    stepped together when backward ends), the latter also with activation checkpointing (torch's
    non-reentrant kind, each block): the comparison, and the sets of modules stepped together."""
    import swan_dist.in_backward

    out = {}
    default = swan_dist.in_backward._BATCH_BYTES
    for bound, ckpt in ((1, False), (default, False), (default, True)):
        swan_dist.in_backward._BATCH_BYTES = bound
        seen = []
        step_entries = SWAN.step_entries

        def spy(self, entries, failure=None, memo="all", defer=False):
            if memo != "all":  # a step made during backward: the modules it covers
                seen.append(frozenset(_module(e.record.name) for e in entries))
            return step_entries(self, entries, failure, memo, defer)

        SWAN.step_entries = spy
        try:
            out[bound, ckpt] = (*_compare(rank, world, layout, micro, ckpt), set(seen))
        finally:
            SWAN.step_entries = step_entries
    return out


@pytest.mark.parametrize("layout, world, micro", [("fsdp2", 2, 1), ("fsdp2", 4, 1), ("hsdp", 4, 1), ("fsdp2", 2, 2)])
def test_fsdp2_and_hsdp_equal_the_ordinary_step(layout, world, micro):
    for out in run_distributed(_dist_worker, world, layout, micro):
        for key, (err, early, early_want, stepped) in out.items():
            assert err < 1e-6, (layout, world, key, err)
            assert early == [(True, True)] * 3, (key, early)
            assert early_want == [(False, False)] * 3
            # the three blocks and the root (embedding, norm, head): one step each, or one step of all four
            modules = {"block 0", "block 1", "block 2", "root"}
            want = {frozenset([m]) for m in modules} if key[0] == 1 else {frozenset(modules)}
            assert stepped == want, (key, stepped)


def _refused_worker(rank, world, kind):
    torch.manual_seed(0)
    model = Net()
    if kind == "ddp":
        nn.parallel.DistributedDataParallel(model)
        target = model
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        target = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
    else:  # FSDP2 but the optimizer given bare parameters: no model to find the units in
        target = _fsdp(model, world).parameters()
    try:
        SWAN(target, lr=0.02, verbose=False, step_in_backward=True)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind, words", [("ddp", "DDP"), ("fsdp1", "FSDP1"), ("bare", "pass SWAN(model")])
def test_what_cannot_follow_is_refused_on_every_rank(kind, words):
    for msg in run_distributed(_refused_worker, 2, kind):
        assert msg is not None and words in msg and "step_in_backward" in msg, msg


def _fault_worker(rank, world, layout):
    """Each fault of the failure matrix (tests/test_failures.py) injected on the last rank inside the
    backward that updates, each FSDP module stepped alone (a batch bound of one byte: the fault raised
    from a hook mid-backward) and batched (the default: here at the end of backward): what every rank
    raised (or warned), and whether the injected code ran."""
    import swan_dist.in_backward
    from test_failures import FAULTS, _inject

    out = {}
    default = swan_dist.in_backward._BATCH_BYTES
    for bound, fault in [(b, f) for b in (1, default) for f in FAULTS]:
        swan_dist.in_backward._BATCH_BYTES = bound
        torch.manual_seed(0)
        model = _fsdp(Net(), world, hsdp=layout == "hsdp")
        opt = SWAN(model, lr=0.02, verbose=False, bucket_mb=0.0005, step_in_backward=True)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: float("nan") if fault == "nan_lr" and rank == world - 1 and t >= 1 else 1.0)
        opt.zero_grad()
        model(torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
        opt.step()
        sched.step()
        monkey, calls = [], []
        if rank == world - 1:
            _inject(fault, monkey, calls)
            opt._collector.reuse.clear()  # the adapter is asked again
        opt.zero_grad()
        err, warned = None, []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
            warned = [str(w.message) for w in caught if "non-finite" in str(w.message)]
        except Exception as e:  # noqa: BLE001 - what the test checks
            err = (type(e).__name__, str(e))
        finally:
            for mod, name, orig in monkey:
                setattr(mod, name, orig)
        out[bound, fault] = dict(err=err, warned=warned, injected=len(calls), skips=dict(opt.nonfinite_skips))
    return out


@pytest.mark.parametrize("layout, world", [("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4)])
def test_a_fault_inside_backward_is_every_ranks_error(layout, world):
    from test_failures import EXPECT

    last = world - 1
    for rank, out in enumerate(run_distributed(_fault_worker, world, layout)):
        for bound in sorted({b for b, _ in out}):
            for fault in ("adapter", "fallback", "whiten", "oom", "nan_output"):
                got = out[bound, fault]
                assert (got["injected"] > 0) == (rank == last), (layout, bound, rank, fault, got)
            for fault, (mine, others, words) in EXPECT.items():
                err = out[bound, fault]["err"]
                assert err is not None and err[0] == (mine if rank == last else others) and words in err[1], \
                    (layout, bound, rank, fault, err)
                if rank != last:
                    assert f"on rank {last}" in err[1], (layout, bound, rank, fault, err)
            nan = out[bound, "nan_output"]
            assert nan["err"] is None and nan["warned"] and nan["skips"], (layout, bound, rank, nan)


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_nonfinite_gradient_inside_backward(nonfinite, monkeypatch):
    """skip: that parameter alone is left as it was (a warning names it); raise: FloatingPointError from
    backward at the unit where it is found, the units stepped before it staying updated (one parameter
    per unit here: a batch bound of one byte)."""
    import swan_dist.in_backward

    monkeypatch.setattr(swan_dist.in_backward, "_BATCH_BYTES", 1)
    torch.manual_seed(0)
    model = Net()
    opt = SWAN(model, lr=0.02, verbose=False, step_in_backward=True, nonfinite=nonfinite)
    bad = model.blocks[1][2].weight
    bad.register_hook(lambda g: g * float("nan"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    loss = model(torch.randint(0, 11, (3, 5))).pow(2).mean()
    if nonfinite == "skip":
        with pytest.warns(RuntimeWarning, match="non-finite gradient"):
            loss.backward()
        opt.step()
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert changed == set(before) - {"blocks.1.2.weight"}
        assert opt.nonfinite_skips["blocks.1.2.weight"] == 1
    else:
        with pytest.raises(FloatingPointError, match="blocks.1.2.weight"):
            loss.backward()
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert "blocks.1.2.weight" not in changed and "head.weight" in changed  # the head's came first
