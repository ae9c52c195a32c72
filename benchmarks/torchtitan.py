"""swan_dist in torchtitan's trainer, side by side with torchtitan's own optimizers.

CPU (default): torchtitan's unmodified trainer (``torchtitan.train.main`` through tests/torchtitan_harness.py,
the debug llama3 model, W=2 FSDP2, float32) with AdamW and with SWAN at each lr of a small sweep, all jobs of one
launch (the same load on each): loss after N steps, step time and tokens/s (torchtitan's own log), peak resident
memory per rank. ``--planning-only``: DistMuon's planning against swan_dist's on the same matrix shapes and FSDP
layout: DistMuon cannot run without CUDA, but its owner balancer (``_balance_loads_across_partitions`` with its cost model
``_estimate_muon_compute_cost``) is pure Python; both assignments are scored on both cost models, with the bytes
each rank sends per step (row shards to the owner and updates back).

    python benchmarks/torchtitan.py                 # CPU, writes the `torchtitan-cpu` section
    python benchmarks/torchtitan.py --planning-only # DistMuon's planning vs swan_dist's only (`torchtitan-planning`)
    python benchmarks/torchtitan.py --cuda          # one GPU: AdamW vs DistMuon vs SWAN step time and peak memory

``--cuda`` (benchmarks/gpu_suite.sh step ``torchtitan_cuda``) runs ``torchtitan.train`` at W=1 on the GPU with
the debug llama3 model (bf16 FSDP parameters off at W=1), each optimizer selected by its one config entry, and
reads step time from torchtitan's log and ``torch.cuda.max_memory_allocated`` from its memory monitor; it exits 0
with a message where torchtitan does not import.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
# this file is named like the package it measures: keep its folder off the import path (``import torchtitan``
# must find torchtitan), the harness's folder on it
sys.path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != HERE] + [TESTS]


def _measure():
    import importlib.util
    spec = importlib.util.spec_from_file_location("measure", os.path.join(HERE, "measure.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

LOG = re.compile(r"step:\s+(\d+)\s+\S*\s*loss:\s+([-0-9.]+).*?memory:\s+([0-9.]+)GiB.*?tps:\s+([0-9,]+)")
TIME = re.compile(r"^\[titan\] (\d+-\d+-\d+ \d+:\d+:\d+,\d+)")


def _strip(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def parse_jobs(out: str) -> list[dict]:
    """Per job (in launch order): losses, peak memory (GiB), tokens/s and seconds per step after the first."""
    import datetime
    jobs: list[dict] = []
    for line in _strip(out).splitlines():
        if "Training starts at step" in line:
            jobs.append({"loss": [], "mem": [], "tps": [], "t": []})
        m = LOG.search(line)
        if m and jobs:
            j = jobs[-1]
            j["loss"].append(float(m.group(2)))
            j["mem"].append(float(m.group(3)))
            j["tps"].append(float(m.group(4).replace(",", "")))
            t = TIME.search(line)
            if t:
                j["t"].append(datetime.datetime.strptime(t.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    for j in jobs:
        dt = [b - a for a, b in zip(j["t"], j["t"][1:])]
        j["step_s"] = sorted(dt)[len(dt) // 2] if dt else float("nan")
    return jobs


def launch(nproc: int, jobs: list[list[str]], assets: str, harness: bool = True, timeout: int = 1200) -> str:
    args: list[str] = []
    for job in jobs:
        args += (["---"] if args else []) + job
    entry = [os.path.join(TESTS, "torchtitan_harness.py")] if harness else ["-m", "torchtitan.train"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--local-ranks-filter", "0", *entry, *args]
    env = {**os.environ, "SWAN_TT_ASSETS": assets, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        sys.stderr.write(out[-5000:])
        raise SystemExit(f"torchtitan launch failed ({p.returncode})")
    return out


# ---------------------------------------------------------------- planning: DistMuon's balancer vs swan_dist's planner


def matrix_shapes(flavor: str) -> list[tuple[str, tuple[int, int]]]:
    """The 2-D weights SWAN whitens in torchtitan's llama3 ``flavor`` (built on the meta device)."""
    import torch
    from torchtitan.models.llama3 import model_registry
    from swan_dist.selection import classify
    with torch.device("meta"):
        model = model_registry(flavor).model.build()
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()
            if p.ndim == 2 and classify(n, p).use_swan]


