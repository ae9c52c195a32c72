"""Peak memory of a whole training step per optimizer, one process, same model and data (the paper's Fig. 1(c)):
resident and live tensor bytes by category on the CPU, each optimizer in a fresh process, also estimated under
``FakeTensorMode``; or on one GPU. Writes ``memory-cpu`` (``memory-cuda``) of docs/benchmarks.md.

    python benchmarks/memory.py --sizes 350m,1b3 --skip 1b3:muon --estimate 350m,1b3,7b,13b --save PATH
    python benchmarks/memory.py --device cuda --sizes 1b3,7b --size-timeout 115
"""

import contextlib
import gc
import json
import multiprocessing
import os
import sys
import tempfile

import torch

from measure import median_time, mib, parser, publish, reset_hwm, row, rss_status, settle
from memory_estimate import build, model_config, phase, tracked, transient, transient_bound

OPTIMIZERS = {"adamw": "AdamW (foreach)", "adamw_fused": "AdamW (fused)", "swan_ddagger": "SWAN‡",  # default order
              "swan_ddagger+sign": "SWAN‡ + sign fallback", "swan_ddagger@backward": "SWAN‡, updates in backward",
              "swan_ddagger+sign@backward": "SWAN‡ + sign, updates in backward", "muon": "Muon + AdamW", "sgd": "SGD"}
PAPER_SIZES = {"350m": "LLaMA 350M", "1b3": "LLaMA 1.3B", "7b": "LLaMA 7B", "13b": "LLaMA 13B"}  # 7B, 13B: estimated
WARMUP, STEPS, SEQ = 2, 1, 256  # warm-up steps, measured steps (then one under MemTracker), tokens (batch 1)


def config(size: str):
    """The reference LLaMA of ``size``: the papers' 32k vocabulary at their sizes, the repository's 8k BPE below."""
    return model_config(size, max_seq_len=1024, **({} if size in PAPER_SIZES else {"vocab_size": 8192}))


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
    assert name == "sgd", name
    return [torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)]


def measure_row(size: str, name: str, device: str, fake: bool = False) -> dict:
    """One optimizer's row: on the CPU the resident peak (above the RSS before the model was built) and MemTracker's,
    on a GPU torch.cuda's peaks; ``fake``: MemTracker's under ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    settle()
    baseline = rss_status()["VmRSS"]
    with FakeTensorMode() if fake else contextlib.nullcontext():
        cfg = config(size)
        model = build(cfg, device, fake=fake)
        opts = optimizers(name, model)
        tokens = torch.randint(0, cfg.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

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
            return {**out, "estimate": True, **tracked(model, opts, step)}
        for _ in range(WARMUP):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            out.update(between=torch.cuda.memory_allocated(),
                       step_s=median_time(step, STEPS, sync=torch.cuda.synchronize)[0])
            return {**out, "allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}
        settle()
        out["resident_between_steps"] = rss_status()["VmRSS"] - baseline
        reset_hwm()
        out["step_s"] = median_time(step, STEPS)[0]
        return {**out, "peak_rss": rss_status()["VmHWM"] - baseline, **tracked(model, opts, step)}


def measure_rows(size: str, names: list[str], device: str, path: str) -> None:
    """``names`` measured in turn in this (spawned) process, the rows written to ``path`` after each."""
    rows = []
    for name in names:
        try:
            rows.append(measure_row(size, name, device))
        except torch.OutOfMemoryError as e:
            rows.append({"size": size, "optimizer": name, "oom": str(e)[:200]})
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        with open(path, "w") as f:
            json.dump(rows, f)
        print(f"[{size} {name}] peak {mib(rows[-1].get('peak_rss', rows[-1].get('allocated')))} MiB", file=sys.stderr)


def in_fresh_process(size: str, names: list[str], args) -> list[dict]:
    """:func:`measure_rows` in a fresh process; on CUDA the rows measured before a failure or ``--size-timeout``."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        proc = multiprocessing.get_context("spawn").Process(target=measure_rows, args=(size, names, args.device, path))
        proc.start()
        proc.join(args.size_timeout if args.device == "cuda" else None)
        proc.kill()
        proc.join()
        if proc.exitcode and args.device != "cuda":
            raise SystemExit(f"[{size} {','.join(names)}] failed (exit {proc.exitcode})")
        if proc.exitcode:
            print(f"[cuda {size}] stopped (exit {proc.exitcode})", file=sys.stderr)
        return json.load(open(path)) if os.path.exists(path) else []


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def by_category(r: dict) -> list[str]:
    """parameters, gradients, activations, state, step transient, temporaries."""
    p = r["peak"]
    return [mib(p.get(k, 0)) for k in ("Parameter", "Gradient", "Activation")] + [
        mib(r["after"].get("Optstate", 0)), mib(transient(r)), mib(p.get("Temp", 0))]


