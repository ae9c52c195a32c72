"""What does the owner engine cost at large W? One process as rank 0 of W on torch's fake process group with
meta-device gradients: per model (LLaMA-7B, -70B, an MoE), layout (FSDP, HSDP) and W, plan and exchange build time,
plan memory, peers, collectives, bytes sent against the minimum, the whitening critical path against its bounds.

    python benchmarks/scale.py            # W = 8, 64, 256, 1024 (a few minutes)
    python benchmarks/scale.py --quick    # W up to 256
"""

import gc
import tracemalloc
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from swan_dist.functional import WhitenConfig
from swan_dist.plan import MatrixSpec, Plan, row_shard_ranges
from swan_dist.whitening import swan_exchange, swan_plan

from measure import median_time, parser, publish, traced  # noqa: E402 (benchmarks/ is the script's folder)

META = torch.device("meta")
DTYPE = torch.bfloat16
SHARD_GROUPS = (8, 64)
BUCKET_MB, BUCKET_MBS = 256, (256, 1024, 4096)  # the measured rows' bucket_mb; the bucket table's


def llama(layers: int, dim: int, kv: int, ffn: int, cfg: WhitenConfig = WhitenConfig()) -> list[MatrixSpec]:
    """A LLaMA's per-layer matrices (out, in): q, k, v, o, gate, up, down."""
    shapes = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    return [MatrixSpec(f"l{i}.{j}", s, cfg) for i in range(layers) for j, s in enumerate(shapes)]


def moe(layers: int = 16, dim: int = 2048, experts: int = 64, ffn: int = 1408) -> list[MatrixSpec]:
    """Attention (4 x dim x dim) and expert stacks (E, out, in): gate, up (E x ffn x dim), down (E x dim x ffn)."""
    shapes = [(dim, dim)] * 4 + [(experts, ffn, dim), (experts, ffn, dim), (experts, dim, ffn)]
    return [MatrixSpec(f"l{i}.{j}", s, WhitenConfig()) for i in range(layers) for j, s in enumerate(shapes)]


MODELS: dict[str, Callable[[], list[MatrixSpec]]] = {
    "LLaMA-7B": lambda: llama(32, 4096, 4096, 11008),
    "LLaMA-70B": lambda: llama(80, 8192, 1024, 28672),
    "MoE 64x": moe,
}


class Layout(NamedTuple):
    """Who holds what: row shards over ``shard`` ranks (replicated across the W / shard groups), the
    exchange over ``group`` ranks (the shard group, or all W)."""

    name: str
    shard: int
    group: int

    def ranges(self, specs: list[MatrixSpec]) -> list[list[tuple[int, int]]]:
        rows = row_shard_ranges(specs, self.shard)
        return [rows[r % self.shard] for r in range(self.group)]


def layouts(world: int) -> list[Layout]:
    out = [Layout("FSDP", world, world)]
    for g in (g for g in SHARD_GROUPS if g < world):
        out += [Layout(f"HSDP {g}, group", g, g), Layout(f"HSDP {g}, world", g, world)]
    return out


def plan_memory(specs: list[MatrixSpec], layout: Layout, bucket_bytes: int) -> float:
    """MiB the plan holds once the gathered ranges it was built from are gone."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ranges = [list(rg) for rg in layout.ranges(specs)]  # as gathered: one list per rank
    plan = swan_plan(specs, ranges, bucket_bytes=bucket_bytes)
    del ranges
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del plan
    return held / 2**20


def minimum_bytes(plan: Plan, rank: int, elem: int) -> int:
    """What this rank must send for the plan's owners: of each matrix it does not own, the part of its
    range the owner lacks; of each it owns, every other holder's range."""
    total = 0
    for b in plan.buckets:
        for m, o in b.owners.items():
            lo, hi = plan.ranges[rank][m]
            if o == rank:
                total += sum(h - lo_ for d, (lo_, h) in enumerate(rg[m] for rg in plan.ranges) if d != rank)
            else:
                a, z = plan.ranges[o][m]
                total += (hi - lo) - max(0, min(hi, z) - max(lo, a))
    return total * elem


