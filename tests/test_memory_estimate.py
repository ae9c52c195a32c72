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
