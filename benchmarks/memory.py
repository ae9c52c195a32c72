"""Peak memory of a whole training step (forward, backward, ``step()``, ``zero_grad``) per optimizer, one
process, same model and data (the paper's Fig. 1(c)): resident and live tensor bytes by category on the CPU
(each optimizer in a fresh subprocess), also estimated under ``FakeTensorMode``, or on one GPU (``--device
cuda``). Writes the ``memory-cpu`` (``memory-cuda``) section of docs/benchmarks.md.

    python benchmarks/memory.py --sizes 350m,1b3 --skip 1b3:muon --estimate 350m,1b3,7b,13b --save PATH
    python benchmarks/memory.py --device cuda --sizes 1b3,7b --size-timeout 115
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

from measure import categories, median_time, reset_hwm, rss_status, settle, write_section

OPTIMIZERS = {  # in the default order
    "adamw": "AdamW (foreach)",
    "adamw_fused": "AdamW (fused)",
    "swan_ddagger": "SWAN‡",
    "swan_ddagger+sign": "SWAN‡ + sign fallback",
    "swan_ddagger@backward": "SWAN‡, updates in backward",
    "swan_ddagger+sign@backward": "SWAN‡ + sign, updates in backward",
    "muon": "Muon + AdamW",
    "sgd": "SGD",
}
PAPER_VOCAB = 32000  # the papers' LLaMA tokenizer; reference sizes below 350m keep the repo's 8k BPE
PAPER_SIZES = {"350m": "LLaMA 350M", "1b3": "LLaMA 1.3B", "7b": "LLaMA 7B", "13b": "LLaMA 13B"}
# the LLaMA paper's 7B and 13B shapes (not among the reference model's sizes: estimated, never built)
LARGE_SHAPES = {"7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
                "13b": dict(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824)}
WARMUP, STEPS, TRACKED = 2, 1, 1  # warm-up steps, measured steps, steps under MemTracker after them
MiB = 2**20


def config(size: str):
    from swan_dist.reference.model import model_config

    if size in LARGE_SHAPES:
        return model_config("1b3", vocab_size=PAPER_VOCAB, **LARGE_SHAPES[size])
    return model_config(size, vocab_size=PAPER_VOCAB if size in PAPER_SIZES else 8192)


def build(cfg, device: str = "cpu", shard=None, fake: bool = False):
    """The reference LLaMA ``cfg`` in bf16, made on ``meta`` (``shard(model)`` there) and materialised on
    ``device`` in place: no fp32 copy, no second copy of any weight. ``fake``: made directly under the caller's
    ``FakeTensorMode`` (``Module.to_empty`` cannot swap fake tensors)."""
    from swan_dist.reference.model import Llama, rope_tables

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with contextlib.nullcontext() if fake else torch.device("meta"):
            model = Llama(cfg)
    finally:
        torch.set_default_dtype(default)
    if shard is not None:
        shard(model)
    if not fake:
        model.to_empty(device=device)
        torch.manual_seed(0)
        model.reset_parameters()
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # the constant tables, fp32 as the model keeps
    return model


def optimizers(name: str, model) -> list[torch.optim.Optimizer]:
    import swan_dist

    if name.startswith("adamw"):
        kernel = "fused" if name == "adamw_fused" else "foreach"
        return [torch.optim.AdamW(model.parameters(), lr=3e-4, **{kernel: True})]
    if name.startswith("swan_ddagger"):  # @backward: step_in_backward (armed by zero_grad after a step)
        return [swan_dist.SWAN(model, preset="swan_ddagger", verbose=False, step_in_backward=name.endswith("@backward"),
                               **({"fallback": "sign"} if "+sign" in name else {}))]
    if name == "muon":  # Muon on the hidden matrices, AdamW on embeddings, head and norms
        hidden, rest = [], []
        for n, p in model.named_parameters():
            (hidden if p.dim() == 2 and not n.startswith(("tok_embeddings", "output")) else rest).append(p)
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4, foreach=True)]
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)]
    raise ValueError(f"unknown optimizer {name!r}; choose from {list(OPTIMIZERS)}")


def tracked(model, opts, step) -> dict:
    """``TRACKED`` steps under MemTracker: its peak and current snapshots by category, the model's own
    forward/backward peaks (its module-wise snapshots)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *opts)
    fw_bw: dict[str, dict[str, int]] = {}
    with tracker:
        for _ in range(TRACKED):
            step()
            stats = tracker.memory_tracking.get(model)
            for state, snaps in (stats.snapshots.items() if stats else ()):
                name = getattr(state, "value", str(state))
                for snap in (categories(s) for s in snaps if name in ("Peak-Forward", "Peak-Backward")):
                    if snap.get("Total", 0) > fw_bw.get(name, {}).get("Total", -1):
                        fw_bw[name] = snap
            tracker.reset_mod_stats()  # MemTracker takes one forward of the root per iteration
    return dict(peak=categories(tracker.get_tracker_snapshot("peak")),
                after=categories(tracker.get_tracker_snapshot("current")), module_peaks=fw_bw)


