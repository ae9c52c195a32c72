"""Convergence study: SWAN‡, SWAN†, SWAN-0 against the AdamW and Muon baselines, on the reference trainer
(``swan_dist.reference.train``, called in-process with parallel none: each run is one process, this script's own
or, with ``--jobs N``, one of N worker processes that run N runs at a time) and the embedded wiki corpus.

Every optimizer trains the same model on the same data for the same number of tokens, with the same
schedule shape (linear warm-up over 10 % of the steps, cosine decay to 0.1 x lr; SWAN-0 keeps its
preset's defining choice of no warm-up). Nothing is hand-tuned: each baseline's lr (AdamW; Muon, whose
lr is scaled per matrix to AdamW's update RMS, ``adjust_lr_fn="match_rms_adamw"``), and each SWAN
preset's global lr unless ``--no-sweep-swan``, is the one with the lowest final validation loss in a
short sweep this script runs first (a grid that grows past its edge when the best lr lies on it).
The main comparison then runs every optimizer with ``--seeds`` seeds (mean and min/max shown), and the
ablations run SWAN‡ with NSDS 1 step instead of 2, without GradNorm, and without whitening.

Muon (torch.optim.Muon on the matrices SWAN whitens, AdamW on the rest) and AdamW are baselines.

Reported in the ``convergence-<device>-<model>`` section of docs/benchmarks.md (e.g. ``convergence-cpu-tiny``,
``convergence-cuda-60m``), one per model size: final validation loss, perplexity, tokens to reach the tuned
AdamW's final validation loss as a ratio to AdamW's own (linear interpolation between evaluations),
optimizer state bytes, training time per token; and the validation curves in
docs/convergence_<device>_<model>.png. Run folders: runs/convergence-<model>. See docs/convergence.md.

    python benchmarks/convergence.py                       # the full study: hours on 2 CPU cores (it prints an estimate)
    python benchmarks/convergence.py --jobs 2              # the same, 2 runs at a time (C cores: --jobs C)
    python benchmarks/convergence.py --tokens 500000 --sweep-tokens 125000 --seeds 0
    python benchmarks/convergence.py --quick               # smoke: a few steps each, written to a temp file
    python benchmarks/convergence.py --estimate-only       # the full study's expected runtime, from a few steps each
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import multiprocessing
import os
import shlex
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if "measure" in sys.modules:
    measure = sys.modules["measure"]
else:  # by its path: putting benchmarks/ on sys.path would shadow packages (benchmarks/megatron.py)
    _spec = importlib.util.spec_from_file_location("measure", HERE / "measure.py")
    measure = sys.modules["measure"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(measure)

from swan_dist.reference.config import load_config  # noqa: E402
from swan_dist.reference.model import MODEL_SIZES  # noqa: E402
from swan_dist.reference.train import main as train_main  # noqa: E402


@dataclass(frozen=True)
class Arm:
    """One optimizer setting: a trainer ``optimizer`` (+ SWAN preset and extra SWAN options)."""

    key: str
    label: str
    optimizer: str
    preset: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    weight_decay: float = 0.0  # the trainer's weight_decay (the study: none)

    def sets(self) -> list[str]:
        sets = [f"optimizer={self.optimizer}"]
        if self.preset is not None:
            sets.append(f"preset={self.preset}")
        sets += [f"swan_options.{k}={v}" for k, v in self.options.items()]
        return sets


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


# --------------------------------------------------------------------------- runs


@dataclass
class Pending:
    """A submitted run (``Study.submit``): its trainer config and folder, and where its result comes from."""

    arm: Arm
    lr: float | None
    seed: int
    tag: str
    steps: int
    sets: list[str]
    out: Path
    reused: bool = False  # --reuse: a finished run of this config is in ``out``; read back, not run
    future: Future | None = None  # --jobs > 1: running (or queued) in a worker process


class Study:
    """The study's runs. ``submit`` prepares a run (and with ``--jobs`` > 1 starts it in a pool of worker processes);
    ``result`` gives its record, in the order asked for, so records and output keep the sequential order. With
    ``--jobs 1`` a run trains in this process when its result is asked for. Use as a context manager: on leaving
    with an error, runs not started are cancelled and the workers stopped."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.tokens_per_step = args.batch * args.seq
        self.runs: list[dict[str, Any]] = []  # every run's record, for results.json
        self.pool = None
        if args.jobs > 1:  # spawn: fresh interpreters, none of this process's torch state forked
            self.pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_set_threads, initargs=(args.threads,))  # fmt: skip

    def __enter__(self) -> Study:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        if self.pool is None:
            return
        if exc_type is None:
            self.pool.shutdown()
            return
        workers = list(self.pool._processes.values())  # as Python 3.14's terminate_workers() does
        self.pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.terminate()

    def steps(self, tokens: int) -> int:
        return max(2, round(tokens / self.tokens_per_step))

    def submit(self, arm: Arm, lr: float | None, tokens: int, seed: int, tag: str,
               eval_every_tokens: int | None = None) -> Pending:  # fmt: skip
        """One trainer run; its log goes to ``work/tag/log.txt``. ``lr=None``: the trainer's default. With
        ``--reuse``, a finished run of the same trainer config in ``work/tag`` is read instead of run again."""
        a = self.args
        steps = self.steps(tokens)
        eval_every = steps if eval_every_tokens is None else max(1, round(eval_every_tokens / self.tokens_per_step))
        out = self.work / tag
        sets = [f"model.size={a.model}", *(f"model.{k}={v}" for k, v in a.model_overrides.items()), "data=wiki",
                f"seq_len={a.seq}", f"batch_size={a.batch}", "grad_accum=1", f"steps={steps}", *arm.sets(),
                f"lr={'null' if lr is None else repr(float(lr))}", f"weight_decay={float(arm.weight_decay)!r}",
                "grad_clip=1.0", f"seed={seed}", "parallel=none", f"eval_every={eval_every}",
                f"eval_batches={a.eval_batches}", f"log_every={eval_every}", f"out_dir={out}", "save_model=false",
                "checkpoint_every=0", "resume=never"]  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        run = Pending(arm, lr, seed, tag, steps, sets, out, reused=a.reuse and _finished_as(out, sets))
        if self.pool is not None and not run.reused:
            run.future = self.pool.submit(_execute, sets, out / "log.txt")
        return run

    def result(self, run: Pending) -> dict[str, Any]:
        """The record of a submitted run (waiting for it, or with ``--jobs 1`` running it now), added to ``runs``."""
        wall = None
        if not run.reused:
            try:
                wall = run.future.result() if run.future is not None else _execute(run.sets, run.out / "log.txt")
            except BaseException:
                print(f"run {run.tag} failed; its log: {run.out / 'log.txt'}", file=sys.stderr, flush=True)
                raise
        summary = json.loads((run.out / "summary.json").read_text())
        wall = summary["time_s"] if wall is None else wall
        rows = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
        curve = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
        record = {
            "tag": run.tag, "arm": run.arm.key, "lr": run.lr, "seed": run.seed, "tokens": summary["tokens"],
            "steps": run.steps, "curve": curve, "final_val_loss": summary["final_val_loss"],
            "tok_per_s": summary["tok_per_s"],
            "optimizer_state": summary["optimizer_state"] + summary["master_weights"],
            "time_s": summary["time_s"], "wall_s": wall, "n_params": summary["n_params"], "sets": run.sets,
        }  # fmt: skip
        self.runs.append(record)
        print(f"  {run.tag:<40} lr {_lr(run.lr):>7}  final val loss {summary['final_val_loss']:.4f}  "
              f"{summary['tok_per_s']:,.0f} tok/s  {wall:.0f} s", flush=True)
        return record


