"""SWAN's numerics on a CUDA device against the CPU: ``swan_update`` per whitening and dtype against fp64 (and
on extreme gradients against the CPU's fp32), NS's polar factor against the exact one, one SWAN step of the
reference ``tiny`` model against the CPU's, and ``step_in_backward`` (one process, FSDP2 at W=1) against the
ordinary step. Skipped without CUDA (benchmarks/gpu_suite.sh runs it on a GPU): on the CPU the same properties
are tests/test_functional.py's (fp64 references, extreme inputs, NS's polar factor, the bf16 rule) and
tests/test_in_backward.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import swan_dist
from swan_dist.functional import WhitenConfig, resolve_dtype, swan_update, whiten
from swan_dist.reference.model import Llama, model_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compares a CUDA device with the CPU")

# max |Δ| / RMS(update) against fp64 on the CPU: fp32 within 1e-3; bf16 whitening (8-bit mantissa, two NSDS
# steps) is expected to differ by a few percent of the update's scale per element
TOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}
CASES = {
    "nsds-256x1024": ((256, 1024), WhitenConfig()),
    "nsds-1024x256": ((1024, 256), WhitenConfig()),
    "nsds-512x512": ((512, 512), WhitenConfig()),
    "ns10-beta0.8-256x1024": ((256, 1024), WhitenConfig(method="ns", steps=10, beta=0.8)),
    "nsds-mean-gradnorm-384x768": ((384, 768), WhitenConfig(grad_norm="mean")),
    "nsds-stack-4x128x512": ((4, 128, 512), WhitenConfig()),
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the RMS of ``want`` (a CPU tensor)."""
    return (got.double().cpu() - want).abs().max().item() / want.double().pow(2).mean().sqrt().item()


def _tiny(device, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(model_config("tiny", vocab_size=512)).to(device=device, dtype=dtype)


def _weights(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2's gathered), as a float64 copy on the CPU."""
    return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).double().cpu().clone()
            for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_swan_update_against_fp64(case, dtype):
    """fp32 within 1e-3 of the update's RMS; 'auto' as it resolves on CUDA (bf16 for NSDS), within 0.1."""
    shape, cfg = CASES[case]
    run = dataclasses.replace(cfg, dtype=dtype)
    used = resolve_dtype(run, torch.device("cuda"))
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e-3
    want = swan_update(grad, dataclasses.replace(cfg, dtype="float64"))[0]
    got, finite = swan_update(grad.float().cuda(), run)
    assert bool(finite.all())
    assert _rel(got, want) <= TOL[used], (case, dtype, used, _rel(got, want))


_BASE = torch.randn(256, 96, generator=torch.Generator().manual_seed(3))
EXTREME = {
    "tiny-1e-30": lambda: _BASE * 1e-30,
    "huge-1e30": lambda: _BASE * 1e30,
    "subnormal-1e-41": lambda: _BASE * 1e-41,
    "one-subnormal-column": lambda: _BASE.index_copy(1, torch.tensor([3]), _BASE[:, 3:4] * 1e-41),
}
EXTREME_CONFIGS = {"swan-ddagger": WhitenConfig(dtype="float32"),
                   "no-gradnorm-no-whitening": WhitenConfig(method="none", grad_norm="none")}


@pytest.mark.parametrize("config", list(EXTREME_CONFIGS))
@pytest.mark.parametrize("kind", list(EXTREME))
def test_extreme_gradients(kind, config):
    """fp32 gradients at the edges of fp32's range: finite, the same finite flags and the same update (within
    1e-3 of its RMS) as the CPU's fp32 update."""
    x, cfg = EXTREME[kind](), EXTREME_CONFIGS[config]
    want, want_finite = swan_update(x, cfg)
    got, finite = swan_update(x.cuda(), cfg)
    assert bool(want_finite.all()) and bool(finite.cpu().all())
    assert bool(got.isfinite().all())
    assert _rel(got, want) <= 1e-3, (kind, config, _rel(got, want))


@pytest.mark.parametrize("rows, cols", [(64, 256), (256, 64), (48, 48)])
def test_ns_polar_factor(rows, cols):
    """30 NS steps in fp32 on a well-conditioned matrix (singular values in [1, 3]) give U V^T within 5e-5."""
    g = torch.Generator().manual_seed(4)
    k = min(rows, cols)
    u, v = (torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0] for n in (rows, cols))
    m = (u * (1 + 2 * torch.rand(k, generator=g, dtype=torch.float64))) @ v.T
    out = whiten(m.float().cuda(), "ns", steps=30, beta=0.5)
    err = (out.double().cpu() - u @ v.T).abs().max().item()
    assert err <= 5e-5, err


def _one_step(device, dtype) -> tuple[dict, dict]:
    model = _tiny(device, dtype)
    start, g = _weights(model), torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device=device, dtype=dtype)
    swan_dist.SWAN(model, preset="swan_ddagger", lr=0.02, whiten_dtype=str(dtype).removeprefix("torch."),
                   verbose=False).step()
    return start, _weights(model)


def test_swan_step_on_the_tiny_model():
    """One SWAN‡ step (fp32 whitening) of the reference ``tiny`` model on CUDA against the CPU's: per tensor, the
    largest difference within 1e-3 of the largest step."""
    start, want = _one_step("cpu", torch.float32)
    _, got = _one_step("cuda", torch.float32)
    worst = {n: ((got[n] - want[n]).abs().max() / (want[n] - start[n]).abs().max().clamp_min(1e-12)).item()
             for n in start}
    assert max(worst.values()) <= 1e-3, worst


def _in_backward(device: torch.device, fsdp: bool) -> float:
    """Largest weight difference between ``step_in_backward=True`` and the ordinary step after three
    iterations (same data, lr schedule), over the largest movement of a weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out, moved = {}, {}
    for in_backward in (False, True):
        model = _tiny(device)
        if fsdp:
            mesh = init_device_mesh(device.type, (1,))
            for module in [*model.layers, model]:
                fully_shard(module, mesh=mesh)
        start = _weights(model)
        opt = swan_dist.SWAN(model, preset="swan_ddagger", lr=0.02, whiten_dtype="float32", verbose=False,
                             step_in_backward=in_backward)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            tokens = torch.randint(0, 512, (2, 33), generator=g).to(device)
            opt.zero_grad()
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
            opt.step()
            sched.step()
        out[in_backward] = _weights(model)
        moved[in_backward] = max((out[in_backward][n] - start[n]).abs().max().item() for n in start)
    assert min(moved.values()) > 0, moved  # nothing moved: the comparison would prove nothing
    return max((out[True][n] - out[False][n]).abs().max().item() for n in out[True]) / moved[False]


@pytest.mark.parametrize("layout", ["one-process", "fsdp2-w1"])
def test_step_in_backward_equals_the_ordinary_step(layout):
    """Three steps with an lr schedule on CUDA: within 1e-4 of the largest movement of a weight. FSDP2 at W=1
    in this process (NCCL over an in-memory store)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if layout == "one-process":
        err = _in_backward(dev, fsdp=False)
    else:
        assert not dist.is_initialized()
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=dev)
        try:
            err = _in_backward(dev, fsdp=True)
        finally:
            dist.destroy_process_group()
    assert err <= 1e-4, err
