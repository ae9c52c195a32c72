"""GradNorm variants, measured side by side in one run: SWAN‡ on the reference model with the paper's
RMS GradNorm (eq. 1), the mean-centred variant, and none (whitening only), same data, seed and steps.
Prints and writes the final validation losses to docs/benchmarks.md.

    python benchmarks/gradnorm_ablation.py --steps 250
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from swan_dist.reference.train import main as train_main

from measure import write_section  # noqa: E402 (benchmarks/ is the script's folder)

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "train" / "swan_ddagger_tiny.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--variants", nargs="+", default=["rms", "mean", "none"])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for variant in args.variants:
            summary = train_main([
                "--config", str(CONFIG), "--set", f"steps={args.steps}", f"out_dir={d}/{variant}",
                f"swan_options.grad_norm={variant}", "save_model=false",
            ])
            rows.append((variant, summary["initial_val_loss"], summary["final_val_loss"], summary["time_s"]))
    lines = [
        f"SWAN‡ on `{CONFIG.name}` (tiny model, wiki, {args.steps} steps, single process, torch {torch.__version__}); "
        "validation loss in nats/token, lower is better.",
        "",
        "| GradNorm | initial val loss | final val loss | time (s) |",
        "|---|---:|---:|---:|",
    ] + [f"| {v} | {a:.3f} | {b:.3f} | {t:.0f} |" for v, a, b, t in rows]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("gradnorm-ablation", "GradNorm (CPU): RMS vs mean-centred vs none", text)


if __name__ == "__main__":
    main()
