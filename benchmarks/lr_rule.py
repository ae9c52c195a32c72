"""Where to start SWAN‡'s learning rates from a tuned AdamW lr η: the reference trainer on the embedded wiki
corpus, short runs of the convergence study (``benchmarks/convergence.py``: same trainer, data, schedule shape
and run machinery), four sweeps, each keeping the lr of lowest final validation loss:

1. AdamW's lr: η;
2. SWAN‡'s global lr with the fallback rule (embeddings, head, norms: AdamW) at that same lr, as the preset
   does (the matrices at lr x alpha);
3. SWAN‡'s global lr with ``fallback_lr = η`` (the fallback tensors at AdamW's tuned lr);
4. ``fallback_lr`` at --fallback-ratios x η, with the global lr of sweep 3.

``--seeds 0,1`` runs every point with each seed (a sweep's value: the seeds' mean); ``--swan-ratios 2,4,8`` puts
SWAN‡'s grid at multiples of η; ``--tied-only`` runs sweeps 1 and 2 alone. With validation every
``--eval-every-tokens`` (below ``--sweep-tokens``) the section also gives the tokens at which each point's seed-mean
curve reaches AdamW's best final loss. ``--weight-decay λ`` adds AdamW at η with λ and SWAN‡ at 4 η (the
convention, fallback tied) with ``--wd-ratios`` x λ; ``--name`` names the section (default: the model).

Written to the ``lr-rule-<device>-<model>`` section of docs/convergence.md (tables, the rule as ratios to η)
with its plot docs/lr_rule_<device>_<model>.png, and as JSON under docs/results/.

    python benchmarks/lr_rule.py --jobs 2                   # tiny (default): about 30 min on 2 CPU cores
    python benchmarks/lr_rule.py --model small --jobs 2 --sweep-tokens 200000
    python benchmarks/lr_rule.py --model 60m --jobs 2 --seeds 0,1 --tied-only --swan-ratios 2,4,8 ...
    python benchmarks/lr_rule.py --quick                    # smoke: a few steps per run, temporary files
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
measure = conv.measure

TIED = "swan_ddagger"
AT_ETA = "ddagger_fallback_eta"


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--fallback-ratios", type=conv._floats, default=[0.25, 0.5, 1.0, 2.0, 4.0],
                    help="fallback_lr values of sweep 4, as multiples of AdamW's best lr")
    ap.add_argument("--seeds", type=conv._ints, default=[0], help="every run with each of these seeds (comma-"
                    "separated); a sweep's value per lr is the seeds' mean final validation loss")
    ap.add_argument("--swan-ratios", type=conv._floats, default=None, help="SWAN‡'s lr grid as multiples of AdamW's "
                    "best lr η (default: --swan-lrs or the preset's grid)")
    ap.add_argument("--tied-only", action="store_true", help="sweeps 1 and 2 only (no fallback_lr sweeps)")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="λ > 0: also run AdamW at η with weight decay λ "
                    "and SWAN‡ at the convention (lr 4 η, fallback tied) with weight decay r λ, r in --wd-ratios")
    ap.add_argument("--wd-ratios", type=conv._floats, default=[1.0, 5.0])
    ap.add_argument("--name", default=None, help="section, JSON and plot name (default: --model)")
    ours, rest = ap.parse_known_args(argv)
    args = conv.parse(rest)
    for key, value in vars(ours).items():
        setattr(args, key, value)
    args.name = args.name or args.model
    return args


def _submit(study: conv.Study, arm: conv.Arm, lr: float, tag: str) -> list[conv.Pending]:
    """One run per seed (tag/seed<s> with more than one seed), validation every --eval-every-tokens."""
    a = study.args
    return [study.submit(arm, lr, a.sweep_tokens, s, f"{tag}/seed{s}" if len(a.seeds) > 1 else tag,
                         min(a.eval_every_tokens, a.sweep_tokens)) for s in a.seeds]  # fmt: skip


def _point(study: conv.Study, pending: list[conv.Pending]) -> dict[str, Any]:
    runs = [study.result(p) for p in pending]
    finals = [conv._finite(r["final_val_loss"]) for r in runs]
    return {"final": sum(finals) / len(finals), "min": min(finals), "max": max(finals),
            "curve": conv.mean_curve(runs)}


def sweep(study: conv.Study, key: str, lrs: list[float]) -> dict[str, Any]:
    """Seed-mean final val loss per lr (grid submitted at once; a best lr on the edge extends the grid one 1-2-5
    step, at most --sweep-extend times); the best lr."""
    arm = conv.BY_KEY[key]
    pending = {lr: _submit(study, arm, lr, f"sweep/{key}/lr{lr:g}") for lr in sorted(lrs)}
    points = {lr: _point(study, p) for lr, p in pending.items()}
    for _ in range(study.args.sweep_extend):
        best = min(points, key=lambda lr: points[lr]["final"])
        if best not in (min(points), max(points)):
            break
        lr = conv._series_step(best, up=best == max(points))
        points[lr] = _point(study, _submit(study, arm, lr, f"sweep/{key}/lr{lr:g}"))
    points = dict(sorted(points.items()))
    best = min(points, key=lambda lr: points[lr]["final"])
    return {"arm": key, "results": {lr: p["final"] for lr, p in points.items()}, "best": best,
            "edge": len(points) > 1 and best in (min(points), max(points)), "points": points}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with conv.Study(args, work) as study:
        print("lr sweep AdamW:", flush=True)
        adamw = sweep(study, "adamw", conv.grid(args, "adamw"))
        eta = adamw["best"]
        conv.BY_KEY[AT_ETA] = conv.Arm(AT_ETA, f"SWAN‡, fallback_lr = η ({eta:g})", "swan", "swan_ddagger",
                                       {"fallback_lr": eta})
        swan_grid = [r * eta for r in args.swan_ratios] if args.swan_ratios else conv.grid(args, TIED)
        print("lr sweep SWAN‡ (fallback at the global lr):", flush=True)
        tied = sweep(study, TIED, swan_grid)
        res = {"adamw": adamw, "tied": tied, "eta": eta, "seeds": args.seeds}
        if not args.tied_only:
            print(f"lr sweep SWAN‡ (fallback_lr = {eta:g}):", flush=True)
            at_eta = res["at_eta"] = sweep(study, AT_ETA, swan_grid)
            lr = at_eta["best"]
            print(f"fallback_lr sweep at lr {lr:g}:", flush=True)
            arms = [(r, conv.Arm(f"ddagger_fallback_x{r:g}", f"SWAN‡, fallback_lr = {r:g} η", "swan", TIED,
                                 {"fallback_lr": r * eta})) for r in args.fallback_ratios]  # fmt: skip
            pending = [(r, _submit(study, arm, lr, f"fallback/lr{lr:g}/x{r:g}")) for r, arm in arms]
            res["fallback"] = {r: _point(study, p)["final"] for r, p in pending}
            res["best_fallback_ratio"] = min(res["fallback"], key=res["fallback"].get)
        if args.weight_decay > 0:
            lam = args.weight_decay
            print(f"weight decay at η = {eta:g} (AdamW) and lr = 4 η (SWAN‡), λ = {lam:g}:", flush=True)
            arms = [(eta, conv.Arm("adamw_wd", "AdamW", "adamw", weight_decay=lam))]
            arms += [(4 * eta, conv.Arm(f"ddagger_wd_x{r:g}", "SWAN‡", "swan", TIED, weight_decay=r * lam))
                     for r in args.wd_ratios]
            pending = [(lr, arm, _submit(study, arm, lr, f"wd/{arm.key}/lr{lr:g}")) for lr, arm in arms]
            res["wd"] = [{"optimizer": arm.label, "lr": lr, "weight_decay": arm.weight_decay, **_point(study, p)}
                         for lr, arm, p in pending]
        res["runs"] = study.runs
    return res


def _reach(res: dict[str, Any]) -> dict[str, Any]:
    """Tokens at which each sweep point's seed-mean validation curve first reaches AdamW's best (seed-mean) final
    loss (linear interpolation between evaluations; None: not reached), and AdamW's own."""
    target = res["adamw"]["results"][res["eta"]]
    reach = {key: {lr: conv.tokens_to_reach(p["curve"], target) for lr, p in res[key]["points"].items()}
             for key in ("adamw", "tied", "at_eta") if key in res}  # fmt: skip
    return {"target": target, "adamw_tokens": reach["adamw"][res["eta"]], "tokens": reach}


