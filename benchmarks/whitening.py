"""How close does SWAN's update come to the GEMMs it needs? ``swan_update`` on the reference model's matrices
(stacked by shape) per preset and dtype, against the device's rate on the same GEMMs and on one square product (on
a glibc CPU also with glibc's trimming off).

    python benchmarks/whitening.py --size small
"""

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections import Counter

import torch

from swan_dist.functional import WhitenConfig, swan_update
from swan_dist.reference.model import Llama, model_config

from measure import median_time, parser, publish  # noqa: E402 (benchmarks/ is the script's folder)
from optimizer_step import device_name, sync_of  # noqa: E402

PRESETS = {"SWAN‡ (NSDS 2)": WhitenConfig("nsds", 2, 0.4), "SWAN† (NS 10)": WhitenConfig("ns", 10, 0.8)}
NO_TRIM = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def _needed_flops(shape: tuple[int, int], cfg: WhitenConfig) -> float:
    s, n = min(shape), max(shape)
    return 4.0 * s * s * n + (2.0 * (3 * cfg.steps - 3) * s**3 if cfg.method == "ns" else 0.0)


def _gemms_only(stack: torch.Tensor, cfg: WhitenConfig):
    """The products the algorithm needs on these shapes, nothing else (the Gram of the smaller side), on matrices
    of spectral norm 1: NS's chain of products then never sinks into subnormals (slow on x86 CPUs)."""
    x = (stack.mT if stack.shape[-1] <= stack.shape[-2] else stack).contiguous()  # (.., s, l)
    x = x / torch.linalg.matrix_norm(x.float(), ord=2, keepdim=True).clamp_min(1e-30).to(x.dtype)
    n_small = 3 * cfg.steps - 3 if cfg.method == "ns" else 0

    def run():
        z = y = x @ x.mT
        for _ in range(n_small):
            z = z @ y
        return z @ x
    return run


def _no_trim_rows(args) -> list:
    """The same measurement in a child process with glibc's mmap/trim thresholds fixed high."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        subprocess.run([sys.executable, __file__, "--size", args.size, "--reps", str(args.reps), "--dtypes",
                        args.dtypes, "--compile", args.compile, "--rows-out", out], check=True,
                       env={**os.environ, **NO_TRIM})
        with open(out) as f:
            return [tuple(r) for r in json.load(f)]


def main() -> None:
    # compile: auto (on CUDA), yes, no; rows_out: the child run's rows
    ap = parser(__doc__, size="small", reps=5, dtypes="float32,bfloat16", compile="auto", rows_out="")
    ap.add_argument("--no-allocator-run", action="store_true", help="skip the second run with glibc's trimming off")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = Llama(model_config(args.size, vocab_size=8192))
    shapes = Counter(tuple(p.shape) for n, p in model.named_parameters()
                     if p.dim() == 2 and "tok_embeddings" not in n and not n.startswith("output"))
    stacks = {s: torch.randn(c, *s, device=device) * 1e-3 for s, c in sorted(shapes.items())}
    timed = lambda fn: median_time(fn, args.reps, warmup=2, sync=sync_of(device))[0]  # noqa: E731
    big = 4096 if device.type == "cuda" else 1024
    compiled = args.compile == "yes" or (args.compile == "auto" and device.type == "cuda")
    rows = []
    for dt in args.dtypes.split(","):
        a = torch.randn(big, big, device=device, dtype=getattr(torch, dt))
        square = 2 * big**3 / timed(lambda: a @ a) / 1e9
        for label, base in PRESETS.items():
            cfg = WhitenConfig(base.method, base.steps, base.beta, dtype=dt)
            t_upd = t_comp = t_gemm = flops = 0.0
            for shape, stack in stacks.items():
                os.environ["SWAN_DIST_COMPILE"] = "0"
                t_upd += timed(lambda: swan_update(stack, cfg))
                if compiled:
                    os.environ["SWAN_DIST_COMPILE"] = "1"
                    t_comp += timed(lambda: swan_update(stack, cfg))
                t_gemm += timed(_gemms_only(stack.to(getattr(torch, dt)), cfg))
                flops += _needed_flops(shape, cfg) * stack.shape[0]
            os.environ.pop("SWAN_DIST_COMPILE", None)
            rows.append(("glibc, no trim" if args.rows_out else "glibc", dt, label, t_comp if compiled else t_upd,
                         t_upd, t_gemm, flops, square))
    if args.rows_out:
        with open(args.rows_out, "w") as f:
            json.dump(rows, f)
        return
    if device.type == "cpu" and platform.libc_ver()[0] == "glibc" and not args.no_allocator_run:
        rows += _no_trim_rows(args)
    lines = [
        f"Reference model `{args.size}`: {sum(shapes.values())} matrices "
        f"({', '.join(f'{c}x {list(s)}' for s, c in sorted(shapes.items()))}), one process, {device_name(device)}, "
        f"torch {torch.__version__}; median of {args.reps}; update: {'compiled' if compiled else 'eager'}. Needed "
        "FLOPs: Gram + final product (4 s² l per matrix), for NS 3K − 3 s×s products; same-shape: those GEMMs alone.",
        "",
        f"| allocator | dtype | preset | update (ms) | eager update (ms) | GEMMs alone (ms) | needed GFLOP | achieved "
        f"GFLOP/s | same-shape GEMM GFLOP/s | vs same-shape (target ≥ 80 %) | {big}² matmul GFLOP/s | vs {big}² |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for alloc, dt, label, t_upd, t_eager, t_gemm, flops, square in rows:
        ach, gem = flops / t_upd / 1e9, flops / t_gemm / 1e9
        lines.append(f"| {alloc} | {dt} | {label} | {t_upd * 1e3:.2f} | {t_eager * 1e3:.2f} | {t_gemm * 1e3:.2f} | "
                     f"{flops / 1e9:.2f} | {ach:.1f} | {gem:.1f} | {100 * ach / gem:.0f} % | {square:.1f} | "
                     f"{100 * ach / square:.0f} % |")
    size = "" if args.size == "small" else f"-{args.size}"  # (a section per model size besides `small`)
    kind = ("GPU" if device.type == "cuda" else "CPU") + (f", {args.size}" if size else "")
    publish(f"whitening-{device.type}{size}", f"Whitening efficiency ({kind}): swan_update vs its GEMMs",
            "\n".join(lines), write=not args.no_write)


if __name__ == "__main__":
    main()
