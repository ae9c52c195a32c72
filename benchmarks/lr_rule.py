"""Where to start SWAN‡'s learning rates from a tuned AdamW lr η: the reference trainer on the embedded wiki
corpus, short runs of the convergence study (``benchmarks/convergence.py``: same trainer, data, schedule shape
and run machinery), four sweeps, each keeping the lr of lowest final validation loss:

1. AdamW's lr: η;
2. SWAN‡'s global lr with the fallback rule (embeddings, head, norms: AdamW) at that same lr, as the preset
   does (the matrices at lr x alpha);
3. SWAN‡'s global lr with ``fallback_lr = η`` (the fallback tensors at AdamW's tuned lr);
4. ``fallback_lr`` at --fallback-ratios x η, with the global lr of sweep 3.

Written to the ``lr-rule-<device>-<model>`` section of docs/convergence.md (tables, the rule as ratios to η)
with its plot docs/lr_rule_<device>_<model>.png, and as JSON under docs/results/.

    python benchmarks/lr_rule.py --jobs 2                   # tiny (default): about 30 min on 2 CPU cores
    python benchmarks/lr_rule.py --model small --jobs 2 --sweep-tokens 200000
    python benchmarks/lr_rule.py --quick                    # smoke: a few steps per run, temporary files
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("convergence", HERE / "convergence.py")
conv = sys.modules["convergence"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conv)
_report = conv._report

TIED = "swan_ddagger"
AT_ETA = "ddagger_fallback_eta"


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--fallback-ratios", type=conv._floats, default=[0.25, 0.5, 1.0, 2.0, 4.0],
                    help="fallback_lr values of sweep 4, as multiples of AdamW's best lr")
    ours, rest = ap.parse_known_args(argv)
    args = conv.parse(rest)
    args.fallback_ratios = ours.fallback_ratios
    return args


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with conv.Study(args, work) as study:
        print("lr sweep AdamW:", flush=True)
        adamw = conv.sweep(study, "adamw", [conv.sweep_run(study, "adamw", lr) for lr in conv.grid(args, "adamw")])
        eta = adamw["best"]
        conv.BY_KEY[AT_ETA] = conv.Arm(AT_ETA, f"SWAN‡, fallback_lr = η ({eta:g})", "swan", "swan_ddagger",
                                       {"fallback_lr": eta})
        swan_grid = conv.grid(args, TIED)
        print("lr sweep SWAN‡ (fallback at the global lr):", flush=True)
        tied = conv.sweep(study, TIED, [conv.sweep_run(study, TIED, lr) for lr in swan_grid])
        print(f"lr sweep SWAN‡ (fallback_lr = {eta:g}):", flush=True)
        at_eta = conv.sweep(study, AT_ETA, [conv.sweep_run(study, AT_ETA, lr) for lr in swan_grid])
        lr = at_eta["best"]
        print(f"fallback_lr sweep at lr {lr:g}:", flush=True)
        pending = []
        for r in args.fallback_ratios:
            arm = conv.Arm(f"ddagger_fallback_x{r:g}", f"SWAN‡, fallback_lr = {r:g} η", "swan", "swan_ddagger",
                           {"fallback_lr": r * eta})
            pending.append((r, study.submit(arm, lr, args.sweep_tokens, args.seeds[0],
                                            f"fallback/lr{lr:g}/x{r:g}")))  # fmt: skip
        fallback = {r: conv._finite(study.result(p)["final_val_loss"]) for r, p in pending}
        runs = study.runs
    best_ratio = min(fallback, key=fallback.get)
    return {"adamw": adamw, "tied": tied, "at_eta": at_eta, "fallback": fallback, "eta": eta,
            "best_fallback_ratio": best_ratio, "runs": runs}


def _row(sweep: dict[str, Any]) -> str:
    return " · ".join(f"**{lr:g}: {v:.3f}**" if lr == sweep["best"] else f"{lr:g}: {v:.3f}"
                      for lr, v in sweep["results"].items())


def report(args: argparse.Namespace, res: dict[str, Any], png: Path, command: str) -> str:
    eta, tied, at_eta, fb = res["eta"], res["tied"], res["at_eta"], res["fallback"]
    edge = lambda s: " (on the grid's edge)" if s["edge"] else ""  # noqa: E731
    best_fb = res["best_fallback_ratio"]
    return "\n".join([
        f"Reference LLaMA `{args.model}`{args.model_overrides or ''}, embedded wiki corpus, {args.batch}x{args.seq} "
        f"tokens per step, {args.sweep_tokens:,} training tokens per run, seed {args.seeds[0]}; the convergence "
        "study's schedule (10 % linear warm-up, cosine decay to 0.1 x lr), grad clip 1.0, no weight decay, fp32, one "
        f"process per run ({args.jobs} at a time, {args.threads} torch thread each). Final validation loss per lr; "
        "the best in bold. SWAN‡'s global lr drives the fallback rule (AdamW on embeddings, output head, norms) "
        "unless `fallback_lr` is given; its whitened matrices move at lr x alpha (0.05).",
        "", "```", command, "```", "",
        "| sweep | final val loss per lr | best |",
        "|---|---|---:|",
        f"| 1. AdamW | {_row(res['adamw'])} | η = {eta:g}{edge(res['adamw'])} |",
        f"| 2. SWAN‡, fallback at the global lr | {_row(tied)} | {tied['best']:g} = {tied['best'] / eta:.3g} η"
        f"{edge(tied)} |",
        f"| 3. SWAN‡, fallback_lr = η | {_row(at_eta)} | {at_eta['best']:g} = {at_eta['best'] / eta:.3g} η"
        f"{edge(at_eta)} |",
        f"| 4. fallback_lr at lr {at_eta['best']:g} | "
        + " · ".join(f"**{r:g} η: {v:.3f}**" if r == best_fb else f"{r:g} η: {v:.3f}" for r, v in fb.items())
        + f" | {best_fb:g} η{' (on the grid' + chr(39) + 's edge)' if best_fb in (min(fb), max(fb)) else ''} |",
        "",
        _rule(args.model, res),
        "", f"![final validation loss against lr]({png.name})",
    ])


def _rule(model: str, res: dict[str, Any]) -> str:
    """The starting point the sweeps support: the lowest loss of the tied sweep and of the fallback_lr sweep."""
    eta, tied, at_eta, fb = res["eta"], res["tied"], res["at_eta"], res["fallback"]
    best_fb = res["best_fallback_ratio"]
    tied_loss, fb_loss = tied["results"][tied["best"]], fb[best_fb]
    ranked = " · ".join(f"{r:g} η: {v:.3f}" for r, v in fb.items())
    if tied_loss <= fb_loss:
        head = (f"start SWAN‡ at `lr` = {tied['best'] / eta:.3g} η with the fallback at that same lr, as the preset "
                f"does (final val loss {tied_loss:.3f}); a separate `fallback_lr` did no better")
    else:
        head = (f"start SWAN‡ at `lr` = {at_eta['best'] / eta:.3g} η with `fallback_lr` = {best_fb:g} η (final val "
                f"loss {fb_loss:.3f}; tied at {tied['best'] / eta:.3g} η: {tied_loss:.3f})")
    return (f"**The rule this run gives** (`{model}`): from AdamW's tuned lr η, {head}. The fallback rule (AdamW on "
            f"embeddings, head and norms) wants more than η here: at `lr` = {at_eta['best'] / eta:.3g} η, "
            f"`fallback_lr` {ranked}; AdamW alone {res['adamw']['results'][eta]:.3f}.")


def plot(png: Path, res: dict[str, Any]) -> None:
    eta = res["eta"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, label in (("adamw", "AdamW"), ("tied", "SWAN‡, fallback at lr"), ("at_eta", "SWAN‡, fallback_lr = η")):
        s = res[key]
        a.plot([lr / eta for lr in s["results"]], list(s["results"].values()), "o-", label=label)
    a.set(xscale="log", xlabel="lr / η (η: AdamW's best lr)", ylabel="final validation loss", title="lr sweeps")
    a.legend()
    b.plot(list(res["fallback"]), list(res["fallback"].values()), "o-", color="C2")
    b.set(xscale="log", xlabel="fallback_lr / η", title=f"fallback_lr at lr {res['at_eta']['best']:g}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    conv._set_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="swan_lr_rule_")) if args.quick else None
    work = Path(args.work_dir) if args.work_dir else (tmp / "runs" if tmp else conv.REPO / "runs" / f"lr-rule-{args.model}")
    out = Path(args.out) if args.out else (tmp / "convergence.md" if tmp else conv.REPO / "docs" / "convergence.md")
    png = out.parent / f"lr_rule_{device}_{args.model}.png"
    res = run(args, work)
    plot(png, res)
    command = "python benchmarks/lr_rule.py" + ("" if not argv else " " + " ".join(argv))
    body = report(args, res, png, command)
    print(body)
    saved = _report.DOC
    try:
        _report.DOC = out
        _report.write_section(f"lr-rule-{device}-{args.model}",
                              f"Starting lrs from AdamW's ({'GPU' if device == 'cuda' else 'CPU'}, {args.model})", body)
    finally:
        _report.DOC = saved
    (work / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return {**res, "out": str(out), "png": str(png)}


if __name__ == "__main__":
    main()
