"""Peak memory of a whole training step (forward, backward, ``optimizer.step()``, ``zero_grad``), one
process on the CPU, per optimizer, on the same model and data: SWAN's reason to exist (the paper, Fig. 1(c):
about half of Adam's end-to-end memory at batch 1).

Optimizers (``--optimizers``): torch's AdamW (``foreach=True``); SWAN‡ (``preset="swan_ddagger"``, AdamW
fallback on embeddings, head and norms); SWAN‡ with ``fallback="sign"`` (no optimizer state at all);
torch's Muon on the 2-D hidden matrices with torch's AdamW (foreach) on the rest, stepped together; plain
SGD (no state: the floor); torch's fused AdamW (``adamw_fused``, what the reference trainer and SWAN's
own AdamW fallback run on CPU tensors: no scratch copy); and both SWAN‡ rows with ``step_in_backward=True``
(``@backward``: each parameter updated during backward and its gradient freed).

Model: the reference LLaMA (``swan_dist.reference.model``) at the papers' 350M and 1.3B shapes (32k
vocabulary) or a reference size (``small``: 8k vocabulary), bf16 weights (no fp32 master copy, no autocast),
batch 1 x ``--seq`` tokens, ``--warmup`` steps, then ``--steps`` measured steps.

Each (size, optimizer) runs in a fresh subprocess, one after another, which measures two peaks:

1. **resident memory**: the model is built on ``meta`` and materialised (``to_empty``, then initialised in
   place) so that no construction transient counts; after the warm-up, glibc's ``malloc_trim(0)`` and ``5``
   written to ``/proc/self/clear_refs`` (the high-water mark reset to the current RSS) just before the
   measured steps; ``VmHWM`` of ``/proc/self/status`` read after them, minus the process's RSS before the
   model was built (torch imported: the baseline).
2. **live tensor bytes by category**: then ``--tracked-steps`` more steps under torch's
   ``torch.distributed._tools.mem_tracker.MemTracker`` (model and optimizers registered with
   ``track_external``), its peak snapshot per category, and its current snapshot after the step (the
   optimizer state kept between steps).

Writes the ``memory-cpu`` section of docs/benchmarks.md and docs/results/memory-cpu.json.

    python benchmarks/memory.py --sizes small --no-write     # quick check, under a minute
    python benchmarks/memory.py --sizes 350m,1b3 --skip 1b3:muon
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from measure import reset_hwm, rss_status, settle, write_section  # noqa: E402 (benchmarks/ is the script's folder)

OPTIMIZERS = {
    "adamw": "AdamW (foreach)",
    "swan_ddagger": "SWAN‡",
    "swan_ddagger+sign": "SWAN‡ + sign fallback",
    "swan_ddagger@backward": "SWAN‡, updates in backward",
    "swan_ddagger+sign@backward": "SWAN‡ + sign, updates in backward",
    "muon": "Muon + AdamW",
    "sgd": "SGD",
    "adamw_fused": "AdamW (fused)",
}
DEFAULT_OPTIMIZERS = ("adamw,adamw_fused,swan_ddagger,swan_ddagger+sign,swan_ddagger@backward,"
                      "swan_ddagger+sign@backward,muon,sgd")
PAPER_VOCAB = 32000  # the papers' LLaMA tokenizer; reference sizes below 350m keep the repo's 8k BPE
PAPER_SIZES = {"350m": "LLaMA 350M", "1b3": "LLaMA 1.3B", "7b": "LLaMA 7B", "13b": "LLaMA 13B"}
# the LLaMA paper's 7B and 13B shapes (not among the reference model's sizes: estimated, never built)
LARGE_SHAPES = {"7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
                "13b": dict(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824)}
CATEGORIES = ("Parameter", "Gradient", "Activation", "Optstate", "Temp", "Buffer", "Other")
MiB = 2**20


# ---------------------------------------------------------------------------------------------- child


def _vocab(size: str) -> int:
    return PAPER_VOCAB if size in PAPER_SIZES else 8192


def _config(size: str):
    from swan_dist.reference.model import model_config

    if size in LARGE_SHAPES:
        return model_config("1b3", vocab_size=PAPER_VOCAB, **LARGE_SHAPES[size])
    return model_config(size, vocab_size=_vocab(size))


def _build_fake(size: str):
    """The same model of fake tensors (the caller's ``FakeTensorMode``: shapes, no data, nothing
    allocated), its weights made in bf16 directly."""
    from swan_dist.reference.model import Llama, rope_tables

    cfg = _config(size)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Llama(cfg)
    finally:
        torch.set_default_dtype(old)
    model.rope_cos, model.rope_sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
    return model, cfg


def _build(size: str, device: str = "cpu"):
    """The reference LLaMA of ``size`` in bf16, built on ``meta`` and materialised on ``device`` in place:
    no fp32 copy and no second copy of any weight is ever made."""
    from swan_dist.reference.model import Llama, rope_tables

    cfg = _config(size)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    model.to_empty(device=device)
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # the constant tables, fp32 as the model keeps them
    torch.manual_seed(0)
    model.reset_parameters()
    return model, cfg


def _optimizers(name: str, model) -> list[torch.optim.Optimizer]:
    import swan_dist

    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)]
    if name == "adamw_fused":
        return [torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)]
    if name.startswith("swan_ddagger"):  # @backward: step_in_backward (armed by zero_grad after a step)
        extra = {"fallback": "sign"} if "+sign" in name else {}
        return [swan_dist.SWAN(model, preset="swan_ddagger", verbose=False,
                               step_in_backward=name.endswith("@backward"), **extra)]
    if name == "muon":  # Muon on the hidden matrices, AdamW on embeddings, head and norms
        hidden, rest = [], []
        for n, p in model.named_parameters():
            (hidden if p.dim() == 2 and not n.startswith(("tok_embeddings", "output")) else rest).append(p)
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4, foreach=True)]
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)]
    raise ValueError(f"unknown optimizer {name!r}; choose from {sorted(OPTIMIZERS)}")


def _by_value(snapshot: dict) -> dict[str, int]:
    """MemTracker's snapshot of the CPU, keyed by category name ("Parameter", ..., "Total")."""
    dev = snapshot.get(torch.device("cpu"), {})
    return {getattr(k, "value", k): int(v) for k, v in dev.items()}


