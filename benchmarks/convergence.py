"""Convergence study: SWAN‡, SWAN†, SWAN-0 against the AdamW and Muon baselines on the reference trainer and the
embedded wiki corpus, every lr from a sweep the script runs first, then every optimizer with --seeds and SWAN‡'s
ablations; the convergence-<device>-<model> section of docs/benchmarks.md and its curves (docs/convergence.md).

    python benchmarks/convergence.py --jobs 2              # the full study (it prints an estimate first)
    python benchmarks/convergence.py --quick               # smoke: a few steps each, written to a temp file
"""

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

if "study" not in sys.modules:  # by its path: benchmarks/ on sys.path would shadow packages (benchmarks/megatron.py)
    _spec = importlib.util.spec_from_file_location("study", Path(__file__).resolve().parent / "study.py")
    sys.modules["study"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["study"])
study = sys.modules["study"]
measure, Arm = study.measure, study.Arm

MAIN = (
    Arm("swan_ddagger", "SWAN‡", "swan", "swan_ddagger"),
    Arm("swan_dagger", "SWAN†", "swan", "swan_dagger"),
    Arm("swan_0", "SWAN-0", "swan", "swan_0"),
    Arm("adamw", "AdamW (baseline)", "adamw"),
    Arm("muon", "Muon (baseline)", "muon"),
)
ABLATIONS = (  # each changes one thing of SWAN‡ (NSDS 2 steps, RMS GradNorm, whitening on) at SWAN‡'s lr
    Arm("ddagger_nsds1", "SWAN‡, NSDS 1 step (not 2)", "swan", "swan_ddagger", {"ns_steps": 1}),
    Arm("ddagger_no_gradnorm", "SWAN‡ without GradNorm", "swan", "swan_ddagger", {"grad_norm": "none"}),
    Arm("ddagger_no_whitening", "SWAN‡ without whitening (GradNorm only)", "swan", "swan_ddagger",
        {"whitening": "none"}),
)
BY_KEY = {a.key: a for a in MAIN + ABLATIONS}
SWEPT = (*MAIN[3:], *MAIN[:3])  # every lr swept, the baselines' first


def calibrate(runs: study.Study) -> dict[str, dict[str, float]]:
    """A few steps of each optimizer, sharing the cores as the study's runs will: seconds per token, evaluation, run."""
    rates, tokens = {}, runs.args.calib_steps * runs.tokens_per_step
    for run in [runs.submit(a, None, tokens, 0, f"calibrate/{a.key}") for a in MAIN]:
        r = run()
        train_s = r["tokens"] / r["tok_per_s"]
        rates[r["arm"]] = {"s_per_token": 1 / r["tok_per_s"], "eval_s": max(0.0, r["time_s"] - train_s) / 2,
                           "overhead_s": max(0.0, r["wall_s"] - r["time_s"])}
    return rates


def estimate(args, rates: dict[str, dict[str, float]], parallel: int) -> tuple[float, int]:
    """Expected runtime and runs: per phase of independent runs (the sweeps' grids without extensions; the main
    comparison with the ablations) its runs' total over ``parallel``, but no less than its longest run."""

    def seconds(arm: Arm, tokens: int, evals: int) -> float:
        r = rates.get(arm.key, rates["swan_ddagger"])  # ablations: SWAN‡'s rates
        return tokens * r["s_per_token"] + evals * r["eval_s"] + r["overhead_s"]

    evals = 1 + math.ceil(args.tokens / max(1, args.eval_every_tokens))
    sweeps = [seconds(a, args.sweep_tokens, 2) for a in SWEPT for _ in study.grid_of(args, a)]
    final = [seconds(a, args.tokens, evals) for _ in args.seeds for a in MAIN]
    final += [seconds(a, args.tokens, evals) for _ in args.ablation_seeds for a in ABLATIONS]
    return sum(max(sum(p) / parallel, max(p, default=0.0)) for p in (sweeps, final)), len(sweeps) + len(final)