def _set_threads(threads: int) -> None:
    """``--threads`` torch threads (0: leave the choice to the trainer); in this process and in every worker."""
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the trainer then leaves the thread count alone
        torch.set_num_threads(threads)


def _execute(sets: list[str], log: Path) -> float:
    """Train one run (``--set`` overrides ``sets``), its stdout and stderr to ``log``; its wall-clock seconds. Runs
    in this process (--jobs 1) or in a worker process; the record is read from the run's folder afterwards."""
    t = time.perf_counter()
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        train_main(["--set", *sets])
    return time.perf_counter() - t


def _finished_as(out: Path, sets: list[str]) -> bool:
    """``out`` holds a finished run (summary.json) whose config.yaml is the one ``sets`` gives."""
    if not (out / "summary.json").is_file() or not (out / "config.yaml").is_file():
        return False
    return yaml.safe_load((out / "config.yaml").read_text()) == dataclasses.asdict(load_config(None, sets))


def _lr(lr: float | None) -> str:
    return "default" if lr is None else f"{lr:g}"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else math.inf


# --------------------------------------------------------------------------- estimate


def calibrate(study: Study, arms: list[Arm]) -> dict[str, dict[str, float]]:
    """A few steps of each arm: training seconds per token, seconds per evaluation, per-run overhead. With --jobs > 1
    these runs share the cores as the study's runs will."""
    rates = {}
    steps = study.args.calib_steps
    runs = [study.submit(arm, None, steps * study.tokens_per_step, 0, f"calibrate/{arm.key}") for arm in arms]
    for run in runs:
        r = study.result(run)
        train_s = r["tokens"] / r["tok_per_s"]
        eval_s = max(0.0, r["time_s"] - train_s) / 2  # evaluations at step 0 and at the last step
        rates[r["arm"]] = {"s_per_token": 1 / r["tok_per_s"], "eval_s": eval_s,
                           "overhead_s": max(0.0, r["wall_s"] - r["time_s"])}
    return rates


