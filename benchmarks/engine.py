"""How fast is the owner engine's step at W ranks (FSDP2, DDP), how many bytes does it send, how well does its planner
balance (LLaMA shapes up to W=512, planning only)?

    python benchmarks/engine.py --planner-only
    python benchmarks/engine.py --step-only --steps 15
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from swan_dist.functional import WhitenConfig
from swan_dist.plan import row_shard_ranges
from swan_dist.whitening import swan_exchange, swan_plan

from measure import parser, publish, spawn, turns  # noqa: E402 (the script's folder)
from scale import llama  # noqa: E402

# (dim, ffn, layers) of the GaLore/SWAN LLaMA configurations.
LLAMA = {"130M": (768, 2048, 12), "350M": (1024, 2736, 24), "1.3B": (2048, 5461, 24), "7B": (4096, 11008, 32)}
PRESETS = {"SWAN‡ (NSDS)": WhitenConfig(), "SWAN† (NS 10)": WhitenConfig(method="ns", steps=10, beta=0.8)}
# name: (mode, preset, whole bucket in one phase); "owner-1p": no overlap of the exchange with the whitening
NAMES = {"adamw": None, "owner": ("owner", "swan_ddagger", False), "owner-1p": ("owner", "swan_ddagger", True),
         "replicated": ("replicated", "swan_ddagger", False), "owner-ns": ("owner", "swan_dagger", False),
         "replicated-ns": ("replicated", "swan_dagger", False)}


def best_split(costs: list[float], world: int) -> float | None:
    """The smallest slowest-owner total over all owner assignments (one bucket, no byte bound), below which no
    plan goes; exact for at most two distinct costs (LLaMA: attention and MLP matrices), ``None`` otherwise."""
    if len(costs) <= world:
        return max(costs)
    values = sorted(set(costs), reverse=True)
    if len(values) > 2:
        return None
    big, small = values[0], values[-1]
    n_big = costs.count(big) if len(values) == 2 else 0
    n_small = len(costs) - n_big

    def fits(cap: float) -> bool:  # most[j]: the most small matrices placeable on the ranks so far holding j big
        most = [0] + [-1] * n_big
        for _ in range(world):
            most = [max([most[j - a] + int((cap - a * big) // small) for a in range(j + 1)
                         if most[j - a] >= 0 and a * big <= cap], default=-1) for j in range(n_big + 1)]
        return most[n_big] >= n_small

    floor = max(sum(costs) / world, big)
    loads = sorted(x for x in {a * big + b * small for a in range(n_big + 1) for b in range(n_small + 1)}
                   if x >= floor)
    lo, hi = 0, len(loads) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(loads[mid]) else (mid + 1, hi)
    return loads[lo]


def planner_table(bucket_mb: float = 256) -> str:
    """Per model, whitening and W: the plan's Σ over buckets of the slowest owner's cost against three
    lower bounds (the planner alone, no processes)."""
    gf = lambda x: f"{x / 1e9:,.0f}" if x >= 1e11 else f"{x / 1e9:,.1f}"  # noqa: E731
    lines = [
        "| model | whitening | W | buckets | planned | per bucket | planned/bound | whole model | planned/bound "
        "| best split | planned/best |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, (dim, ffn, layers) in LLAMA.items():
        for label, cfg in PRESETS.items():
            specs = llama(layers, dim, dim, ffn, cfg)
            for world in (8, 64, 512):
                plan = swan_plan(specs, row_shard_ranges(specs, world), bucket_bytes=int(bucket_mb * 2**20))
                cost, (per_bucket, whole), best = plan.slowest(), plan.bounds(), best_split(plan.costs, world)
                best_cells = f"{gf(best)} | {cost / best:.3f}" if best else "- | -"
                lines.append(f"| LLaMA {name} | {label} | {world} | {len(plan.buckets)} | {gf(cost)} | "
                             f"{gf(per_bucket)} | {cost / per_bucket:.3f} | {gf(whole)} | {cost / whole:.3f} | "
                             f"{best_cells} |")
    return "\n".join(lines)


def _threads(world: int) -> int:
    return max(1, (os.cpu_count() or 2) // world)


def _rank(rank: int, world: int, size: str, steps: int) -> list[list]:
    """This rank's rows: (layout, optimizer, median step s, bytes sent / step by all ranks, bytes of SWAN's
    matrices, median whitening s or None), each step's time and split the slowest rank's."""
    import swan_dist
    from swan_dist.reference.baselines import adamw_kernel
    from swan_dist.reference.model import Llama, model_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(_threads(world))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results, spent = [], [0.0]

    def timed(compute):  # the time in the whitening itself (CPU ops are synchronous: no sync to add)
        def run(stack, cfg):
            t0 = time.perf_counter()
            out = compute(stack, cfg)
            spent[0] += time.perf_counter() - t0
            return out
        return run

    def before(name: str, k: int) -> None:
        dist.barrier()
        spent[0] = 0.0

    def slowest(name: str, t: float) -> tuple[float, float]:  # the step ends for everyone at the slowest rank
        every = [torch.empty(2, dtype=torch.float64, device=device) for _ in range(world)]
        dist.all_gather(every, torch.tensor([t, spent[0]], dtype=torch.float64, device=device))
        return tuple(max(every, key=lambda x: x[0].item()).tolist())

    for layout in ("fsdp2", "ddp"):
        torch.manual_seed(0)
        model = Llama(model_config(size, vocab_size=8192)).to(device)
        swan_dist.tag_model(model)
        mesh = init_device_mesh(device.type, (world,)) if layout == "fsdp2" else None
        for module in [*model.layers, model] if mesh is not None else []:  # each block, then the root
            fully_shard(module, mesh=mesh)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        # lr 0: the parameters never change, so the optimizers share the model and run in turn
        opts = {}
        for name, spec in NAMES.items():
            params = list(model.parameters())
            opts[name] = (torch.optim.AdamW(params, lr=0.0, **adamw_kernel(params)) if spec is None
                          else swan_dist.SWAN(model, preset=spec[1], lr=0.0, mode=spec[0], verbose=False))
            opts[name].step()  # warm-up: plan, state
            if spec and spec[2]:  # the same plan run as one phase per bucket
                plans = opts[name].plans
                ex = plans.last
                plans.last = swan_exchange(ex.plan, ex.rank, ex.group, ex.device, ex.dtypes, phase_bytes=None)
                plans.cache = {k: plans.last for k in plans.cache}
        exchanges = {n: o.exchange for n, o in opts.items() if getattr(o, "exchange", None)}
        sent0 = {n: ex.bytes_sent for n, ex in exchanges.items()}
        if not cuda:
            for ex in exchanges.values():
                ex.compute = timed(ex.compute)
        runs = turns({n: o.step for n, o in opts.items()}, steps, sync=torch.cuda.synchronize if cuda else lambda: None,
                     before=before, after=slowest)
        for name, opt in opts.items():
            sent = torch.tensor([(exchanges[name].bytes_sent - sent0[name]) / steps if name in exchanges else 0],
                                dtype=torch.float64, device=device)
            dist.all_reduce(sent)
            swan_bytes = sum(4 * p.numel() for g in getattr(opt, "param_groups", []) if g.get("use_swan")
                             for p in g["params"])
            results.append([layout, name, statistics.median(t for t, _ in runs[name]), sent.item(), swan_bytes,
                            None if cuda else statistics.median(w for _, w in runs[name])])
        del opts, model, exchanges
    dist.destroy_process_group()
    return results


def step_table(results: list[list], world: int, size: str, steps: int) -> str:
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else f"CPU, {world} processes of {_threads(world)} thread(s)")
    lines = [
        f"Reference model `{size}`, W={world}, {device}, torch {torch.__version__}; optimizer.step() only, median over "
        f"{steps} steps on fixed gradients of the slowest rank's time per step.",
        "",
        "| layout | optimizer | step (ms) | vs AdamW | replicated / owner | whitening (ms) | rest (ms) | Amdahl "
        "| bytes sent / step (all ranks) | minimum | sent / minimum |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    minimum = {("fsdp2", "owner"): 2 * (world - 1) / world, ("fsdp2", "replicated"): world - 1,
               ("ddp", "owner"): world - 1, ("ddp", "replicated"): 0}  # x bytes(matrices)
    for layout in ("fsdp2", "ddp"):
        rows = {r[1]: r for r in results if r[0] == layout}
        for _, name, t, sent, swan_bytes, w in rows.values():
            if name == "adamw":
                lines.append(f"| {layout} | adamw | {t * 1e3:.1f} | 1.00x | - | - | - | - | - | - | - |")
                continue
            rep = rows["replicated-ns" if name.endswith("-ns") else "replicated"]
            owner = name.startswith("owner")
            amdahl = f"{rep[2] / (rep[5] / world + rep[2] - rep[5]):.2f}x" if owner and w is not None else "-"
            split = f"{w * 1e3:.1f} | {(t - w) * 1e3:.1f}" if w is not None else "- | -"
            least = minimum[(layout, name.split("-")[0])] * swan_bytes
            lines.append(f"| {layout} | {name} | {t * 1e3:.1f} | {t / rows['adamw'][2]:.2f}x | "
                         f"{f'**{rep[2] / t:.2f}x**' if owner else '-'} | {split} | {amdahl} | "
                         f"{sent / 2**20:.1f} MiB | {least / 2**20:.1f} MiB | "
                         f"{f'{sent / least:.2f}' if least else '-'} |")
    return "\n".join(lines)


def main() -> None:
    ap = parser(__doc__, world=2, size="small", steps=5)
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--planner-only", action="store_true", help="only the planner table (computed, no processes)")
    only.add_argument("--step-only", action="store_true", help="only the step-time table (W processes)")
    args = ap.parse_args()
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.step_only:
        publish("engine-planner", "Owner engine: planner balance (planning only, no device)", planner_table(),
                write=not args.no_write)
    if args.planner_only:
        return
    results = spawn(_rank, args.world, args.size, args.steps)[0]
    publish(f"engine-step-{kind}", f"Owner engine ({kind.upper() if kind == 'cpu' else 'GPU'}): step time and bytes "
            f"at W={args.world}", step_table(results, args.world, args.size, args.steps), write=not args.no_write)


if __name__ == "__main__":
    main()