def planning_rows(flavor: str, world: int) -> dict:
    from torchtitan.distributed.flex_shard.dist_muon import (
        _balance_loads_across_partitions, _estimate_muon_compute_cost)
    from swan_dist.functional import WhitenConfig
    from swan_dist.plan import MatrixSpec, row_shard_ranges
    from swan_dist.whitening import swan_cost, swan_plan

    shapes = matrix_shapes(flavor)
    specs = [MatrixSpec(n, s, WhitenConfig()) for n, s in shapes]
    ranges = row_shard_ranges(specs, world)
    ranges = [ranges[r] for r in range(world)]
    plan = swan_plan(specs, ranges, bucket_bytes=1 << 62)  # one bucket, as DistMuon balances one bucket here
    swan_owner = [b.owners[m] for m in range(len(specs)) for b in plan.buckets if m in b.owners]
    muon_cost = [_estimate_muon_compute_cost(s, 5) for _, s in shapes]
    loads = tuple((c, s[0] * s[1] * 4, n) for c, (n, s) in zip(muon_cost, shapes))
    muon_owner, _ = _balance_loads_across_partitions(loads, initial_cumulative_primary_loads=(0,) * world)
    sw_cost = [swan_cost(spec) for spec in specs]

    def imbalance(owner, cost):
        per = [0.0] * world
        for o, c in zip(owner, cost):
            per[o] += c
        return max(per) / (sum(per) / world)

    def sent_bytes(owner):  # per rank, fp32: its row shard of each matrix it does not own, both ways
        per = [0] * world
        for m, o in enumerate(owner):
            for r in range(world):
                lo, hi = ranges[r][m]
                if r != o:
                    per[r] += 2 * (hi - lo) * 4
        return max(per)
    return {"model": f"llama3 {flavor}", "W": world, "matrices": len(shapes),
            "muon": (imbalance(muon_owner, muon_cost), imbalance(muon_owner, sw_cost), sent_bytes(muon_owner)),
            "swan": (imbalance(swan_owner, muon_cost), imbalance(swan_owner, sw_cost), sent_bytes(swan_owner))}


# ---------------------------------------------------------------- CPU and CUDA runs


def cpu(args) -> str:
    import torchtitan_harness
    tmp = tempfile.mkdtemp(prefix="swan_tt_bench_")
    assets = os.path.join(tmp, "assets")
    torchtitan_harness.make_assets(assets, seq_len=args.seq)
    common = ["--module", "torchtitan_configs", "--training.steps", str(args.steps), "--training.seq_len",
              str(args.seq), "--training.local_batch_size", "4", "--training.global_batch_size", "8",
              "--lr_scheduler.warmup_steps", "2"]
    jobs, names = [], []
    for lr in args.adamw_lrs:
        jobs.append(["--config", f"llama3_adamw_lr{lr:g}", "--dump_folder", os.path.join(tmp, f"a{lr}"), *common])
        names.append(("torchtitan AdamW", lr))
    for lr in args.swan_lrs:
        jobs.append(["--config", f"llama3_swan_lr{lr:g}", "--dump_folder", os.path.join(tmp, f"s{lr}"), *common])
        names.append(("swan_dist SWAN‡", lr))
    out = launch(2, jobs, assets)
    res = parse_jobs(out)
    assert len(res) == len(jobs), (len(res), out[-3000:])
    rows = []
    best: dict[str, tuple] = {}
    for (opt, lr), r in zip(names, res):
        rows.append(f"| {opt} | {lr:g} | {r['loss'][-1]:.3f} | {r['step_s']:.3f} | {sorted(r['tps'])[len(r['tps']) // 2]:,.0f} "
                    f"| {max(r['mem']):.2f} |")
        if opt not in best or r["loss"][-1] < best[opt][1]["loss"][-1]:
            best[opt] = (lr, r)
    body = (f"torchtitan {args.version}, torchtitan's trainer at W=2 (FSDP2, gloo, float32 parameters), debug llama3 "
            f"(6 layers, dim 256, vocab 2048), seq {args.seq}, global batch 8, {args.steps} steps, warmup 2, "
            "linear decay, clipping at 1.0; the harness's tiny word-level data (two alternating documents, so "
            "losses fall fast). Step time: the median interval between torchtitan's step logs (rank 0); tokens/s "
            "its `tps` (per rank, median); memory: peak resident set per rank (`ru_maxrss`, whole process).\n\n"
            "| optimizer | lr | loss at the last step | s/step | tokens/s per rank | peak RSS per rank (GiB) |\n"
            "|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n")
    (la, ra), (ls, rs) = best["torchtitan AdamW"], best["swan_dist SWAN‡"]
    body += (f"At each one's best lr: AdamW (lr {la:g}) {ra['loss'][-1]:.3f}, SWAN‡ (lr {ls:g}) {rs['loss'][-1]:.3f}; "
             f"SWAN's step {rs['step_s'] / ra['step_s']:.2f}x AdamW's, its peak RSS {max(rs['mem']) / max(ra['mem']):.2f}x"
             f" (where a ratio is above 1, swan_dist is behind).\n\n")
    return body  # the planning comparison is its own section (--planning-only), not repeated here


