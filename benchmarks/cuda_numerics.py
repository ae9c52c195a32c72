"""SWAN's numerics on an accelerator vs the CPU, printed, not a test (the suite has no CUDA cases): ``swan_update``
on the device vs fp64 on the CPU (and on extreme gradients), NS's polar factor vs the exact one, one SWAN step of
the reference ``tiny`` model vs the CPU's, ``step_in_backward`` (alone, FSDP2 at W=1) vs the ordinary step.

    python benchmarks/cuda_numerics.py              # exit 1 past a tolerance; --device cpu: the same on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import swan_dist
from measure import free_port  # (benchmarks/ is the script's folder)
from swan_dist.functional import WhitenConfig, resolve_dtype, swan_update, whiten
from swan_dist.reference.model import Llama, model_config

# max |Δ| / RMS(update): fp32 on the device vs fp64 on the CPU; bf16 whitening (8-bit mantissa,
# two NSDS steps) is expected to differ by a few percent of the update's scale per element
TOL = {"float32": 1e-3, "bfloat16": 0.1}
CASES = {
    "SWAN‡ (NSDS) 256x1024": ((256, 1024), WhitenConfig()),
    "SWAN‡ (NSDS) 1024x256": ((1024, 256), WhitenConfig()),
    "SWAN‡ (NSDS) 512x512": ((512, 512), WhitenConfig()),
    "SWAN† (NS 10, β 0.8) 256x1024": ((256, 1024), WhitenConfig(method="ns", steps=10, beta=0.8)),
    "NSDS, mean GradNorm 384x768": ((384, 768), WhitenConfig(grad_norm="mean")),
    "NSDS, stack of 4 x 128x512": ((4, 128, 512), WhitenConfig()),
}
FAILED: list[str] = []


def _report(label: str, err: float, tol: float) -> None:
    ok = err <= tol
    print(f"  {'ok  ' if ok else 'FAIL'} {label}: {err:.2e} (tolerance {tol:.2g})")
    if not ok:
        FAILED.append(label)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the RMS of ``want`` (a CPU tensor)."""
    return (got.double().cpu() - want).abs().max().item() / want.double().pow(2).mean().sqrt().item()


def _tiny(dev) -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(model_config("tiny", vocab_size=512)).to(dev)


def _weights(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2's gathered), as a float64 copy on the CPU."""
    return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).double().cpu().clone()
            for n, p in model.named_parameters()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    if (device := ap.parse_args().device) is None:
        print("cuda_numerics: no CUDA device here; pass --device cpu to run the comparisons on the CPU")
        return 0
    dev = torch.device(device)
    print(f"cuda_numerics: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}, torch "
          f"{torch.__version__}, TF32 matmul allowed: {torch.backends.cuda.matmul.allow_tf32}, fp32 matmul "
          f"precision: {torch.get_float32_matmul_precision()}")
    g = torch.Generator().manual_seed(0)
    for label, (shape, cfg) in CASES.items():
        grad = torch.randn(*shape, generator=g, dtype=torch.float64) * 1e-3
        ref = swan_update(grad, dataclasses.replace(cfg, dtype="float64"))[0]
        for dtype in ("float32", "auto"):
            run = dataclasses.replace(cfg, dtype=dtype)
            used = str(resolve_dtype(run, dev)).removeprefix("torch.")
            _report(f"swan_update {label}, {dtype} ({used})", _rel(swan_update(grad.float().to(dev), run)[0], ref),
                    TOL[used])

    # extreme gradients: the device's update and finite flags against the CPU's (fp32 both)
    base = torch.randn(256, 96, generator=g)
    extreme = {"tiny (1e-30)": base * 1e-30, "huge (1e30)": base * 1e30, "subnormal (1e-41)": base * 1e-41,
               "one subnormal column": base.index_copy(1, torch.tensor([3]), base[:, 3:4] * 1e-41)}
    for label, x in extreme.items():
        for name, cfg in (("SWAN‡", WhitenConfig(dtype="float32")),
                          ("no GradNorm, no whitening", WhitenConfig(method="none", grad_norm="none"))):
            (want, want_ok), (got, ok) = swan_update(x, cfg), swan_update(x.to(dev), cfg)
            same = bool(ok.cpu() == want_ok) and bool(got.isfinite().all())
            _report(f"swan_update, {label} gradient, {name}: device vs CPU", _rel(got, want) if same else float("inf"),
                    1e-3)

    for rows, cols in ((64, 256), (256, 64), (48, 48)):  # well-conditioned: singular values in [1, 3]
        k = min(rows, cols)
        u, v = (torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))[0] for n in (rows, cols))
        m = (u * (1 + 2 * torch.rand(k, generator=g, dtype=torch.float64))) @ v.T
        out = whiten(m.float().to(dev), "ns", steps=30, beta=0.5)
        _report(f"NS(30) polar factor {rows}x{cols}, float32", (out.double().cpu() - u @ v.T).abs().max().item(), 5e-5)

    after = {}
    for where in ("cpu", dev):
        model = _tiny(where)
        start, gg = _weights(model), torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gg) * 1e-3).to(where)
        swan_dist.SWAN(model, preset="swan_ddagger", lr=0.02, whiten_dtype="float32", verbose=False).step()
        after[str(where)] = _weights(model)
    cpu, on_dev = after["cpu"], after[str(dev)]
    worst = max(((on_dev[n] - cpu[n]).abs().max() / (cpu[n] - start[n]).abs().max().clamp_min(1e-12)).item()
                for n in start)
    _report("SWAN step on the reference tiny model (device vs CPU, per tensor, / step size)", worst, 1e-3)
    for layout in ("one process", "FSDP2 W=1"):
        _report(f"step_in_backward vs the ordinary step, {layout}, 3 steps (/ movement)",
                _in_backward(dev, layout.startswith("FSDP2")), 1e-4)
    print(f"cuda_numerics: {'FAILED: ' + ', '.join(FAILED) if FAILED else 'all within tolerance'}")
    return 1 if FAILED else 0


def _in_backward(dev: torch.device, fsdp: bool) -> float:
    """Largest weight difference between ``step_in_backward=True`` and the ordinary step after three
    iterations (same data, lr schedule), over the largest movement of a weight."""
    if fsdp:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cuda = torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else None
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, device_id=cuda)
    out = {}
    for in_backward in (False, True):
        model = _tiny(dev)
        for module in [*model.layers, model] if fsdp else []:
            fully_shard(module)
        start = _weights(model)
        opt = swan_dist.SWAN(model, preset="swan_ddagger", lr=0.02, whiten_dtype="float32", verbose=False,
                             step_in_backward=in_backward)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            tokens = torch.randint(0, 512, (2, 33), generator=g).to(dev)
            opt.zero_grad()
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
            opt.step()
            sched.step()
        out[in_backward] = _weights(model)
        moved = max((out[in_backward][n] - start[n]).abs().max().item() for n in start)
    if fsdp:
        dist.destroy_process_group()
    if moved == 0:  # nothing moved: the comparison would prove nothing
        return float("inf")
    return max((out[True][n] - out[False][n]).abs().max().item() for n in out[True]) / moved


if __name__ == "__main__":
    sys.exit(main())