def _row(sweep: dict[str, Any]) -> str:
    return " · ".join(f"**{lr:g}: {v:.3f}**" if lr == sweep["best"] else f"{lr:g}: {v:.3f}"
                      for lr, v in sweep["results"].items())


def _tokens(t: float | None, own: float | None) -> str:
    return "not reached" if t is None else f"{t / 1e3:,.1f}K ({t / own:.2f}x)" if own else f"{t / 1e3:,.1f}K"


def _loss(p: dict[str, Any]) -> str:
    half = (p["max"] - p["min"]) / 2
    return f"{p['final']:.3f}" + (f" ± {half:.3f}" if half else "")


def report(args: argparse.Namespace, res: dict[str, Any], png: Path, command: str) -> str:
    eta, tied = res["eta"], res["tied"]
    edge = lambda s: " (on the grid's edge)" if s["edge"] else ""  # noqa: E731
    seeds = ", ".join(map(str, args.seeds))
    lines = [
        f"Reference LLaMA `{args.model}`{args.model_overrides or ''}, embedded wiki corpus, {args.batch}x{args.seq} "
        f"tokens per step, {args.sweep_tokens:,} training tokens per run, seed{'s' * (len(args.seeds) > 1)} {seeds}"
        f"{' (values: the seeds' + chr(39) + ' mean)' if len(args.seeds) > 1 else ''}; the convergence study's "
        "schedule (10 % linear warm-up, cosine decay to 0.1 x lr), grad clip 1.0, no weight decay unless stated, fp32, "
        f"one process per run ({args.jobs} at a time, {args.threads} torch thread each), validation loss every "
        f"{min(args.eval_every_tokens, args.sweep_tokens):,} tokens on {args.eval_batches * args.batch} fixed windows. "
        "Final validation loss per lr; the best in bold. SWAN‡'s global lr drives the fallback rule (AdamW on "
        "embeddings, output head, norms) unless `fallback_lr` is given; its whitened matrices move at lr x alpha "
        "(0.05).",
        "", "```", command, "```", "",
        "| sweep | final val loss per lr | best |",
        "|---|---|---:|",
        f"| 1. AdamW | {_row(res['adamw'])} | η = {eta:g}{edge(res['adamw'])} |",
        f"| 2. SWAN‡, fallback at the global lr | {_row(tied)} | {tied['best']:g} = {tied['best'] / eta:.3g} η"
        f"{edge(tied)} |",
    ]
    if "at_eta" in res:
        at_eta, fb, best_fb = res["at_eta"], res["fallback"], res["best_fallback_ratio"]
        lines += [
            f"| 3. SWAN‡, fallback_lr = η | {_row(at_eta)} | {at_eta['best']:g} = {at_eta['best'] / eta:.3g} η"
            f"{edge(at_eta)} |",
            f"| 4. fallback_lr at lr {at_eta['best']:g} | "
            + " · ".join(f"**{r:g} η: {v:.3f}**" if r == best_fb else f"{r:g} η: {v:.3f}" for r, v in fb.items())
            + f" | {best_fb:g} η{' (on the grid' + chr(39) + 's edge)' if best_fb in (min(fb), max(fb)) else ''} |",
        ]
    reach = _reach(res)
    if any(len(p["curve"]) > 2 for p in res["adamw"]["points"].values()):
        own = reach["adamw_tokens"]
        lines += [
            "", f"Tokens to AdamW's best final loss ({reach['target']:.3f}, AdamW at η = {eta:g}): where the "
            "seed-mean validation curve first reaches it (linear interpolation between evaluations), and as a ratio "
            "to AdamW's own; below 1 is faster.", "",
            "| run | lr | final val loss | tokens to AdamW's best final loss |", "|---|---:|---:|---:|",
        ]
        names = {"adamw": "AdamW", "tied": "SWAN‡, fallback tied", "at_eta": "SWAN‡, fallback_lr = η"}
        for key, name in names.items():
            for lr, p in res.get(key, {}).get("points", {}).items():
                label = name + (" (the convention: `adamw_lr=η`)" if key == "tied" and math.isclose(lr, 4 * eta)
                                else "")  # fmt: skip
                lines.append(f"| {label} | {lr:g} = {lr / eta:.3g} η | {_loss(p)} | "
                             f"{_tokens(reach['tokens'][key][lr], own)} |")
    if "wd" in res:
        base = {"AdamW": res["adamw"]["points"][eta], "SWAN‡": tied["points"].get(4 * eta)}
        lines += [
            "", f"Weight decay at AdamW's η and the convention's SWAN‡ lr (4 η, fallback tied), λ = "
            f"{args.weight_decay:g}: AdamW decays its matrices other than the token embedding (not the vectors); SWAN "
            "decays every parameter by `p * (1 - lr_eff * wd)` (matrices at lr_eff = 0.2 η, fallback at 4 η).", "",
            "| optimizer | lr | weight decay | final val loss | vs no decay |", "|---|---:|---:|---:|---:|",
        ]
        for name, p in base.items():
            if p is not None:
                lines.append(f"| {name} | {(eta if name == 'AdamW' else 4 * eta):g} | 0 | {_loss(p)} | |")
        for w in res["wd"]:
            b = base[w["optimizer"]]
            diff = "" if b is None else f"{w['final'] - b['final']:+.3f}"
            lines.append(f"| {w['optimizer']} | {w['lr']:g} | {w['weight_decay']:g} | {_loss(w)} | {diff} |")
    lines += ["", _rule(args.name, res), "", f"![final validation loss against lr]({png.name})"]
    return "\n".join(lines)