def plan(args: argparse.Namespace) -> list[list[tuple[str, int, int]]]:
    """(arm key, tokens, evaluations) of every planned run, per phase of independent runs: the sweeps' grids (without
    grid extensions), then the main comparison with the ablations."""
    sweeps = [(key, args.sweep_tokens, 2) for key in sweep_arms(args) for _ in grid(args, key)]
    n_eval = 1 + math.ceil(args.tokens / max(1, args.eval_every_tokens))
    final = [(arm.key, args.tokens, n_eval) for arm in MAIN for _ in args.seeds]
    if not args.no_ablations:
        final += [(arm.key, args.tokens, n_eval) for arm in ABLATIONS for _ in args.ablation_seeds]
    return [sweeps, final]


def parallel_runs(args: argparse.Namespace, cores: int) -> int:
    """Runs that actually proceed at once: --jobs, but no more than the cores hold at --threads each."""
    return max(1, min(args.jobs, cores // (args.threads or cores)))


def estimate_seconds(args: argparse.Namespace, rates: dict[str, dict[str, float]], parallel: int = 1) -> float:
    """Expected runtime with ``parallel`` runs at a time: per phase, its runs' total over ``parallel``, but no less
    than its longest run."""
    total = 0.0
    for phase in plan(args):
        seconds = []
        for key, tokens, n_eval in phase:
            r = rates.get(key) or rates["swan_ddagger"]  # ablations: SWAN‡'s rates
            seconds.append(tokens * r["s_per_token"] + n_eval * r["eval_s"] + r["overhead_s"])
        total += max(sum(seconds) / parallel, max(seconds, default=0.0))
    return total


def _hms(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h} h {rem // 60:02d} min" if h else f"{rem // 60} min {rem % 60:02d} s"


# --------------------------------------------------------------------------- sweeps


def sweep_arms(args: argparse.Namespace) -> list[str]:
    return ["adamw", "muon"] + ([] if args.no_sweep_swan else ["swan_ddagger", "swan_dagger", "swan_0"])


def grid(args: argparse.Namespace, key: str) -> list[float]:
    """The lr grid of an arm; a SWAN preset's default: its own lr and the 1-2-5 values either side (SWAN‡, SWAN†:
    0.01, 0.02, 0.05; SWAN-0, whose lr is Adam's and alpha 1: 0.0005, 0.001, 0.002)."""
    if key == "adamw":
        return sorted(args.adamw_lrs)
    if key == "muon":
        return sorted(args.muon_lrs)
    if args.swan_lrs:
        return sorted(args.swan_lrs)
    from swan_dist import load_preset

    lr = float(load_preset(BY_KEY[key].preset)["optimizer"]["lr"])
    return [_series_step(lr, up=False), lr, _series_step(lr, up=True)]


def _series_step(lr: float, up: bool) -> float:
    """The next value of the 1-2-5 series above (``up``) or below ``lr``."""
    exp = math.floor(math.log10(lr) + 1e-9)
    series = [m * 10.0**e for e in (exp - 1, exp, exp + 1) for m in (1, 2, 5)]
    return min(v for v in series if v > lr * 1.0001) if up else max(v for v in series if v < lr * 0.9999)


def sweep_run(study: Study, key: str, lr: float) -> Pending:
    args = study.args
    return study.submit(BY_KEY[key], lr, args.sweep_tokens, args.seeds[0], f"sweep/{key}/lr{lr:g}")


def run_sweeps(study: Study) -> dict[str, dict[str, Any]]:
    """The lr sweep of every arm of ``sweep_arms``. Every arm's grid is submitted at once; an arm's grid extensions
    depend on its results, so they follow, one at a time, once its grid has finished."""
    keys = sweep_arms(study.args)
    grids = {key: [sweep_run(study, key, lr) for lr in grid(study.args, key)] for key in keys}
    done = {}
    for key in keys:
        print(f"lr sweep {BY_KEY[key].label}:", flush=True)
        done[key] = sweep(study, key, grids[key])
        note = " (on the grid's edge)" if done[key]["edge"] else ""
        print(f"  -> lr {done[key]['best']:g}{note}", flush=True)
    return done


def sweep(study: Study, key: str, grid_runs: list[Pending]) -> dict[str, Any]:
    """Final val loss per lr at ``--sweep-tokens`` (seed: the first of ``--seeds``) of the submitted ``grid_runs``;
    the best lr. A best lr on the grid's edge extends the grid one 1-2-5 step past it, up to ``--sweep-extend``
    times."""
    results: dict[float, float] = {}

    def add(run: Pending) -> None:
        results[run.lr] = _finite(study.result(run)["final_val_loss"])

    for run in grid_runs:
        add(run)
    for _ in range(study.args.sweep_extend):
        best = min(results, key=results.get)
        if best == min(results):
            add(sweep_run(study, key, _series_step(best, up=False)))
        elif best == max(results):
            add(sweep_run(study, key, _series_step(best, up=True)))
        else:
            break
    best = min(results, key=results.get)
    edge = best in (min(results), max(results))
    return {"arm": key, "results": dict(sorted(results.items())), "best": best, "edge": edge}


# --------------------------------------------------------------------------- analysis


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First token count at which the validation curve reaches ``target``, interpolated linearly between
    evaluations; None if it never does."""
    for i, (t, v) in enumerate(curve):
        if v <= target:
            if i == 0:
                return float(t)
            t0, v0 = curve[i - 1]
            return t0 + (v0 - target) / (v0 - v) * (t - t0)
    return None


def mean_curve(runs: list[dict[str, Any]]) -> list[tuple[int, float]]:
    tokens = [t for t, _ in runs[0]["curve"]]
    return [(t, sum(r["curve"][i][1] for r in runs) / len(runs)) for i, t in enumerate(tokens)]


def summarise(runs: list[dict[str, Any]], target: float, adamw_tokens: float) -> dict[str, Any]:
    finals = [r["final_val_loss"] for r in runs]
    reach = tokens_to_reach(mean_curve(runs), target)
    per_seed = [tokens_to_reach(r["curve"], target) for r in runs]
    return {
        "final": sum(finals) / len(finals), "final_min": min(finals), "final_max": max(finals),
        "ratio": None if reach is None else reach / adamw_tokens,
        "ratio_seeds": [None if x is None else x / adamw_tokens for x in per_seed],
        "state": sum(r["optimizer_state"] for r in runs) / len(runs),
        "us_per_token": sum(1e6 / r["tok_per_s"] for r in runs) / len(runs),
        "n": len(runs),
    }  # fmt: skip


def _loss_cell(s: dict[str, Any]) -> str:
    if not math.isfinite(s["final"]):
        return "diverged"
    half = (s["final_max"] - s["final_min"]) / 2
    return f"{s['final']:.3f} ± {half:.3f}" if s["n"] > 1 else f"{s['final']:.3f}"


def _ppl_cell(s: dict[str, Any]) -> str:
    if not math.isfinite(s["final"]):
        return "-"
    ppl = f"{math.exp(s['final']):.1f}"
    return f"{ppl} ({math.exp(s['final_min']):.1f}–{math.exp(s['final_max']):.1f})" if s["n"] > 1 else ppl


def _ratio_cell(s: dict[str, Any]) -> str:
    if s["ratio"] is None:
        return "not reached"
    seeds = s["ratio_seeds"]
    cell = f"{s['ratio']:.2f}x"
    if len(seeds) > 1:  # n/r: a seed whose own curve does not reach the target
        reached = [x for x in seeds if x is not None]
        lo = f"{min(reached):.2f}" if reached else "n/r"
        hi = "n/r" if len(reached) < len(seeds) else f"{max(reached):.2f}"
        cell += f" ({lo}–{hi})"
    return cell


def table(rows: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    lines = ["| optimizer | lr | final val loss | perplexity | tokens to AdamW's final loss (vs AdamW) | "
             "optimizer state | µs / token |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, lr, s in rows:
        lines.append(f"| {label} | {lr} | {_loss_cell(s)} | {_ppl_cell(s)} | {_ratio_cell(s)} | "
                     f"{s['state'] / 2**20:.2f} MiB | {s['us_per_token']:.0f} |")
    return lines


def plot(path: Path, groups: list[tuple[str, list[tuple[str, list[dict[str, Any]]]]]], target: float) -> None:
    """Validation loss against tokens: per optimizer the mean over seeds, the min-max band shaded."""
    from matplotlib.figure import Figure  # object API: Agg canvas, no pyplot, no global backend

    fig = Figure(figsize=(6.5 * len(groups), 4.8), dpi=120)
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, (title, arms) in zip(axes, groups):
        finals, later = [], []
        for label, runs in arms:
            tokens = [t / 1e6 for t, _ in runs[0]["curve"]]
            values = [[r["curve"][i][1] for r in runs] for i in range(len(tokens))]
            mean = [sum(v) / len(v) for v in values]
            (line,) = ax.plot(tokens, mean, marker=".", label=label)
            if len(runs) > 1:
                ax.fill_between(tokens, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                                alpha=0.2, linewidth=0)  # fmt: skip
            finals += [m for m in mean[-1:] if math.isfinite(m)]
            later += [m for m in mean[1:] if math.isfinite(m)]  # the step-0 loss (ln vocab) would squash the rest
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="AdamW's final loss")
        if finals:
            low = min(min(later), target)
            ax.set_ylim(low - 0.1, max(min(max(later), low + 2.0), low + 0.5, target + 0.1))
        ax.set(xlabel="training tokens (millions)", ylabel="validation loss (nats/token)", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


# --------------------------------------------------------------------------- main


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(MODEL_SIZES), help="reference model size")
    ap.add_argument("--tokens", type=int, default=2_000_000,
                    help="training tokens per run of the main comparison and the ablations")
    ap.add_argument("--sweep-tokens", type=int, default=500_000, help="training tokens per lr-sweep run")
    ap.add_argument("--seeds", type=_ints, default=[0, 1], help="comma-separated; the sweep uses the first")
    ap.add_argument("--ablation-seeds", type=_ints, default=None, help="default: --seeds")
    ap.add_argument("--eval-every-tokens", type=int, default=100_000, help="validation loss every this many tokens")
    ap.add_argument("--eval-batches", type=int, default=8, help="validation set: this many batches of fixed windows")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--adamw-lrs", type=_floats, default=[1e-3, 2e-3, 5e-3, 1e-2], help="AdamW lr grid")
    ap.add_argument("--muon-lrs", type=_floats, default=[1e-3, 2e-3, 5e-3, 1e-2],
                    help="Muon lr grid (AdamW-matched scale: match_rms_adamw)")
    ap.add_argument("--swan-lrs", type=_floats, default=None, help="SWAN global lr grid for every preset (default: "
                    "each preset's lr and its 1-2-5 neighbours, e.g. 0.01,0.02,0.05 for SWAN‡)")
    ap.add_argument("--no-sweep-swan", action="store_true", help="SWAN presets at their own lr, no sweep")
    ap.add_argument("--sweep-extend", type=int, default=2, help="grid extensions past an edge best, at most")
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="read runs already finished in --work-dir with the same "
                    "trainer config instead of running them again (to continue an interrupted study)")
    ap.add_argument("--calib-steps", type=int, default=4, help="steps per optimizer of the runtime estimate")
    ap.add_argument("--estimate-only", action="store_true",
                    help="run the calibration, print the expected runtime, and stop")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process (default 1: one "
                    "after the other in this process). On a machine with C cores, C jobs of --threads 1 is the fast "
                    "setting; results are the same as with --jobs 1")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: on a shared 2-core "
                    "machine 2 threads ran the tiny model 3-6x slower; 0: the trainer's choice, all cores)")
    ap.add_argument("--work-dir", default=None, help="run folders and results.json (default runs/convergence-<model>; "
                    "--quick: a temporary folder)")
    ap.add_argument("--out", default=None, help="Markdown file whose convergence section is written "
                    "(default docs/benchmarks.md; --quick: a temporary file); the PNG goes beside it")
    ap.add_argument("--quick", action="store_true", help="smoke mode: 2-layer tiny model, a few steps per run, "
                    "2-point grids; written to a temporary file, not docs/")
    args = ap.parse_args(argv)
    args.model_overrides = {}
    if args.quick:
        args.model_overrides = {"n_layers": 2}
        args.batch, args.seq, args.eval_batches, args.calib_steps = 4, 32, 1, 2
        tps = args.batch * args.seq
        args.tokens, args.sweep_tokens, args.eval_every_tokens = 4 * tps, 2 * tps, 2 * tps
        args.adamw_lrs, args.muon_lrs = [2e-3, 5e-3], [2e-3, 5e-3]
        args.sweep_extend = 0
        args.ablation_seeds = args.ablation_seeds or args.seeds[:1]
    args.ablation_seeds = args.ablation_seeds or args.seeds
    if not args.seeds:
        raise SystemExit("--seeds: at least one seed")
    if args.jobs < 1:
        raise SystemExit("--jobs: at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    _set_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = tempfile.mkdtemp(prefix="swan_convergence_") if args.quick and not (args.work_dir and args.out) else None
    default_work = Path(tmp) / "runs" if tmp else REPO / "runs" / f"convergence-{args.model}"
    work = Path(args.work_dir) if args.work_dir else default_work
    out = Path(args.out) if args.out else (Path(tmp) / "benchmarks.md" if tmp else measure.DOC)
    tag = f"{device}-{args.model}"  # one section and one plot per device and model size
    png = out.parent / f"convergence_{device}_{args.model}.png"
    cores = len(os.sched_getaffinity(0))
    parallel = parallel_runs(args, cores)
    started = time.perf_counter()

    print(f"convergence study: model {args.model}{args.model_overrides or ''}, {args.batch}x{args.seq} tokens/step, "
          f"{args.tokens:,} tokens x seeds {args.seeds}, sweeps {args.sweep_tokens:,} tokens, on {device} "
          f"({cores} cores, --jobs {args.jobs}); runs in {work}", flush=True)
    with Study(args, work) as study:
        print("calibrating the runtime estimate:", flush=True)
        rates = calibrate(study, list(MAIN))
        expected = estimate_seconds(args, rates, parallel)
        n_runs = sum(map(len, plan(args)))
        speeds = ", ".join(f"{k} {1 / r['s_per_token']:,.0f}" for k, r in rates.items())
        print(f"expected runtime: about {_hms(expected)} for {n_runs} runs, {parallel} at a time (--jobs {args.jobs}, "
              f"{cores} cores, --threads {args.threads}) (from {args.calib_steps}-step runs at {speeds} tok/s; more "
              "if a sweep extends its grid)", flush=True)
        if args.estimate_only:
            return {"expected_s": expected, "rates": rates, "runs": n_runs, "parallel": parallel}

        # 1. lr sweeps (short runs, first seed)
        sweeps = run_sweeps(study)
        lr_of = {key: s["best"] for key, s in sweeps.items()}

        # 2. main comparison, 3. ablations (at SWAN‡'s lr): independent of each other, all submitted at once
        comparison = [study.submit(arm, lr_of.get(arm.key), args.tokens, seed, f"main/{arm.key}/seed{seed}",
                                   args.eval_every_tokens) for seed in args.seeds for arm in MAIN]  # fmt: skip
        ablations = [] if args.no_ablations else [
            study.submit(arm, lr_of.get("swan_ddagger"), args.tokens, seed, f"ablation/{arm.key}/seed{seed}",
                         args.eval_every_tokens) for seed in args.ablation_seeds for arm in ABLATIONS]  # fmt: skip
        results: dict[str, list[dict[str, Any]]] = {}
        for title, runs in (("main comparison", comparison), ("ablations", ablations)):
            if runs:
                print(f"{title}:", flush=True)
            for run in runs:
                results.setdefault(run.arm.key, []).append(study.result(run))
    elapsed = time.perf_counter() - started

    adamw_curve = mean_curve(results["adamw"])
    target = adamw_curve[-1][1]  # the tuned AdamW's mean final validation loss
    stats = {key: summarise(runs, target, tokens_to_reach(adamw_curve, target)) for key, runs in results.items()}
    main_keys = [a.key for a in MAIN]
    ablation_keys = ["swan_ddagger", *(a.key for a in ABLATIONS)]
    panels = [("SWAN presets vs baselines", [(BY_KEY[k].label, results[k]) for k in main_keys])]
    if not args.no_ablations:
        panels.append(("SWAN‡ ablations", [(BY_KEY[k].label, results[k]) for k in ablation_keys]))
    plot(png, panels, target)
    context = {"argv": argv, "device": device, "cores": cores, "elapsed": elapsed, "expected": expected, "png": png,
               "n_params": results["adamw"][0]["n_params"], "tokens": results["adamw"][0]["tokens"]}  # fmt: skip
    body = report(args, sweeps, stats, context)
    print(body)
    saved = measure.DOC
    try:  # measure writes the section into its DOC: point it at --out for this call
        measure.DOC = out
        measure.write_section(f"convergence-{tag}", f"Convergence ({'GPU' if device == 'cuda' else 'CPU'}, {args.model}): SWAN presets vs AdamW and Muon", body)
    finally:
        measure.DOC = saved
    work.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(args), "command": _command(argv), "cores": cores, "threads": torch.get_num_threads(),
              "elapsed_s": elapsed, "expected_s": expected, "sweeps": sweeps, "target": target, "stats": stats,
              "runs": study.runs}  # fmt: skip
    (work / "results.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote the convergence-{tag} section of {out}, {png}, and {work / 'results.json'} "
          f"(took {_hms(elapsed)}, estimated {_hms(expected)})", flush=True)
    return {"out": str(out), "png": str(png), "work": str(work), "stats": stats, "sweeps": sweeps,
            "elapsed_s": elapsed, "expected_s": expected, "rates": rates}


def _command(argv: list[str]) -> str:
    return "python benchmarks/convergence.py" + ("" if not argv else " " + shlex.join(argv))


def report(args: argparse.Namespace, sweeps: dict[str, Any], stats: dict[str, Any], ctx: dict[str, Any]) -> str:
    """The Markdown body of the section: setup, command, main table, plot, sweeps, ablations."""
    lr_of = {key: s["best"] for key, s in sweeps.items()}

    def lr_cell(key: str) -> str:
        source = "swan_ddagger" if key in {a.key for a in ABLATIONS} else key
        if source not in lr_of:
            from swan_dist import load_preset

            return f"{load_preset(BY_KEY[key].preset)['optimizer']['lr']:g} (preset)"
        return f"{lr_of[source]:g}" + (" (edge)" if sweeps[source]["edge"] else "")

    def rows(keys: list[str]) -> list[str]:
        return table([(BY_KEY[k].label, lr_cell(k), stats[k]) for k in keys])

    model = f"`{args.model}`" + (f" {json.dumps(args.model_overrides)}" if args.model_overrides else "")
    if ctx["device"] == "cuda":
        where = f"on {torch.cuda.get_device_name()} ({ctx['cores']} CPU cores)"
    else:
        threads = torch.get_num_threads()
        where = f"on the CPU: **ran on {ctx['cores']} CPU cores** ({threads} torch thread{'s' * (threads != 1)})"
    if args.jobs > 1:
        where += f", {args.jobs} runs at a time (`--jobs {args.jobs}`)"
    seeds = ", ".join(map(str, args.seeds))
    lines = [
        f"Reference LLaMA {model} ({ctx['n_params'] / 1e6:.2f}M parameters), embedded wiki corpus, "
        f"{args.batch}x{args.seq} tokens per step, {ctx['tokens']:,} training tokens per run; 10 % linear warm-up, "
        "cosine decay to 0.1 x lr (SWAN-0: no warm-up, as its preset defines); grad clip 1.0, no weight decay, fp32. "
        f"Single process (parallel none) per run {where}, torch {torch.__version__}. Validation loss every "
        f"{args.eval_every_tokens:,} tokens on {args.eval_batches * args.batch} fixed windows. Seeds {seeds}: mean "
        "± half the min–max range (perplexity: of the mean, min–max). "
        f"The study took {_hms(ctx['elapsed'])} (estimated {_hms(ctx['expected'])} at its start).",
        "",
        "AdamW and Muon are baselines: torch's `AdamW`, and torch's `Muon` on exactly the matrices SWAN whitens "
        "(AdamW on embeddings, head and norms; Muon's lr scaled to AdamW's update RMS, "
        "`adjust_lr_fn=\"match_rms_adamw\"`). Tokens to AdamW's final loss: where the mean validation curve first "
        "reaches the tuned AdamW's mean final validation loss (linear interpolation between evaluations), over "
        "AdamW's own; seed range in brackets, below 1 is faster. Optimizer state: bytes the optimizer keeps "
        "(`swan_dist.memory.state_bytes`). µs / token: training time per token, evaluation excluded. "
        "How to re-run and read this: [convergence.md](convergence.md).",
        "",
        "```",
        _command(ctx["argv"]),
        "```",
        "",
        *rows([a.key for a in MAIN]),
        "",
        f"![validation loss against training tokens]({ctx['png'].name})",
        "",
        f"Learning rates: the lowest final validation loss in a sweep of {args.sweep_tokens:,}-token runs (same "
        f"schedule shape, seed {args.seeds[0]}) that the script runs; a best lr on the grid's edge extends the grid "
        f"(at most {args.sweep_extend} steps of the 1-2-5 series). "
        + ("SWAN presets: their own lr, not swept. " if args.no_sweep_swan else "SWAN: the global lr (the "
           "fallback's; x alpha 0.05 on SWAN matrices for SWAN‡ and SWAN†, x 1 for SWAN-0). ")
        + "Short sweeps may favour larger lrs than the full runs would.",
        "",
        "| optimizer | final val loss per lr (sweep) | chosen lr |",
        "|---|---|---:|",
    ]
    for key, s in sweeps.items():
        cells = " · ".join(f"**{lr:g}: {v:.3f}**" if lr == s["best"] else f"{lr:g}: {v:.3f}"
                           for lr, v in s["results"].items())  # fmt: skip
        lines.append(f"| {BY_KEY[key].label} | {cells} | {s['best']:g}{' (grid edge)' if s['edge'] else ''} |")
    if not args.no_ablations:
        lines += [
            "",
            f"Ablations of SWAN‡ at its lr ({lr_cell('swan_ddagger')}), seeds "
            f"{', '.join(map(str, args.ablation_seeds))}; each changes one thing of SWAN‡ (NSDS 2 steps, RMS "
            "GradNorm, whitening on):",
            "",
            *rows(["swan_ddagger", *(a.key for a in ABLATIONS)]),
        ]
    return "\n".join(lines)

if __name__ == "__main__":
    main()