def child(size: str, name: str, args) -> dict:
    """One optimizer's row, measured in this process: on the CPU the resident peak (``VmHWM`` reset after the warm-up,
    above the RSS before the model was built) then MemTracker's; on a GPU torch.cuda's peaks (reset after
    the warm-up); with ``--estimate-child`` MemTracker's peak of the step under ``FakeTensorMode``."""
    cuda, fake, mode = args.device == "cuda", args.estimate_child, contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    settle()
    baseline = rss_status()["VmRSS"]
    with mode:
        cfg = config(size)
        model = build(cfg, args.device, fake=fake)
        opts = optimizers(name, model)
        tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1].contiguous().to(args.device), tokens[:, 1:].contiguous().to(args.device)

        def step() -> None:
            for o in opts:  # before backward as well: step_in_backward updates from step one
                o.zero_grad(set_to_none=True)
            model(x, y)[1].backward()  # the logits are dropped at once
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)

        out = {"size": size, "optimizer": name, "params": sum(p.numel() for p in model.parameters())}
        if fake:
            step()  # the optimizer's state made
            return {**out, "estimate": True, "seq": args.seq, **tracked(model, opts, step)}
        for _ in range(WARMUP):
            step()
        sync = torch.cuda.synchronize if cuda else lambda: None
        sync()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            between = torch.cuda.memory_allocated()
        else:
            settle()
            between = rss_status()["VmRSS"] - baseline
            reset_hwm()
        out["step_s"] = median_time(step, STEPS, sync=sync)[0]
        if cuda:
            return {**out, "between": between, "allocated": torch.cuda.max_memory_allocated(),
                    "reserved": torch.cuda.max_memory_reserved()}
        out.update(resident_between_steps=between, peak_rss=rss_status()["VmHWM"] - baseline)
        return {**out, **tracked(model, opts, step)}


