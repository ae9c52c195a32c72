"""Peak memory per rank of a whole training step under DDP, FSDP2, DeepSpeed ZeRO-1/2/3 and Megatron-core's
distributed optimizer (spawned ranks, gloo on the CPU), AdamW against SWAN‡: resident and live by category, each
SWAN step's transient against its bound, the FSDP2 steps traced without allocating. Writes ``memory-dist``.

    python benchmarks/memory_dist.py --seq 128 --layouts fsdp2,ddp,zero1,zero2,zero3,megatron
"""

import argparse
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

import memory_frameworks
from measure import Marks, categories, mib, parser, publish, reset_hwm, row, rss_status, settle, spawn
from memory import build
from memory_estimate import VARIANTS, model_config, optimizer, state_bytes, step_bound, trace_step

NAMES = {"fsdp2": "FSDP2", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
         "megatron": "Megatron DistOpt"}
FRAMEWORKS = ("zero1", "zero2", "zero3", "megatron")
CATS = (("Parameter", "Sharded Param", "Unsharded Param"), ("Gradient", "Sharded Grad", "Unsharded Grad"),
        ("Optstate", "OptState"), ("Framework masters",), ("Activation",), ("Temp",),
        ("All Gather", "Reduce Scatter", "Framework comm"))  # the table's columns, in order
BUCKET_MB, MiB = 256.0, 2**20


def _variants(layout: str) -> tuple[str, ...]:
    return ("adamw", "owner", "replicated") + (("backward",) if layout == "fsdp2" else ())


# ---------------------------------------------------------------------------------------------- ranks
def _setup(layout: str, variant: str, world: int, args, x, y) -> SimpleNamespace:
    """The bf16 model and optimizer of ``layout``: ``iteration()`` (forward, backward, step), ``inners`` (the
    optimizers whose step is measured), ``framework`` (the framework's step), ``held()`` (its tensors)."""
    cfg, swan = model_config(args.size), {"preset": "swan_ddagger", "verbose": False, "mode": variant,
                                          "bucket_mb": args.bucket_mb}
    if layout in ("fsdp2", "ddp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel

        from swan_dist.reference.parallel import shard_fsdp2

        mesh = init_device_mesh("cpu", (world,)) if layout == "fsdp2" else None
        model = build(cfg, shard=(lambda m: shard_fsdp2(m, mesh)) if mesh else None)
        model = DistributedDataParallel(model) if layout == "ddp" else model
        opt = optimizer(variant, model, args.bucket_mb)

        def iteration() -> None:
            opt.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            opt.step()

        return SimpleNamespace(module=model, inners=[opt], iteration=iteration, framework=None, held=list,
                               params=sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()))
    return memory_frameworks.setup(layout, variant, world, args, cfg, swan, x, y)


