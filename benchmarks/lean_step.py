"""Lean step: SWAN's bookkeeping on hundreds of small matrices, against torch AdamW (foreach).

The model is deliberately made of tensors too small for the math to matter: 48 layers of 7
``Linear(64, 64, bias=False)`` (336 matrices SWAN whitens) and 2 RMSNorms each, plus an embedding,
a final norm and an output head (99 tensors on the fallback rule), 435 tensors in all. With
``whitening="none"`` SWAN's math is GradNorm and the rescale, a few memory passes like AdamW's, so
what is measured is the step's bookkeeping: listing pieces, the finite checks, the step agreement,
batching, applying updates and the fallback rule.

Measured side by side in one run, on the same parameters and the same fixed gradients
(``optimizer.step()`` only, median over ``--steps`` after warm-up; weight decay 0.1 everywhere):
  - step time, and per tensor in µs (step time / number of parameter tensors), for torch AdamW
    (``foreach=True``, the reference; ``fused=True`` where the device has it), SWAN
    (``whitening="none"``, AdamW fallback) and SWAN with the stateless ``sign`` fallback;
    the ratio to AdamW (foreach) against the target: within 2x;
  - host syncs per step: on CUDA, the synchronising calls ``torch.cuda.set_sync_debug_mode`` reports;
    on the CPU (where a sync costs nothing, but the count is the same code path), the Python-level
    host reads (torch.Tensor's value-reading methods, anyone's: ``swan_dist.host_reads``);
  - at W=2 (``--world``; gloo on the CPU, NCCL on GPUs, spawned processes holding the whole model as
    under DDP): the same step times (slowest rank's median) and the collectives one step issues
    (``torch.distributed`` functions wrapped with counters): the step agreement and, in ``owner`` mode,
    the exchange of updates; ``local`` mode (no exchange) next to it.
Writes a section of docs/benchmarks.md.

    python benchmarks/lean_step.py --steps 50
    python benchmarks/lean_step.py --world 0 --no-write   # one process only
    python benchmarks/lean_step.py --steps 30 --against 1aaf204   # this commit's step against another's
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from swan_dist.host_reads import HostReads

from measure import against, against_table, free_port, write_section  # noqa: E402 (benchmarks/ is the script's folder)

TARGET = 2.0  # SWAN (whitening none) within 2x of AdamW (foreach) per tensor
# The same script on the optimizer before the lean step (swan_dist/optimizer.py and adapter.py of commit
# c92af58, everything else as measured), on the machines the sections below were measured on.
BEFORE = {
    "cpu": "Before the lean step (this script, the optimizer of commit c92af58, the same 2-core CPU machine, 2026-11-23, constant lr): W=1 "
           "swan-none 49.62 ms (114.1 µs per tensor, 2.19x AdamW foreach at 22.66 ms), swan-none+sign 47.76 ms "
           "(2.11x); W=2 swan-none@owner 58.73 ms (2.70x AdamW foreach at 21.73 ms), swan-none+sign@owner 54.99 ms "
           "(2.53x), swan-none@local 59.32 ms (2.73x): per-parameter adapter calls, two kernels per gradient for "
           "the finite check, a repr of every parameter's options for the configuration hash (W>1), per-matrix "
           "update kernels, stacks past the CPU's caches and a single-tensor AdamW fallback.",
    "cuda": "Before the lean step (this script, the optimizer of commit c92af58, on an H100, 2026-11-23, constant lr): swan-none "
            "43.81 ms (100.7 µs per tensor, 6.03x AdamW foreach at 7.27 ms), swan-none+sign 45.28 ms (6.23x): "
            "per-parameter adapter calls, two kernels per gradient for the finite check, a repr of every "
            "parameter's options for the configuration hash (W>1), per-matrix update kernels and a single-tensor "
            "AdamW fallback.",
}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(d)
        self.w1, self.w2, self.w3 = (nn.Linear(d, d, bias=False) for _ in range(3))


class ManySmall(nn.Module):
    def __init__(self, layers: int = 48, d: int = 64, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)


def build(layers: int, d: int, device: torch.device) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = ManySmall(layers, d).to(device)
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
    return model, grads


def make(name: str, model: nn.Module, grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    import swan_dist

    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    if name == "adamw-foreach":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    if name == "adamw-fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    base, _, mode = name.partition("@")
    fallback = "sign" if base.endswith("+sign") else "adamw"
    return swan_dist.SWAN(model, preset="swan_ddagger", lr=1e-4, whitening="none", weight_decay=0.1,
                          fallback=fallback, mode=mode or "auto", verbose=False)


def fused_ok(device: torch.device) -> bool:
    try:
        p = nn.Parameter(torch.zeros(2, device=device))
        p.grad = torch.zeros(2, device=device)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def count_syncs(fn, device: torch.device) -> int:
    """Host syncs in one call of ``fn``: CUDA's sync debug mode on CUDA, Python-level host reads (anyone's:
    :class:`swan_dist.host_reads.HostReads`) on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
    with HostReads() as reads:
        fn()
    return reads.n_all


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
                "all_to_all_single", "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier",
                "send", "recv", "isend", "irecv", "gather", "scatter")