def _module_peaks(tracker, model) -> dict[str, dict[str, int]]:
    """The model's own peak snapshots in forward and backward (by category), from MemTracker's
    module-wise snapshots."""
    stats = tracker.memory_tracking.get(model)
    out = {}
    if stats is None:
        return out
    for state, snaps in stats.snapshots.items():
        name = getattr(state, "value", str(state))
        if name in ("Peak-Forward", "Peak-Backward") and snaps:
            out[name] = max((_by_value(s) for s in snaps), key=lambda d: d.get("Total", 0))
    return out


def _tracked(model, opts, step, steps: int) -> dict:
    """``steps`` steps under MemTracker: its peak and current snapshots by category, the model's own
    forward/backward peaks, seconds per step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *opts)
    fw_bw: dict[str, dict[str, int]] = {}
    t0 = time.perf_counter()
    with tracker:
        for _ in range(steps):
            step()
            for k, v in _module_peaks(tracker, model).items():
                if v.get("Total", 0) > fw_bw.get(k, {}).get("Total", -1):
                    fw_bw[k] = v
            tracker.reset_mod_stats()  # MemTracker takes one forward of the root per iteration
    return dict(tracked_s=(time.perf_counter() - t0) / steps, peak=_by_value(tracker.get_tracker_snapshot("peak")),
                after=_by_value(tracker.get_tracker_snapshot("current")), module_peaks=fw_bw)


def child_estimate(size: str, name: str, args) -> dict:
    """The step under ``FakeTensorMode`` (nothing allocated) and MemTracker: the live-tensor peak by
    category as the real step would make it, assuming every gradient finite."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model, cfg = _build_fake(size)
        opts = _optimizers(name, model)
        n_params = sum(p.numel() for p in model.parameters())
        x = torch.randint(0, cfg.vocab_size, (1, args.seq))
        y = torch.randint(0, cfg.vocab_size, (1, args.seq))

        def step() -> None:
            for o in opts:  # before backward as well: step_in_backward updates from step one
                o.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)

        step()  # the optimizer's state made
        out = {"size": size, "optimizer": name, "params": n_params, "estimate": True, "seq": args.seq}
        out.update(_tracked(model, opts, step, 1))
    return out