def measure(model: str, specs: list[MatrixSpec], world: int, layout: Layout, group, bucket_bytes: int,
            sent: torch.dtype = DTYPE, shards: torch.dtype = DTYPE) -> SimpleNamespace:
    """Rank 0's row (one step through the exchange's own code on meta tensors); ``shards``: the gradients'
    dtype, ``sent``: the dtype the exchange sends them in."""
    ranges, rank = layout.ranges(specs), dist.get_rank(group)
    build_s = min(median_time(lambda: swan_plan(specs, ranges, bucket_bytes=bucket_bytes), 3)[1])  # best of 3
    plan = swan_plan(specs, ranges, bucket_bytes=bucket_bytes)
    exchange_s = min(median_time(lambda: swan_exchange(plan, rank, group, META, [sent] * len(specs)), 3)[1])
    ex = swan_exchange(plan, rank, group, META, [sent] * len(specs))
    ex.run([torch.empty(hi - lo, dtype=shards, device=META) for lo, hi in plan.ranges[rank]], set(),
           lambda m, update, finite: None)
    if ex.failure is not None:
        raise ex.failure
    per_bucket, bound = plan.bounds()  # Σ_b max(cost(b) / group, largest of b); max(total / group, largest)
    return SimpleNamespace(
        model=model, layout=layout.name, world=world, group=layout.group, build_s=build_s, exchange_s=exchange_s,
        plan_mib=plan_memory(specs, layout, bucket_bytes), sent=ex.bytes_sent, slowest=plan.slowest(),
        grad_peers=len({d for st in ex.steps for d, n in enumerate(st.grads.send) if n}),
        update_peers=len({d for st in ex.steps for d, n in enumerate(st.updates.send) if n}),
        collectives=sum(st.moves.grads + st.moves.updates for st in ex.steps),  # all_to_all_single calls
        messages=sum(1 for st in ex.steps for n in (*st.grads.send, *st.updates.send) if n),  # non-empty splits
        minimum=None if layout.group > layout.shard else minimum_bytes(plan, rank, sent.itemsize),  # (replicas)
        per_bucket=per_bucket, bound=bound, world_bound=max(sum(plan.costs) / world, max(plan.costs)))


