"""Whole training iterations, SWAN‡ vs AdamW, measured side by side in one run: the reference trainer
(``swan_dist.reference.train``) under ``torchrun`` at W processes on the embedded wiki corpus, with
FSDP2 (torch AdamW, foreach) and DeepSpeed ZeRO-2 (DeepSpeed's AdamW), each optimizer on the same
model, data, batch and steps. Reported: steady tokens/s (the first ``--warmup`` steps dropped,
evaluation excluded), SWAN/AdamW, and the optimizer step's share of the training time (the trainer's
``optimizer_s``: ``optimizer.step()``, or DeepSpeed's ``engine.step()``). Rounds alternate the
optimizers so that drift on a shared machine hits both alike. Writes a section of docs/benchmarks.md.

    python benchmarks/end_to_end.py                                   # small, W=2, 16x256 tokens per rank
    python benchmarks/end_to_end.py --size tiny --steps 6 --no-write  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from measure import write_section  # noqa: E402 (benchmarks/ is the script's folder)

REPO = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("adamw", "swan")


def run_once(layout: str, optimizer: str, args, work: Path) -> dict:
    out = work / f"{layout}_{optimizer}"
    sets = [f"model.size={args.size}", f"optimizer={optimizer}", f"parallel={layout}", f"steps={args.warmup + args.steps}",
            f"batch_size={args.batch}", f"seq_len={args.seq}", "log_every=1", f"eval_every={10**6}", "eval_batches=1",
            "save_model=false", "checkpoint_every=0", "resume=never", "grad_clip=1.0", f"out_dir={out}",
            "time_optimizer=true", "swan_mode=owner"]  # fmt: skip
    if layout == "deepspeed":  # a JSON without an optimizer block: the trainer's optimizer key fills it
        ds = work / "zero2.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "steps_per_print": 10**9}))
        sets.append(f"deepspeed_config={ds}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.world),
           "-m", "swan_dist.reference.train", "--config", str(REPO / "configs" / "train" / "main.yaml"), "--set", *sets]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout}/{optimizer} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if r.get("tok_per_s") and r["step"] > args.warmup]
    tokens = sum(r["tokens"] - p["tokens"] for p, r in zip(rows, rows[1:]) if r in steady)
    seconds = sum((r["tokens"] - p["tokens"]) / r["tok_per_s"] for p, r in zip(rows, rows[1:]) if r in steady)
    return {"tok_per_s": tokens / seconds, "optimizer_share": summary["optimizer_share"],
            "optimizer_s": summary["optimizer_s"], "n_params": summary["n_params"],
            "final_train_loss": summary["final_train_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps per run not timed")
    ap.add_argument("--rounds", type=int, default=2, help="runs per optimizer, alternating")
    ap.add_argument("--layouts", default="fsdp2,deepspeed")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            for r in range(args.rounds):
                for opt in OPTIMIZERS if r % 2 == 0 else OPTIMIZERS[::-1]:
                    res = run_once(layout, opt, args, Path(tmp) / f"r{r}")
                    results.setdefault((layout, opt), []).append(res)
                    print(f"{layout} {opt} round {r}: {res['tok_per_s']:,.0f} tok/s, optimizer "
                          f"{100 * res['optimizer_share']:.0f} %", flush=True)

    device = "CUDA" if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    lines = [
        f"Reference model `{args.size}`, W={args.world} under torchrun, {device}, torch {torch.__version__}; "
        f"{args.batch}x{args.seq} tokens per rank and step, fp32; per run {args.warmup} warm-up + {args.steps} timed "
        f"steps, {args.rounds} runs per optimizer alternating (median shown), each under the trainer's lr schedule "
        "(linear warm-up, then cosine decay: a new lr every step). FSDP2: torch AdamW (foreach) vs SWAN‡ "
        "owner mode; DeepSpeed ZeRO-2: DeepSpeed's AdamW vs `\"type\": \"SWAN\"`. Optimizer share: time in "
        "`optimizer.step()` (DeepSpeed: `engine.step()`, which also finishes the gradient reduction) over the "
        "training time.",
        "",
        "| layout | optimizer | tokens/s | SWAN / AdamW (target ≥ 0.90x) | optimizer share | final train loss |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for layout in layouts:
        base = statistics.median(r["tok_per_s"] for r in results[(layout, "adamw")])
        for opt in OPTIMIZERS:
            rs = results[(layout, opt)]
            tps = statistics.median(r["tok_per_s"] for r in rs)
            share = statistics.median(r["optimizer_share"] for r in rs)
            ratio = f"**{tps / base:.2f}x**" if opt == "swan" else "1.00x"
            lines.append(f"| {layout} | {'SWAN‡' if opt == 'swan' else 'AdamW'} | {tps:,.0f} | {ratio} | "
                         f"{100 * share:.0f} % | {rs[-1]['final_train_loss']:.3f} |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        key = "end-to-end-" + ("cuda" if torch.cuda.is_available() else "cpu")
        where = "CUDA" if torch.cuda.is_available() else "CPU"
        write_section(key, f"End to end ({where}): trainer tokens/s, SWAN‡ vs AdamW (W={args.world})", body)


if __name__ == "__main__":
    main()