def count_collectives(fn) -> Counter:
    calls: Counter = Counter()
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    for n, orig in saved.items():
        def counted(*a, _n=n, _orig=orig, **k):
            calls[_n] += 1
            return _orig(*a, **k)

        setattr(dist, n, counted)
    try:
        fn()
    finally:
        for n, orig in saved.items():
            setattr(dist, n, orig)
    return calls


def schedule(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The reference trainer's schedule (``build_scheduler``: linear warm-up over 10 % of the steps, then
    cosine to 10 %), so that every measured step runs at another lr, as in a real run."""
    from swan_dist.reference.config import TrainConfig
    from swan_dist.reference.optim import build_scheduler

    return build_scheduler(TrainConfig(steps=steps + 4, warmup_ratio=0.1, min_lr_ratio=0.1), opt)


def measure(names, model, grads, steps, device, sync, barrier=lambda: None, collectives=False) -> list[dict]:
    """Every optimizer on the same parameters, stepped in turn (one step each per round, so that a load
    change on the machine hits all alike), each under the trainer's lr schedule (stepped after each
    optimizer step, outside the timed region); the median per optimizer, its host syncs and collectives
    (one scheduled step)."""
    opts = [make(name, model, grads) for name in names]
    scheds = [schedule(opt, steps) for opt in opts]
    for _ in range(3):
        for opt, sched in zip(opts, scheds):
            opt.step()  # warm-up: state, plan, caches
            sched.step()
    times: list[list[float]] = [[] for _ in opts]
    for _ in range(steps):
        for k, opt in enumerate(opts):
            barrier()
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times[k].append(time.perf_counter() - t0)
            scheds[k].step()
    rows = []
    for name, opt, sched, ts in zip(names, opts, scheds, times):
        row = dict(name=name, t=statistics.median(ts), syncs=count_syncs(opt.step, device))
        sched.step()
        if collectives:
            row["coll"] = count_collectives(opt.step)
        rows.append(row)
    return rows


def _worker(rank: int, world: int, port: int, layers: int, d: int, steps: int, names, out: str, cuda: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, grads = build(layers, d, device)
    rows = measure(names, model, grads, steps, device, sync, barrier=dist.barrier, collectives=True)
    for row in rows:  # the slowest rank's median
        t = torch.tensor([row["t"]], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        row["t"] = t.item()
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, layers: int, d: int, steps: int, names, cuda: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.start_processes(_worker, args=(world, free_port(), layers, d, steps, names, out, cuda), nprocs=world,
                           start_method="spawn")
        return torch.load(out)


def table(rows: list[dict], n_tensors: int, world: int) -> list[str]:
    ref = next(r["t"] for r in rows if r["name"] == "adamw-foreach")
    head = "| W | optimizer | step (ms) | per tensor (µs) | vs AdamW foreach | target ≤ 2x | host syncs / step |"
    sep = "|---:|---|---:|---:|---:|---|---:|"
    if any("coll" in r for r in rows):
        head += " collectives / step |"
        sep += "---|"
    lines = [head, sep]
    for r in rows:
        ratio = r["t"] / ref
        swan = r["name"].startswith("swan")
        verdict = ("met" if ratio <= TARGET else "missed") if swan else "-"
        line = (f"| {world} | {r['name']} | {r['t'] * 1e3:.2f} | {r['t'] / n_tensors * 1e6:.1f} | {ratio:.2f}x | "
                f"{verdict} | {r['syncs']} |")
        if "coll" in r:
            line += " " + (", ".join(f"{k} {v}" for k, v in sorted(r["coll"].items())) or "none") + " |"
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--world", type=int, default=2, help="also run W processes (0: one process only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads of the one-process run (W>1: one each)")
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    ap.add_argument("--json", help="also write the rows (world, optimizer, median step, host reads) here")
    ap.add_argument("--against", metavar="COMMIT", help="run this script on this checkout and on COMMIT's swan_dist "
                    "in turn, --rounds times each, and write the ratios (section lean-step-<device>-against)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.against:
        return compare(args)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)

    model, grads = build(args.layers, args.dim, device)
    n_tensors = len(grads)
    n_matrices = 7 * args.layers
    names = ["adamw-foreach"] + (["adamw-fused"] if fused_ok(device) else []) + ["swan-none", "swan-none+sign"]
    rows = measure(names, model, grads, args.steps, device, sync)
    lines = table(rows, n_tensors, 1)
    found = [dict(r, world=1) for r in rows]
    cuda = device.type == "cuda"
    multi = args.world > 1 and (not cuda or torch.cuda.device_count() >= args.world)
    if multi:  # one GPU per rank under NCCL; on the CPU, gloo
        wnames = ["adamw-foreach", "swan-none@owner", "swan-none+sign@owner", "swan-none@local"]
        wrows = run_world(args.world, args.layers, args.dim, args.steps, wnames, cuda)
        lines += table(wrows, n_tensors, args.world)[2:]
        found += [dict(r, world=args.world) for r in wrows]
    if args.json:
        Path(args.json).write_text(json.dumps([{k: r[k] for k in ("world", "name", "t", "syncs")} for r in found]))

    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    setup = (f"{args.layers} layers x 7 `Linear({args.dim}, {args.dim}, bias=False)` ({n_matrices} matrices) + 2 "
             f"RMSNorms each, embedding, final norm, head: {n_tensors} tensors ({sum(g.numel() for g in grads) / 1e6:.2f}M "
             f"parameters). Device: {dev_name}, torch {torch.__version__}; `optimizer.step()` only, median of "
             f"{args.steps} steps on fixed gradients, the optimizers stepped in turn, each under the reference trainer's "
             "lr schedule (linear warm-up, then cosine: a new lr at every step)")
    if multi:
        setup += (f" (W={args.world}: {args.world} processes, " + ("one GPU each, NCCL" if cuda else "1 thread each, gloo")
                  + ", the whole model on every rank as under DDP; the slowest rank's median)")
    setup += "."
    if args.world > 1 and not multi:
        setup += f" W={args.world} needs {args.world} GPUs; this machine has {torch.cuda.device_count()}."
    notes = [
        f"`swan-none`: SWAN with `whitening=\"none\"` (GradNorm and rescale only, so the step is bookkeeping), "
        f"AdamW fallback for the {n_tensors - n_matrices} embedding/norm/head tensors; `+sign`: the stateless sign "
        "fallback; `@owner` / `@local`: the engine mode at W>1 (owner: each matrix's update computed on one rank "
        "and sent to the other, two all_to_all; local: each rank computes what it holds, no exchange). Collectives: "
        "one scheduled step after warm-up (a new lr: the plan is kept; one all_reduce agrees on codes, structure and "
        "scalars, one ends the step with every rank's status). Per tensor = "
        "step time / tensors; target: SWAN within 2x of AdamW (foreach).",
        "",
        "Host syncs: on CUDA what `torch.cuda.set_sync_debug_mode` reports; on the CPU the Python-level reads "
        "of tensor values (`item`, `tolist`, `bool`, ...), anyone's, which cost nothing there and are counted for "
        "the code path: torch's foreach AdamW reads each parameter's CPU step counter twice (no device sync on "
        "CUDA); SWAN reads nothing in one process and the step's closing status once at W>1.",
    ]
    before = BEFORE.get(device.type) if (args.layers, args.dim) == (48, 64) else None
    if before:
        notes += ["", before]
    text = "\n".join([setup, "", *lines, "", *notes])
    print(text)
    if not args.no_write:
        write_section(f"lean-step-{device.type}", f"Lean step ({device.type.upper()}): per-tensor overhead on many small matrices under an lr schedule", text)


def compare(args: argparse.Namespace) -> None:
    """This checkout's step against ``args.against``'s, the same script run on each in turn: per world size
    and optimizer the best of the rounds' medians (a round slowed by the machine counts least), the ratio
    of the two, and the same ratio with each run's time taken relative to its own AdamW (foreach) step."""
    argv = ["--layers", str(args.layers), "--dim", str(args.dim), "--steps", str(args.steps), "--world",
            str(args.world), "--device", args.device, "--threads", str(args.threads)]
    new, old = against(args.against, __file__, argv, args.rounds)
    lines, _ = against_table(args.against, new, old, ("world", "W", "---:"), ("adamw-foreach", "AdamW foreach"),
                             (f"host reads / step: this, {args.against}", lambda r, r0: f"{r['syncs']}, {r0['syncs']}"))
    text = "\n".join([
        f"This script's model ({args.layers} layers x 7 `Linear({args.dim}, {args.dim})`, the rows of the section "
        f"above), run {args.rounds} times on this commit's swan_dist and {args.rounds} times on commit "
        f"{args.against}'s, in turn; per row the best of the rounds' median step times. A ratio under 1 is this "
        "commit faster. Host reads: torch.Tensor's value-reading methods in one step, anyone's (torch's foreach "
        "AdamW reads its CPU step counters).", "", *lines])
    print(text)
    if not args.no_write:
        kind = torch.device(args.device).type
        write_section(f"lean-step-{kind}-against", f"Lean step ({kind.upper()}): this commit against {args.against}",
                      text)


if __name__ == "__main__":
    main()
