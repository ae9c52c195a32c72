"""The run machinery of convergence.py and lr_rule.py: reference-trainer runs, here or ``--jobs N`` at a time in worker
processes; lr sweeps whose grid grows past an edge best; the runs' records and curves; the flags the two share."""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from swan_dist import load_preset
from swan_dist.reference.config import load_config
from swan_dist.reference.model import MODEL_SIZES
from swan_dist.reference.train import main as train_main

REPO = Path(__file__).resolve().parent.parent
if "measure" not in sys.modules:  # by its path: benchmarks/ on sys.path would shadow packages (benchmarks/megatron.py)
    _spec = importlib.util.spec_from_file_location("measure", REPO / "benchmarks" / "measure.py")
    sys.modules["measure"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["measure"])
measure = sys.modules["measure"]


@dataclasses.dataclass(frozen=True)
class Arm:
    """One optimizer setting: a trainer ``optimizer`` (+ SWAN preset and extra SWAN options), its weight decay."""

    key: str
    label: str
    optimizer: str
    preset: str | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    weight_decay: float = 0.0

    def sets(self) -> list[str]:
        preset = [] if self.preset is None else [f"preset={self.preset}"]
        return [f"optimizer={self.optimizer}", *preset, *(f"swan_options.{k}={v}" for k, v in self.options.items())]


class Study(contextlib.AbstractContextManager):
    """A study's runs, ``--jobs`` at a time in spawned workers (1: in this process), records in the order asked for;
    an error inside the ``with`` block cancels the runs not started and stops the workers."""

    def __init__(self, args: argparse.Namespace, work: Path, sweep_seeds=None, sweep_eval_tokens=None) -> None:
        self.args, self.work, self.tokens_per_step = args, work, args.batch * args.seq
        self.sweep_seeds, self.sweep_eval_tokens = sweep_seeds or args.seeds[:1], sweep_eval_tokens
        self.runs: list[dict[str, Any]] = []  # every run's record, for results.json
        spawn = multiprocessing.get_context("spawn")  # fresh interpreters, none of this process's torch state forked
        self.pool = ProcessPoolExecutor(args.jobs, mp_context=spawn, initializer=set_threads,
                                        initargs=(args.threads,)) if args.jobs > 1 else None

    def __exit__(self, exc_type: type[BaseException] | None, *_: Any) -> None:
        if self.pool is None:
            return
        workers = list(self.pool._processes.values())  # as Python 3.14's terminate_workers() does
        self.pool.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)
        for worker in workers if exc_type is not None else ():
            worker.terminate()

    def submit(self, arm: Arm, lr: float | None, tokens: int, seed: int, tag: str, eval_every_tokens=None) -> Callable:
        """A trainer run in ``work/tag`` (lr None: the trainer's default; evaluations every ``eval_every_tokens``, None:
        at the start and the end); the function giving its record. ``--reuse`` reads a finished run back."""
        a = self.args
        steps = max(2, round(tokens / self.tokens_per_step))
        eval_every = steps if eval_every_tokens is None else max(1, round(eval_every_tokens / self.tokens_per_step))
        out = self.work / tag
        sets = [f"model.size={a.model}", *(f"model.{k}={v}" for k, v in a.model_overrides.items()), "data=wiki",
                f"seq_len={a.seq}", f"batch_size={a.batch}", "grad_accum=1", f"steps={steps}", *arm.sets(),
                f"lr={'null' if lr is None else repr(float(lr))}", f"weight_decay={float(arm.weight_decay)!r}",
                "grad_clip=1.0", f"seed={seed}", "parallel=none", f"eval_every={eval_every}",
                f"eval_batches={a.eval_batches}", f"log_every={eval_every}", f"out_dir={out}", "save_model=false",
                "checkpoint_every=0", "resume=never"]
        out.mkdir(parents=True, exist_ok=True)
        reused = a.reuse and _finished_as(out, sets)
        future = self.pool.submit(execute, sets, out / "log.txt") if self.pool is not None and not reused else None

        def record() -> dict[str, Any]:
            wall = None
            if not reused:
                try:
                    wall = future.result() if future is not None else execute(sets, out / "log.txt")
                except BaseException:
                    print(f"run {tag} failed; its log: {out / 'log.txt'}", file=sys.stderr, flush=True)
                    raise
            s = json.loads((out / "summary.json").read_text())
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            r = {"tag": tag, "arm": arm.key, "lr": lr, "seed": seed, "steps": steps, "sets": sets,
                 **{k: s[k] for k in ("tokens", "final_val_loss", "tok_per_s", "time_s", "n_params")},
                 "curve": [(m["tokens"], m["val_loss"]) for m in rows if "val_loss" in m],
                 "optimizer_state": s["optimizer_state"] + s["master_weights"], "wall_s": wall or s["time_s"]}
            self.runs.append(r)
            print(f"  {tag:<40} lr {'default' if lr is None else f'{lr:g}':>7}  final val loss "
                  f"{r['final_val_loss']:.4f}  {r['tok_per_s']:,.0f} tok/s  {r['wall_s']:.0f} s", flush=True)
            return r

        return record

    def point(self, arm: Arm, lr: float, tag: str) -> list[Callable]:
        """A sweep point: a ``--sweep-tokens`` run per sweep seed (``tag/seed<s>`` where there are several)."""
        seeds = self.sweep_seeds
        return [self.submit(arm, lr, self.args.sweep_tokens, s, f"{tag}/seed{s}" if len(seeds) > 1 else tag,
                            self.sweep_eval_tokens) for s in seeds]  # fmt: skip

    def value(self, point: list[Callable]) -> dict[str, Any]:
        """A sweep point's seed-mean final validation loss (a diverged run's: inf), min, max and mean curve."""
        runs = [run() for run in point]
        finals = [x if math.isfinite(x) else math.inf for x in (r["final_val_loss"] for r in runs)]
        return {"final": sum(finals) / len(finals), "min": min(finals), "max": max(finals), "curve": mean_curve(runs)}

    def grid(self, arm: Arm, lrs: list[float]) -> dict[float, list[Callable]]:
        return {lr: self.point(arm, lr, f"sweep/{arm.key}/lr{lr:g}") for lr in sorted(lrs)}

    def sweep(self, arm: Arm, grid: dict[float, list[Callable]]) -> dict[str, Any]:
        """Final val loss per lr of a submitted :meth:`grid`, the best lr; a best lr on the edge extends the grid by a
        1-2-5 step, at most ``--sweep-extend`` times (each extension waits for the results before)."""
        print(f"lr sweep {arm.label}:", flush=True)
        points = {lr: self.value(p) for lr, p in grid.items()}
        for _ in range(self.args.sweep_extend):
            best = min(points, key=lambda lr: points[lr]["final"])
            if best not in (min(points), max(points)):
                break
            lr = step(best, up=best != min(points))
            points[lr] = self.value(self.grid(arm, [lr])[lr])
        points = dict(sorted(points.items()))
        best = min(points, key=lambda lr: points[lr]["final"])
        return {"arm": arm.key, "results": {lr: p["final"] for lr, p in points.items()}, "best": best,
                "edge": len(points) > 1 and best in (min(points), max(points)), "points": points}


