"""swan_dist in torchtitan's unmodified trainer (tests/torchtitan_harness.py), side by side with its own optimizers:
    python benchmarks/torchtitan.py                 # CPU, W=2 FSDP2: AdamW vs SWAN, where step time and memory go
    python benchmarks/torchtitan.py --planning-only # DistMuon's owner planning vs swan_dist's (no launch)
    python benchmarks/torchtitan.py --cuda          # one GPU, W=1: AdamW vs DistMuon vs SWAN (gpu_suite.sh)
"""

import contextlib
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
# named like the package it measures: its folder last on the path (``import torchtitan`` finds torchtitan)
sys.path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != HERE] + [TESTS, HERE]
import measure  # noqa: E402
import torch  # noqa: E402
from swan_dist import engine, whitening  # noqa: E402

LOG = re.compile(r"^\[titan\] (\S+ \S+) .*?step:\s+\d+\s+\S*\s*loss:\s+([-0-9.]+).*?memory:\s+([0-9.]+)GiB"
                 r".*?tps:\s+([0-9,]+)")
MiB = 2**20
PARTS = ("whitening", "exchange", "fallback", "bookkeeping")
TRACKED = ("Parameter", "Gradient", "Optstate", "Activation", "Temp", "Total")  # MemTracker's categories


