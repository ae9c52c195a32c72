"""What a SWAN step adds per rank under FSDP2 at scale (W = 8, 64, 1,024; LLaMA 7B and 70B shapes), owner
vs replicated mode, two ways:

1. the bound of docs/engine.md ("Memory a step adds", ``Exchange.transient_bound``) evaluated on the schedule
   the planner makes for FSDP2's row shards (:func:`swan_dist.plan.row_shard_ranges`), for rank 0 and for the
   rank that computes the most bytes, without a process group and without allocating any matrix; beside it,
   AdamW's state per rank (bf16 parameters, moments in the parameters' dtype, sharded 1/W);
2. one rank's whole training step traced (``benchmarks/memory_estimate.py``: torch's fake process group,
   ``FakeTensorMode``, ``FSDPMemTracker``; batch 1 x ``--seq`` tokens, bf16): AdamW's and SWAN‡'s peaks per
   rank, by category, SWAN's traced step transient against its rank's bound, and ``step_in_backward``.

Writes the ``memory-dist-scale`` section of docs/benchmarks.md (and keeps the traces in
``--save``, default /tmp/memory_dist_scale.json, to report again with ``--load``).

    python benchmarks/memory_dist_scale.py --worlds 8,64 --sizes 7b --trace "7b@8"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import write_section  # noqa: E402

from swan_dist.functional import WhitenConfig
from swan_dist.plan import MatrixSpec, row_shard_ranges
from swan_dist.whitening import _CPU_EXCHANGE_STACK_BYTES, _CPU_PASS_BYTES, _FLUSH_BYTES, swan_exchange, swan_plan

MiB, GiB = 2**20, 2**30


def specs(size: str) -> tuple[list[MatrixSpec], int]:
    from memory_estimate import model_config

    c = model_config(size)  # the shapes the traces build
    dim, layers, ffn, vocab = c.dim, c.n_layers, c.ffn_dim, c.vocab_size
    kv = (c.n_kv_heads or c.n_heads) * (dim // c.n_heads)
    cfg = WhitenConfig()
    out = []
    for i in range(layers):
        for name, shape in (("wq", (dim, dim)), ("wk", (kv, dim)), ("wv", (kv, dim)), ("wo", (dim, dim)),
                            ("w1", (ffn, dim)), ("w3", (ffn, dim)), ("w2", (dim, ffn))):
            out.append(MatrixSpec(f"layers.{i}.{name}", shape, cfg))
    n_params = sum(s.numel for s in out) + 2 * vocab * dim + (2 * layers + 1) * dim
    return out, n_params


def bound(size: str, world: int, mode: str, bucket_mb: float, device: str) -> dict:
    ms, n_params = specs(size)
    ranges = row_shard_ranges(ms, world)
    plan = swan_plan(ms, ranges, mode, int(bucket_mb * MiB))
    load = [0] * world  # full fp32 bytes each rank computes in its largest bucket share
    for b in plan.buckets:
        per = [0] * world
        for m, r in b.owners.items():
            if r >= 0:
                per[r] += 4 * ms[m].numel
        load = [max(a, c) for a, c in zip(load, per)]
    busiest = max(range(world), key=lambda r: load[r])
    out = {"busiest_rank": busiest}
    for tag, rank in (("rank0", 0), ("busiest", busiest)):
        ex = swan_exchange(plan, rank, None, torch.device(device), [torch.bfloat16] * len(ms),
                           stack_bytes=_CPU_EXCHANGE_STACK_BYTES if device == "cpu" else None)
        out[tag] = ex.transient_bound(_CPU_PASS_BYTES if device == "cpu" else _FLUSH_BYTES)["total"]
    out["adamw_state"] = 2 * 2 * n_params / world
    out["params"] = n_params
    return out


def traces(spec: str, seq: int, bucket_mb: float, variants: list[str], save: str) -> list[dict]:
    """Whole steps traced for ``spec`` ("7b@8,64 70b@1024"): AdamW and replicated mode on rank 0, owner
    mode (and in backward) on the rank whose owner bound is the largest."""
    from memory_estimate import trace_step

    out = []
    for item in spec.split():
        size, worlds = item.split("@")
        for world in map(int, worlds.split(",")):
            ranks = bound(size, world, "owner", bucket_mb, "cpu")
            for v in variants:
                rank = ranks["busiest_rank"] if v in ("owner", "backward") else 0
                t0 = time.perf_counter()
                r = trace_step(size, world, v, seq, rank=rank, bucket_mb=bucket_mb)
                r["trace_s"] = time.perf_counter() - t0
                out.append(r)
                print(f"traced {size} W={world} {v} rank {rank}: peak {r['peak_total'] / GiB:,.2f} GiB, transient "
                      f"{r['transient'] / GiB:,.3f}" + (f" (bound {r['bound']['total'] / GiB:,.3f})" if r["bound"] else "")
                      + f" [{r['trace_s']:.0f} s]", flush=True)
                with open(save, "w") as f:
                    json.dump(out, f)
    return out


def trace_table(rows: list[dict]) -> tuple[list[str], list[str]]:
    from memory_estimate import TRACED

    by = {(r["size"], r["world"], r["variant"]): r for r in rows}
    lines = ["| shape | W | optimizer | traced rank | peak / rank (GiB) | + one RS input (GiB) | vs AdamW | params | grads | opt. state "
             "| activations | temporaries | comm. buffers | step transient (GiB) | bound (GiB) | transient / bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    checks = []

    def cat(r, *names):
        return sum(v for k, v in r["peak"].items() if k in names) / GiB

    for r in rows:
        a = by.get((r["size"], r["world"], "adamw"))
        p, b = r["peak"], r["bound"]
        vs = f"{r['peak_total'] / a['peak_total']:.2f}" if a else "-"
        ratio = r["transient"] / b["total"] if b else None
        lines.append(
            f"| {r['size']} | {r['world']:,} | {TRACED[r['variant']]} | {r['rank']} | {r['peak_total'] / GiB:,.2f} "
            f"| {(r['peak_total'] + r['largest_unit_bytes']) / GiB:,.2f} | {vs} "
            f"| {cat(r, 'Sharded Param', 'Unsharded Param'):,.2f} | {cat(r, 'Sharded Grad', 'Unsharded Grad'):,.2f} "
            f"| {cat(r, 'OptState'):,.2f} | {p.get('Activation', 0) / GiB:,.2f} | {p.get('Temp', 0) / GiB:,.2f} "
            f"| {cat(r, 'All Gather', 'Reduce Scatter'):,.2f} | "
            + ("in backward" if r["variant"] == "backward" else f"{r['transient'] / GiB:,.3f}")
            + f" | {b['total'] / GiB:,.3f} | {ratio:.2f} |" if b else
            f"| {r['size']} | {r['world']:,} | {TRACED[r['variant']]} | {r['rank']} | {r['peak_total'] / GiB:,.2f} "
            f"| {(r['peak_total'] + r['largest_unit_bytes']) / GiB:,.2f} | {vs} "
            f"| {cat(r, 'Sharded Param', 'Unsharded Param'):,.2f} | {cat(r, 'Sharded Grad', 'Unsharded Grad'):,.2f} "
            f"| {cat(r, 'OptState'):,.2f} | {p.get('Activation', 0) / GiB:,.2f} | {p.get('Temp', 0) / GiB:,.2f} "
            f"| {cat(r, 'All Gather', 'Reduce Scatter'):,.2f} | "
            + ("in backward" if r["variant"] == "backward" else f"{r['transient'] / GiB:,.3f}") + " | - | - |")
        if ratio is not None:
            checks.append(f"{r['size']} W={r['world']:,} {TRACED[r['variant']]}: traced transient / bound {ratio:.2f} "
                          f"{'OK' if ratio <= 1.10 else 'VIOLATED'} (<= 1.10)")
        if r["variant"] == "owner" and a:
            limit = a["peak_total"] - a["state_bytes"] + b["total"]
            checks.append(f"{r['size']} W={r['world']:,}: owner peak {r['peak_total'] / GiB:,.2f} GiB <= AdamW peak "
                          f"{a['peak_total'] / GiB:,.2f} - AdamW state {a['state_bytes'] / GiB:,.2f} + bound "
                          f"{b['total'] / GiB:,.2f} = {limit / GiB:,.2f} GiB: "
                          f"{'OK' if r['peak_total'] <= limit else 'NOT MET'}")
    return lines, checks


def reading(rows: list[dict]) -> str:
    """What the traces say, from their figures."""
    by = {(r["size"], r["world"], r["variant"]): r for r in rows}
    out = []
    for (size, world, v), r in by.items():
        a, bw = by.get((size, world, "adamw")), by.get((size, world, "backward"))
        if v != "owner" or not a:
            continue
        step_peak = r["live_before_step"] + r["transient"]
        where = ("inside `step()`" if step_peak >= r["peak_before_step"] else
                 f"in forward/backward (the step reaches {step_peak / GiB:,.2f})")
        text = (f"{size} W={world:,}: SWAN‡ {r['peak_total'] / GiB:,.2f} GiB against AdamW's {a['peak_total'] / GiB:,.2f} "
                f"({r['peak_total'] / a['peak_total']:.2f}x; AdamW's state {a['state_bytes'] / GiB:,.2f}), its peak "
                f"{where}")
        if bw:
            text += (f"; in backward {bw['peak_total'] / GiB:,.2f} (live bytes when backward ends "
                     f"{bw['live_before_step'] / GiB:,.2f} against {r['live_before_step'] / GiB:,.2f})")
        out.append(text + ".")
    return ("Reading, per shape and W: " + " ".join(out) + " Where the peak falls in forward/backward (saved "
            "activations, the unit being gathered and reduced) the step's transient sits under it and costs "
            "nothing; SWAN‡ then saves AdamW's whole sharded state, which shrinks as 1/W. Updates in backward "
            "drop every gradient before backward ends, but their unit step's transient now lands while "
            "activations are live: they pay off while a rank's gradients (2 bytes per parameter / W) outweigh "
            "one unit's whitening transient, and not at large W with large matrices.") if out else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="7b,70b")
    p.add_argument("--worlds", default="8,64,1024")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--device", default="cuda", help="the flush size of the device (cpu: 1 MiB, else 32 MiB)")
    p.add_argument("--trace", default="7b@8,64,1024 70b@64,1024", help="shapes@worlds whose whole step is traced")
    p.add_argument("--trace-variants", default="adamw,owner,backward")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--save", default=os.path.join(tempfile.gettempdir(), "memory_dist_scale.json"))
    p.add_argument("--load", default=None, help="report traces saved by an earlier run instead of tracing")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    lines = ["| shape | W | mode | bound, rank 0 (MiB) | bound, busiest owner (MiB) | AdamW state / rank (MiB) | plan (s) |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for size in args.sizes.split(","):
        for world in map(int, args.worlds.split(",")):
            for mode in ("owner", "replicated"):
                t0 = time.perf_counter()
                r = bound(size, world, mode, args.bucket_mb, args.device)
                lines.append(f"| {size} ({r['params'] / 1e9:.1f}B) | {world:,} | {mode} | {r['rank0'] / MiB:,.0f} | "
                             f"{r['busiest'] / MiB:,.0f} | {r['adamw_state'] / MiB:,.0f} | {time.perf_counter() - t0:.1f} |")
                print(lines[-1], flush=True)
    if args.load:
        traced = json.load(open(args.load))
    else:
        traced = traces(args.trace, args.seq, args.bucket_mb, args.trace_variants.split(","), args.save) if args.trace else []
    tlines, checks = trace_table(traced)
    print("\n".join(tlines + [""] + checks))
    if args.no_write:
        return
    body = "\n".join([
        f"What a SWAN‡ step adds per rank under FSDP2 (bf16 parameters, `bucket_mb={args.bucket_mb:g}`), and the "
        "whole step's peak per rank, at shapes and world sizes no machine here holds. **The bound** (first table, "
        f"the {args.device} flush size): docs/engine.md's (\"Memory a step adds\", `Exchange.transient_bound`) on "
        "the schedule the planner makes for FSDP2's row shards, for rank 0 and for the rank that computes the most "
        "bytes; no process group, nothing allocated; AdamW's state per rank (two bf16 moments, sharded 1/W) from "
        "the shapes.", "", *lines, "",
        f"**The whole step traced** (second table; benchmarks/memory_estimate.py): one rank of W on torch's fake "
        f"process group, the reference LLaMA at the shape (70B with 8 key/value heads) built under `FakeTensorMode` "
        f"and sharded as the reference trainer shards it (embeddings, each block, the head: one FSDP2 unit each), "
        f"bf16, batch 1 x {args.seq} tokens, no activation checkpointing, two steps under `FSDPMemTracker` with the "
        "real optimizer (the second counted): torch's AdamW (foreach) on rank 0, SWAN‡ on the rank with the largest "
        "owner bound. GiB per rank at the tracker's peak; *+ one RS input*: the trace plus the largest unit's "
        "reduce-scatter input, which a real run can hold at its peak and the fake process group does not (at the "
        "shapes both run, real peaks lie between the two columns: \"Memory, distributed\"); *step transient*: the "
        "peak inside `step()` over the live bytes before it, against that rank's bound on the CPU engine's "
        "budgets.", "", *tlines, "", "Checks:", "", *[f"- {c}" for c in checks], "", reading(traced)])
    write_section("memory-dist-scale", "Memory, distributed, at scale (no device: the step bound and one rank's "
                  "whole step traced)", body)


if __name__ == "__main__":
    main()