def set_threads(threads: int) -> None:
    """``--threads`` torch threads (0: leave the choice to the trainer); in this process and in every worker."""
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the trainer then leaves the thread count alone
        torch.set_num_threads(threads)


def execute(sets: list[str], log: Path) -> float:
    """Train one run (``--set`` overrides ``sets``), its stdout and stderr to ``log``; its wall-clock seconds."""
    t = time.perf_counter()
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        train_main(["--set", *sets])
    return time.perf_counter() - t


def _finished_as(out: Path, sets: list[str]) -> bool:
    """``out`` holds a finished run (summary.json) whose config.yaml is the one ``sets`` gives."""
    done = (out / "summary.json").is_file() and (out / "config.yaml").is_file()
    return done and yaml.safe_load((out / "config.yaml").read_text()) == dataclasses.asdict(load_config(None, sets))


def step(lr: float, up: bool) -> float:
    """The next value of the 1-2-5 series above (``up``) or below ``lr``."""
    exp = math.floor(math.log10(lr) + 1e-9)
    series = [m * 10.0**e for e in (exp - 1, exp, exp + 1) for m in (1, 2, 5)]
    return min(v for v in series if v > lr * 1.0001) if up else max(v for v in series if v < lr * 0.9999)


def grid_of(args: argparse.Namespace, arm: Arm) -> list[float]:
    """An arm's lr grid: ``--<optimizer>-lrs``, by default a SWAN preset's own lr and the 1-2-5 values either side."""
    if getattr(args, f"{arm.optimizer}_lrs"):
        return sorted(getattr(args, f"{arm.optimizer}_lrs"))
    lr = float(load_preset(arm.preset)["optimizer"]["lr"])
    return [step(lr, up=False), lr, step(lr, up=True)]


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The tokens at which the validation curve first reaches ``target`` (linear interpolation); None if never."""
    for (t0, v0), (t, v) in zip(curve[:1] + curve[:-1], curve):  # each evaluation with the one before
        if v <= target:
            return float(t) if v0 <= target else t0 + (v0 - target) / (v0 - v) * (t - t0)
    return None


def mean_curve(runs: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(t, sum(r["curve"][i][1] for r in runs) / len(runs)) for i, (t, _) in enumerate(runs[0]["curve"])]


def cells(values: dict[float, float], best: float | None = None, unit: str = "") -> str:
    """``key: loss`` per point, `` · ``-separated, the best in bold."""
    return " · ".join(f"**{k:g}{unit}: {v:.3f}**" if k == best else f"{k:g}{unit}: {v:.3f}" for k, v in values.items())


def curves(ax, series: list[tuple[str, list[list]]], target: float, unit: str = "millions") -> None:
    """Validation loss against tokens (``unit``) on ``ax``: per label its curves' mean and range, ``target`` dashed."""
    later, per = [], 1e6 if unit == "millions" else 1e3
    for label, runs in series:
        tokens = [t / per for t, _ in runs[0]]
        values = [[r[i][1] for r in runs] for i in range(len(tokens))]
        mean = [sum(v) / len(v) for v in values]
        (line,) = ax.plot(tokens, mean, marker=".", label=label)
        ax.fill_between(tokens, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                        alpha=0.2, linewidth=0)  # the seeds' range
        later += [m for m in mean[1:] if math.isfinite(m)]
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="AdamW's final loss")
    if later:  # the y range from the evaluations after step 0 (whose ln-vocab loss would squash the rest)
        low = min(min(later), target)
        ax.set_ylim(low - 0.1, max(min(max(later), low + 2.0), low + 0.5, target + 0.1))
    ax.set(xlabel=f"training tokens ({unit})", ylabel="validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def listed(kind: type) -> Callable[[str], list]:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def parser(doc: str, **options) -> argparse.ArgumentParser:
    """The flags both studies take (what each does: docs/convergence.md), and ``options`` as measure.parser's."""
    ap = measure.parser(doc, sweep_tokens=500_000, eval_every_tokens=100_000, eval_batches=8, batch=16, seq=128,
                        sweep_extend=2, jobs=1, threads=1, work_dir="", out="", **options)
    ap.add_argument("--model", default="tiny", choices=sorted(MODEL_SIZES), help="reference model size")
    ap.add_argument("--adamw-lrs", type=listed(float), default=[1e-3, 2e-3, 5e-3, 1e-2], help="AdamW lr grid")
    ap.add_argument("--swan-lrs", type=listed(float), help="SWAN's global lr grid (default: the preset's lr ± a step)")
    ap.add_argument("--reuse", action="store_true", help="read back runs finished in --work-dir with the same config")
    ap.add_argument("--quick", action="store_true", help="smoke: 2-layer tiny model, a few steps a run, temp files")
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The flags parsed, --quick's sizes set, the flags checked."""
    args = ap.parse_args(argv)
    args.model_overrides = {"n_layers": 2} if args.quick else {}
    if args.quick:
        args.batch, args.seq, args.eval_batches, args.adamw_lrs, args.sweep_extend = 4, 32, 1, [2e-3, 5e-3], 0
        args.sweep_tokens = args.eval_every_tokens = 2 * args.batch * args.seq
    if not args.seeds or args.jobs < 1:
        raise SystemExit("--jobs: at least 1" if args.seeds else "--seeds: at least one seed")
    return args


def folders(args: argparse.Namespace, runs: str, page: str) -> tuple[Path, Path]:
    """The threads set; the run folder (``--work-dir``, runs/<runs>) and the page (``--out``, docs/<page>), or temp."""
    set_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="swan_study_")) if args.quick and not (args.work_dir and args.out) else None
    work = Path(args.work_dir) if args.work_dir else (tmp / "runs" if tmp else REPO / "runs" / runs)
    measure.DOC = Path(args.out) if args.out else (tmp / page if tmp else REPO / "docs" / page)  # write_section's page
    return work, measure.DOC

