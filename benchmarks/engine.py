"""The owner-rank engine, measured side by side in one run.

1. Optimizer step time at world size W (default 2, gloo on CPU / NCCL on GPU) on the reference
   model, FSDP2-sharded and DDP-replicated: SWAN owner mode (phased, and in one phase) vs replicated
   mode vs torch AdamW; on the CPU each step split into the whitening itself and the rest.
2. Bytes this run's exchange actually sent per step vs the minimum 2·(W−1)/W·bytes(matrices) for
   sharded gradients (under DDP every rank needs every update: (W−1)·bytes(matrices) at least).
3. Planner balance (Σ over buckets of the slowest owner's cost vs lower bounds) for the matrix shapes of
   LLaMA 130M, 350M, 1.3B and 7B at W = 8, 64, 512 (computed, no processes; ``--planner-only`` runs
   just this one and refreshes just its section; ``--step-only`` runs just 1. and 2.).
4. ``--against COMMIT``: the step times of 1. on this checkout's swan_dist against COMMIT's, the script run
   on each in turn (``--rounds`` times each), as ratios.
Writes sections of docs/benchmarks.md.

    python benchmarks/engine.py --world 2 --size small --steps 5
    python benchmarks/engine.py --planner-only
    python benchmarks/engine.py --step-only --steps 15
    python benchmarks/engine.py --step-only --steps 10 --against 1aaf204 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from swan_dist.functional import WhitenConfig
from swan_dist.plan import MatrixSpec, row_shard_ranges
from swan_dist.whitening import swan_exchange, swan_plan

from measure import against, against_table, free_port, write_section  # noqa: E402 (benchmarks/ is the script's folder)

# (dim, ffn, layers) of the GaLore/SWAN LLaMA configurations.
LLAMA = {"130M": (768, 2048, 12), "350M": (1024, 2736, 24), "1.3B": (2048, 5461, 24), "7B": (4096, 11008, 32)}
PRESETS = {"SWAN‡ (NSDS)": WhitenConfig(), "SWAN† (NS 10)": WhitenConfig(method="ns", steps=10, beta=0.8)}


def llama_specs(name: str, cfg: WhitenConfig) -> list[MatrixSpec]:
    dim, ffn, layers = LLAMA[name]
    shapes = [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn), (ffn, dim)]
    return [MatrixSpec(f"l{i}.{j}", s, cfg) for i in range(layers) for j, s in enumerate(shapes)]


def best_split(costs: list[float], world: int) -> float | None:
    """The smallest possible slowest-owner total over all owner assignments (one bucket, no byte bound):
    no plan goes below it, since Σ over buckets of the slowest owner >= the slowest owner's total.
    Exact for at most two distinct costs (LLaMA: attention and MLP matrices); ``None`` otherwise."""
    if len(costs) <= world:
        return max(costs)
    values = sorted(set(costs), reverse=True)
    if len(values) > 2:
        return None
    big, small = values[0], values[-1]
    n_big = costs.count(big) if len(values) == 2 else 0
    n_small = len(costs) - n_big

    def fits(cap: float) -> bool:  # most small matrices placeable on i ranks holding j big ones
        most = [0] + [-1] * n_big
        for _ in range(world):
            nxt = list(most)
            for j, s in enumerate(most):
                if s < 0:
                    continue
                a = 0
                while a * big <= cap and j + a <= n_big:
                    nxt[j + a] = max(nxt[j + a], s + int((cap - a * big) // small))
                    a += 1
            most = nxt
        return most[n_big] >= n_small

    floor = max(sum(costs) / world, big)
    loads = sorted({a * big + b * small for a in range(n_big + 1) for b in range(n_small + 1)} - {0.0})
    loads = [x for x in loads if x >= floor]
    lo, hi = 0, len(loads) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(loads[mid]) else (mid + 1, hi)
    return loads[lo]


def planner_table(bucket_mb: float) -> str:
    """Per model, whitening and W: the plan's Σ over buckets of the slowest owner's cost against three
    lower bounds. Computed from the planner alone, no processes."""
    gf = lambda x: f"{x / 1e9:,.0f}" if x >= 1e11 else f"{x / 1e9:,.1f}"  # noqa: E731
    lines = [
        f"Σ over buckets of the slowest owner's whitening cost (GFLOP, `whiten_flops`) for FSDP2 row-sharded ranges, "
        f"bucket_mb={bucket_mb:g} per owner, against lower bounds: **per bucket** Σ_b max(cost(b)/W, largest matrix "
        "of b) for the buckets as cut (target: planned within 1.05x); **whole model** max(total/W, largest matrix), "
        "unbucketed; **best split**: the smallest slowest-owner total any owner assignment reaches (exact, one "
        "bucket, no byte bound), below which no plan can go.",
        "",
        "| model | whitening | W | buckets | planned | per bucket | planned/bound | whole model | planned/bound "
        "| best split | planned/best |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in LLAMA:
        for label, cfg in PRESETS.items():
            specs = llama_specs(name, cfg)
            for world in (8, 64, 512):
                plan = swan_plan(specs, row_shard_ranges(specs, world), bucket_bytes=int(bucket_mb * 2**20))
                cost = plan.slowest()
                per_bucket, whole = plan.bounds()
                best = best_split(plan.costs, world)
                best_cells = f"{gf(best)} | {cost / best:.3f}" if best else "- | -"
                lines.append(f"| LLaMA {name} | {label} | {world} | {len(plan.buckets)} | {gf(cost)} | {gf(per_bucket)} | "
                             f"{cost / per_bucket:.3f} | {gf(whole)} | {cost / whole:.3f} | {best_cells} |")
    lines += ["", "planned/best = 1.000: no assignment of whole matrices to owners does better, whatever the buckets."]
    if bucket_mb == 256:
        lines[-1] += (
            " Every row above 1.05x is there except LLaMA 7B SWAN† at W=64 (1.026x the best split; 130M at W=64: "
            "84 matrices on 64 ranks, so some rank whitens two). For 7B SWAN† at W=64 the only assignment below "
            "the plan's slowest total (3 attention + 1 MLP matrix) gives 32 ranks 4 attention matrices and 32 ranks "
            "3 MLP matrices (4096x11008, 172 MiB: one per owner and bucket at 256 MiB), which takes 3 buckets of at "
            "least one MLP matrix each, 1.03x the plan at best: the plan is the minimum under the byte bound. "
            "At W=512 there are fewer matrices than ranks: each matrix gets an owner of its own in one bucket "
            "(1.000 by construction; most ranks idle). The previous planner (consecutive buckets, LPT inside "
            "each) was at up to 1.13 (1.3B) and 1.39 (7B) at W=8 and 1.22 / 1.64 (7B) at W=64 against the "
            "whole-model bound.")
    return "\n".join(lines)


# name: (mode, preset, whole bucket in one phase); "owner-1p": no overlap of the exchange with the whitening
NAMES = {"adamw": None, "owner": ("owner", "swan_ddagger", False), "owner-1p": ("owner", "swan_ddagger", True),
         "replicated": ("replicated", "swan_ddagger", False), "owner-ns": ("owner", "swan_dagger", False),
         "replicated-ns": ("replicated", "swan_dagger", False)}


def _timed(compute, spent: list[float]):
    def run(stack, cfg):
        t0 = time.perf_counter()
        out = compute(stack, cfg)
        spent[0] += time.perf_counter() - t0
        return out
    return run


def _worker(rank: int, world: int, port: int, size: str, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    import swan_dist
    from swan_dist.reference.baselines import adamw_kernel
    from swan_dist.reference.model import Llama, model_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = []
    for layout in ("fsdp2", "ddp"):
        torch.manual_seed(0)
        model = Llama(model_config(size, vocab_size=8192)).to(device)
        swan_dist.tag_model(model)
        if layout == "fsdp2":
            mesh = init_device_mesh(device.type, (world,))
            for blk in model.layers:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        # lr 0: the parameters never change, so the optimizers share the model and run interleaved,
        # one step each per round, so that a change in the machine's load hits them alike
        opts = {}
        for name in NAMES:
            if name == "adamw":
                opts[name] = torch.optim.AdamW(model.parameters(), lr=0.0, **adamw_kernel(list(model.parameters())))
            else:
                mode, preset, one_phase = NAMES[name]
                opts[name] = swan_dist.SWAN(model, preset=preset, lr=0.0, mode=mode, verbose=False)
            opts[name].step()  # warm-up: plan, state
            if name != "adamw" and NAMES[name][2]:  # the same plan run as one phase per bucket
                plans = opts[name].plans
                ex = plans.last
                plans.last = swan_exchange(ex.plan, ex.rank, ex.group, ex.device, ex.dtypes, phase_bytes=None)
                plans.cache = {k: plans.last for k in plans.cache}
        sent0 = {n: o.exchange.bytes_sent if getattr(o, "exchange", None) else 0 for n, o in opts.items()}
        times: dict[str, list[float]] = {n: [] for n in NAMES}
        whiten: dict[str, list[float]] = {n: [] for n in NAMES}
        spent = [0.0]
        if not cuda:  # the time in the whitening itself (CPU ops are synchronous: no sync to add)
            for opt in opts.values():
                if getattr(opt, "exchange", None):
                    opt.exchange.compute = _timed(opt.exchange.compute, spent)
        for _ in range(steps):
            for name, opt in opts.items():
                dist.barrier()
                sync()
                spent[0] = 0.0
                t0 = time.perf_counter()
                opt.step()
                sync()
                t = torch.tensor([time.perf_counter() - t0, spent[0]], dtype=torch.float64, device=device)
                every = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(every, t)  # the step ends for everyone at the slowest rank: its split
                slowest = max(every, key=lambda x: x[0].item())
                times[name].append(slowest[0].item())
                whiten[name].append(slowest[1].item())
        for name, opt in opts.items():
            sent = ((opt.exchange.bytes_sent - sent0[name]) / steps) if getattr(opt, "exchange", None) else 0
            tot = torch.tensor([sent], dtype=torch.float64, device=device)
            dist.all_reduce(tot)
            swan_bytes = sum(
                4 * p.numel() for g in getattr(opt, "param_groups", []) if g.get("use_swan") for p in g["params"]
            )
            results.append((layout, name, statistics.median(times[name]), tot.item(), swan_bytes,
                            statistics.median(whiten[name]) if not cuda else None))
        del opts, model
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


TARGET = 1.85  # replicated / owner at W=2 (2x is the ideal)


def run_steps(world: int, size: str, steps: int) -> list[tuple]:
    """The workers' rows: (layout, optimizer, median step s, bytes sent / step, bytes of SWAN's matrices,
    median whitening s or None)."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "res.pt")
        mp.start_processes(_worker, args=(world, free_port(), size, steps, out), nprocs=world, start_method="spawn")
        return torch.load(out)


