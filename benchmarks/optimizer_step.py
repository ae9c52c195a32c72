"""Single-process optimizer step: SWAN presets vs torch AdamW on the reference LLaMA model.

Measured side by side in one run, on the same model and the same gradients:
  - optimizer step time (median over --steps, after warm-up) and its ratio to AdamW;
  - optimizer-state bytes after a step (SWAN matrices hold none; the fallback rule may);
  - fp32 vs bf16 matmul throughput on this device (what whiten_dtype='auto' weighs).
Writes a section of docs/benchmarks.md.

    python benchmarks/optimizer_step.py --size small --steps 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import swan_dist
from swan_dist.functional import cpu_has_native_bf16
from swan_dist.reference.baselines import adamw_kernel
from swan_dist.reference.model import Llama, model_config

from measure import write_section  # noqa: E402 (benchmarks/ is the script's folder)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)
    )


def _time_steps(opt, steps: int, sync) -> float:
    opt.step()  # warm-up (allocates state)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_gflops(dtype: torch.dtype, device: torch.device, n: int = 1024, reps: int = 3) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", help="reference model size (tiny, small, 60m, 130m)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    torch.manual_seed(0)
    model = Llama(model_config(args.size, vocab_size=8192)).to(device)
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
    n_params = sum(p.numel() for p in model.parameters())

    def fresh(name: str) -> torch.optim.Optimizer:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        if name == "adamw":  # torch's fastest kernel for these tensors (fused)
            params = list(model.parameters())
            return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, **adamw_kernel(params))
        if name == "adamw-default":  # what AdamW(params) picks: a loop over tensors on the CPU, foreach on CUDA
            return torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        preset, fallback = name.split("+") if "+" in name else (name, None)
        return swan_dist.SWAN(model, preset=preset, lr=0.0, fallback=fallback, verbose=False)

    rows = []
    for name in ["adamw", "adamw-default", "swan_ddagger", "swan_dagger", "swan_ddagger+sign"]:
        opt = fresh(name)
        t = _time_steps(opt, args.steps, sync)
        rows.append((name, t, _state_bytes(opt)))
        del opt
    t_adam = rows[0][1]
    gf32 = _matmul_gflops(torch.float32, device)
    gbf16 = _matmul_gflops(torch.bfloat16, device)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    lines = [
        f"Reference model `{args.size}` ({n_params / 1e6:.1f}M parameters), one process, device: {dev_name}, "
        f"torch {torch.__version__}, median of {args.steps} steps on fixed gradients.",
        "",
        "| optimizer | step time (ms) | vs AdamW | optimizer state (MB) | state / params bytes |",
        "|---|---:|---:|---:|---:|",
    ]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for name, t, sb in rows:
        lines.append(f"| {name} | {t * 1e3:.1f} | {t / t_adam:.2f}x | {sb / 2**20:.1f} | {sb / param_bytes:.2f} |")
    lines += [
        "",
        "`adamw`: torch's AdamW with its fastest kernel for these tensors (fused); `adamw-default`: "
        "`AdamW(params)` as torch picks it (on the CPU a loop over tensors, on CUDA foreach). "
        "`swan_ddagger+sign` uses the stateless `sign` fallback: zero optimizer state for the whole model.",
        "",
        f"Matmul 1024x1024 on this device: fp32 {gf32:.1f} GFLOP/s, bf16 {gbf16:.1f} GFLOP/s "
        f"(bf16/fp32 = {gbf16 / gf32:.2f}). whiten_dtype='auto' runs NSDS in bf16 on CUDA and on CPUs with "
        f"native bf16 (this one: {'yes' if cpu_has_native_bf16() else 'no'}; a bf16 update stays within 2 % of "
        "the fp32 one, tests/test_functional.py), fp32 otherwise and for NS.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section(f"optimizer-step-{device.type}", f"Optimizer step, single process ({'GPU' if device.type == 'cuda' else 'CPU'})", text)


if __name__ == "__main__":
    main()