def hms(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


def summarise(runs: list[dict[str, Any]], target: float, adamw_tokens: float) -> dict[str, Any]:
    finals = [r["final_val_loss"] for r in runs]
    reach = study.tokens_to_reach(study.mean_curve(runs), target)
    per_seed = [study.tokens_to_reach(r["curve"], target) for r in runs]
    return {"final": sum(finals) / len(finals), "final_min": min(finals), "final_max": max(finals),
            "ratio": None if reach is None else reach / adamw_tokens,
            "ratio_seeds": [None if x is None else x / adamw_tokens for x in per_seed],
            "state": sum(r["optimizer_state"] for r in runs) / len(runs),
            "us_per_token": sum(1e6 / r["tok_per_s"] for r in runs) / len(runs), "n": len(runs)}


def table(rows: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """The main table's lines (what each column is: docs/convergence.md)."""
    lines = ["| optimizer | lr | final val loss | perplexity | tokens to AdamW's final loss (vs AdamW) | "
             "optimizer state | µs / token |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, lr, s in rows:
        loss, ppl, ratio = "diverged", "-", "not reached"
        if math.isfinite(s["final"]):
            loss, ppl = f"{s['final']:.3f}", f"{math.exp(s['final']):.1f}"
            if s["n"] > 1:
                loss += f" ± {(s['final_max'] - s['final_min']) / 2:.3f}"
                ppl += f" ({math.exp(s['final_min']):.1f}–{math.exp(s['final_max']):.1f})"
        if s["ratio"] is not None:
            ratio = f"{s['ratio']:.2f}x"
            reached = [x for x in s["ratio_seeds"] if x is not None]
            if s["n"] > 1:
                lo = f"{min(reached):.2f}" if reached else "n/r"
                hi = "n/r" if len(reached) < s["n"] else f"{max(reached):.2f}"
                ratio += f" ({lo}–{hi})"
        state, us = f"{s['state'] / 2**20:.2f} MiB", f"{s['us_per_token']:.0f}"
        lines.append(measure.row(label, lr, loss, ppl, ratio, state, us))
    return lines


def plot(path: Path, panels: list[tuple[str, list[tuple[str, list[dict[str, Any]]]]]], target: float) -> None:
    """Validation loss against tokens, per panel: per optimizer the mean over seeds, the min-max band shaded."""
    from matplotlib.figure import Figure  # object API: Agg canvas, no pyplot, no global backend

    fig = Figure(figsize=(6.5 * len(panels), 4.8), dpi=120)
    for ax, (title, arms) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        study.curves(ax, [(label, [r["curve"] for r in runs]) for label, runs in arms], target)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)


def parse(argv: list[str] | None) -> Any:
    ap = study.parser(__doc__, tokens=2_000_000, calib_steps=4)
    ap.add_argument("--seeds", type=study.listed(int), default=[0, 1], help="the sweeps use the first")
    ap.add_argument("--ablation-seeds", type=study.listed(int), help="default: --seeds")
    ap.add_argument("--muon-lrs", type=study.listed(float), default=[1e-3, 2e-3, 5e-3, 1e-2], help="Muon lr grid")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--estimate-only", action="store_true", help="print the expected runtime and stop")
    args = study.parse(ap, argv)
    if args.quick:
        args.tokens, args.calib_steps, args.muon_lrs = 4 * args.batch * args.seq, 2, [2e-3, 5e-3]
        args.ablation_seeds = args.ablation_seeds or args.seeds[:1]
    args.ablation_seeds = [] if args.no_ablations else args.ablation_seeds or args.seeds
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    work, out = study.folders(args, f"convergence-{args.model}", "benchmarks.md")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cores = len(os.sched_getaffinity(0))
    parallel = max(1, min(args.jobs, cores // (args.threads or cores)))  # runs the cores hold at --threads each
    started = time.perf_counter()
    print(f"convergence study: model {args.model}{args.model_overrides or ''}, {args.tokens:,} tokens x seeds "
          f"{args.seeds}, on {device} ({cores} cores); runs in {work}\ncalibrating the runtime estimate:", flush=True)
    with study.Study(args, work) as runs:
        rates = calibrate(runs)
        expected, n_runs = estimate(args, rates, parallel)
        speeds = ", ".join(f"{k} {1 / r['s_per_token']:,.0f}" for k, r in rates.items())
        print(f"expected runtime: about {hms(expected)} for {n_runs} runs, {parallel} at a time (--jobs {args.jobs}, "
              f"--threads {args.threads}; {args.calib_steps}-step runs at {speeds} tok/s)", flush=True)
        if args.estimate_only:
            return
        grids = [(a, runs.grid(a, study.grid_of(args, a))) for a in SWEPT]  # all at once; extensions arm by arm
        sweeps = {arm.key: runs.sweep(arm, grid) for arm, grid in grids}
        lr_of = {key: s["best"] for key, s in sweeps.items()}
        # the main comparison and the ablations (at SWAN‡'s lr) are independent of each other: submitted at once
        submitted = [runs.submit(a, lr_of.get(a.key), args.tokens, s, f"main/{a.key}/seed{s}", args.eval_every_tokens)
                     for s in args.seeds for a in MAIN]  # fmt: skip
        submitted += [runs.submit(a, lr_of.get("swan_ddagger"), args.tokens, s, f"ablation/{a.key}/seed{s}",
                                  args.eval_every_tokens) for s in args.ablation_seeds for a in ABLATIONS]  # fmt: skip
        results: dict[str, list[dict[str, Any]]] = {}
        for record in (run() for run in submitted):
            results.setdefault(record["arm"], []).append(record)

    adamw = study.mean_curve(results["adamw"])
    target = adamw[-1][1]  # the tuned AdamW's mean final validation loss
    stats = {key: summarise(r, target, study.tokens_to_reach(adamw, target)) for key, r in results.items()}
    png = out.parent / f"convergence_{device}_{args.model}.png"  # one section and plot per device and model size
    panels = [("SWAN presets vs baselines", MAIN)]
    if args.ablation_seeds:
        panels.append(("SWAN‡ ablations", (MAIN[0], *ABLATIONS)))
    plot(png, [(title, [(a.label, results[a.key]) for a in arms]) for title, arms in panels], target)
    elapsed = time.perf_counter() - started
    context = {"command": measure.provenance()["command"], "device": device, "cores": cores, "elapsed": elapsed,
               "expected": expected, "png": png, **{k: results["adamw"][0][k] for k in ("n_params", "tokens")}}
    title = f"Convergence ({'GPU' if device == 'cuda' else 'CPU'}, {args.model}): SWAN presets vs AdamW and Muon"
    body = report(args, sweeps, stats, context)
    measure.publish(f"convergence-{device}-{args.model}", title, body, write=not args.no_write)
    record = {"args": vars(args), "command": context["command"], "cores": cores, "target": target,
              "elapsed_s": elapsed, "expected_s": expected, "sweeps": sweeps, "stats": stats, "runs": runs.runs}
    (work / "results.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"took {hms(elapsed)}; the plot: {png}; every run and results.json: {work}", flush=True)


def report(args, sweeps: dict[str, Any], stats: dict[str, Any], ctx: dict[str, Any]) -> str:
    """The Markdown body of the section: setup, command, main table, plot, sweeps, ablations."""

    def lr_cell(key: str) -> str:
        s = sweeps["swan_ddagger" if key in {a.key for a in ABLATIONS} else key]
        return f"{s['best']:g}" + (" (edge)" if s["edge"] else "")

    def rows(arms: tuple[Arm, ...]) -> list[str]:
        return table([(a.label, lr_cell(a.key), stats[a.key]) for a in arms])

    model = f"`{args.model}`" + (f" {json.dumps(args.model_overrides)}" if args.model_overrides else "")
    threads = torch.get_num_threads()
    where = (f"on {torch.cuda.get_device_name()} ({ctx['cores']} CPU cores)" if ctx["device"] == "cuda" else
             f"on the CPU: **ran on {ctx['cores']} CPU cores** ({threads} torch thread{'s' * (threads != 1)})")
    if args.jobs > 1:
        where += f", {args.jobs} runs at a time (`--jobs {args.jobs}`)"
    lines = [
        f"Reference LLaMA {model} ({ctx['n_params'] / 1e6:.2f}M parameters), {args.batch}x{args.seq} tokens per step, "
        f"{ctx['tokens']:,} training tokens per run, a single process per run {where}, torch {torch.__version__}. "
        f"Validation loss every {args.eval_every_tokens:,} tokens on {args.eval_batches * args.batch} fixed windows; "
        f"seeds {', '.join(map(str, args.seeds))}. The study took {hms(ctx['elapsed'])} (estimated "
        f"{hms(ctx['expected'])} at its start).",
        "", "```", ctx["command"], "```", "",
        *rows(MAIN),
        "", f"![validation loss against training tokens]({ctx['png'].name})", "",
        f"Learning rates: the best of a sweep of {args.sweep_tokens:,}-token runs (seed {args.seeds[0]}), the grid "
        f"extended at most {args.sweep_extend} steps past an edge best.",
        "", "| optimizer | final val loss per lr (sweep) | chosen lr |", "|---|---|---:|",
    ]
    for key, s in sweeps.items():
        lines.append(measure.row(BY_KEY[key].label, study.cells(s["results"], s["best"]),
                                 f"{s['best']:g}" + (" (grid edge)" if s["edge"] else "")))
    if args.ablation_seeds:
        lines += ["", f"Ablations of SWAN‡ at its lr ({lr_cell('swan_ddagger')}), seeds "
                  f"{', '.join(map(str, args.ablation_seeds))}; each changes one thing of SWAN‡ (NSDS 2 steps, RMS "
                  "GradNorm, whitening on):", "", *rows((MAIN[0], *ABLATIONS))]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
