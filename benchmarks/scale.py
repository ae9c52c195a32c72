"""The owner engine at large W, simulated in one process: planning, the exchange and the bytes of one rank.

One process is rank 0 of W under torch's fake process group (``init_process_group("fake",
store=FakeStore(), ...)``: every collective returns at once and moves nothing) with gradients on the meta
device, so plans and exchanges are built from shapes alone and one step runs through the exchange's own
code (packing, the ``all_to_all_single`` calls with their splits, assembling, the math on meta tensors,
handing back), with no real tensor of the model's size. Per model, layout and W, for rank 0:

- ``build_plan`` and ``Exchange`` construction time (best of 3, one thread: torchrun's default with
  several processes per node) and the memory the plan holds (``tracemalloc``: what stays allocated once
  the gathered ranges are dropped);
- peers this rank sends gradients and updates to (non-empty splits), collectives per step;
- bytes it sends in one step (bf16 gradients; the exchange's own count) against the minimum for the
  plan's owners: its piece of every matrix it does not own to that matrix's owner, and each other holder's
  piece of every matrix it owns;
- the whitening critical path on the cost model (``Plan.slowest()``: Σ over buckets of the slowest
  owner) against its lower bound max(total/W, largest matrix) (``Plan.bounds()``).

Layouts: FSDP2 row shards over all W ranks; HSDP, row shards within shard groups of 8 or 64 ranks and
replicated across them, the exchange either inside rank 0's shard group (its plan is that of the group:
the group's bound and the world's show what keeping owners in the group costs) or over all W ranks
(``process_group`` left at the world: owners anywhere, replicas as extra holders).

    python benchmarks/scale.py            # W = 8, 64, 256, 1024 (a few minutes)
    python benchmarks/scale.py --quick    # W up to 256
    python benchmarks/scale.py --bucket-mb 1024
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from swan_dist.functional import WhitenConfig
from swan_dist.plan import MatrixSpec, Plan, row_shard_ranges
from swan_dist.whitening import swan_exchange, swan_plan

from measure import write_section  # noqa: E402 (benchmarks/ is the script's folder)

META = torch.device("meta")
DTYPE = torch.bfloat16
SHARD_GROUPS = (8, 64)


def llama(layers: int, dim: int, kv: int, ffn: int) -> list[MatrixSpec]:
    """A LLaMA's per-layer matrices (out, in): q, k, v, o, gate, up, down."""
    shapes = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    return [MatrixSpec(f"l{i}.{j}", s, WhitenConfig()) for i in range(layers) for j, s in enumerate(shapes)]


def moe(layers: int = 16, dim: int = 2048, experts: int = 64, ffn: int = 1408) -> list[MatrixSpec]:
    """Attention (4 x dim x dim) and expert stacks (E, out, in): gate, up (E x ffn x dim), down (E x dim x ffn)."""
    shapes = [(dim, dim)] * 4 + [(experts, ffn, dim), (experts, ffn, dim), (experts, dim, ffn)]
    return [MatrixSpec(f"l{i}.{j}", s, WhitenConfig()) for i in range(layers) for j, s in enumerate(shapes)]


MODELS: dict[str, Callable[[], list[MatrixSpec]]] = {
    "LLaMA-7B": lambda: llama(32, 4096, 4096, 11008),
    "LLaMA-70B": lambda: llama(80, 8192, 1024, 28672),
    "MoE 64x": moe,
}


@dataclass(frozen=True)
class Layout:
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
    for g in SHARD_GROUPS:
        if g < world:
            out += [Layout(f"HSDP {g}, group", g, g), Layout(f"HSDP {g}, world", g, world)]
    return out