def step_table(results: list[tuple], world: int, size: str, steps: int) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {world} processes of {max(1, (os.cpu_count() or 2) // world)} thread(s)"
    lines = [
        f"Reference model `{size}`, W={world}, {device}, torch {torch.__version__}; optimizer.step() only, "
        f"median over {steps} steps on fixed gradients of the slowest rank's time per step, the six optimizers "
        "of a layout interleaved (one step each per round). adamw: torch's AdamW, fused (DDP) or foreach "
        "(FSDP2's DTensors). owner/replicated: SWAN‡ (NSDS); -ns: SWAN† (NS, 10 "
        "steps); owner-1p: owner SWAN‡ with each bucket exchanged in one phase (no exchange in flight while it "
        f"whitens). **replicated / owner**: how much faster owner mode is (ideal W = {world}x; target at W=2: "
        f"{TARGET}x). **whitening**: the slowest rank's time in the whitening itself (`swan_update` on its "
        "stacks), for each step the rank whose step was slowest; **rest**: its step − whitening (the "
        "exchange, the fallback rule on the other parameters, the finite checks, applying the updates). **Amdahl**: replicated / owner if owner mode only split the "
        f"whitening {world} ways and left the replicated step's rest as it is: the most owner mode can gain "
        "without also splitting the rest.",
        "",
        "| layout | optimizer | step (ms) | vs AdamW | replicated / owner | whitening (ms) | rest (ms) | Amdahl "
        "| bytes sent / step (all ranks) | minimum | sent / minimum |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in ("fsdp2", "ddp"):
        rows = [r for r in results if r[0] == layout]
        t_of = {r[1]: r[2] for r in rows}
        w_of = {r[1]: r[5] for r in rows}
        t_adam = t_of["adamw"]
        for _, name, t, sent, swan_bytes, w in rows:
            if name == "adamw":
                lines.append(f"| {layout} | adamw | {t * 1e3:.1f} | 1.00x | - | - | - | - | - | - | - |")
                continue
            rep = "replicated-ns" if name.endswith("-ns") else "replicated"
            amdahl = "-"
            if name.startswith("owner") and w is not None:
                t_rep, w_rep = t_of[rep], w_of[rep]
                amdahl = f"{t_rep / (w_rep / world + t_rep - w_rep):.2f}x"
            split = f"{w * 1e3:.1f} | {(t - w) * 1e3:.1f}" if w is not None else "- | -"
            factor = {("fsdp2", "owner"): 2 * (world - 1) / world, ("fsdp2", "replicated"): world - 1,
                      ("ddp", "owner"): world - 1, ("ddp", "replicated"): 0}[(layout, name.split("-")[0])]
            minimum = factor * swan_bytes
            ratio = f"{sent / minimum:.2f}" if minimum else "-"
            speed = f"**{t_of[rep] / t:.2f}x**" if name.startswith("owner") else "-"
            lines.append(f"| {layout} | {name} | {t * 1e3:.1f} | {t / t_adam:.2f}x | {speed} | {split} | {amdahl} | "
                         f"{sent / 2**20:.1f} MiB | {minimum / 2**20:.1f} MiB | {ratio} |")
    lines += [
        "",
        "Minimum: owner mode on sharded gradients 2·(W−1)/W·bytes(matrices) (gather to the owner, scatter "
        "back); owner mode on replicated (DDP) gradients (W−1)·bytes (every rank needs every update); "
        "replicated mode on shards: every rank gathers every matrix, (W−1)·bytes; on DDP nothing moves.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--no-write", action="store_true")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--planner-only", action="store_true",
                      help="only the planner table (computed, no processes); refreshes only its section")
    only.add_argument("--step-only", action="store_true",
                      help="only the step-time table (W processes); refreshes only its section")
    ap.add_argument("--json", help="also write the step table's rows (layout, optimizer, median step and whitening "
                    "seconds) here")
    ap.add_argument("--against", metavar="COMMIT", help="the step table only: run it on this checkout and on "
                    "COMMIT's swan_dist in turn, --rounds times each, and write the ratios (section "
                    "engine-step-<device>-against)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.against:
        if args.planner_only:
            ap.error("--against compares the step table; it does not go with --planner-only")
        return compare(args)
    if not args.step_only:
        plan_text = planner_table(args.bucket_mb)
        print(plan_text)
        if not args.no_write:
            write_section("engine-planner", "Owner engine: planner balance (planning only, no device)", plan_text)
    if args.planner_only:
        return
    results = run_steps(args.world, args.size, args.steps)
    if args.json:
        rows = [dict(layout=r[0], name=r[1], t=r[2], whiten=None if r[1] == "adamw" else r[5]) for r in results]
        Path(args.json).write_text(json.dumps(rows))
    step_text = step_table(results, args.world, args.size, args.steps)
    print(step_text)
    if not args.no_write:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        write_section(f"engine-step-{kind}", f"Owner engine ({kind.upper() if kind == 'cpu' else 'GPU'}): step time and bytes at W={args.world}", step_text)


def compare(args: argparse.Namespace) -> None:
    """This checkout's step table against ``args.against``'s, the same script run on each in turn: per layout
    and optimizer the best of the rounds' medians, the ratio of the two, and the same ratio with each run's
    time taken relative to its own adamw step."""
    argv = ["--step-only", "--world", str(args.world), "--size", args.size, "--steps", str(args.steps)]
    new, old = against(args.against, __file__, argv, args.rounds)
    measured = any(r["whiten"] is not None for run in new for r in run)  # on the CPU only
    ms = lambda w: "-" if w is None else f"{w * 1e3:.1f}"  # noqa: E731
    whitening = (f"whitening (ms): this, {args.against}", lambda r, r0: f"{ms(r['whiten'])}, {ms(r0['whiten'])}")
    lines, ratios = against_table(args.against, new, old, ("layout", "layout", "---"), ("adamw", "adamw"),
                                  whitening if measured else None)

    swan = {key: ratio for key, ratio in ratios.items() if key[1] != "adamw"}
    spread = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}x"  # noqa: E731
    per_layout = [f"{layout}: {spread([r for (g, _), (r, _) in swan.items() if g == layout])} "
                  f"({spread([q for (g, _), (_, q) in swan.items() if g == layout])} each vs its adamw; "
                  f"adamw {ratios[(layout, 'adamw')][0]:.2f}x)" for layout in dict.fromkeys(g for g, _ in ratios)]
    worst = max(swan, key=lambda key: swan[key][1])
    intro = (f"This script's step table (reference model `{args.size}`, W={args.world}, the section above: median "
             f"over {args.steps} steps of the slowest rank's step) run {args.rounds} times on this commit's swan_dist "
             f"and {args.rounds} times on commit {args.against}'s, in turn; per row the best of the rounds' medians. "
             "A ratio under 1 is this commit faster.")
    if measured:
        intro += " Whitening: the slowest rank's time in the whitening itself, in the round kept."
    summary = (f"The SWAN rows' step time against {args.against}: {'; '.join(per_layout)}. The highest ratio each "
               f"vs its adamw: {worst[0]} {worst[1]}, {swan[worst][1]:.2f}x.")
    text = "\n".join([intro, "", *lines, "", summary])
    print(text)
    if not args.no_write:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        write_section(f"engine-step-{kind}-against", f"Owner engine ({kind.upper() if kind == 'cpu' else 'GPU'}): "
                      f"this commit against {args.against}", text)


if __name__ == "__main__":
    main()