def _rule(model: str, res: dict[str, Any]) -> str:
    """The starting point the sweeps support: the lowest loss of the tied sweep and of the fallback_lr sweep."""
    eta, tied = res["eta"], res["tied"]
    tied_loss = tied["results"][tied["best"]]
    if "at_eta" not in res:
        conv_loss = tied["results"].get(4 * eta)
        at4 = "" if conv_loss is None or tied["best"] == 4 * eta else f"; at the convention's 4 η: {conv_loss:.3f}"
        return (f"**The rule this run gives** (`{model}`): from AdamW's tuned lr η, start SWAN‡ at `lr` = "
                f"{tied['best'] / eta:.3g} η with the fallback at that same lr (final val loss {tied_loss:.3f}{at4}); "
                f"AdamW alone {res['adamw']['results'][eta]:.3f}.")
    at_eta, fb = res["at_eta"], res["fallback"]
    best_fb = res["best_fallback_ratio"]
    fb_loss = fb[best_fb]
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
    labels = (("adamw", "AdamW"), ("tied", "SWAN‡, fallback at lr"), ("at_eta", "SWAN‡, fallback_lr = η"))
    for key, label in labels:
        if key in res:
            s = res[key]
            a.plot([lr / eta for lr in s["results"]], list(s["results"].values()), "o-", label=label)
    a.set(xscale="log", xlabel="lr / η (η: AdamW's best lr)", ylabel="final validation loss", title="lr sweeps")
    ratios = sorted({lr / eta for key in ("adamw", "tied", "at_eta") if key in res for lr in res[key]["results"]})
    a.set_xticks(ratios, [f"{r:.3g}" for r in ratios])
    a.minorticks_off()
    a.legend()
    if "fallback" in res:
        b.plot(list(res["fallback"]), list(res["fallback"].values()), "o-", color="C2")
        b.set(xscale="log", xlabel="fallback_lr / η", title=f"fallback_lr at lr {res['at_eta']['best']:g}")
    else:  # validation curves: AdamW at η, SWAN‡ at each lr of its sweep
        curves = [("AdamW, η", res["adamw"]["points"][eta]["curve"])]
        curves += [(f"SWAN‡, {lr / eta:.3g} η", p["curve"]) for lr, p in res["tied"]["points"].items()]
        later = []
        for label, curve in curves:
            b.plot([t / 1e3 for t, _ in curve], [v for _, v in curve], ".-", label=label)
            later += [v for _, v in curve[1:] if math.isfinite(v)]
        target = res["adamw"]["results"][eta]
        b.axhline(target, color="grey", linestyle="--", linewidth=1)
        if later:
            b.set_ylim(min(later) - 0.1, min(max(later), min(later) + 2.0) + 0.1)
        b.set(xlabel="training tokens (thousands)", ylabel="validation loss (seed mean)",
              title="validation curves (dashed: AdamW's final)")
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    conv._set_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="swan_lr_rule_")) if args.quick else None
    default_work = tmp / "runs" if tmp else conv.REPO / "runs" / f"lr-rule-{args.name}"
    work = Path(args.work_dir) if args.work_dir else default_work
    out = Path(args.out) if args.out else (tmp / "convergence.md" if tmp else conv.REPO / "docs" / "convergence.md")
    png = out.parent / f"lr_rule_{device}_{args.name}.png"
    res = run(args, work)
    plot(png, res)
    command = "python benchmarks/lr_rule.py" + ("" if not argv else " " + " ".join(argv))
    body = report(args, res, png, command)
    print(body)
    saved = measure.DOC
    try:
        measure.DOC = out
        what = "Weight decay" if args.weight_decay > 0 else "Starting lrs"
        measure.write_section(f"lr-rule-{device}-{args.name}",
                              f"{what} from AdamW's ({'GPU' if device == 'cuda' else 'CPU'}, "
                              f"{args.model if args.weight_decay > 0 else args.name})", body)
    finally:
        measure.DOC = saved
    (work / "results.json").write_text(json.dumps(res, indent=1, default=str))
    return {**res, "out": str(out), "png": str(png)}


if __name__ == "__main__":
    main()