@dataclass
class Row:
    model: str
    layout: str
    world: int
    group: int  # ranks in the exchange
    build_s: float
    exchange_s: float
    plan_mib: float
    grad_peers: int  # ranks this one sends gradients to
    update_peers: int  # ranks this one sends updates to
    collectives: int  # all_to_all_single calls per step
    messages: int  # non-empty send splits over the step's collectives
    sent: int  # bytes this rank sent in the step
    minimum: int | None  # None where replicas could send in its place
    slowest: float  # whitening critical path on the cost model (FLOPs)
    per_bucket: float  # Σ over buckets of max(cost(b) / group, largest of b)
    bound: float  # max(total / group, largest)
    world_bound: float  # max(total / W, largest)


def best_of(n: int, fn: Callable[[], object]) -> tuple[float, object]:
    times, out = [], None
    for _ in range(n):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


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
            sent: torch.dtype = DTYPE, shards: torch.dtype = DTYPE) -> Row:
    """Rank 0's row; ``shards``: the gradients' dtype, ``sent``: the dtype the exchange sends them in."""
    ranges = layout.ranges(specs)
    rank = dist.get_rank(group)
    build_s, plan = best_of(3, lambda: swan_plan(specs, ranges, bucket_bytes=bucket_bytes))
    exchange_s, ex = best_of(3, lambda: swan_exchange(plan, rank, group, META, [sent] * len(specs)))
    grads = [torch.empty(hi - lo, dtype=shards, device=META) for lo, hi in plan.ranges[rank]]
    ex.run(grads, set(), lambda m, update, finite: None)
    if ex.failure is not None:
        raise ex.failure
    grad_peers = {d for st in ex.steps for d, n in enumerate(st.grads.send) if n}
    update_peers = {d for st in ex.steps for d, n in enumerate(st.updates.send) if n}
    total, largest = sum(plan.costs), max(plan.costs)
    replicas = layout.group > layout.shard
    return Row(model, layout.name, world, layout.group, build_s, exchange_s, plan_memory(specs, layout, bucket_bytes),
               len(grad_peers), len(update_peers), sum(st.moves.grads + st.moves.updates for st in ex.steps),
               sum(1 for st in ex.steps for n in (*st.grads.send, *st.updates.send) if n), ex.bytes_sent,
               None if replicas else minimum_bytes(plan, rank, sent.itemsize),
               plan.slowest(), *plan.bounds(), max(total / world, largest))


def run(worlds: tuple[int, ...], bucket_bytes: int) -> list[Row]:
    torch.set_num_threads(1)
    warm = llama(1, 64, 64, 172)
    swan_exchange(swan_plan(warm, row_shard_ranges(warm, 4)), 0, None, META, [DTYPE] * len(warm))
    rows = []
    for world in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            groups = {g: dist.new_subgroups(group_size=g)[0] for g in SHARD_GROUPS if g < world}
            for model, make in MODELS.items():
                specs = make()
                for layout in layouts(world):
                    group = dist.group.WORLD if layout.group == world else groups[layout.group]
                    rows.append(measure(model, specs, world, layout, group, bucket_bytes))
                    print(format_row(rows[-1]), flush=True)
        finally:
            dist.destroy_process_group()
    return rows