def _rank(rank: int, world: int, layout: str, variant: str, args) -> dict:
    """This rank's resident peak over one step after the warm-up (``VmHWM`` above the RSS before the model was
    built), then its live peak by category over one more, the steps in :class:`measure.Marks` windows."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        memory_frameworks.prepare(layout)
        settle()
        baseline = rss_status()["VmRSS"]
        tokens = torch.randint(0, 32000, (1, args.seq + 1), generator=torch.Generator().manual_seed(rank + 1))
        run = _setup(layout, variant, world, args, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        run.iteration()  # the warm-up
        dist.barrier()
        settle()
        reset_hwm()
        run.iteration()
        out = {"rank": rank, "rss_peak": rss_status()["VmHWM"] - baseline, "params": run.params,
               "inner": type(run.inners[0]).__name__}
        from torch.distributed._tools.fsdp2_mem_tracker import (
            FSDPMemTracker,  # (not in the resident baseline)
        )
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = (FSDPMemTracker(run.module, run.inners[0]) if layout == "fsdp2" else
                   memory_frameworks.framework_tracker() if layout in FRAMEWORKS else MemTracker())
        tracker.track_external(run.module, *run.inners)
        if layout in FRAMEWORKS:
            tracker.register(run.held())
        marks = Marks(tracker)
        for o in run.inners:
            marks.wrap(o, "step", "step")
        if run.framework:
            marks.wrap(*run.framework, "framework")
        dist.barrier()
        with tracker:
            run.iteration()
            whole = categories(tracker.get_tracker_snapshot("peak"))
        out.update(peak=whole, **marks.out, state_bytes=state_bytes(run.inners), bucket_mb=args.bucket_mb)
        out["peak_total"] = max(whole.get("Total", 0), out.get("peak_before_step", 0), out.get("step_peak", 0))
        bound = step_bound(run.inners, variant)
        return {**out, "bound": bound} if bound else out
    finally:
        if layout == "megatron" and "megatron.core" in sys.modules:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.destroy_process_group()


def measure(layout: str, variant: str, world: int, args, bucket_mb: float | None = None) -> list[dict]:
    a = argparse.Namespace(**{**vars(args), "bucket_mb": bucket_mb or args.bucket_mb})
    ranks = [{**r, "layout": layout, "variant": variant, "world": world}
             for r in spawn(_rank, world, layout, variant, a)]
    print(f"{layout} W={world} {variant} bucket_mb={a.bucket_mb:g}: peak live "
          f"{mib(max(r['peak_total'] for r in ranks))} MiB, RSS {mib(max(r['rss_peak'] for r in ranks))} MiB, "
          f"transient {max(r['transient'] for r in ranks) / MiB:,.1f} MiB", flush=True)
    return ranks


def _largest(ranks: list[dict]) -> dict:
    """The rank with the largest live peak, with the rank whose step transient comes closest to its bound."""
    top = dict(max(ranks, key=lambda r: r["peak_total"]))
    bounded = [r for r in ranks if "bound" in r]
    if bounded:
        w = max(bounded, key=lambda r: r["transient"] / r["bound"]["total"])
        top["worst"] = {"rank": w["rank"], "transient": w["transient"], "bound": w["bound"]["total"]}
    return top


# --------------------------------------------------------------------------------------------- report
def _cat(r: dict, names: tuple) -> int:
    return sum(v for k, v in r["peak"].items() if k in names)


def _label(r: dict) -> str:
    if r["variant"] == "adamw" and r["layout"].startswith("zero"):
        return "AdamW (torch, DeepSpeed `torch_adam`)"
    return f"Megatron Adam (`{r['inner']}`)" if r["variant"] == "adamw" and r["layout"] == "megatron" else \
        VARIANTS[r["variant"]]


def _ok(good: bool, no: str = "NOT MET") -> str:
    return "OK" if good else no


def _mib1(b: float) -> str:
    return f"{b / MiB:,.1f}"


def report(rows: list[dict], sweep: list[dict], args) -> str:
    lines = [f"Reference LLaMA `{args.size}` ({rows[0]['params'] if rows else 0:,} parameters held by the largest "
             f"rank), bf16, batch 1 x {args.seq} tokens per rank, `bucket_mb={args.bucket_mb:g}`; per rank, the "
             "largest over ranks.", "",
             "| layout | W | optimizer | live peak MiB | params | grads | opt. state | fp32 masters | activations "
             "| temporaries | comm. buffers | other | RSS peak MiB | step transient MiB | framework step MiB "
             "| bound MiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cats = [_cat(r, c) for c in CATS]
        lines.append(row(NAMES[r["layout"]], r["world"], _label(r), mib(r["peak_total"]), *map(mib, cats),
                         mib(r["peak"].get("Total", 0) - sum(cats)), mib(r["rss_peak"]), _mib1(r["transient"]),
                         _mib1(r["framework_transient"]) if "framework_transient" in r else "-",
                         _mib1(r["bound"]["total"]) if "bound" in r else "-"))
    checks: list[str] = []
    if sweep:
        lines += ["", "The transient against the bound, FSDP2 owner mode, per `bucket_mb` (the largest rank; parts of "
                  "its bound):", "", "| W | bucket_mb | measured MiB | bound MiB | measured / bound | matrices "
                  "| grad buffers | update buffers | workspace | held |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            b, ratio = r["bound"], r["transient"] / r["bound"]["total"]
            lines.append(row(r["world"], f"{r['bucket_mb']:g}", _mib1(r["transient"]), _mib1(b["total"]),
                             f"{ratio:.2f}", *(_mib1(b[k]) for k in ("matrices", "grad_buffers", "update_buffers",
                                                                      "workspace", "held"))))
    by = {(r["layout"], r["world"], r["variant"]): r for r in rows}
    reading = []
    for layout in NAMES:
        for w in sorted({r["world"] for r in rows}):
            a = by.get((layout, w, "adamw"))
            parts = [f"{VARIANTS[v]} {by[(layout, w, v)]['peak_total'] / a['peak_total']:.2f}x live, "
                     f"{by[(layout, w, v)]['rss_peak'] / a['rss_peak']:.2f}x resident"
                     for v in _variants(layout)[1:] if a and (layout, w, v) in by]
            if parts:
                reading.append(f"{NAMES[layout]} W={w}, against {_label(a)}: " + "; ".join(parts) + ".")
    if reading:
        layouts = {r["layout"] for r in rows}
        notes = [n for k, n in (
            ({"ddp"}, "DDP's reducer buckets count in the resident peak, not the live (made before the tracker "
                      "starts)"),
            ({"zero1", "zero2", "zero3"}, "ZeRO's live bytes count DeepSpeed's whole reduce bucket (5e8 bf16 "
                                          "elements, 954 MiB), the resident peak only the pages written"),
            ({"megatron"}, "gloo's coalesced reduce-scatter copies Megatron's whole fp32 gradient buffer (comm. "
                           "buffers; NCCL reduces in place)")) if k & layouts]
        ratios = {f"{NAMES[r['layout']]} W={r['world']} {VARIANTS[r['variant']]}": r["worst"]["transient"]
                  / r["worst"]["bound"] for r in rows if "worst" in r}
        ratios.update({f"FSDP2 W={r['world']} owner, bucket_mb={r['bucket_mb']:g}": r["transient"]
                       / r["bound"]["total"] for r in sweep})
        over, top = [k for k, v in ratios.items() if v > 1.10], max(ratios, key=ratios.get)
        bounds = (f"The transient a SWAN step adds (on the rank nearest its bound) exceeds its bound by more than "
                  f"10 % in: {', '.join(over)}" if over else f"The transient a SWAN step adds stays within 1.10x its "
                  f"bound on every rank (at most {ratios[top]:.2f}x: {top})")
        lines += ["", "Reading: " + " ".join(reading) + " " + bounds + "".join(f"; {n}" for n in notes) + "."]
    for w in sorted({r["world"] for r in rows}):
        a, o, bw = by.get(("fsdp2", w, "adamw")), by.get(("fsdp2", w, "owner")), by.get(("fsdp2", w, "backward"))
        if a and o and "bound" in o:
            limit = a["peak_total"] - a["state_bytes"] + o["bound"]["total"]
            checks.append(f"FSDP2 W={w} owner peak {mib(o['peak_total'])} <= AdamW peak {mib(a['peak_total'])} - "
                          f"its state {mib(a['state_bytes'])} + bound {mib(o['bound']['total'])} = {mib(limit)} "
                          f"MiB: {_ok(o['peak_total'] <= limit)}; + SWAN‡'s fallback state {mib(o['state_bytes'])} "
                          f"= {mib(limit + o['state_bytes'])} MiB: {_ok(o['peak_total'] <= limit + o['state_bytes'])}")
        if o and bw:
            grads = sum(v for k, v in o["step_peak_categories"].items() if k in CATS[1])  # every rank's gradients
            live = bw["peak_total"] <= o["peak_total"] - grads
            work = sum(v for k, v in bw["peak"].items() if k in CATS[4] + CATS[5] + CATS[6])
            checks += [f"FSDP2 W={w} step_in_backward resident peak {mib(bw['rss_peak'])} <= owner "
                       f"{mib(o['rss_peak'])} - its gradients {mib(grads)} = {mib(o['rss_peak'] - grads)} MiB: "
                       f"{_ok(bw['rss_peak'] <= o['rss_peak'] - grads)}",
                       f"FSDP2 W={w} step_in_backward live peak {mib(bw['peak_total'])} <= owner "
                       f"{mib(o['peak_total'])} - {mib(grads)} = {mib(o['peak_total'] - grads)} MiB: {_ok(live)}"
                       + ("" if live else f" (its peak is in backward: {mib(work)} MiB of activations, temporaries, "
                          f"collective buffers, {mib(_cat(bw, CATS[1]))} MiB of gradients not yet reduced)"),
                       f"FSDP2 W={w} live bytes when backward ends: owner {mib(o['live_before_step'])}, "
                       f"step_in_backward {mib(bw['live_before_step'])} MiB; the difference >= 0.98 x its gradients "
                       f"{mib(grads)} MiB: {_ok(o['live_before_step'] - bw['live_before_step'] >= 0.98 * grads)}"]
    return "\n".join(lines + (["", "Checks:", ""] + [f"- {c}" for c in checks] if checks else []))


def estimates_report(est: list[dict], rows: list[dict]) -> list[str]:
    """The traces of benchmarks/memory_estimate.py (fake process group, no allocation) against the real rows."""
    real = {(r["world"], r["variant"]): r for r in rows if r["layout"] == "fsdp2"}
    lines = ["", "The same steps traced without allocating (benchmarks/memory_estimate.py), against the live peaks "
             "above:", "", "| W | optimizer | traced peak MiB | + one RS input MiB | measured live peak MiB "
             "| traced / measured | (+ RS input) / measured | traced transient MiB | measured transient MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in est:
        r = real.get((e["world"], e["variant"]))
        if r:
            upper = e["peak_total"] + e["largest_unit_bytes"]
            lines.append(row(e["world"], VARIANTS[e["variant"]], mib(e["peak_total"]), mib(upper),
                             mib(r["peak_total"]), f"{e['peak_total'] / r['peak_total']:.2f}",
                             f"{upper / r['peak_total']:.2f}", _mib1(e["transient"]), _mib1(r["transient"])))
    return lines


def main() -> None:
    args = parser(__doc__, size="130m", seq=256, worlds="2,4", layouts="fsdp2,ddp", sweep="4,16,64",
                  estimate="1").parse_args()  # --sweep: bucket_mb of the FSDP2 owner sweep; --estimate 0/"": none
    args.bucket_mb = BUCKET_MB
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = [_largest(measure(layout, v, w, args)) for layout in args.layouts.split(",") for w in worlds
            for v in _variants(layout)]
    closest = lambda r: r["transient"] / r["bound"]["total"]  # noqa: E731 - the rank nearest its bound
    sweep = [max(measure("fsdp2", "owner", w, args, bucket_mb=float(b)), key=closest)
             for w in worlds for b in args.sweep.split(",") if b]
    est = [{**trace_step(args.size, r["world"], r["variant"], args.seq, bucket_mb=args.bucket_mb),
            "variant": r["variant"]} for r in rows if r["layout"] == "fsdp2" and args.estimate.strip("0")]
    text = report(rows, sweep, args) + ("\n" + "\n".join(estimates_report(est, rows)) if est else "")
    publish("memory-dist", "Memory, distributed (CPU): peak per rank under DDP, FSDP2, ZeRO-1/2/3 and Megatron's "
            "distributed optimizer, and each SWAN step's transient against its bound", text, write=not args.no_write)


if __name__ == "__main__":
    main()