def table(caption: str, header: str, rows: list[str]) -> list[str]:
    """``rows`` under ``caption``: model, optimizer, then ``header``'s columns (right-aligned but for ``at``)."""
    rule = "".join("---|" if c == "at" else "---:|" for c in header.split(" | "))
    return (["", caption] if caption else []) + ["", f"| model | optimizer | {header} |", f"|---|---|{rule}", *rows]


def cuda_report(rows: list[dict]) -> str:
    base = {r["size"]: r for r in rows if r["optimizer"] == "adamw" and "allocated" in r}
    out = []
    for r in rows:
        b, name = base.get(r["size"], {}), OPTIMIZERS[r["optimizer"]]
        out.append(row(r["size"], name, "out of memory", *"-----") if "oom" in r else
                   row(r["size"], name, mib(r["allocated"]), ratio(r["allocated"], b.get("allocated")),
                       mib(r["reserved"]), ratio(r["reserved"], b.get("reserved")), mib(r["between"]),
                       f"{r['step_s']:.2f}"))
    return "\n".join([f"One {torch.cuda.get_device_name(0)}, torch {torch.__version__}; batch 1 x {SEQ} tokens.",
                      *table("", "allocated peak (MiB) | vs AdamW | reserved peak (MiB) | vs AdamW | between steps "
                             "(MiB) | step (s)", out)])


def reading(results: list[dict]) -> list[str]:
    """The largest size's figures, read."""
    rows = {r["optimizer"]: r for r in results if r["size"] == results[-1]["size"]} if results else {}
    adam, swan, back = (rows.get(k) for k in ("adamw", "swan_ddagger", "swan_ddagger@backward"))
    if not (adam and swan):
        return []
    return ["", f"Reading, at `{results[-1]['size']}`: SWAN‡ keeps {mib(swan['after'].get('Optstate', 0))} MiB of "
            f"state (its AdamW fallback's moments), AdamW {mib(adam['after'].get('Optstate', 0))} MiB; SWAN‡'s step "
            f"adds {mib(transient(swan))} MiB (one stack of same-shape matrices whitened at a time), foreach AdamW's "
            f"{mib(transient(adam))} MiB (`_foreach_sqrt(exp_avg_sq)`: a copy of the parameters)" + (
                f"; updating in backward, SWAN‡'s resident peak is {back['peak_rss'] / adam['peak_rss']:.2f} of "
                "AdamW's (the paper's per-layer figure: about 0.30)" if back else "") + ". Resident peaks exceed "
            "tensor peaks by the code the first step faulted in and the freed pages glibc keeps."]