HEADER = ("| model | layout, exchange | W | build_plan | Exchange | plan | peers sent to: gradients / updates (of) | "
          "all_to_all per step | non-empty splits | sent / step | minimum | mean message | critical path | "
          "/ per-bucket bound | / bound | / world bound |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def format_row(r: Row) -> str:
    splits = r.collectives * r.group
    share = f"{r.messages} of {splits} ({r.messages / splits:.0%})" if splits else "-"
    mean = f"{r.sent / r.messages / 2**10:,.0f} KiB" if r.messages else "-"
    return (f"| {r.model} | {r.layout} | {r.world} | {r.build_s:.3f} s | {r.exchange_s:.3f} s | {r.plan_mib:.1f} MiB | "
            f"{r.grad_peers} / {r.update_peers} ({r.group - 1}) | {r.collectives} | {share} | "
            f"{r.sent / 2**20:,.0f} MiB | {'-' if r.minimum is None else f'{r.minimum / 2**20:,.0f} MiB'} | {mean} | "
            f"{r.slowest / 1e12:,.2f} TFLOP | {r.slowest / r.per_bucket:.2f} | {r.slowest / r.bound:.2f} | "
            f"{r.slowest / r.world_bound:.2f} |")


def find(rows: list[Row], model: str, layout: str, world: int) -> Row:
    return next(r for r in rows if (r.model, r.layout, r.world) == (model, layout, world))


BUCKET_MBS = (256, 1024, 4096)


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


def findings(rows: list[Row], bucket_mb: float) -> str:
    """What the numbers above say about the exchange at the largest W measured."""
    world = max(r.world for r in rows)
    big, small, moe_row = (find(rows, m, "FSDP", world) for m in ("LLaMA-70B", "LLaMA-7B", "MoE 64x"))
    group = [find(rows, "LLaMA-70B", f"HSDP {g}, group", world) for g in SHARD_GROUPS]
    over = [find(rows, "LLaMA-70B", f"HSDP {g}, world", world) for g in SHARD_GROUPS]
    pct = lambda r: f"{r.messages / (r.collectives * r.group):.0%}"  # noqa: E731
    kib = lambda r: f"{r.sent / r.messages / 2**10:,.0f} KiB"  # noqa: E731
    mib = lambda x: f"{x / 2**20:,.0f} MiB"  # noqa: E731
    each = lambda items, f: " / ".join(f(x) for x in items)  # noqa: E731
    fsdp = [r for r in rows if r.layout == "FSDP"]
    worst = max(fsdp, key=lambda r: r.slowest / r.bound)
    off = [r for r in rows if r.slowest > 1.005 * r.per_bucket]
    off_text = (", except " + ", ".join(sorted({f"{r.model} at W = {r.group}: {r.slowest / r.per_bucket:.2f}"
                                                for r in off}))) if off else ""
    return "\n\n".join([
        f"**The exchange at W = {world}.** Each collective is one `all_to_all_single` over all {world} ranks "
        f"({big.collectives} per step for LLaMA-70B under FSDP). Dense models under FSDP do not leave it mostly "
        f"empty: every rank holds a row slice of every matrix, so rank 0 sends gradients to the owner of each "
        f"matrix it does not own (LLaMA-70B / 7B: {big.grad_peers} / {small.grad_peers} peers) and its own "
        f"matrix's update to every holder ({big.update_peers} / {small.update_peers}); {pct(big)} / {pct(small)} "
        f"of the splits are non-empty, messages average {kib(big)} / {kib(small)}, and it sends "
        f"{mib(big.sent)} / {mib(small.sent)} per step, the minimum for the plan's owners "
        f"({big.sent / big.minimum:.2f}x / {small.sent / small.minimum:.2f}x). Owners in a sub-group would not "
        f"shrink the update fan-out (every rank holds a piece of every matrix, whoever whitens it), and a two-level "
        f"exchange would add a hop for every byte: for FSDP, **keep the one collective**. The MoE "
        f"({len(MODELS['MoE 64x']())} matrices on {world} ranks, expert stacks sharded by whole experts) is the "
        f"sparse case: {moe_row.messages} non-empty splits of {moe_row.collectives * moe_row.group} "
        f"({pct(moe_row)}), {moe_row.grad_peers} + {moe_row.update_peers} peers. torch's NCCL `all_to_all_single` "
        f"with splits issues a send and a receive for every rank, empty ones included (`all2all_single_unequal_split`, "
        f"NCCL >= 2.14), so each of its {moe_row.collectives} collectives per step makes {world} of each on every "
        f"rank for {moe_row.messages} messages in all; what that costs needs a GPU run (not measured here).",
        f"**HSDP** (LLaMA-70B, shard groups of {each(group, lambda r: str(r.group))}). The exchange inside the "
        f"shard group keeps rank 0's peers at {each(group, lambda r: str(r.grad_peers))}, but every group whitens "
        f"every matrix: the critical path is {each(group, lambda r: f'{r.slowest / 1e12:,.1f}')} TFLOP, "
        f"{each(group, lambda r: f'{r.slowest / r.world_bound:.1f}x')} the world bound, and rank 0 sends "
        f"{each(group, lambda r: mib(r.sent))}. Over the world each matrix is whitened once: the critical path is "
        f"{each(list(zip(group, over)), lambda t: f'{t[0].slowest / t[1].slowest:.1f}x')} shorter, but rank 0 "
        f"sends {each(over, lambda r: mib(r.sent))} "
        f"({each(list(zip(group, over)), lambda t: f'{t[1].sent / t[0].sent:.1f}x')}) to "
        f"{each(over, lambda r: str(r.update_peers))} peers: the cover takes every replicated piece from its "
        f"lowest-rank holder (rank 0's replica group sends every gradient), and an owner sends its update to all "
        f"{world - 1} other holders, W/g copies of each piece. Restricting owners to the shard group buys few peers "
        f"with whitening; where the world exchange also sends much more at the owner, a two-level exchange (owners "
        f"across the world, gradients spread over the replicas, each update sent within one replica group and "
        f"passed on across groups) would keep the world's critical path without the owner's W/g-fold fan-out. "
        f"HSDP is the layout where that is on the table; FSDP has no replica level to split.",
        f"**Buckets.** The critical path meets its per-bucket bound{off_text}. Against the whole-model bound, "
        f"`bucket_mb` decides: a matrix above it (LLaMA-70B's MLP matrices, 896 MiB in fp32; the MoE's expert "
        f"stacks, 704 MiB) fills its owner's share of a bucket, W of them side by side; where such matrices and "
        f"those of exactly bucket_mb (LLaMA-70B's 8192 x 8192: 256 MiB) outnumber W, they need more buckets than "
        f"the bound's even split, which would put more than bucket_mb on some owner (bucket_mb={bucket_mb:g}: up to "
        f"{worst.slowest / worst.bound:.2f}x, {worst.model} at W = {worst.world}). Per bucket_mb (FSDP, planning "
        f"only):",
    ])


LR_NOTE = ("**An lr schedule** adds nothing to these costs: the plan and exchange are keyed by the layouts only "
           "(the lr and other scalars travel as a hash in the step agreement's one all_reduce), so they are built "
           "once, at the first step; a run under a warm-up + cosine schedule builds one plan and issues the same "
           "collectives at every step (tests/test_schedules.py, W = 2 and 4).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="W up to 256")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    worlds = (8, 64, 256) if args.quick else (8, 64, 256, 1024)
    print(HEADER)
    rows = run(worlds, int(args.bucket_mb * 2**20))
    text = findings(rows, args.bucket_mb) + "\n\n" + bucket_table(worlds) + "\n\n" + LR_NOTE
    body = "\n".join([
        "One process as rank 0 of W (torch's fake process group, meta-device gradients), NSDS whitening, "
        f"bucket_mb={args.bucket_mb:g}, bf16 gradients, one thread; times are the best of 3. *HSDP g, group*: row "
        "shards within shard groups of g ranks, the exchange inside rank 0's group; *HSDP g, world*: the same "
        "layout, the exchange over all W ranks. *peers*: ranks this one sends non-empty splits to, of the exchange "
        "group's others; *minimum*: its piece of every matrix it does not own to the owner, and every other "
        "holder's piece of each matrix it owns (- where a replica could send in its place); *critical path*: Σ "
        "over buckets of the slowest owner's whitening cost, against Σ_b max(cost(b)/W, largest of b) "
        "(*per-bucket bound*), max(total/W, largest matrix) for the exchange group (*bound*) and for all W "
        "ranks (*world bound*).",
        "",
        HEADER,
        *map(format_row, rows),
        "",
        text,
    ])
    print()
    print(text)
    if not args.no_write:
        write_section("engine-scale-cpu", "Owner engine at scale: planning, exchange and bytes per rank "
                      "(CPU, simulated W)", body)


if __name__ == "__main__":
    main()
