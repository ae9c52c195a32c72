"""How long is the optimizer step on one GPU, eager and captured in a CUDA graph? SWAN‡ (plain, capturable, and
captured once and replayed) against torch's AdamW (foreach, fused) and Muon, on the reference LLaMA in bf16 with
fixed gradients under an lr schedule. Writes `captured-step-cuda`; without CUDA, a dry run at `tiny`, unwritten.

    python benchmarks/captured_step.py --sizes 1b3,7b
"""

import types
import warnings

import torch

import swan_dist
from swan_dist.reference.baselines import MuonWithAdamW, muon_split

from measure import median_time, parser, publish  # (benchmarks/ is the script's folder)
from optimizer_step import reference, sync_of  # noqa: E402

WARMUP, LR = 3, 1e-3
NAMES = ("adamw-foreach", "adamw-fused", "muon", "swan", "swan-capturable", "swan-captured")


def _build(name: str, model: torch.nn.Module, lr: float):
    params = list(model.parameters())
    if name.startswith("adamw"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **{name.split("-")[1]: True})
    if name == "muon":  # torch's Muon on the matrices SWAN whitens, AdamW (foreach on CUDA) on the rest
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


def best_time(name: str, model: torch.nn.Module, args, device: torch.device) -> float:
    """The best round's median step time (s) of optimizer ``name``, built and warmed up here."""
    opt = _build(name, model, LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.01 * t))  # a new lr every step
    step = _captured(opt, WARMUP) if name == "swan-captured" else opt.step
    for _ in range(0 if name == "swan-captured" else WARMUP):
        step()

    def next_lr(_: int) -> None:  # untimed, as in training (a captured step reads the lr tensor)
        with warnings.catch_warnings():  # (a replayed step is not seen by the scheduler's order check)
            warnings.simplefilter("ignore", UserWarning)
            sched.step()

    return min(median_time(step, args.steps, sync=sync_of(device), before=next_lr)[0] for _ in range(args.rounds))


def measure(size: str, args, device: torch.device) -> dict[str, float]:
    """Per optimizer, its best time: each built, timed and let go of in turn (at 7B every optimizer's state at
    once would not fit beside the model on an 80 GB GPU)."""
    model = reference(size, device, torch.bfloat16)
    best = {}
    for name in (n for n in NAMES if device.type == "cuda" or n != "swan-captured"):
        best[name] = best_time(name, model, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return best


def main() -> None:
    args = parser(__doc__, sizes="", steps=10, rounds=3).parse_args()  # sizes: default 1b3,7b on CUDA, tiny on a CPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = (args.sizes or ("1b3,7b" if device.type == "cuda" else "tiny")).split(",")
    lines = ["| model | optimizer | step (ms) | vs AdamW fused | vs AdamW foreach |", "|---|---|---:|---:|---:|"]
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    for size in sizes:  # each size written once measured: a later size cut short loses only its own
        best = measure(size, args, device)
        for name, t in best.items():
            lines.append(f"| {size} | {name} | {t * 1e3:.2f} | {t / best['adamw-fused']:.2f}x | "
                         f"{t / best['adamw-foreach']:.2f}x |")
        if "swan-captured" in best:
            ratio = best["swan-captured"] / best["swan-capturable"]
            lines.append(f"| {size} | captured / eager (capturable) | | **{ratio:.2f}x** | |")
        text = "\n".join([
            f"Reference LLaMA in bf16, one process, {dev}, torch {torch.__version__}: `optimizer.step()` on fixed "
            f"gradients, a new lr every step (LambdaLR); {args.rounds} rounds of {args.steps} steps after {WARMUP} "
            "warm-up, the best round's median; weight decay 0.1. `swan-capturable`: `capturable=True`, eager; "
            "`swan-captured`: its step replayed from a CUDA graph; `muon`: torch's Muon on SWAN's matrices, AdamW on "
            "the rest.", "", *lines])
        publish("captured-step-cuda", "Optimizer step on one GPU (CUDA): eager and captured, SWAN‡ vs AdamW and Muon",
                text, write=device.type == "cuda" and not args.no_write)


if __name__ == "__main__":
    main()