def run_child(size: str, names: list[str], args, estimate: bool = False) -> list[dict]:
    """``names`` measured in a subprocess for ``size`` (one after another, the rows written after each: a run
    cut short by ``--size-timeout`` keeps what it measured)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{size}:{','.join(names)}", "--child-out", path,
               "--seq", str(args.seq), "--device", args.device] + (["--estimate-child"] if estimate else [])
        try:
            subprocess.run(cmd, check=True, timeout=args.size_timeout if args.device == "cuda" else None)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            if args.device != "cuda":
                raise
            print(f"[cuda {size}] stopped: {e}", file=sys.stderr, flush=True)
        return json.load(open(path)) if os.path.exists(path) else []


def mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def phase(r: dict) -> str:
    """Where MemTracker's peak fell: the model's forward or backward (its module-wise peak reaches the
    global one), else the optimizer step."""
    total, mods = r["peak"].get("Total", 0), r.get("module_peaks", {})
    for name in ("Backward", "Forward"):
        if mods.get(f"Peak-{name}", {}).get("Total", -1) >= total:
            return name.lower()
    return "step"


def transient(r: dict) -> int:
    """The step's scratch at MemTracker's peak: its optimizer category less the state kept after it."""
    return max(0, r["peak"].get("Optstate", 0) - r["after"].get("Optstate", 0))


def categories_cells(r: dict) -> list[str]:
    """parameters, gradients, activations, state, step transient, temporaries."""
    p = r["peak"]
    return [mib(p.get(k, 0)) for k in ("Parameter", "Gradient", "Activation")] + [
        mib(r["after"].get("Optstate", 0)), mib(transient(r)), mib(p.get("Temp", 0))]


def cuda_report(rows: list[dict], args) -> str:
    lines = [
        f"One {torch.cuda.get_device_name(0)}, torch {torch.__version__}; the reference LLaMA at the paper's shapes, "
        f"bf16 weights (no fp32 master copy, no autocast), batch 1 x {args.seq} tokens; per size one process, the "
        f"optimizers one after another (the caching allocator emptied between): {WARMUP} warm-up steps, then the "
        f"peaks reset and {STEPS} measured step(s). *allocated*: `torch.cuda.max_memory_allocated` (live tensor "
        "bytes, the counterpart of MemTracker's peak); *reserved*: `max_memory_reserved` (what the caching "
        "allocator held: the counterpart of the resident peak); *between steps*: allocated before the measured "
        "step (parameters and optimizer state). MiB = 2^20 bytes; ratios over AdamW (foreach) at the same size.",
        "",
        "| model | optimizer | allocated peak (MiB) | vs AdamW | reserved peak (MiB) | vs AdamW | between steps (MiB) "
        "| step (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["size"]: r for r in rows if r["optimizer"] == "adamw" and "allocated" in r}
    for r in rows:
        b = base.get(r["size"], {})
        lines.append(row(r["size"], OPTIMIZERS[r["optimizer"]], "out of memory", *"-----") if "oom" in r else
                     row(r["size"], OPTIMIZERS[r["optimizer"]], mib(r["allocated"]), ratio(r["allocated"],
                         b.get("allocated")), mib(r["reserved"]), ratio(r["reserved"], b.get("reserved")),
                         mib(r["between"]), f"{r['step_s']:.2f}"))
    return "\n".join(lines)


def reading(results: list[dict]) -> list[str]:
    """One paragraph reading the largest size measured, its figures filled in."""
    size = results[-1]["size"] if results else None
    rows = {r["optimizer"]: r for r in results if r["size"] == size}
    adam, swan, sign, fused = (rows.get(k) for k in ("adamw", "swan_ddagger", "swan_ddagger+sign", "adamw_fused"))
    if not (adam and swan):
        return []
    kept = lambda r: r["after"].get("Optstate", 0)  # noqa: E731
    pg = swan["peak"].get("Parameter", 0) + swan["peak"].get("Gradient", 0)
    act = max(snap.get("Activation", 0) for r in rows.values() for snap in r.get("module_peaks", {}).values())
    where = {phase(adam), phase(swan)}
    text = (
        f"Reading, at `{size}`: at batch 1 parameters and gradients ({mib(pg)} MiB) are "
        f"{pg / swan['peak']['Total']:.0%} of SWAN‡'s tensor peak and {pg / adam['peak']['Total']:.0%} of AdamW's; "
        f"activations reach at most {mib(act)} MiB (in forward/backward)"
        + (", all freed before `step()`, where AdamW and SWAN‡ peak. " if where == {"step"} else
           f"; AdamW peaks in {phase(adam)}, SWAN‡ in {phase(swan)}. ")
        + f"AdamW adds its two moments ({mib(kept(adam))} MiB) and, inside `step()`, the foreach kernel's "
        f"scratch ({mib(transient(adam))} MiB: `_foreach_sqrt(exp_avg_sq)` is one more copy of the parameters)"
        + (f"; torch's fused AdamW makes no such copy (step transient at its peak {mib(transient(fused))} MiB, "
           f"peak in {phase(fused)}), and SWAN‡'s tensor peak is "
           f"{swan['peak']['Total'] / fused['peak']['Total']:.2f} of its. " if fused else ". ")
        + f"SWAN‡ keeps only its AdamW fallback's moments (embeddings, head, norms: {mib(kept(swan))} MiB); its "
        f"whitening shows as {mib(transient(swan))} MiB of step transient: one stack of same-shape matrices at a "
        "time (at most 16 MiB of fp32 gradients on the CPU, or one matrix where a matrix is larger), live at once "
        "the copy `torch.stack` makes of the gradients, the Gram and the fp32 update (the final product cast into "
        "it 4 MiB of rows at a time): bounded by a stack, not by the model.")
    if sign:
        text += f" With the sign fallback SWAN‡ keeps no state; its step transient is {mib(transient(sign))} MiB" + (
            ", more than with the AdamW fallback: `torch._foreach_sign` writes the signs of every fallback gradient "
            "(embeddings and head) at once, where the fused AdamW kernel writes nothing new."
            if transient(sign) > transient(swan) else ".")
    back = rows.get("swan_ddagger@backward")
    if back:
        text += (f" With `step_in_backward=True` each gradient is freed as soon as its parameter is updated: "
                 f"SWAN‡'s peak holds {mib(back['peak'].get('Gradient', 0))} MiB of gradients (the ordinary step: "
                 f"{mib(swan['peak'].get('Gradient', 0))} MiB) and falls in {phase(back)}, at "
                 f"{back['peak_rss'] / adam['peak_rss']:.2f} of AdamW's resident peak (the paper's per-layer "
                 "figure: about 0.30), parameters and the fallback's state now most of it.")
    return ["", text + " The resident peaks run above the tensor peaks: between steps the RSS exceeds parameters + "
            "state by the code and threads the first step faulted in, and at the peak glibc also holds pages of "
            "freed tensors (chunks below its mmap threshold stay in its heap)."]


def report(results: list[dict], args) -> str:
    sizes = list(dict.fromkeys(r["size"] for r in results))
    desc = [f"{PAPER_SIZES.get(s, f'reference `{s}`')} (`{s}`, "
            f"{next(r['params'] for r in results if r['size'] == s) / 1e6:,.1f}M parameters, vocab "
            f"{config(s).vocab_size:,})" for s in sizes]
    lines = [
        f"{'; '.join(desc)}; bf16 weights (no fp32 master copy, no autocast), batch 1 x {args.seq} tokens, one "
        f"process on the CPU ({platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}. "
        f"Per optimizer a fresh subprocess, one after another: {WARMUP} warm-up steps, then {STEPS} measured "
        f"step(s) (forward, backward, `step()`, `zero_grad()`), then {TRACKED} under MemTracker. MiB = 2^20 bytes. "
        "AdamW and the AdamW of Muon + AdamW: torch's, `foreach=True`; SWAN‡'s AdamW fallback: torch's fused "
        "kernel (what SWAN runs on CPU tensors).",
        "",
        "**Peak per step.** *resident*: peak RSS (`VmHWM`, reset with `/proc/self/clear_refs` after `malloc_trim(0)` "
        "just before the measured steps) above the process's RSS before the model was built (torch imported); "
        "*between steps*: RSS above that baseline just before the measured steps (parameters and optimizer state; "
        "the gradients are freed by `zero_grad`); *tensors*: MemTracker's peak of live tensor bytes over the whole "
        "step; *fw/bw*: the model's own peak in forward and backward (MemTracker's module-wise snapshots). "
        "Ratios: each optimizer's peak over AdamW's at the same size (the paper's Fig. 1(c): SWAN's end-to-end "
        "memory about half of Adam's).",
        "",
        "| model | optimizer | resident peak (MiB) | vs AdamW | between steps (MiB) | tensors peak (MiB) | vs AdamW "
        "| fw/bw peak (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {s: next((r for r in results if r["size"] == s and r["optimizer"] == "adamw"), {}) for s in sizes}
    for r in results:
        b, tot, mods = base[r["size"]], r["peak"].get("Total"), r["module_peaks"].values()
        lines.append(row(r["size"], OPTIMIZERS[r["optimizer"]], mib(r["peak_rss"]), ratio(r["peak_rss"],
                         b.get("peak_rss")), mib(r["resident_between_steps"]), mib(tot),
                         ratio(tot, b.get("peak", {}).get("Total")),
                         mib(max(m.get("Total", 0) for m in mods) if mods else None)))
    lines += [
        "",
        "**Live tensor bytes by category at MemTracker's peak** (MiB). *state*: the optimizer tensors still "
        "live after the step (MemTracker's current snapshot between steps); *step transient*: the rest of "
        "MemTracker's optimizer category at the peak (MemTracker counts every tensor allocated inside "
        "`optimizer.step()` as optimizer state, so the step's scratch tensors, SWAN's whitening included, "
        "land there, not under temporaries; the split is these two snapshots' difference); *temporaries*: "
        "MemTracker's `Temp`, what backward allocates besides parameter gradients (a gradient is `Temp` until "
        "its hook files it under gradients); *other*: buffers (the rotary tables; no loose tensors are "
        "registered, so MemTracker's `Other` stays empty, and the token ids, made before, are not tracked). *at*: "
        "where the peak fell (forward / backward: the model's module-wise peak reached it; step: outside both, "
        "in `optimizer.step()`).",
        "",
        "| model | optimizer | parameters | gradients | activations | state | step transient | temporaries "
        "| other | total peak | vs AdamW | at |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        p, btot = r["peak"], base[r["size"]].get("peak", {}).get("Total")
        lines.append(row(r["size"], OPTIMIZERS[r["optimizer"]], *categories_cells(r),
                         mib(p.get("Buffer", 0) + p.get("Other", 0)), mib(p.get("Total")), ratio(p.get("Total"), btot),
                         phase(r)))
    if args.skip_pairs:
        why = []
        for s, o in args.skip_pairs:
            ran = [f"{r['step_s']:.0f} s at `{r['size']}`" for r in results if r["optimizer"] == o]
            why.append(f"{OPTIMIZERS[o]} at `{s}`"
                       + (f" (one step of it took {', '.join(ran)} on this CPU)" if ran else ""))
        lines += ["", "Not run (`--skip`): " + "; ".join(why) + "."]
    return "\n".join(lines + reading(results))


def transient_bound(size: str, fallback: str) -> dict:
    """The bound of docs/engine.md ("Memory a step adds", one process) on the ordinary step's transient for
    the model of ``size`` (bf16 gradients and weights), SWAN‡ (NSDS: two s x s buffers per matrix) with
    ``fallback``, the whitening dtype ``auto`` resolves to here, the CPU's stack budget. Bytes."""
    from swan_dist.functional import WhitenConfig, resolve_dtype
    from swan_dist.rules.fallback import _SIGN_CPU_BYTES
    from swan_dist.whitening import _CPU_BATCH_BYTES

    cfg = config(size)
    w = torch.empty((), dtype=resolve_dtype(WhitenConfig(method="nsds"), torch.device("cpu"))).element_size()
    g = p = 2  # bf16 gradients and weights
    shapes = {(cfg.dim, cfg.dim): 4 * cfg.n_layers, (cfg.ffn_dim, cfg.dim): 2 * cfg.n_layers,
              (cfg.dim, cfg.ffn_dim): cfg.n_layers}  # wq wk wv wo; w1 w3; w2 (out, in)
    worst = 0
    for (m, n), count in shapes.items():
        k = min(count, max(1, _CPU_BATCH_BYTES // (4 * m * n)))
        worst = max(worst, k * m * n * ((g if k > 1 else 0) + 2 * w + 4 + p) + 2 * k * min(m, n) ** 2 * max(w, 4))
    fb = 0 if fallback == "adamw" else min(_SIGN_CPU_BYTES, 2 * cfg.vocab_size * cfg.dim * g)
    return {"whitening": worst, "fallback": fb, "total": max(worst, fb), "whiten_bytes": w}


def transient_check(results: list[dict]) -> list[str]:
    """The ordinary SWAN‡ step's transient two ways against the stated bound and against 3 % of AdamW's
    peak: MemTracker's step transient, and (its peak) - (SGD's peak) - (the fallback's state)."""
    rows = {(r["size"], r["optimizer"]): r for r in results}
    lines = []
    for size in dict.fromkeys(r["size"] for r in results):
        adam, sgd = rows.get((size, "adamw")), rows.get((size, "sgd"))
        for name, fallback in (("swan_ddagger", "adamw"), ("swan_ddagger+sign", "sign")):
            r = rows.get((size, name))
            if r and adam and sgd:
                state = r["after"].get("Optstate", 0)
                tens, rss = r["peak"]["Total"] - sgd["peak"]["Total"] - state, r["peak_rss"] - sgd["peak_rss"] - state
                lines.append(row(size, OPTIMIZERS[name], mib(transient_bound(size, fallback)["total"]),
                                 mib(transient(r)), mib(tens), f"{tens / adam['peak']['Total']:.1%}", mib(rss),
                                 f"{rss / adam['peak_rss']:.1%}"))
    return ["", "**The ordinary step's transient against its bound** (docs/engine.md, \"Memory a step adds\", one "
            "process: per stack of k same-shape m x n matrices at most k·m·n·(2w + 4 + 2, plus 2 for the stack's "
            "copy when k > 1) + 2·k·s²·max(w, 4) bytes, k·m·n·4 within the CPU's 16 MiB stack budget or k = 1, "
            "w the whitening dtype's size; the sign fallback's signs at most 16 MiB at a time). *measured*: "
            "MemTracker's step transient; *peak − SGD − state*: the goal's measure (SWAN‡'s peak less SGD's and "
            "less the fallback's state), on tensors and on resident memory, and its share of AdamW's peak "
            "(goal: under 3 %).",
            "",
            "| model | optimizer | bound (MiB) | measured (MiB) | tensors: peak − SGD − state (MiB) | of AdamW "
            "| resident: peak − SGD − state (MiB) | of AdamW |",
            "|---|---|---:|---:|---:|---:|---:|---:|"] + lines if lines else []


def estimate_report(estimates: list[dict], results: list[dict]) -> list[str]:
    """The estimated table, each estimate checked against the real run of the same size and optimizer."""
    if not estimates:
        return []
    real = {(r["size"], r["optimizer"]): r for r in results}
    lines = [
        "",
        "**Estimated without allocating** (torch's `FakeTensorMode`: tensors with shapes and no data, the same "
        "step traced; `MemTracker`'s peak of live tensor bytes by category, MiB; the estimate assumes every "
        "gradient finite, the branch the real step takes when they are). 7B and 13B: the LLaMA paper's shapes "
        f"(dim 4096 / 5120, 32 / 40 layers, FFN 11008 / 13824, vocab {PAPER_VOCAB:,}), bf16, batch 1 x "
        f"{estimates[0]['seq']} tokens. *est./real*: the estimate's total over the real run's MemTracker peak "
        "(tensors) and over its resident peak, where the same size ran above.",
        "",
        "| model | optimizer | parameters | gradients | activations | state | step transient | temporaries "
        "| total (est.) | vs AdamW | est./real tensors | est./real resident |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["size"]: r for r in estimates if r["optimizer"] == "adamw"}
    for r in estimates:
        tot, b, twin = r["peak"].get("Total"), base.get(r["size"], {}), real.get((r["size"], r["optimizer"]), {})
        lines.append(row(r["size"], OPTIMIZERS[r["optimizer"]], *categories_cells(r), mib(tot),
                         ratio(tot, b.get("peak", {}).get("Total")), ratio(tot, twin.get("peak", {}).get("Total")),
                         ratio(tot, twin.get("peak_rss"))))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="350m,1b3", help="comma list of model sizes (350m, 1b3, small, ...)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma list of {', '.join(OPTIMIZERS)}")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (batch 1)")
    ap.add_argument("--skip", default="", help="comma list of SIZE:OPTIMIZER pairs not to run (too slow here)")
    ap.add_argument("--estimate", default="350m,1b3,7b,13b", help="comma list of sizes estimated under "
                    "FakeTensorMode (nothing allocated; sizes also measured are checked against them); '' for none")
    ap.add_argument("--estimate-optimizers", default=",".join(o for o in OPTIMIZERS if o != "adamw_fused"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the single-GPU table")
    ap.add_argument("--size-timeout", type=float, default=110.0, help="--device cuda: seconds per size at most")
    ap.add_argument("--save", help="write the raw results (measured and estimated) to this JSON file")
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # SIZE:OPTIMIZERS, measured in this process
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--estimate-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        size, names = args.child.split(":", 1)
        rows = []
        for name in names.split(","):
            try:
                rows.append(child(size, name, args))
            except torch.OutOfMemoryError as e:
                rows.append({"size": size, "optimizer": name, "oom": str(e)[:200]})
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            with open(args.child_out, "w") as f:
                json.dump(rows, f)
            r = rows[-1]
            print(f"[{size} {name}] peak {mib(r['peak'].get('Total') if 'peak' in r else None)} MiB of tensors, "
                  f"{mib(r.get('peak_rss', r.get('allocated')))} MiB", file=sys.stderr, flush=True)
        return
    names = [n for n in args.optimizers.split(",") if n]
    args.skip_pairs = [tuple(p.split(":", 1)) for p in args.skip.split(",") if p]
    bad = [n for n in names if n not in OPTIMIZERS] + [p for p in args.skip_pairs if p[-1] not in OPTIMIZERS]
    if bad:
        ap.error(f"unknown optimizer(s) or --skip pair(s) {bad}; choose from {list(OPTIMIZERS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    results, estimates = [], []
    for size in [s for s in args.sizes.split(",") if s]:
        if args.device == "cuda":
            results += run_child(size, names, args)
            continue
        for name in names:
            if (size, name) not in args.skip_pairs:
                results += run_child(size, [name], args)
                if args.save:  # after each subprocess: a run cut short keeps what it measured
                    json.dump({"results": results, "estimates": estimates}, open(args.save, "w"))
    if args.device == "cuda":
        text = cuda_report(results, args)
        print(text)
        if not args.no_write and results:
            write_section("memory-cuda", "Memory (CUDA): peak per step, single GPU", text)
        return
    for size in [s for s in args.estimate.split(",") if s]:
        for name in [n for n in args.estimate_optimizers.split(",") if n]:
            try:
                estimates += run_child(size, [name], args, estimate=True)
            except subprocess.CalledProcessError as e:  # (an optimizer that cannot run on fake tensors)
                print(f"[estimate {size} {name}] failed: {e}", file=sys.stderr, flush=True)
            if args.save:
                json.dump({"results": results, "estimates": estimates}, open(args.save, "w"))
    text = "\n".join([report(results, args), *transient_check(results), *estimate_report(estimates, results)])
    print(text)
    if not args.no_write:
        write_section("memory-cpu", "Memory (CPU): peak per step by category, single process", text)


if __name__ == "__main__":
    main()