def launch(nproc: int, config: str, steps: int, tmp: str, *extra: str, probe: bool = False) -> dict:
    """One job in a launch of its own: rank 0's last loss, memory (GiB), tokens/s, s/step, ``probe``d parts."""
    out, entry = os.path.join(tmp, config), os.path.abspath(__file__) if probe else f"{TESTS}/torchtitan_harness.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--local-ranks-filter", "0", entry, "--module", "torchtitan_configs", "--config", config,
           "--dump_folder", out, "--training.steps", str(steps), *extra]
    env = {**os.environ, "SWAN_TT_ASSETS": os.path.join(tmp, "assets"), "SWAN_TT_OUT": out, "SWAN_TT_PROBE": str(probe),
           "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    os.makedirs(out, exist_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if p.returncode != 0:
        sys.stderr.write((p.stdout + p.stderr)[-5000:])
        raise SystemExit(f"torchtitan launch failed ({p.returncode})")
    logs = [m.groups() for m in map(LOG.search, re.sub(r"\x1b\[[0-9;]*m", "", p.stdout + p.stderr).splitlines()) if m]
    t = [datetime.datetime.strptime(a, "%Y-%m-%d %H:%M:%S,%f").timestamp() for a, *_ in logs]
    dt = sorted(b - a for a, b in zip(t, t[1:]))
    return {"loss": float(logs[-1][1]), "mem": max(float(m[2]) for m in logs), "step_s": dt[len(dt) // 2],
            "tps": sorted(float(m[3].replace(",", "")) for m in logs)[len(logs) // 2],
            **(json.load(open(os.path.join(out, "0.json"))) if probe else {})}


def probed(argv: list[str]) -> None:
    """A rank of a CPU job (the harness's ``main``): ms per iteration by part, its resident set before step 1, its
    last step under torch's MemTracker (MiB by category), written to $SWAN_TT_OUT/<rank>.json."""
    import torchtitan_harness
    torchtitan_harness.cpu_device()
    from torch.distributed._tools.mem_tracker import MemTracker
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.trainer import Trainer
    steps, job = [], {}

    class Tracker(MemTracker):  # torchtitan's loss calls the head once per chunk: its module stats are not kept
        def _pre_fw_hook(self, module, inputs) -> None:
            with contextlib.suppress(NotImplementedError):
                super()._pre_fw_hook(module, inputs)

    def train_step(inner, self, *a, **k):
        steps.append({})
        job.setdefault("start", measure.rss_status()["VmRSS"])  # the model built, before the first step
        if self.step < self.config.training.steps:
            return inner(self, *a, **k)
        tracker = Tracker()
        tracker.track_external(*self.model_parts, *self.optimizers.optimizers)
        marks = measure.Marks(tracker)
        marks.wrap(self.optimizers, "step", "step")
        with tracker:
            inner(self, *a, **k)
        job.update(swan=getattr(self.optimizers, "swan", None), **marks.out,
                   tracked=measure.categories(tracker.get_tracker_snapshot("peak")))

    def timed(owner, attr: str, key: str, around=lambda f, *a, **k: f(*a, **k)) -> None:
        def call(*a, inner=getattr(owner, attr), **k):
            t0 = time.perf_counter()
            try:
                return around(inner, *a, **k)
            finally:
                steps[-1][key] = steps[-1].get(key, 0.0) + time.perf_counter() - t0
        setattr(owner, attr, call)
    for args in ((Trainer, "train_step", "iteration", train_step), (OptimizersContainer, "step", "step"),
                 (engine, "run_fallbacks", "fallback"), (whitening, "swan_compute", "whitening"),
                 (whitening.Plans, "run", "exchange")):
        timed(*args)
    sys.argv = [sys.argv[0], *argv]
    torchtitan_harness.main()
    job["peak"] = measure.rss_status()["VmHWM"]  # the process's peak: ru_maxrss, to the byte
    ex, timed_steps = job["swan"] and job["swan"]._memos["all"].plans.last, steps[2:-1]  # the tracked step left out
    ms = {k: 1e3 * sum(s.get(k, 0.0) for s in timed_steps) / len(timed_steps)
          for k in ("iteration", "step", "fallback", "whitening", "exchange")}
    ms.update(exchange=ms["exchange"] - ms["whitening"], bookkeeping=ms["step"] - ms["fallback"] - ms["exchange"])
    mib = {k: job[k] / MiB for k in ("start", "peak", "live_before_step", "transient")}
    mib.update({c: job["tracked"].get(c, 0) / MiB for c in TRACKED},
               bound=ex.transient_bound(whitening._CPU_PASS_BYTES)["total"] / MiB if ex else 0)
    with open(os.path.join(os.environ["SWAN_TT_OUT"], f"{os.environ['RANK']}.json"), "w") as f:  # rank 0's read
        json.dump({"ms": ms, "mib": mib}, f)


def planning_rows(flavor: str, world: int) -> dict:
    """DistMuon's and swan_dist's owners for torchtitan's llama3 ``flavor`` (its whitened matrices, built on the
    meta device): imbalance on each cost model (slowest owner / mean) and the most bytes a rank sends (fp32)."""
    from torchtitan.distributed.flex_shard.dist_muon import (
        _balance_loads_across_partitions, _estimate_muon_compute_cost)
    from torchtitan.models.llama3 import model_registry
    from swan_dist.functional import WhitenConfig
    from swan_dist.plan import MatrixSpec, row_shard_ranges
    from swan_dist.selection import classify
    with torch.device("meta"):
        model = model_registry(flavor).model.build()
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.ndim == 2 and classify(n, p).use_swan]
    specs = [MatrixSpec(n, s, WhitenConfig()) for n, s in shapes]
    ranges = row_shard_ranges(specs, world)
    plan = whitening.swan_plan(specs, [ranges[r] for r in range(world)], bucket_bytes=1 << 62)  # one bucket
    costs = ([_estimate_muon_compute_cost(s, 5) for _, s in shapes], [whitening.swan_cost(m) for m in specs])
    loads = tuple((c, s[0] * s[1] * 4, n) for c, (n, s) in zip(costs[0], shapes))
    owners = {"muon": _balance_loads_across_partitions(loads, initial_cumulative_primary_loads=(0,) * world)[0],
              "swan": [b.owners[m] for m in range(len(specs)) for b in plan.buckets if m in b.owners]}

    def score(owner) -> tuple:  # a rank sends its row shard of each matrix it does not own, both ways
        per = [[sum(c[m] for m, o in enumerate(owner) if o == r) for r in range(world)] for c in costs]
        sent = [sum(8 * (ranges[r][m][1] - ranges[r][m][0]) for m, o in enumerate(owner) if o != r)
                for r in range(world)]
        return (*(max(p) / (sum(p) / world) for p in per), max(sent))
    return {"model": f"llama3 {flavor}", "W": world, "matrices": len(shapes),
            **{k: score(o) for k, o in owners.items()}}


def planning(args) -> str:
    plan = [planning_rows(f, w) for f in ("debugmodel", "8B") for w in (2, 8, 64)]
    lines = ["| model | W | matrices | DistMuon: imbalance (its cost) | (SWAN cost) | MiB sent | swan_dist: imbalance "
             "(DistMuon cost) | (SWAN cost) | MiB sent |", "|---|" + "---:|" * 8]
    lines += [measure.row(p["model"], p["W"], p["matrices"], *(f"{p[k][0]:.3f} | {p[k][1]:.3f} | {p[k][2] / MiB:,.1f}"
                                                             for k in ("muon", "swan"))) for p in plan]
    same = all(p["muon"] == p["swan"] for p in plan)
    verdict = ("The two planners reach the same balance and bytes at every layout here (both assign whole matrices "
               "largest first)" if same else "The planners differ where the rows differ")
    return "\n".join(lines) + f"\n\n{verdict}. Where W exceeds the matrices (debugmodel at W=64: 30) most ranks own " \
        "none.\n"


def cpu(args) -> str:
    tmp, rows, best = tempfile.mkdtemp(prefix="swan_tt_bench_"), [], {}
    __import__("torchtitan_harness").make_assets(os.path.join(tmp, "assets"), seq_len=64)
    for opt, config in (("torchtitan AdamW", "llama3_adamw_lr0.0008"), ("torchtitan AdamW", "llama3_adamw_lr0.003"),
                        ("swan_dist SWAN‡", "llama3_swan_lr0.002"), ("swan_dist SWAN‡", "llama3_swan_lr0.008")):
        r = launch(2, config, args.steps, tmp, "--training.seq_len", "64", "--training.local_batch_size", "4",
                   "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "2", probe=True)
        r["lr"], r["gib"] = config.split("_lr")[1], r["mib"]["peak"] / 1024
        rows.append(measure.row(opt, r["lr"], f"{r['loss']:.3f}", f"{r['step_s']:.3f}", f"{r['tps']:,.0f}",
                                f"{r['gib']:.2f}"))
        best[opt] = min(best.get(opt, r), r, key=lambda x: x["loss"])
    a, s = best["torchtitan AdamW"], best["swan_dist SWAN‡"]
    lines = [f"torchtitan {importlib.metadata.version('torchtitan')}'s trainer, W=2 FSDP2, debug llama3, seq 64, "
             f"global batch 8, {args.steps} steps.", "",
             "| optimizer | lr | loss at the last step | s/step | tokens/s per rank | peak RSS per rank (GiB) |",
             "|---|---:|---:|---:|---:|---:|", *rows, "",
             f"At each one's best lr: AdamW (lr {a['lr']}) {a['loss']:.3f}, SWAN‡ (lr {s['lr']}) {s['loss']:.3f}; "
             f"SWAN's step {s['step_s'] / a['step_s']:.2f}x AdamW's, its peak RSS {s['gib'] / a['gib']:.2f}x (where a "
             "ratio is above 1, swan_dist is behind).", "",
             "| optimizer | iteration | optimizer step | step / iteration | whitening | exchange | fallback | "
             "bookkeeping |", "|---|" + "---:|" * 7]
    mem = ["", "| optimizer | RSS before step 1 | peak RSS | params | grads | opt. state | activations | temporaries | "
           "tracked peak | live at step() | step transient | bound |", "|---|" + "---:|" * 11]
    for name, r in (("torchtitan AdamW (fused)", a), ("swan_dist SWAN‡", s)):
        ms, m = r["ms"], r["mib"]
        lines.append(measure.row(name, *(f"{x:.1f}" for x in (ms["iteration"], ms["step"])),
                                 f"{ms['step'] / ms['iteration']:.2f}",
                                 *(f"{ms[k]:.1f}" if r is s else "-" for k in PARTS)))
        mem.append(measure.row(name, f"{m['start']:.0f}", f"{m['peak']:.0f}",
                               *(f"{m[k]:.1f}" for k in (*TRACKED, "live_before_step", "transient")),
                               f"{m['bound']:.1f}" if r is s else "-"))
    return "\n".join(lines + mem) + "\n"


def cuda(args) -> str | None:
    if not torch.cuda.is_available():
        return print("no CUDA device; skipped")
    try:
        import torchtitan.train  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return print(f"torchtitan does not import here ({type(e).__name__}: {e}); skipped")
    tmp, rows = tempfile.mkdtemp(prefix="swan_tt_cuda_"), []
    for name in ("adamw", "distmuon", "swan"):
        try:
            r = launch(1, f"cuda_{name}", args.steps, tmp)
            rows.append(measure.row(name, f"{r['step_s']:.4f}", f"{r['tps']:,.0f}", f"{r['mem']:.2f}"))
        except (SystemExit, subprocess.TimeoutExpired) as e:
            rows.append(f"| {name} | failed: {e} | | |")
    return ("torchtitan's trainer at W=1 on the GPU, llama3 debugmodel (seq 512, batch 8), each optimizer by its one "
            "config entry; s/step: the median interval between step logs; peak GiB: torchtitan's max active.\n\n"
            "| optimizer | s/step | tokens/s | peak GiB |\n|---|---:|---:|---:|\n" + "\n".join(rows) + "\n")


SECTIONS = {"planning": ("torchtitan-planning", "torchtitan: DistMuon's owner planning vs swan_dist's (planning only, "
                         "no device)", planning),
            "cuda": ("torchtitan-cuda", "torchtitan (GPU): AdamW vs DistMuon vs SWAN at W=1", cuda),
            "cpu": ("torchtitan-cpu", "torchtitan (CPU): SWAN vs torchtitan's AdamW in its trainer (W=2)", cpu)}


def main() -> None:
    if os.environ.pop("SWAN_TT_PROBE", "") == "True":
        return probed(sys.argv[1:])
    ap = measure.parser(__doc__, steps=20)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--planning-only", action="store_true", help="only DistMuon's planning vs swan_dist's (no launch)")
    args = ap.parse_args()
    __import__("torchtitan_harness").cpu_device()  # without CUDA, torchtitan's device (picked at import) is the CPU
    key, title, make = SECTIONS["planning" if args.planning_only else "cuda" if args.cuda else "cpu"]
    body = make(args)
    if body:
        measure.publish(key, title, body, write=not args.no_write)


if __name__ == "__main__":
    main()
