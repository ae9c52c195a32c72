"""How long does one optimizer step take, and how much state does it hold? SWAN presets against torch AdamW on
the reference LLaMA model, one process, the same fixed gradients; also the device's fp32 vs bf16 matmul rate.

    python benchmarks/optimizer_step.py --size small --steps 5
"""

import platform

import torch

import swan_dist
from swan_dist.functional import cpu_has_native_bf16
from swan_dist.reference.baselines import adamw_kernel
from swan_dist.reference.model import Llama, model_config

from measure import median_time, parser, publish  # noqa: E402 (benchmarks/ is the script's folder)

NAMES = ("adamw", "adamw-default", "swan_ddagger", "swan_dagger", "swan_ddagger+sign")


def reference(size: str, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The reference LLaMA of ``size`` (seed 0, built on ``device``, in ``dtype``), every ``.grad`` fixed random."""
    torch.manual_seed(0)
    with device:
        model = Llama(model_config(size)).to(dtype or torch.float32)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def sync_of(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _matmul_gflops(dtype: torch.dtype, device: torch.device, n: int = 1024) -> float:
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / median_time(lambda: a @ b, 3, warmup=1, sync=sync_of(device))[0] / 1e9


def _build(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "adamw":  # torch's fastest kernel for these tensors (fused)
        return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0, **adamw_kernel(params))
    if name == "adamw-default":  # what AdamW(params) picks: a loop over tensors on the CPU, foreach on CUDA
        return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
    preset, _, fallback = name.partition("+")
    return swan_dist.SWAN(model, preset=preset, lr=0.0, fallback=fallback or None, verbose=False)


def main() -> None:
    args = parser(__doc__, size="small", steps=5).parse_args()  # size: tiny, small, 60m, 130m
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = reference(args.size, device)
    grads = [p.grad for p in model.parameters()]
    n_params, param_bytes = sum(g.numel() for g in grads), sum(g.numel() * g.element_size() for g in grads)
    rows = []
    for name in NAMES:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        opt = _build(name, model)
        t, _ = median_time(opt.step, args.steps, warmup=1, sync=sync_of(device))  # (the warm-up allocates state)
        rows.append((name, t, sum(x.numel() * x.element_size() for st in opt.state.values() for x in st.values()
                                  if isinstance(x, torch.Tensor))))
        del opt
    gf32, gbf16 = (_matmul_gflops(dtype, device) for dtype in (torch.float32, torch.bfloat16))
    lines = [
        f"Reference model `{args.size}` ({n_params / 1e6:.1f}M parameters), one process, device: "
        f"{device_name(device)}, torch {torch.__version__}, median of {args.steps} steps on fixed gradients.",
        "",
        "| optimizer | step time (ms) | vs AdamW | optimizer state (MB) | state / params bytes |",
        "|---|---:|---:|---:|---:|",
        *(f"| {name} | {t * 1e3:.1f} | {t / rows[0][1]:.2f}x | {sb / 2**20:.1f} | {sb / param_bytes:.2f} |"
          for name, t, sb in rows),
        "",
        f"Matmul 1024x1024 on this device: fp32 {gf32:.1f} GFLOP/s, bf16 {gbf16:.1f} GFLOP/s (bf16/fp32 = "
        f"{gbf16 / gf32:.2f}). whiten_dtype='auto' whitens NSDS in bf16 on CUDA and on CPUs with native bf16 (this "
        f"one: {'yes' if cpu_has_native_bf16() else 'no'}), fp32 otherwise and for NS.",
    ]
    kind = "GPU" if device.type == "cuda" else "CPU"
    publish(f"optimizer-step-{device.type}", f"Optimizer step, single process ({kind})", "\n".join(lines),
            write=not args.no_write)


if __name__ == "__main__":
    main()
