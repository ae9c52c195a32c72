"""SWAN's numerics on an accelerator vs the CPU: a check for a GPU machine, printed, not a test.

tests/test_functional.py and tests/test_optimizer.py have no CUDA cases, so on a GPU machine this
script is what exercises the device path. Measured in one run, each against an fp64 CPU reference on
the same gradients:

1. ``swan_update`` (GradNorm, whitening, rescale) for SWAN‡ (NSDS), SWAN† (NS, 10 steps, β 0.8), the
   mean-centred GradNorm and a batched stack, on the device with ``whiten_dtype`` float32 and ``auto``
   (bf16 for NSDS on CUDA, fp32 otherwise): max |Δ| over the update's RMS (1 after rescale);
   on tiny (1e-30), huge (1e30) and subnormal gradients (a whole matrix, one column), the update against
   the CPU's (inf where the finite flags differ or the update is not finite);
2. the polar factor: NS with 30 steps, β 0.5 on well-conditioned matrices vs SVD, on the device in fp32;
3. one ``swan_dist.SWAN`` step (fallback AdamW) on the reference ``tiny`` model: the parameters after
   the step on the device vs on the CPU (fp32 whitening on both), relative to the step's size;
4. ``step_in_backward=True`` on the device: three iterations of the reference ``tiny`` model under an lr
   schedule, in one process and under FSDP2 at W=1 (NCCL on CUDA: the freed gradients are views of
   FSDP's reduce-scatter output, kept alive for their stream by ``record_stream``), vs the ordinary
   step on the same device and data: max |Δ| of the weights over the three steps' total movement.

Fails (exit 1) past the tolerances below; prints a line per case. ``--device cpu`` runs the same
comparisons on the CPU (to check the script where there is no GPU).

    python benchmarks/cuda_numerics.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from swan_dist.functional import WhitenConfig, resolve_dtype, swan_update, whiten

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


def _well_conditioned(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g, dtype=torch.float64))
    return (u * (1 + 2 * torch.rand(k, generator=g, dtype=torch.float64))) @ v.T


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    args = ap.parse_args()
    if args.device is None:
        print("cuda_numerics: no CUDA device here; pass --device cpu to run the comparisons on the CPU")
        return 0
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"cuda_numerics: {name}, torch {torch.__version__}, TF32 matmul allowed: "
          f"{torch.backends.cuda.matmul.allow_tf32}, fp32 matmul precision: {torch.get_float32_matmul_precision()}")
    failed = []

    def report(label: str, err: float, tol: float) -> None:
        ok = err <= tol
        print(f"  {'ok  ' if ok else 'FAIL'} {label}: {err:.2e} (tolerance {tol:.2g})")
        if not ok:
            failed.append(label)

    g = torch.Generator().manual_seed(0)
    for label, (shape, cfg) in CASES.items():
        grad = torch.randn(*shape, generator=g, dtype=torch.float64) * 1e-3
        ref = swan_update(grad, dataclasses.replace(cfg, dtype="float64"))[0]
        rms = ref.pow(2).mean().sqrt().item()
        for dtype in ("float32", "auto"):
            run = dataclasses.replace(cfg, dtype=dtype)
            used = str(resolve_dtype(run, dev)).removeprefix("torch.")
            out = swan_update(grad.float().to(dev), run)[0]
            report(f"swan_update {label}, {dtype} ({used})", (out.double().cpu() - ref).abs().max().item() / rms,
                   TOL[used])

    # extreme gradients: the device's update and finite flags against the CPU's (fp32 both)
    base = torch.randn(256, 96, generator=g)
    extreme = {"tiny (1e-30)": base * 1e-30, "huge (1e30)": base * 1e30, "subnormal (1e-41)": base * 1e-41,
               "one subnormal column": base.index_copy(1, torch.tensor([3]), base[:, 3:4] * 1e-41)}
    for label, x in extreme.items():
        for name, cfg in (("SWAN‡", WhitenConfig(dtype="float32")), ("no GradNorm, no whitening",
                                                                      WhitenConfig(method="none", grad_norm="none"))):
            want, want_ok = swan_update(x, cfg)
            got, ok = swan_update(x.to(dev), cfg)
            same = bool(ok.cpu() == want_ok) and bool(got.isfinite().all())
            err = (got.double().cpu() - want).abs().max().item() / want.pow(2).mean().sqrt().item() if same else float("inf")
            report(f"swan_update, {label} gradient, {name}: device vs CPU", err, 1e-3)

    for shape in ((64, 256), (256, 64), (48, 48)):
        m = _well_conditioned(*shape)
        u, _, vh = torch.linalg.svd(m, full_matrices=False)
        out = whiten(m.float().to(dev), "ns", steps=30, beta=0.5)
        report(f"NS(30) polar factor {shape[0]}x{shape[1]}, float32", (out.double().cpu() - u @ vh).abs().max().item(),
               5e-5)

    import swan_dist
    from swan_dist.reference.model import Llama, model_config

    after = {}
    for where in ("cpu", dev):
        torch.manual_seed(0)
        model = Llama(model_config("tiny", vocab_size=512)).to(where)
        start = {n: p.detach().double().cpu().clone() for n, p in model.named_parameters()}
        gg = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gg) * 1e-3).to(where)
        opt = swan_dist.SWAN(model, preset="swan_ddagger", lr=0.02, whiten_dtype="float32", verbose=False)
        opt.step()
        after[str(where)] = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
    cpu_after, dev_after = after["cpu"], after[str(dev)]
    worst = max(((dev_after[n] - cpu_after[n]).abs().max() / (cpu_after[n] - start[n]).abs().max().clamp_min(1e-12)).item()
                for n in start)
    report("SWAN step on the reference tiny model (device vs CPU, per tensor, / step size)", worst, 1e-3)
    for layout in ("one process", "FSDP2 W=1"):
        report(f"step_in_backward vs the ordinary step, {layout}, 3 steps (/ movement)", _in_backward(dev, layout),
               1e-4)
    print(f"cuda_numerics: {'FAILED: ' + ', '.join(failed) if failed else 'all within tolerance'}")
    return 1 if failed else 0


def _in_backward(dev: torch.device, layout: str) -> float:
    """Largest weight difference between ``step_in_backward=True`` and the ordinary step after three
    iterations (same data, lr schedule), over the largest movement of a weight."""
    import os

    import torch.distributed as dist

    import swan_dist
    from swan_dist.reference.model import Llama, model_config

    fsdp = layout.startswith("FSDP2")
    if fsdp and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else None)
    out = {}
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = Llama(model_config("tiny", vocab_size=512)).to(dev)
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        start = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()  # (at W=1
                 for n, p in model.named_parameters()}  # full_tensor() can be the parameter's own storage)
        opt = swan_dist.SWAN(model, preset="swan_ddagger", lr=0.02, whiten_dtype="float32", verbose=False,
                             step_in_backward=in_backward)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            tokens = torch.randint(0, 512, (2, 33), generator=g).to(dev)
            opt.zero_grad()
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            sched.step()
        out[in_backward] = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).double().cpu()
                            for n, p in model.named_parameters()}
        moved = max((out[in_backward][n] - start[n].double().cpu()).abs().max().item() for n in start)
    if fsdp:
        dist.destroy_process_group()
    if moved == 0:  # nothing moved: the comparison would prove nothing
        return float("inf")
    return max((out[True][n] - out[False][n]).abs().max().item() for n in out[True]) / moved


if __name__ == "__main__":
    sys.exit(main())