def planning() -> str:
    plan = [planning_rows(f, w) for f in ("debugmodel", "8B") for w in (2, 8, 64)]
    body = ("DistMuon's owner assignment (its greedy LPT balancer `_balance_loads_across_partitions` on its cost "
             "model `_estimate_muon_compute_cost`, NS 5 steps, one bucket) against swan_dist's planner (`swan_plan`, "
             "one bucket) for the same whitened matrices of torchtitan's llama3 (fused wqkv one matrix in both), "
             "FSDP row shards over W ranks. Imbalance: slowest owner's cost / mean, on each cost model; bytes: "
             "the most any rank sends per step (its row shard of every matrix it does not own, to the owner and "
             "back, fp32). Planning only: DistMuon cannot run without CUDA.\n\n"
             "| model | W | matrices | DistMuon: imbalance (its cost) | (SWAN cost) | MiB sent | "
             "swan_dist: imbalance (DistMuon cost) | (SWAN cost) | MiB sent |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    for p in plan:
        m, s = p["muon"], p["swan"]
        body += (f"| {p['model']} | {p['W']} | {p['matrices']} | {m[0]:.3f} | {m[1]:.3f} | {m[2] / 2**20:,.1f} | "
                 f"{s[0]:.3f} | {s[1]:.3f} | {s[2] / 2**20:,.1f} |\n")
    same = all(p["muon"] == p["swan"] for p in plan)
    body += ("\n" + ("At every layout here the two planners reach the same balance and bytes (both assign whole "
                      "matrices largest first): swan_dist is neither behind nor ahead on planning. "
                      if same else "The planners differ where the rows differ (above). ")
             + "Where W exceeds the matrices (debugmodel at W=64: 30 matrices) most ranks own none. Not compared "
             "here, since DistMuon needs CUDA: its bf16 Newton-Schulz and bucketed all-to-all timings on a GPU "
             "(`--cuda`, benchmarks/gpu_suite.sh).\n")
    return body


def cuda(args) -> str | None:
    try:
        import torch
        import torchtitan  # noqa: F401
        import torchtitan.train  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"torchtitan does not import here ({type(e).__name__}: {e}); skipped")
        return None
    if not torch.cuda.is_available():
        print("no CUDA device; skipped")
        return None
    tmp = tempfile.mkdtemp(prefix="swan_tt_cuda_")
    module = os.path.join(tmp, "swan_tt_cuda_jobs.py")
    with open(module, "w") as f:
        f.write(CUDA_JOBS)
    os.environ["PYTHONPATH"] = tmp + os.pathsep + os.environ.get("PYTHONPATH", "")
    rows = []
    for name in ("adamw", "distmuon", "swan"):
        job = ["--module", "swan_tt_cuda_jobs", "--config", name, "--dump_folder", os.path.join(tmp, name),
               "--training.steps", str(args.steps)]
        try:
            out = launch(1, [job], os.path.join(tmp, "assets"), timeout=300)
        except (SystemExit, subprocess.TimeoutExpired) as e:
            rows.append(f"| {name} | failed: {e} | | |")
            continue
        r = parse_jobs(out)[-1]
        rows.append(f"| {name} | {r['step_s']:.4f} | {sorted(r['tps'])[len(r['tps']) // 2]:,.0f} | {max(r['mem']):.2f} |")
    return ("torchtitan's trainer at W=1 on the GPU, llama3 debugmodel (seq 512, batch 8; the harness's tokenizer "
            "and data), "
            "bf16 autocast off at W=1 (FSDP not applied), each optimizer by its one config entry; step time: median "
            "interval between step logs; memory: torchtitan's max active (`torch.cuda` peak).\n\n"
            "| optimizer | s/step | tokens/s | peak GiB |\n|---|---:|---:|---:|\n" + "\n".join(rows) + "\n")


CUDA_JOBS = '''
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from swan_dist.integrations.torchtitan import SwanOptimizersContainer


def _base():
    import os
    c = llama3_debugmodel()
    c.hf_assets_path = os.environ["SWAN_TT_ASSETS"]
    c.dataloader.dataset_path = os.path.join(os.environ["SWAN_TT_ASSETS"], "data")
    c.validator = None
    c.checkpoint.enable = False
    c.activation_checkpoint = None
    c.training.seq_len = 512
    return c


def adamw():
    return _base()


def distmuon():
    c = _base()
    c.optimizer = OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"layers\\..*\\.weight$", optimizer_name="DistMuon", optimizer_kwargs={"lr": 0.02}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 8e-4})])
    return c


def swan():
    c = _base()
    c.optimizer = SwanOptimizersContainer.Config(lr=2e-3)
    return c
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--adamw-lrs", type=float, nargs="+", default=[8e-4, 3e-3])
    ap.add_argument("--swan-lrs", type=float, nargs="+", default=[2e-3, 8e-3])
    ap.add_argument("--planning-only", action="store_true", help="only DistMuon's planning vs swan_dist's (no launch)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from importlib.metadata import version
    args.version = version("torchtitan")
    write_section = _measure().write_section
    if args.planning_only:
        sys.path.insert(0, TESTS)
        import torchtitan_harness
        torchtitan_harness.cpu_device()
        body = planning()
        if not args.no_write:
            write_section("torchtitan-planning", "torchtitan: DistMuon's owner planning vs swan_dist's (planning only, "
                          "no device)", body)
    elif args.cuda:
        body = cuda(args)
        if body and not args.no_write:
            write_section("torchtitan-cuda", "torchtitan (GPU): AdamW vs DistMuon vs SWAN at W=1", body)
    else:
        body = cpu(args)
        if not args.no_write:
            write_section("torchtitan-cpu", "torchtitan (CPU): SWAN vs torchtitan's AdamW in its trainer (W=2)", body)
    if body:
        print(body)


if __name__ == "__main__":
    main()
