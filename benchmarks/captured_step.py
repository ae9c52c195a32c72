"""The optimizer step on one GPU, eager and captured in a CUDA graph: SWAN‡ against torch's AdamW and Muon.

The reference LLaMA of each ``--sizes`` in bf16 (parameters and gradients), fixed random gradients, one
process, an lr schedule stepped after every step (a new lr each step); each optimizer built over the same model
in turn, warmed up, then ``--rounds`` rounds of ``--steps`` steps, its best round's median ``step()`` time:
  - torch's AdamW, foreach and fused; torch's Muon on the matrices SWAN whitens with AdamW (torch's default,
    foreach on CUDA) on the rest (``swan_dist.reference.baselines.MuonWithAdamW``);
  - SWAN‡ (``SWAN(model)``), SWAN‡ with ``capturable=True`` run eagerly, and that optimizer's step captured
    once in a CUDA graph (after warm-up steps on a side stream, docs/optimizer.md "Capturing the step") and
    replayed;
each against AdamW fused (what runs at scale) and AdamW foreach. Writes the ``captured-step-cuda`` section.
Without CUDA: a dry run on the CPU at ``--sizes tiny``, nothing captured, nothing written.

    python benchmarks/captured_step.py --sizes 1b3,7b
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
import warnings

import torch

import swan_dist
from swan_dist.reference.baselines import MuonWithAdamW, muon_split
from swan_dist.reference.model import Llama, model_config

from measure import write_section  # noqa: E402 (benchmarks/ is the script's folder)

NAMES = ("adamw-foreach", "adamw-fused", "muon", "swan", "swan-capturable", "swan-captured")


def _build(name: str, model: torch.nn.Module, lr: float):
    params = list(model.parameters())
    if name.startswith("adamw"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **{name.split("-")[1]: True})
    if name == "muon":
        muon, rest = muon_split(model, types.SimpleNamespace(swan_options={}))
        return MuonWithAdamW(muon, [{"params": [p for _, p in rest], "param_names": [n for n, _ in rest]}], lr=lr,
                             weight_decay=0.1)
    return swan_dist.SWAN(model, lr=lr, weight_decay=0.1, capturable=name != "swan", verbose=False)


def _captured(opt, warmup: int):
    """``opt.step`` captured in a CUDA graph after ``warmup`` steps on a side stream: the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph.replay


def measure(size: str, args, device: torch.device) -> dict[str, float]:
    """Per optimizer, the best round's median step time (s) on ``size``: each optimizer built, warmed up,
    timed and let go of in turn (at 7B every optimizer's state at once would not fit beside the model on an
    80 GB GPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    with device:
        model = Llama(model_config(size)).to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    best = {}
    for name in (n for n in NAMES if device.type == "cuda" or n != "swan-captured"):
        opt = _build(name, model, args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.01 * t))  # a new lr every step
        step = _captured(opt, args.warmup) if name == "swan-captured" else opt.step
        for _ in range(0 if name == "swan-captured" else args.warmup):
            step()
        rounds = []
        for _ in range(args.rounds):
            times = []
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - t0)
                with warnings.catch_warnings():  # (a replayed step is not seen by the scheduler's order check)
                    warnings.simplefilter("ignore", UserWarning)
                    sched.step()  # outside the timed step, as in training; a captured step reads the lr tensor
            rounds.append(statistics.median(times))
        best[name] = min(rounds)
        del opt, sched, step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma list of reference model sizes (CUDA: 1b3,7b; CPU: tiny)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = (args.sizes or ("1b3,7b" if device.type == "cuda" else "tiny")).split(",")
    lines = ["| model | optimizer | step (ms) | vs AdamW fused | vs AdamW foreach |", "|---|---|---:|---:|---:|"]
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    for size in sizes:  # each size's rows printed and written once measured: a later size cut short loses only its own
        best = measure(size, args, device)
        for name, t in best.items():
            lines.append(f"| {size} | {name} | {t * 1e3:.2f} | {t / best['adamw-fused']:.2f}x | "
                         f"{t / best['adamw-foreach']:.2f}x |")
        if "swan-captured" in best:
            lines.append(f"| {size} | captured / eager (capturable) | | **{best['swan-captured'] / best['swan-capturable']:.2f}x** | |")
        text = "\n".join([
            f"Reference LLaMA in bf16 (parameters and gradients), one process, {dev}, torch {torch.__version__}: "
            f"`optimizer.step()` on fixed gradients under an lr schedule (LambdaLR, a new lr every step), each optimizer in turn: {args.rounds} rounds of "
            f"{args.steps} steps after {args.warmup} warm-up steps, the best round's median (the first warm-up step compiles "
            "SWAN's whitening on CUDA). "
            "`swan`: SWAN‡ (`SWAN(model)`); `swan-capturable`: with `capturable=True`, eager; `swan-captured`: that "
            "step captured once in a CUDA graph and replayed. `muon`: torch's Muon on SWAN's matrices, AdamW (foreach) on "
            "the rest. Weight decay 0.1 for all.", "", *lines])
        print(text, flush=True)
        if device.type == "cuda":
            write_section("captured-step-cuda", "Optimizer step on one GPU (CUDA): eager and captured, SWAN‡ vs AdamW and Muon", text)


if __name__ == "__main__":
    main()