HEADER = ("| model | layout, exchange | W | build_plan | Exchange | plan | peers sent to: gradients / updates (of) | "
          "all_to_all per step | non-empty splits | sent / step | minimum | mean message | critical path | "
          "/ per-bucket bound | / bound | / world bound |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def format_row(r: SimpleNamespace) -> str:
    splits = r.collectives * r.group
    share = f"{r.messages} of {splits} ({r.messages / splits:.0%})" if splits else "-"
    mean = f"{r.sent / r.messages / 2**10:,.0f} KiB" if r.messages else "-"
    return (f"| {r.model} | {r.layout} | {r.world} | {r.build_s:.3f} s | {r.exchange_s:.3f} s | {r.plan_mib:.1f} MiB | "
            f"{r.grad_peers} / {r.update_peers} ({r.group - 1}) | {r.collectives} | {share} | "
            f"{r.sent / 2**20:,.0f} MiB | {'-' if r.minimum is None else f'{r.minimum / 2**20:,.0f} MiB'} | {mean} | "
            f"{r.slowest / 1e12:,.2f} TFLOP | {r.slowest / r.per_bucket:.2f} | {r.slowest / r.bound:.2f} | "
            f"{r.slowest / r.world_bound:.2f} |")


def run(worlds: tuple[int, ...]) -> list[SimpleNamespace]:
    torch.set_num_threads(1)  # torchrun's default with several processes per node
    warm = llama(1, 64, 64, 172)
    swan_exchange(swan_plan(warm, row_shard_ranges(warm, 4)), 0, None, META, [DTYPE] * len(warm))
    rows = []
    for world in worlds:
        with traced(world):
            groups = {g: dist.new_subgroups(group_size=g)[0] for g in SHARD_GROUPS if g < world}
            for model, make in MODELS.items():
                specs = make()
                for layout in layouts(world):
                    group = dist.group.WORLD if layout.group == world else groups[layout.group]
                    rows.append(measure(model, specs, world, layout, group, BUCKET_MB << 20))
                    print(format_row(rows[-1]), flush=True)
    return rows


def bucket_table(worlds: tuple[int, ...]) -> str:
    """Buckets and critical path over the whole-model bound, per bucket_mb (FSDP; planning only)."""
    lines = ["| model | W | " + " | ".join(f"bucket_mb={mb}: buckets, / bound" for mb in BUCKET_MBS) + " |",
             "|---|---:|" + "---:|" * len(BUCKET_MBS)]
    for model in ("LLaMA-70B", "MoE 64x"):
        specs = MODELS[model]()
        for world in worlds:
            plans = [swan_plan(specs, row_shard_ranges(specs, world), bucket_bytes=mb << 20) for mb in BUCKET_MBS]
            lines.append(f"| {model} | {world} | " + " | ".join(
                f"{len(p.buckets)}, {p.slowest() / p.bounds()[1]:.2f}" for p in plans) + " |")
    return "\n".join(lines)


def findings(rows: list[SimpleNamespace]) -> str:
    """What the numbers above say about the exchange at the largest W measured."""
    world = max(r.world for r in rows)
    find = {(r.model, r.layout): r for r in rows if r.world == world}
    big, small, moe_row = (find[m, "FSDP"] for m in ("LLaMA-70B", "LLaMA-7B", "MoE 64x"))
    pairs = [(find["LLaMA-70B", f"HSDP {g}, group"], find["LLaMA-70B", f"HSDP {g}, world"]) for g in SHARD_GROUPS]
    pct = lambda r: f"{r.messages / (r.collectives * r.group):.0%}"  # noqa: E731
    mib = lambda x: f"{x / 2**20:,.0f} MiB"  # noqa: E731
    each = lambda f: " / ".join(f(*pair) for pair in pairs)  # noqa: E731
    worst = max((r for r in rows if r.layout == "FSDP"), key=lambda r: r.slowest / r.bound)
    off = sorted({f"{r.model} at W = {r.group}: {r.slowest / r.per_bucket:.2f}" for r in rows
                  if r.slowest > 1.005 * r.per_bucket})
    return "\n\n".join([
        f"**The exchange at W = {world}** (LLaMA-70B / 7B under FSDP; 70B: {big.collectives} `all_to_all_single` "
        f"per step). Rank 0 sends gradients to {big.grad_peers} / {small.grad_peers} owners and updates to "
        f"{big.update_peers} / {small.update_peers} holders; {pct(big)} / {pct(small)} of the splits are non-empty, "
        f"{mib(big.sent)} / {mib(small.sent)} per step, {big.sent / big.minimum:.2f}x / "
        f"{small.sent / small.minimum:.2f}x the minimum: for FSDP, **keep the one collective**. The MoE is the "
        f"sparse case: {pct(moe_row)} of the splits non-empty, {moe_row.grad_peers} + {moe_row.update_peers} peers.",
        f"**HSDP** (LLaMA-70B, shard groups of {each(lambda g, w: str(g.group))}). The exchange inside the shard "
        f"group keeps {each(lambda g, w: str(g.grad_peers))} peers, but its critical path is "
        f"{each(lambda g, w: f'{g.slowest / g.world_bound:.1f}x')} the world bound; over the world rank 0 sends "
        f"{each(lambda g, w: f'{w.sent / g.sent:.1f}x')} the bytes to {each(lambda g, w: str(w.update_peers))} peers.",
        f"**Buckets.** The critical path meets its per-bucket bound{', except ' + ', '.join(off) if off else ''}; "
        f"against the whole-model bound, bucket_mb={BUCKET_MB} gives up to {worst.slowest / worst.bound:.2f}x "
        f"({worst.model} at W = {worst.world}). Per bucket_mb (FSDP, planning only):",
    ])


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="W up to 256")
    args = ap.parse_args()
    worlds = (8, 64, 256) if args.quick else (8, 64, 256, 1024)
    print(HEADER)
    rows = run(worlds)
    print()
    publish("engine-scale-cpu", "Owner engine at scale: planning, exchange and bytes per rank (CPU, simulated W)",
            "\n".join([f"NSDS whitening, bucket_mb={BUCKET_MB}, bf16 gradients, one thread; times: best of 3.", "",
                        HEADER, *map(format_row, rows), "", findings(rows), "", bucket_table(worlds)]),
            write=not args.no_write)


if __name__ == "__main__":
    main()
