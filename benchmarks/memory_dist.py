"""Peak memory per rank of a whole training step under DDP and FSDP2 (spawned processes, gloo on the CPU),
AdamW against SWAN‡ in owner and replicated mode and FSDP2 with ``step_in_backward=True``, on the same
model and data, and the transient a SWAN step adds against the stated bound (docs/engine.md, "Memory a
step adds") for several ``bucket_mb``.

Model: the reference LLaMA at a ``MODEL_SIZES`` shape with the papers' 32k vocabulary, bf16 weights (no
fp32 master, no autocast), batch 1 x ``--seq`` tokens per rank, built on ``meta`` and materialised in place
(FSDP2: sharded before it is materialised, so no rank ever holds the whole model). Each (layout, optimizer,
W) runs in fresh processes, one configuration after another, and each rank measures:

1. **resident memory**: after ``--warmup`` steps, ``malloc_trim(0)`` and the high-water mark reset (``5``
   to ``/proc/self/clear_refs``), one step, ``VmHWM`` minus the RSS before the model was built;
2. **live tensor bytes by category**: one more step under torch's ``MemTracker`` (``FSDPMemTracker``
   under FSDP2: sharded/unsharded parameters and gradients, all-gather and reduce-scatter buffers apart),
   its peak per category; and the *step transient*: the peak inside ``optimizer.step()`` minus the live
   bytes just before it (SWAN's assembled fp32 matrices, whitening workspace, exchange buffers and the
   fallback rule's temporaries), against the rank's bound computed from its own exchange schedule.

Writes the ``memory-dist`` section of docs/benchmarks.md and docs/results/memory-dist.json.

    python benchmarks/memory_dist.py --size small --no-write           # quick check
    python benchmarks/memory_dist.py --size 130m --worlds 2,4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import write_section  # noqa: E402
from memory import MiB, _reset_hwm, _settle, _status  # noqa: E402

VARIANTS = {
    "adamw": "AdamW (torch, foreach)",
    "owner": "SWAN‡ owner mode",
    "replicated": "SWAN‡ replicated mode",
    "backward": "SWAN‡ owner, step_in_backward",
}
LAYOUT_VARIANTS = {"fsdp2": ("adamw", "owner", "replicated", "backward"), "ddp": ("adamw", "owner", "replicated")}


# ---------------------------------------------------------------------------------------------- ranks
def _build(size: str, layout: str, world: int):
    from swan_dist.reference.model import Llama, model_config, rope_tables

    cfg = model_config(size, vocab_size=32000)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        from swan_dist.reference.parallel import shard_fsdp2

        shard_fsdp2(model, init_device_mesh("cpu", (world,)))
    model.to_empty(device="cpu")
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
    model.rope_cos, model.rope_sin = cos, sin
    torch.manual_seed(0)
    model.reset_parameters()
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    return model, cfg


def _optimizer(variant: str, model, bucket_mb: float):
    import swan_dist

    if variant == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    mode = "replicated" if variant == "replicated" else "owner"
    return swan_dist.SWAN(model, preset="swan_ddagger", verbose=False, mode=mode, bucket_mb=bucket_mb,
                          step_in_backward=variant == "backward")


def _categories(snapshot: dict) -> dict[str, int]:
    dev = snapshot.get(torch.device("cpu"), {})
    return {getattr(k, "value", str(k)): int(v) for k, v in dev.items()}


def _rank(rank: int, world: int, layout: str, variant: str, args) -> dict:
    _settle()
    baseline = _status()["VmRSS"]
    model, cfg = _build(args.size, layout, world)
    opt = _optimizer(variant, model, args.bucket_mb)
    g = torch.Generator().manual_seed(rank + 1)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    marks: dict[str, int] = {}

    def step(tracker=None) -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        if tracker is not None:  # the step's own peak, from the live bytes just before it
            dev = torch.device("cpu")
            before = tracker.get_tracker_snapshot("current").get(dev, {})
            total = next((int(v) for k, v in before.items() if getattr(k, "value", k) == "Total"), 0)
            marks["peak_before_step"] = max(tracker._peak_mem.values(), default=0)
            saved = tracker._peak_mem_snap
            tracker._peak_mem = {dev: total}
            tracker._peak_mem_snap = {dev: dict(before)}
            marks["live_before_step"] = total
        opt.step()
        if tracker is not None:
            marks["step_peak"] = max(tracker._peak_mem.values(), default=0)
            marks["step_peak_categories"] = _categories(tracker.get_tracker_snapshot("peak"))
            if marks["peak_before_step"] > marks["step_peak"]:  # keep the whole step's peak
                tracker._peak_mem = {torch.device("cpu"): marks["peak_before_step"]}
                tracker._peak_mem_snap = saved

    for _ in range(args.warmup):
        step()
    dist.barrier()
    _settle()
    between = _status()["VmRSS"]
    _reset_hwm()
    step()
    hwm = _status()["VmHWM"]
    out = {"rank": rank, "rss_peak": hwm - baseline, "rss_between": between - baseline,
           "params": sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())}

    from torch.distributed._tools.mem_tracker import MemTracker

    if layout == "fsdp2":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(model, opt)
    else:
        tracker = MemTracker()
    tracker.track_external(model, opt)
    dist.barrier()
    with tracker:
        step(tracker)
        whole = _categories(tracker.get_tracker_snapshot("peak"))
    out.update(peak=whole, after=_categories(tracker.get_tracker_snapshot("current")), **marks)
    out["peak_total"] = max(whole.get("Total", 0), marks.get("peak_before_step", 0), marks.get("step_peak", 0))
    out["transient"] = marks["step_peak"] - marks["live_before_step"]
    if variant in ("owner", "replicated"):
        from swan_dist import whitening

        ex = next(iter(opt._memos.values())).plans.last if opt._memos else None
        if ex is not None:
            out["bound"] = ex.transient_bound(whitening._CPU_PASS_BYTES)
            out["bucket_mb"] = args.bucket_mb
    state = 0
    for st in opt.state.values():
        local = [getattr(t, "_local_tensor", t) for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
        state += sum(t.numel() * t.element_size() for t in local)
    out["state_bytes"] = state
    return out


def _worker(rank: int, world: int, port: int, layout: str, variant: str, args, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = _rank(rank, world, layout, variant, args)
        with open(os.path.join(path, f"{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(layout: str, variant: str, world: int, args, bucket_mb: float | None = None) -> list[dict]:
    a = argparse.Namespace(**{**vars(args), "bucket_mb": bucket_mb or args.bucket_mb})
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(world, _free_port(), layout, variant, a, d), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.json")) as f:
                ranks.append(json.load(f))
    for r in ranks:
        r.update(layout=layout, variant=variant, world=world, wall_s=time.perf_counter() - t0)
    print(f"{layout} W={world} {variant} bucket_mb={a.bucket_mb:g}: peak live "
          f"{max(r['peak_total'] for r in ranks) / MiB:,.0f} MiB, RSS {max(r['rss_peak'] for r in ranks) / MiB:,.0f} MiB, "
          f"transient {max(r['transient'] for r in ranks) / MiB:,.1f} MiB"
          + (f" (bound {max(r['bound']['total'] for r in ranks if 'bound' in r) / MiB:,.1f})"
             if any("bound" in r for r in ranks) else "") + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
    top = max(ranks, key=lambda r: r["peak_total"])
    print("  at the peak: " + ", ".join(f"{k} {v / MiB:,.0f}" for k, v in top["peak"].items() if v), flush=True)
    return ranks


# --------------------------------------------------------------------------------------------- report
def _m(b) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def _cat(r: dict, *names: str) -> int:
    return sum(v for k, v in r["peak"].items() if k in names)


PARAM = ("Parameter", "Sharded Param", "Unsharded Param")
GRAD = ("Gradient", "Sharded Grad", "Unsharded Grad")
COMM = ("All Gather", "Reduce Scatter")
OPT = ("Optstate", "OptState")


def report(rows: list[dict], sweep: list[dict], args) -> tuple[str, list[str]]:
    lines = [
        f"Reference LLaMA `{args.size}` (32k vocabulary, {rows[0]['params'] if rows else 0:,} parameters held by "
        f"the largest rank), bf16 weights, batch 1 x {args.seq} tokens per rank, gloo on the CPU, one process per rank; "
        f"`bucket_mb={args.bucket_mb:g}`. Per rank, the largest over ranks: **live** = MemTracker's peak over one whole "
        "step (FSDPMemTracker under FSDP2), by category at that peak; **RSS** = peak resident memory over one step "
        "above the process's RSS before the model was built (allocator trimmed, high-water mark reset before the "
        "step); **transient** = the peak inside `optimizer.step()` minus the live bytes just before it; **bound** = "
        "the rank's bound from its exchange schedule (docs/engine.md, \"Memory a step adds\").",
        "",
        "| layout | W | optimizer | live peak MiB | params | grads | opt. state | activations | temporaries "
        "| comm. buffers | other | RSS peak MiB | step transient MiB | bound MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["peak"]
        cats = [_cat(r, *PARAM), _cat(r, *GRAD), _cat(r, *OPT), p.get("Activation", 0), p.get("Temp", 0), _cat(r, *COMM)]
        bound = f"{r['bound']['total'] / MiB:,.1f}" if "bound" in r else "-"
        lines.append(f"| {r['layout'].upper()} | {r['world']} | {VARIANTS[r['variant']]} | {_m(r['peak_total'])} | "
                     + " | ".join(_m(c) for c in cats) + f" | {_m(p.get('Total', 0) - sum(cats))} | {_m(r['rss_peak'])} "
                     f"| {r['transient'] / MiB:,.1f} | {bound} |")
    checks: list[str] = []
    if sweep:
        lines += ["", "The transient against the bound, FSDP2 owner mode, per `bucket_mb` (the largest rank; "
                  "parts of that rank's bound: assembled fp32 matrices of a phase, gradient and update buffers of "
                  "the phases in flight, one stack's whitening workspace, update pieces held before they are applied):", "",
                  "| W | bucket_mb | measured MiB | bound MiB | measured / bound | matrices | grad buffers "
                  "| update buffers | workspace | held |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            b = r["bound"]
            ratio = r["transient"] / b["total"]
            lines.append(f"| {r['world']} | {r['bucket_mb']:g} | {r['transient'] / MiB:,.1f} | {b['total'] / MiB:,.1f} "
                         f"| {ratio:.2f} | {b['matrices'] / MiB:,.1f} | {b['grad_buffers'] / MiB:,.1f} "
                         f"| {b['update_buffers'] / MiB:,.1f} | {b['workspace'] / MiB:,.1f} | {b['held'] / MiB:,.1f} |")
            checks.append(f"bound W={r['world']} bucket_mb={r['bucket_mb']:g}: measured/bound {ratio:.2f} "
                          f"{'OK' if ratio <= 1.10 else 'VIOLATED'} (<= 1.10)")
    by = {(r["layout"], r["world"], r["variant"]): r for r in rows}
    reading = []
    for layout in ("fsdp2", "ddp"):
        for w in sorted({r["world"] for r in rows}):
            a = by.get((layout, w, "adamw"))
            if not a:
                continue
            parts = [f"{VARIANTS[v]} {by[(layout, w, v)]['peak_total'] / a['peak_total']:.2f}x live, "
                     f"{by[(layout, w, v)]['rss_peak'] / a['rss_peak']:.2f}x resident"
                     for v in LAYOUT_VARIANTS[layout][1:] if (layout, w, v) in by]
            reading.append(f"{layout.upper()} W={w}, against AdamW: " + "; ".join(parts) + ".")
    if reading:
        lines += ["", "Reading: " + " ".join(reading) + " The transient a SWAN step adds stays under its bound "
                  "(measured / bound in the table); under DDP MemTracker does not see the reducer's gradient buckets "
                  "(allocated by DDP's C++ reducer before the tracker starts), which the resident peak counts."]
    for w in sorted({r["world"] for r in rows}):
        a, o, bw = by.get(("fsdp2", w, "adamw")), by.get(("fsdp2", w, "owner")), by.get(("fsdp2", w, "backward"))
        if a and o and "bound" in o:
            limit = a["peak_total"] - a["state_bytes"] + o["bound"]["total"]
            checks.append(f"FSDP2 W={w} owner peak {_m(o['peak_total'])} MiB <= AdamW peak {_m(a['peak_total'])} - "
                          f"AdamW state {_m(a['state_bytes'])} + bound {_m(o['bound']['total'])} = {_m(limit)} MiB: "
                          f"{'OK' if o['peak_total'] <= limit else 'NOT MET'}")
            fb = limit + o["state_bytes"]
            checks.append(f"FSDP2 W={w} the same with SWAN‡'s fallback state ({_m(o['state_bytes'])} MiB: AdamW moments "
                          f"of embeddings, head, norms) added to the right side: {_m(fb)} MiB: "
                          f"{'OK' if o['peak_total'] <= fb else 'NOT MET'}")
        if o and bw:
            grads = sum(v for k, v in o["step_peak_categories"].items() if k in GRAD)  # every rank's gradients
            checks.append(f"FSDP2 W={w} step_in_backward peak {_m(bw['peak_total'])} MiB <= ordinary {_m(o['peak_total'])}"
                          f" - the rank's gradients {_m(grads)} = {_m(o['peak_total'] - grads)} MiB: "
                          f"{'OK' if bw['peak_total'] <= o['peak_total'] - grads else 'NOT MET'}")
            saved = o["live_before_step"] - bw["live_before_step"]
            checks.append(f"FSDP2 W={w} live bytes when backward ends: ordinary {_m(o['live_before_step'])} MiB, "
                          f"step_in_backward {_m(bw['live_before_step'])} MiB: {_m(saved)} MiB less, the rank's "
                          f"gradients {_m(grads)} MiB: {'OK' if saved >= grads else 'NOT MET'}")
    if checks:
        lines += ["", "Checks:", ""] + [f"- {c}" for c in checks]
    return "\n".join(lines), checks


def estimates_report(est: list[dict], rows: list[dict]) -> tuple[str, list[str]]:
    """The traces of benchmarks/memory_estimate.py (fake process group, no allocation) against the real rows."""
    from memory_estimate import TRACED

    real = {(r["world"], r["variant"]): r for r in rows if r["layout"] == "fsdp2"}
    lines = ["", "The same steps traced without allocating (benchmarks/memory_estimate.py: rank 0 of W on torch's fake "
             "process group, `FakeTensorMode`, `FSDPMemTracker`; what benchmarks/memory_dist_scale.py runs at the 7B "
             "and 70B shapes), against the live peaks measured above:", "",
             "| W | optimizer | traced peak MiB | + one RS input MiB | measured live peak MiB | traced / measured "
             "| (+ RS input) / measured | traced transient MiB | measured transient MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    checks = []
    for e in est:
        r = real.get((e["world"], e["variant"]))
        if r is None:
            continue
        ratio = e["peak_total"] / r["peak_total"]
        upper = e["peak_total"] + e["largest_unit_bytes"]
        lines.append(f"| {e['world']} | {TRACED[e['variant']]} | {_m(e['peak_total'])} | {_m(upper)} | "
                     f"{_m(r['peak_total'])} | {ratio:.2f} | {upper / r['peak_total']:.2f} | {e['transient'] / MiB:,.1f} "
                     f"| {r['transient'] / MiB:,.1f} |")
        checks.append(f"traced against measured, W={e['world']} {TRACED[e['variant']]}: {ratio:.2f} "
                      f"(with one reduce-scatter input {upper / r['peak_total']:.2f})")
    return "\n".join(lines), checks


def _largest(ranks: list[dict]) -> dict:
    return max(ranks, key=lambda r: r["peak_total"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="130m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--layouts", default="fsdp2,ddp")
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=256.0)
    p.add_argument("--sweep", default="4,16,64", help="bucket_mb values of the transient sweep (FSDP2 owner mode)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--estimate", type=int, default=1, help="1: trace the same steps on the fake process group")
    p.add_argument("--from-json", default=None, help="report measurements saved by an earlier run instead of measuring")
    p.add_argument("--variants", default=None, help="only these optimizers (e.g. owner,backward)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    rows, sweep, est = [], [], []
    saved = json.load(open(args.from_json)) if args.from_json else None
    for layout in args.layouts.split(",") if saved is None else ():
        for w in worlds:
            for v in LAYOUT_VARIANTS[layout]:
                if args.variants and v not in args.variants.split(","):
                    continue
                rows.append(_largest(measure(layout, v, w, args)))
    for w in worlds if saved is None else ():
        for b in [float(x) for x in args.sweep.split(",") if x]:
            ranks = measure("fsdp2", "owner", w, args, bucket_mb=b)
            sweep.append(max(ranks, key=lambda r: r["transient"] / r["bound"]["total"]))
    if saved is not None:
        rows, sweep, est = saved["rows"], saved["sweep"], saved.get("estimates", [])
    with open(os.path.join(tempfile.gettempdir(), "memory_dist_raw.json"), "w") as f:
        json.dump({"rows": rows, "sweep": sweep, "estimates": est}, f)  # before anything can fail
    if args.estimate and not est:
        from memory_estimate import trace_step

        for w in worlds:
            for v in [v for v in VARIANTS if any(r["layout"] == "fsdp2" and r["world"] == w and r["variant"] == v
                                                  for r in rows)]:
                est.append(trace_step(args.size, w, v, args.seq, bucket_mb=args.bucket_mb))
    text, checks = report(rows, sweep, args)
    if est:
        more, more_checks = estimates_report(est, rows)
        text += "\n" + more
    print(text)
    if not args.no_write:
        write_section("memory-dist", "Memory, distributed", text)


if __name__ == "__main__":
    main()
