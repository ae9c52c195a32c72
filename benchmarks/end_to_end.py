"""Whole training iterations, SWAN‡ vs AdamW, side by side: the reference trainer under torchrun with FSDP2 (torch
AdamW, foreach) and DeepSpeed ZeRO-2 (its AdamW), steady tokens/s and the optimizer's share (``end-to-end-cpu``).

    python benchmarks/end_to_end.py              # small, W=2, 16x256 tokens per rank (--size tiny --steps 6: quick)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from measure import parser, publish  # (benchmarks/ is the script's folder)

REPO = Path(__file__).resolve().parent.parent
LAYOUTS, OPTIMIZERS = ("fsdp2", "deepspeed"), ("adamw", "swan")
ZERO2 = {"zero_optimization": {"stage": 2}, "steps_per_print": 10**9}  # no optimizer block: the trainer's fills it


def run_once(layout: str, optimizer: str, a, out: Path) -> dict:
    """One trainer run: steady tokens/s (steps past the warm-up) and its summary."""
    sets = [f"model.size={a.size}", f"optimizer={optimizer}", f"parallel={layout}", f"steps={a.warmup + a.steps}",
            f"batch_size={a.batch}", f"seq_len={a.seq}", "log_every=1", f"eval_every={10**6}", "eval_batches=1",
            "save_model=false", "checkpoint_every=0", "resume=never", "grad_clip=1.0", f"out_dir={out}",
            "time_optimizer=true", "swan_mode=owner"]
    if layout == "deepspeed":
        out.parent.mkdir(parents=True, exist_ok=True)
        (out.parent / "zero2.json").write_text(json.dumps(ZERO2))
        sets.append(f"deepspeed_config={out.parent / 'zero2.json'}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.world),
           "-m", "swan_dist.reference.train", "--config", str(REPO / "configs" / "train" / "main.yaml"), "--set", *sets]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout}/{optimizer} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [(r["tokens"] - p["tokens"], r["tok_per_s"]) for p, r in zip(rows, rows[1:])
              if r.get("tok_per_s") and r["step"] > a.warmup]
    tok_per_s = sum(n for n, _ in steady) / sum(n / rate for n, rate in steady)
    return {**json.loads((out / "summary.json").read_text()), "tok_per_s": tok_per_s}


def main() -> None:
    a = parser(__doc__, size="small", world=2, batch=16, seq=256, steps=8, warmup=2, rounds=2).parse_args()
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            for r in range(a.rounds):  # alternating: drift on a shared machine hits both alike
                for opt in OPTIMIZERS if r % 2 == 0 else OPTIMIZERS[::-1]:
                    res = run_once(layout, opt, a, Path(tmp) / f"r{r}" / f"{layout}_{opt}")
                    results.setdefault((layout, opt), []).append(res)
                    print(f"{layout} {opt} round {r}: {res['tok_per_s']:,.0f} tok/s, optimizer "
                          f"{100 * res['optimizer_share']:.0f} %", flush=True)
    where = "CUDA" if torch.cuda.is_available() else "CPU"
    lines = [f"Reference model `{a.size}`, W={a.world} under torchrun, {where}"
             f"{'' if where == 'CUDA' else f' ({os.cpu_count()} cores)'}, torch {torch.__version__}; {a.batch}x{a.seq} "
             f"tokens per rank and step, {a.warmup} warm-up + {a.steps} timed steps, {a.rounds} runs per optimizer.",
             "",
             "| layout | optimizer | tokens/s | SWAN / AdamW (target ≥ 0.90x) | optimizer share | final train loss |",
             "|---|---|---:|---:|---:|---:|"]
    for layout in LAYOUTS:
        base = statistics.median(r["tok_per_s"] for r in results[(layout, "adamw")])
        for opt in OPTIMIZERS:
            rs = results[(layout, opt)]
            tps, share = (statistics.median(r[k] for r in rs) for k in ("tok_per_s", "optimizer_share"))
            ratio = f"**{tps / base:.2f}x**" if opt == "swan" else "1.00x"
            lines.append(f"| {layout} | {'SWAN‡' if opt == 'swan' else 'AdamW'} | {tps:,.0f} | {ratio} | "
                         f"{100 * share:.0f} % | {rs[-1]['final_train_loss']:.3f} |")
    publish(f"end-to-end-{where.lower()}", f"End to end ({where}): trainer tokens/s, SWAN‡ vs AdamW (W={a.world})",
            "\n".join(lines), write=not a.no_write)


if __name__ == "__main__":
    main()
