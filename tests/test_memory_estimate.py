"""A step's memory estimated without allocating it: under ``FakeTensorMode`` (shapes, no data) torch's
``MemTracker`` follows SWAN's step as it follows AdamW's, and its peak, by category, is what the same step
on real tensors measures. A fake step reads no value on the host: it assumes every gradient finite (the
branch the real step takes when they are)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from swan_dist import SWAN
from swan_dist.reference.model import Llama, model_config, rope_tables

pytestmark = pytest.mark.timeout(120)

TOLERANCE = 0.05  # the estimate's categories within 5 % of the real run's (they agree exactly today)


def _step_peak(fake: bool, optimizer: str) -> dict[str, int]:
    """MemTracker's peak snapshot (bytes per category) of the second training step of a tiny bf16 LLaMA."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        cfg = model_config("tiny", vocab_size=256, n_layers=2)
        torch.manual_seed(0)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # bf16 weights made so (Module.to cannot swap fake tensors)
        try:
            model = Llama(cfg)
        finally:
            torch.set_default_dtype(old)
        model.rope_cos, model.rope_sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
        assert isinstance(model.output.weight, FakeTensor) == fake
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        else:
            opt = SWAN(model, preset="swan_ddagger", verbose=False, fallback="sign" if "sign" in optimizer else "adamw",
                       step_in_backward=optimizer.endswith("@backward"))
        x = torch.randint(0, cfg.vocab_size, (1, 16))
        y = torch.randint(0, cfg.vocab_size, (1, 16))

        def step():
            model(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # the first step makes the optimizer's state
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        return {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}


@pytest.mark.parametrize("optimizer", ["adamw", "swan_ddagger", "swan_ddagger+sign", "swan_ddagger@backward"])
def test_fake_step_estimates_the_real_peak(optimizer):
    real, estimate = _step_peak(False, optimizer), _step_peak(True, optimizer)
    assert real["Total"] > real["Parameter"] + real["Gradient"] > 0
    if optimizer in ("adamw", "swan_ddagger"):
        assert real["Optstate"] > 0  # AdamW's moments: the embeddings' and head's at least
    for key, value in real.items():
        assert abs(estimate.get(key, 0) - value) <= TOLERANCE * max(value, 1), (key, estimate, real)


def test_fake_step_runs_without_host_reads():
    """SWAN's plain step (default preset) on fake tensors: runs through, and its weights stay fake."""
    with FakeTensorMode():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
        opt = SWAN(model, verbose=False)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert all(isinstance(p, FakeTensor) for p in model.parameters())


@pytest.mark.parametrize("mode, in_backward", [("owner", False), ("replicated", False), ("owner", True)])
def test_fsdp2_step_under_the_fake_process_group(mode, in_backward, monkeypatch):
    """One rank of four simulated (torch's fake process group: no communication) with fake tensors: SWAN's
    FSDP2 step runs (the owners' plan from every rank's ranges, known from the DTensor layout), and
    MemTracker sees this rank's quarter of the parameters and an owner's exchange buffers. The traced
    steady step is the real one: its agreement's and its status's ``all_reduce`` issued (only the status's
    read left out)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    world = 4
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        with FakeTensorMode():
            model = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(4)))
            full = sum(p.numel() * p.element_size() for p in model.parameters())
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = SWAN(model, verbose=False, mode=mode, step_in_backward=in_backward)
            x = torch.randn(2, 64)

            def step():
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()

            step()
            if in_backward:  # the first step is step()'s own, the second the first made during backward
                step()
            reduced = []
            real_all_reduce = dist.all_reduce

            def all_reduce(t, op=dist.ReduceOp.SUM, **kw):
                reduced.append(op)
                return real_all_reduce(t, op=op, **kw)

            monkeypatch.setattr(dist, "all_reduce", all_reduce)
            tracker = MemTracker()
            tracker.track_external(model, opt)
            with tracker:
                step()
            monkeypatch.undo()
            peak = {getattr(k, "value", str(k)): int(v)
                    for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
            assert all(isinstance(p.to_local(), FakeTensor) for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert peak["Parameter"] == full // world
    n_max = reduced.count(dist.ReduceOp.MAX)  # per engine step: the agreement, then the closing status
    assert n_max == 2, reduced
    if not in_backward:  # (inside backward the step's workspace counts as backward's temporaries)
        assert peak["Optstate"] > 0  # the step's workspace: owners' stacks, exchange buffers


def test_sign_fallback_in_bounded_chunks_equals_the_whole(monkeypatch):
    """The sign rule makes its signs a bounded number of bytes at a time (a large gradient in flat slices):
    the same weights as signing every gradient at once."""
    import swan_dist.rules.fallback as fallback

    def run(budget):
        monkeypatch.setattr(fallback, "_SIGN_CPU_BYTES", budget)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
        opt = SWAN(model, preset="swan_ddagger", fallback="sign", weight_decay=0.1, verbose=False)
        for _ in range(2):
            model(torch.arange(10)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    whole, chunked = run(1 << 30), run(100)  # 100 bytes: the embedding (3,200 bytes) in 32 slices
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    calls = []
    monkeypatch.setattr(fallback, "_chunks", lambda t, g, b: calls.append(b) or iter([(t, g)]))
    run(100)
    assert calls  # the chunked path is the one taken