def report(results: list[dict], estimates: list[dict], skip: list[tuple[str, str]]) -> str:
    """The CPU's tables: peaks, categories, SWAN‡'s step transient against its bound, the estimates."""
    real = {(r["size"], r["optimizer"]): r for r in results}
    peaks, cats, bounds, est = [], [], [], []
    for r in results:
        a, sgd, p, mods = real.get((r["size"], "adamw"), {}), real.get((r["size"], "sgd")), r["peak"], r["module_peaks"]
        label, top = (r["size"], OPTIMIZERS[r["optimizer"]]), a.get("peak", {}).get("Total")
        peaks.append(row(*label, mib(r["peak_rss"]), ratio(r["peak_rss"], a.get("peak_rss")),
                         mib(r["resident_between_steps"]), mib(p.get("Total")), ratio(p.get("Total"), top),
                         mib(max(m.get("Total", 0) for m in mods.values()) if mods else None)))
        cats.append(row(*label, *by_category(r), mib(p.get("Buffer", 0) + p.get("Other", 0)), mib(p.get("Total")),
                        ratio(p.get("Total"), top), phase(r)))
        if r["optimizer"] in ("swan_ddagger", "swan_ddagger+sign") and a and sgd:
            state = r["after"].get("Optstate", 0)
            tens, rss = p["Total"] - sgd["peak"]["Total"] - state, r["peak_rss"] - sgd["peak_rss"] - state
            bound = transient_bound(config(r["size"]), "sign" if "+sign" in r["optimizer"] else "adamw")
            bounds.append(row(*label, mib(bound), mib(transient(r)), mib(tens), f"{tens / top:.1%}", mib(rss),
                              f"{rss / a['peak_rss']:.1%}"))
    for r in estimates:
        tot, twin = r["peak"].get("Total"), real.get((r["size"], r["optimizer"]), {})
        a = next((e for e in estimates if e["size"] == r["size"] and e["optimizer"] == "adamw"), {})
        est.append(row(r["size"], OPTIMIZERS[r["optimizer"]], *by_category(r), mib(tot),
                       ratio(tot, a.get("peak", {}).get("Total")), ratio(tot, twin.get("peak", {}).get("Total")),
                       ratio(tot, twin.get("peak_rss"))))
    models = "; ".join(f"{PAPER_SIZES.get(s, f'reference `{s}`')} (`{s}`, {r['params'] / 1e6:,.1f}M parameters, vocab "
                       f"{config(s).vocab_size:,})" for s, r in {r["size"]: r for r in results}.items())
    lines = [f"{models}; batch 1 x {SEQ} tokens, one process on the CPU ({torch.get_num_threads()} threads), torch "
             f"{torch.__version__}.",
             *table("**Peak per step** (MiB):", "resident peak (MiB) | vs AdamW | between steps (MiB) | tensors peak "
                    "(MiB) | vs AdamW | fw/bw peak (MiB)", peaks),
             *table("**Live tensor bytes by category at MemTracker's peak** (MiB):", "parameters | gradients | "
                    "activations | state | step transient | temporaries | other | total peak | vs AdamW | at", cats)]
    if skip:
        lines += ["", "Not run (`--skip`): " + "; ".join(f"{OPTIMIZERS[o]} at `{s}`" for s, o in skip) + "."]
    lines += reading(results)
    if bounds:
        lines += table("**The ordinary step's transient against its bound** (docs/engine.md, \"Memory a step "
                       "adds\"):", "bound (MiB) | measured (MiB) | tensors: peak − SGD − state (MiB) | of AdamW | "
                       "resident: peak − SGD − state (MiB) | of AdamW", bounds)
    if estimates:
        lines += table("**Estimated without allocating** (`FakeTensorMode`, MiB):", "parameters | gradients | "
                       "activations | state | step transient | temporaries | total (est.) | vs AdamW | est./real "
                       "tensors | est./real resident", est)
    return "\n".join(lines)


def main() -> None:
    args = parser(__doc__, sizes="350m,1b3", optimizers=",".join(OPTIMIZERS), skip="", estimate="350m,1b3,7b,13b",
                  estimate_optimizers=",".join(o for o in OPTIMIZERS if o != "adamw_fused"), device="cpu",
                  size_timeout=110.0, save="").parse_args()  # skip: SIZE:OPTIMIZER pairs; size_timeout: CUDA, per size
    names, estimated = ([n for n in o.split(",") if n] for o in (args.optimizers, args.estimate_optimizers))
    skip = [tuple(p.split(":", 1)) for p in args.skip.split(",") if p]
    bad = [n for n in names + estimated if n not in OPTIMIZERS] + [p for p in skip if p[-1] not in OPTIMIZERS]
    if bad:
        raise SystemExit(f"unknown optimizer(s) or --skip pair(s) {bad}; choose from {list(OPTIMIZERS)}")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit(f"--device {args.device}: cpu, or cuda where CUDA is available")
    results, estimates = [], []
    save = lambda: args.save and json.dump({"results": results, "estimates": estimates}, open(args.save, "w"))  # noqa
    for size in [s for s in args.sizes.split(",") if s]:
        for group in [names] if args.device == "cuda" else [[n] for n in names if (size, n) not in skip]:
            results += in_fresh_process(size, group, args)
            save()  # after each process: a run cut short keeps what it measured
    if args.device == "cuda":
        return publish("memory-cuda", "Memory (CUDA): peak per step, single GPU", cuda_report(results),
                       write=not args.no_write and bool(results))
    estimates += [measure_row(s, n, "cpu", fake=True) for s in args.estimate.split(",") if s for n in estimated]
    save()
    publish("memory-cpu", "Memory (CPU): peak per step by category, single process",
            report(results, estimates, skip), write=not args.no_write)


if __name__ == "__main__":
    main()