def child_cuda(size: str, names: list[str], args, path: str) -> None:
    """On one GPU, per optimizer (one after another in this process, the caching allocator emptied
    between): ``torch.cuda.max_memory_allocated`` (live tensor bytes) and ``max_memory_reserved`` (what
    the caching allocator held) over the measured steps, reset after the warm-up. Written to ``path``
    after each optimizer (a run cut short keeps what it measured)."""
    rows = []
    for name in names:
        model, cfg = _build(size, "cuda")
        opts = _optimizers(name, model)
        n_params = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=g).cuda()
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

        def step() -> None:
            for o in opts:  # before backward as well: step_in_backward updates from step one
                o.zero_grad(set_to_none=True)
            model(x, y)[1].backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)

        try:
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            between = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            rows.append({"size": size, "optimizer": name, "params": n_params, "between": between,
                         "allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved(),
                         "step_s": (time.perf_counter() - t0) / args.steps})
        except torch.OutOfMemoryError as e:
            rows.append({"size": size, "optimizer": name, "params": n_params, "oom": str(e)[:200]})
        del model, opts, step
        gc.collect()
        torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump(rows, f)
        print(f"[cuda {size} {name}] {rows[-1]}", file=sys.stderr, flush=True)


def cuda_report(rows: list[dict], args) -> str:
    name = torch.cuda.get_device_name(0)
    lines = [
        f"One {name}, torch {torch.__version__}; the reference LLaMA at the paper's shapes, bf16 weights (no fp32 "
        f"master copy, no autocast), batch 1 x {args.seq} tokens; per size one process, the optimizers one after "
        f"another (the caching allocator emptied between): {args.warmup} warm-up steps, then the peaks reset and "
        f"{args.steps} measured step(s). *allocated*: `torch.cuda.max_memory_allocated` (live tensor bytes, "
        "the counterpart of MemTracker's peak); *reserved*: `max_memory_reserved` (what the caching allocator "
        "held: the counterpart of the resident peak); *between steps*: allocated before the measured step "
        "(parameters and optimizer state). MiB = 2^20 bytes; ratios over AdamW (foreach) at the same size.",
        "",
        "| model | optimizer | allocated peak (MiB) | vs AdamW | reserved peak (MiB) | vs AdamW | between steps (MiB) "
        "| step (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["size"]: r for r in rows if r["optimizer"] == "adamw" and "allocated" in r}
    for r in rows:
        b = base.get(r["size"], {})
        if "oom" in r:
            lines.append(f"| {r['size']} | {OPTIMIZERS[r['optimizer']]} | out of memory | - | - | - | - | - |")
            continue
        lines.append(f"| {r['size']} | {OPTIMIZERS[r['optimizer']]} | {_mib(r['allocated'])} | "
                     f"{_ratio(r['allocated'], b.get('allocated'))} | {_mib(r['reserved'])} | "
                     f"{_ratio(r['reserved'], b.get('reserved'))} | {_mib(r['between'])} | {r['step_s']:.2f} |")
    return "\n".join(lines)


def main_cuda(args) -> None:
    """``--device cuda``: the single-GPU table (a child process per size)."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    rows: list[dict] = []
    for size in [s for s in args.sizes.split(",") if s]:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--device", "cuda", "--child", f"{size}:{args.optimizers}",
                   "--child-out", path, "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
            try:
                subprocess.run(cmd, check=True, timeout=args.size_timeout)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                print(f"[cuda {size}] stopped: {e}", file=sys.stderr, flush=True)
            if os.path.exists(path):
                with open(path) as f:
                    rows += json.load(f)
    text = cuda_report(rows, args)
    print(text)
    if not args.no_write and rows:
        write_section("memory-cuda", "Memory (CUDA): peak per step, single GPU", text)


def child(size: str, name: str, args) -> dict:
    if args.estimate_child:
        return child_estimate(size, name, args)
    settle()
    baseline = rss_status()["VmRSS"]
    t_build = time.perf_counter()
    model, cfg = _build(size)
    opts = _optimizers(name, model)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> None:
        for o in opts:  # before backward as well (the loop the docs give): step_in_backward updates from step one
            o.zero_grad(set_to_none=True)
        loss = model(x, y)[1]  # the logits are dropped at once; the graph frees what it saved in backward
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    build_s = time.perf_counter() - t_build
    settle()
    before = rss_status()["VmRSS"]
    reset_hwm()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    hwm = rss_status()["VmHWM"]
    out = {"size": size, "optimizer": name, "params": n_params, "baseline_rss": baseline,
           "resident_between_steps": before - baseline, "peak_rss": hwm - baseline,
           "step_s": statistics.median(times), "build_warmup_s": build_s}

    if not args.rss_only:
        out.update(_tracked(model, opts, step, args.tracked_steps))
    return out


# --------------------------------------------------------------------------------------------- parent
def _run_child(size: str, name: str, args, estimate: bool = False) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{size}:{name}", "--child-out", path,
               "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--tracked-steps", str(args.tracked_steps)] + (["--rss-only"] if size in args.rss_only_sizes else [])
        cmd += ["--estimate-child"] if estimate else []
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        with open(path) as f:
            result = json.load(f)
        result["wall_s"] = time.perf_counter() - t0
        return result


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _phase(r: dict) -> str:
    """Where MemTracker's peak fell: the model's forward or backward (its module-wise peaks reach the
    global one), else the optimizer step (outside the model's forward and backward)."""
    total, mods = r["peak"].get("Total", 0), r.get("module_peaks", {})
    if mods.get("Peak-Backward", {}).get("Total", -1) >= total:
        return "backward"
    if mods.get("Peak-Forward", {}).get("Total", -1) >= total:
        return "forward"
    return "step"


def _fwbw(r: dict) -> int | None:
    mods = r.get("module_peaks", {})
    return max(m.get("Total", 0) for m in mods.values()) if mods else None


def _reading(results: list[dict]) -> list[str]:
    """One paragraph reading the largest size measured with MemTracker, its figures filled in."""
    tracked = [r for r in results if "peak" in r]
    if not tracked:
        return []
    size = tracked[-1]["size"]
    rows = {r["optimizer"]: r for r in tracked if r["size"] == size}
    adam, swan, sign = rows.get("adamw"), rows.get("swan_ddagger"), rows.get("swan_ddagger+sign")
    fused = rows.get("adamw_fused")
    if not (adam and swan):
        return []

    def cat(r: dict, key: str) -> int:
        return r["peak"].get(key, 0)

    def kept(r: dict) -> int:
        return r["after"].get("Optstate", 0)

    def transient(r: dict) -> int:
        return max(0, cat(r, "Optstate") - kept(r))

    pg = cat(swan, "Parameter") + cat(swan, "Gradient")
    act = max(snap.get("Activation", 0) for r in rows.values() for snap in r.get("module_peaks", {}).values())
    where = {_phase(adam), _phase(swan)}
    text = (
        f"Reading, at `{size}`: at batch 1 parameters and gradients ({_mib(pg)} MiB) are "
        f"{pg / swan['peak']['Total']:.0%} of SWAN‡'s tensor peak and {pg / adam['peak']['Total']:.0%} of AdamW's; "
        f"activations reach at most {_mib(act)} MiB (in forward/backward)"
        + (", all freed before `step()`, where AdamW and SWAN‡ peak. " if where == {"step"} else
           f"; AdamW peaks in {_phase(adam)}, SWAN‡ in {_phase(swan)}. ")
        + f"AdamW adds its two moments ({_mib(kept(adam))} MiB) and, inside `step()`, the foreach kernel's "
        f"scratch ({_mib(transient(adam))} MiB: `_foreach_sqrt(exp_avg_sq)` is one more copy of the parameters)"
        + (f"; torch's fused AdamW makes no such copy (step transient at its peak {_mib(transient(fused))} MiB, "
           f"peak in {_phase(fused)}), and SWAN‡'s tensor peak is "
           f"{swan['peak']['Total'] / fused['peak']['Total']:.2f} of its. " if fused else ". ")
        + f"SWAN‡ keeps only its AdamW fallback's moments (embeddings, head, norms: {_mib(kept(swan))} MiB); its "
        f"whitening shows as {_mib(transient(swan))} MiB of step transient: one stack of same-shape matrices at a "
        "time (at most 16 MiB of fp32 gradients on the CPU, or one matrix where a matrix is larger), live at once "
        "the copy `torch.stack` makes of the gradients, the Gram and the fp32 update (the final product cast into it "
        "4 MiB of rows at a time): bounded by "
        "a stack, not by the model."
    )
    if sign:
        text += f" With the sign fallback SWAN‡ keeps no state; its step transient is {_mib(transient(sign))} MiB"
        text += (", more than with the AdamW fallback: `torch._foreach_sign` writes the signs of every fallback "
                 "gradient (embeddings and head) at once, where the fused AdamW kernel writes nothing new."
                 if transient(sign) > transient(swan) else ".")
    back = rows.get("swan_ddagger@backward")
    if back:
        text += (f" With `step_in_backward=True` each gradient is freed as soon as its parameter is updated: "
                 f"SWAN‡'s peak holds {_mib(cat(back, 'Gradient'))} MiB of gradients (the ordinary step: "
                 f"{_mib(cat(swan, 'Gradient'))} MiB) and falls in {_phase(back)}, at "
                 f"{back['peak_rss'] / adam['peak_rss']:.2f} of AdamW's resident peak (the paper's per-layer "
                 "figure: about 0.30), parameters and the fallback's state now most of it.")
    text += (
        " The resident peaks run above the tensor peaks: between steps the RSS exceeds parameters + state by "
        "the code and threads the first step faulted in, and at the peak glibc also holds pages of freed "
        "tensors (chunks below its mmap threshold stay in its heap)."
    )
    return ["", text]


def report(results: list[dict], args) -> str:
    threads = torch.get_num_threads()
    sizes = list(dict.fromkeys(r["size"] for r in results))
    desc = []
    for s in sizes:
        n = next(r["params"] for r in results if r["size"] == s)
        label = PAPER_SIZES.get(s, f"reference `{s}`")
        desc.append(f"{label} (`{s}`, {n / 1e6:,.1f}M parameters, vocab {_vocab(s):,})")
    lines = [
        f"{'; '.join(desc)}; bf16 weights (no fp32 master copy, no autocast), batch 1 x {args.seq} tokens, one "
        f"process on the CPU ({platform.machine()}, {threads} threads), torch {torch.__version__}. Per optimizer a "
        f"fresh subprocess, one after another: {args.warmup} warm-up steps, then {args.steps} measured step(s) "
        "(forward, backward, `step()`, `zero_grad()`), then "
        + (f"{args.tracked_steps} under MemTracker." if len(args.rss_only_sizes) < len(sizes) else "none under MemTracker.")
        + " MiB = 2^20 bytes. AdamW and the AdamW of Muon + AdamW: torch's, `foreach=True`; SWAN‡'s AdamW "
        "fallback: torch's fused kernel (what SWAN runs on CPU tensors).",
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
    base = {s: next((r for r in results if r["size"] == s and r["optimizer"] == "adamw"), None) for s in sizes}
    for r in results:
        b = base[r["size"]]
        tot = r.get("peak", {}).get("Total")
        btot = b.get("peak", {}).get("Total") if b else None
        lines.append(
            f"| {r['size']} | {OPTIMIZERS[r['optimizer']]} | {_mib(r['peak_rss'])} | "
            f"{_ratio(r['peak_rss'], b['peak_rss'] if b else None)} | {_mib(r['resident_between_steps'])} | "
            f"{_mib(tot)} | {_ratio(tot, btot)} | {_mib(_fwbw(r))} |")
    tracked = [r for r in results if "peak" in r]
    if tracked:
        lines += [
            "",
            "**Live tensor bytes by category at MemTracker's peak** (MiB). *state*: the optimizer tensors still "
            "live after the step (MemTracker's current snapshot between steps); *step transient*: the rest of "
            "MemTracker's optimizer category at the peak (MemTracker counts every tensor allocated inside "
            "`optimizer.step()` as optimizer state, so the step's scratch tensors, SWAN's whitening included, "
            "land there, not under temporaries; the split is these two snapshots' difference); *temporaries*: "
            "MemTracker's `Temp`, what backward allocates besides parameter gradients (a gradient is `Temp` until "
            "its hook files it under gradients); *other*: buffers (the rotary tables; no loose tensors are "
            "registered, so MemTracker's `Other` stays empty, and the token ids, made before, are not tracked). *at*: where the peak fell (forward / backward: the model's module-wise peak "
            "reached it; step: outside both, in `optimizer.step()`).",
            "",
            "| model | optimizer | parameters | gradients | activations | state | step transient | temporaries "
            "| other | total peak | vs AdamW | at |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in tracked:
            p, after = r["peak"], r["after"]
            kept = after.get("Optstate", 0)
            transient = max(0, p.get("Optstate", 0) - kept)
            other = p.get("Buffer", 0) + p.get("Other", 0)
            b = base[r["size"]]
            btot = b.get("peak", {}).get("Total") if b else None
            lines.append(
                f"| {r['size']} | {OPTIMIZERS[r['optimizer']]} | {_mib(p.get('Parameter', 0))} | "
                f"{_mib(p.get('Gradient', 0))} | {_mib(p.get('Activation', 0))} | {_mib(kept)} | "
                f"{_mib(transient)} | {_mib(p.get('Temp', 0))} | {_mib(other)} | {_mib(p.get('Total'))} | "
                f"{_ratio(p.get('Total'), btot)} | {_phase(r)} |")
    if args.rss_only_sizes:
        lines += ["", f"Resident memory only (no MemTracker run) at: {', '.join(args.rss_only_sizes)}."]
    if args.skip_pairs:
        why = []
        for s, o in args.skip_pairs:
            ran = [f"{r['step_s']:.0f} s at `{r['size']}`" for r in results if r["optimizer"] == o]
            why.append(f"{OPTIMIZERS[o]} at `{s}`" + (f" (one step of it took {', '.join(ran)} on this CPU)" if ran else ""))
        lines += ["", "Not run (`--skip`): " + "; ".join(why) + "."]
    lines += _reading(results)
    return "\n".join(lines)


def _transient(r: dict) -> int:
    """The step's scratch at MemTracker's peak: its optimizer category less the state kept after it."""
    return max(0, r["peak"].get("Optstate", 0) - r["after"].get("Optstate", 0))


def transient_bound(size: str, fallback: str) -> dict:
    """The bound of docs/engine.md ("Memory a step adds", one process) on the ordinary step's transient for
    the model of ``size`` (bf16 gradients and weights), SWAN‡ (NSDS: two s x s buffers per matrix) with
    ``fallback``, the whitening dtype ``auto`` resolves to here, the CPU's stack budget. Bytes."""
    from swan_dist.functional import WhitenConfig, resolve_dtype
    from swan_dist.whitening import _CPU_BATCH_BYTES
    from swan_dist.rules.fallback import _SIGN_CPU_BYTES

    cfg = _config(size)
    w = torch.empty((), dtype=resolve_dtype(WhitenConfig(method="nsds"), torch.device("cpu"))).element_size()
    g = p = 2  # bf16 gradients and weights
    shapes = {(cfg.dim, cfg.dim): 4 * cfg.n_layers, (cfg.ffn_dim, cfg.dim): 2 * cfg.n_layers,
              (cfg.dim, cfg.ffn_dim): cfg.n_layers}  # wq wk wv wo; w1 w3; w2 (out, in)
    worst = 0
    for (m, n), count in shapes.items():
        k = min(count, max(1, _CPU_BATCH_BYTES // (4 * m * n)))
        s = min(m, n)
        per = k * m * n * ((g if k > 1 else 0) + 2 * w + 4 + p) + 2 * k * s * s * max(w, 4)
        worst = max(worst, per)
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
            if not (r and adam and sgd):
                continue
            bound = transient_bound(size, fallback)
            state = r.get("after", {}).get("Optstate", 0)
            rss = r["peak_rss"] - sgd["peak_rss"] - state
            cells = [f"| {size} | {OPTIMIZERS[name]} | {_mib(bound['total'])}"]
            if "peak" in r and "peak" in sgd:
                tens = r["peak"]["Total"] - sgd["peak"]["Total"] - state
                cells.append(f"{_mib(_transient(r))} | {_mib(tens)} | {tens / adam['peak']['Total']:.1%}")
            else:
                cells.append("- | - | -")
            cells.append(f"{_mib(rss)} | {rss / adam['peak_rss']:.1%} |")
            lines.append(" | ".join(cells))
    if not lines:
        return []
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
            "|---|---|---:|---:|---:|---:|---:|---:|"] + lines


def estimate_report(estimates: list[dict], results: list[dict]) -> str:
    """The estimated table, each estimate checked against the real run of the same size and optimizer."""
    if not estimates:
        return ""
    real = {(r["size"], r["optimizer"]): r for r in results if "peak" in r}
    lines = [
        "",
        "",
        "**Estimated without allocating** (torch's `FakeTensorMode`: tensors with shapes and no data, the same "
        "step traced; `MemTracker`'s peak of live tensor bytes by category, MiB; the estimate assumes every "
        "gradient finite, the branch the real step takes when they are). 7B and 13B: the LLaMA paper's shapes "
        f"(dim 4096 / 5120, 32 / 40 layers, FFN 11008 / 13824, vocab {PAPER_VOCAB:,}), bf16, batch 1 x "
        f"{args_seq(estimates)} tokens. *est./real*: the estimate's total over the real run's MemTracker peak "
        "(tensors) and over its resident peak, where the same size ran above.",
        "",
        "| model | optimizer | parameters | gradients | activations | state | step transient | temporaries "
        "| total (est.) | vs AdamW | est./real tensors | est./real resident |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["size"]: r for r in estimates if r["optimizer"] == "adamw"}
    for r in estimates:
        p = r["peak"]
        b = base.get(r["size"])
        twin = real.get((r["size"], r["optimizer"]))
        lines.append(
            f"| {r['size']} | {OPTIMIZERS[r['optimizer']]} | {_mib(p.get('Parameter', 0))} | "
            f"{_mib(p.get('Gradient', 0))} | {_mib(p.get('Activation', 0))} | {_mib(r['after'].get('Optstate', 0))} | "
            f"{_mib(_transient(r))} | {_mib(p.get('Temp', 0))} | {_mib(p.get('Total'))} | "
            f"{_ratio(p.get('Total'), b['peak'].get('Total') if b else None)} | "
            f"{_ratio(p.get('Total'), twin['peak'].get('Total') if twin else None)} | "
            f"{_ratio(p.get('Total'), twin['peak_rss'] if twin else None)} |")
    return "\n".join(lines)


def args_seq(estimates: list[dict]) -> str:
    return str(estimates[0].get("seq", "?"))


def _save(path: str | None, results: list[dict], estimates: list[dict]) -> None:
    """The raw results so far (after each subprocess: a run cut short keeps what it measured)."""
    if path:
        with open(path, "w") as f:
            json.dump({"results": results, "estimates": estimates}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="350m,1b3", help="comma list of reference model sizes (350m, 1b3, small, ...)")
    ap.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS, help=f"comma list of {', '.join(OPTIMIZERS)}")
    ap.add_argument("--steps", type=int, default=1, help="measured steps (resident peak; every step allocates alike)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tracked-steps", type=int, default=1, help="steps under MemTracker after the measured ones")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (batch 1)")
    ap.add_argument("--rss-only", default="", help="comma list of sizes measured without MemTracker")
    ap.add_argument("--skip", default="", help="comma list of SIZE:OPTIMIZER pairs not to run (too slow here)")
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    ap.add_argument("--estimate", default="350m,1b3,7b,13b",
                    help="comma list of sizes estimated under FakeTensorMode + MemTracker (nothing allocated; "
                         "sizes also measured are checked against the real peaks); '' for none")
    ap.add_argument("--estimate-optimizers", default="adamw,swan_ddagger,swan_ddagger+sign,swan_ddagger@backward,"
                    "swan_ddagger+sign@backward,muon,sgd")
    ap.add_argument("--estimate-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the single-GPU table (torch.cuda.max_memory_allocated / max_memory_reserved), "
                         "e.g. --device cuda --sizes 1b3,7b")
    ap.add_argument("--size-timeout", type=float, default=110.0, help="--device cuda: seconds per size at most")
    ap.add_argument("--save", help="write the raw results (measured and estimated) to this JSON file")
    ap.add_argument("--load", default="", help="comma list of JSON files from --save: report them (no run)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # SIZE:OPTIMIZER, measured in this process
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "cuda" and args.child:
        size, names = args.child.split(":", 1)
        child_cuda(size, [n for n in names.split(",") if n], args, args.child_out)
        return
    if args.device == "cuda":
        main_cuda(args)
        return
    if args.child:
        size, name = args.child.split(":", 1)
        result = child(size, name, args)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return
    if not sys.platform.startswith("linux"):
        raise SystemExit("benchmarks/memory.py reads /proc/self and calls glibc's malloc_trim: Linux only")
    sizes = [s for s in args.sizes.split(",") if s]
    names = [n for n in args.optimizers.split(",") if n]
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        ap.error(f"unknown optimizer(s) {unknown}; choose from {list(OPTIMIZERS)}")
    args.rss_only_sizes = [s for s in args.rss_only.split(",") if s]
    args.skip_pairs = [tuple(p.split(":", 1)) for p in args.skip.split(",") if p]
    bad = [p for p in args.skip_pairs if len(p) != 2 or p[1] not in OPTIMIZERS]
    if bad:
        ap.error(f"--skip takes SIZE:OPTIMIZER pairs, got {bad}")
    t0 = time.perf_counter()
    results = []
    estimates = []
    for path in [p for p in args.load.split(",") if p]:
        with open(path) as f:
            saved = json.load(f)
        results += saved["results"]
        estimates += saved["estimates"]
    sizes = [] if args.load else sizes
    for size in sizes:
        for name in names:
            if (size, name) in args.skip_pairs:
                continue
            r = _run_child(size, name, args)
            results.append(r)
            _save(args.save, results, estimates)
            print(f"[{size} {name}] resident peak {_mib(r['peak_rss'])} MiB, tensors peak "
                  f"{_mib(r.get('peak', {}).get('Total'))} MiB, step {r['step_s']:.1f} s, "
                  f"subprocess {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    for size in [] if args.load else [s for s in args.estimate.split(",") if s]:
        for name in [n for n in args.estimate_optimizers.split(",") if n]:
            try:
                r = _run_child(size, name, args, estimate=True)
            except subprocess.CalledProcessError as e:  # (an optimizer that cannot run on fake tensors)
                print(f"[estimate {size} {name}] failed: {e}", file=sys.stderr, flush=True)
                continue
            estimates.append(r)
            _save(args.save, results, estimates)
            print(f"[estimate {size} {name}] tensors peak {_mib(r['peak'].get('Total'))} MiB, "
                  f"subprocess {r['wall_s']:.0f} s", file=sys.stderr, flush=True)
    text = report(results, args) + "\n".join(transient_check(results)) + estimate_report(estimates, results)
    print(text)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if not args.no_write:
        write_section("memory-cpu", "Memory (CPU): peak per step by category, single process", text)


if __name__ == "__main__":
    main()
