"""Where to start SWAN‡'s lrs from a tuned AdamW lr η: four short sweeps of the convergence study's runs (AdamW; SWAN‡
with the fallback tied to its lr; SWAN‡ with fallback_lr = η; fallback_lr around η), optionally weight decay; the
lr-rule-<device>-<name> section of docs/convergence.md and its plot (what each flag does: docs/convergence.md).

    python benchmarks/lr_rule.py --jobs 2                   # tiny (default): about 30 min on 2 CPU cores
    python benchmarks/lr_rule.py --quick                    # smoke: a few steps per run, temporary files
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

import study  # this folder is the script's: on sys.path
from study import Arm

TIED = Arm("swan_ddagger", "SWAN‡", "swan", "swan_ddagger")


def parse(argv: list[str]) -> Any:
    ap = study.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=study.listed(int), default=[0], help="every point with each; the value: the mean")
    ap.add_argument("--fallback-ratios", type=study.listed(float), default=[0.25, 0.5, 1.0, 2.0, 4.0],
                    help="sweep 4's fallback_lr values, in η")
    ap.add_argument("--swan-ratios", type=study.listed(float), help="SWAN‡'s lr grid in η (default: --swan-lrs)")
    ap.add_argument("--tied-only", action="store_true", help="sweeps 1 and 2 only (no fallback_lr sweeps)")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="λ > 0: AdamW at η and SWAN‡ at 4 η decaying")
    ap.add_argument("--wd-ratios", type=study.listed(float), default=[1.0, 5.0], help="SWAN‡'s decays, in λ")
    ap.add_argument("--name", help="section, JSON and plot name (default: --model)")
    args = study.parse(ap, argv)
    args.name = args.name or args.model
    return args


def run(args: Any, work: Path) -> dict[str, Any]:
    """The sweeps: AdamW's best lr η; SWAN‡'s lr with the fallback tied to it and (unless --tied-only) at η, then
    fallback_lr around η at the best of those; with --weight-decay, AdamW and SWAN‡ at the convention with it."""
    with study.Study(args, work, args.seeds, min(args.eval_every_tokens, args.sweep_tokens)) as runs:
        print("lr sweep AdamW:", flush=True)
        adamw = Arm("adamw", "AdamW", "adamw")
        res = {"adamw": runs.sweep(adamw, runs.grid(adamw, study.grid_of(args, adamw))), "seeds": args.seeds}
        eta = res["eta"] = res["adamw"]["best"]
        swan_grid = [r * eta for r in args.swan_ratios] if args.swan_ratios else study.grid_of(args, TIED)
        print("lr sweep SWAN‡ (fallback at the global lr):", flush=True)
        res["tied"] = runs.sweep(TIED, runs.grid(TIED, swan_grid))
        if not args.tied_only:
            print(f"lr sweep SWAN‡ (fallback_lr = {eta:g}):", flush=True)
            at_eta = Arm("ddagger_fallback_eta", "SWAN‡, fallback_lr = η", "swan", "swan_ddagger", {"fallback_lr": eta})
            res["at_eta"] = runs.sweep(at_eta, runs.grid(at_eta, swan_grid))
            lr = res["at_eta"]["best"]
            print(f"fallback_lr sweep at lr {lr:g}:", flush=True)
            points = {r: runs.point(Arm(f"ddagger_fallback_x{r:g}", "SWAN‡", "swan", "swan_ddagger",
                                        {"fallback_lr": r * eta}), lr, f"fallback/lr{lr:g}/x{r:g}")
                      for r in args.fallback_ratios}  # fmt: skip
            res["fallback"] = {r: runs.value(p)["final"] for r, p in points.items()}
            res["best_fallback_ratio"] = min(res["fallback"], key=res["fallback"].get)
        if args.weight_decay > 0:
            lam = args.weight_decay
            print(f"weight decay at η = {eta:g} (AdamW) and lr = 4 η (SWAN‡), λ = {lam:g}:", flush=True)
            arms = [(eta, Arm("adamw_wd", "AdamW", "adamw", weight_decay=lam))]
            arms += [(4 * eta, Arm(f"ddagger_wd_x{r:g}", "SWAN‡", "swan", "swan_ddagger", weight_decay=r * lam))
                     for r in args.wd_ratios]
            points = [(lr, arm, runs.point(arm, lr, f"wd/{arm.key}/lr{lr:g}")) for lr, arm in arms]
            res["wd"] = [{"optimizer": arm.label, "lr": lr, "weight_decay": arm.weight_decay, **runs.value(p)}
                         for lr, arm, p in points]
        res["runs"] = runs.runs
    return res


def _loss(p: dict[str, Any]) -> str:
    half = (p["max"] - p["min"]) / 2
    return f"{p['final']:.3f}" + (f" ± {half:.3f}" if half else "")


def report(args: Any, res: dict[str, Any], png: Path, command: str) -> str:
    eta, tied = res["eta"], res["tied"]
    edge = lambda s: " (on the grid's edge)" if s["edge"] else ""  # noqa: E731

    def sweep(s: dict[str, Any]) -> str:
        return f"{study.cells(s['results'], s['best'])} | {s['best']:g} = {s['best'] / eta:.3g} η{edge(s)} |"

    seeds = ", ".join(map(str, args.seeds)) + (" (values: the seeds' mean)" if len(args.seeds) > 1 else "")
    lines = [
        f"Reference LLaMA `{args.model}`{args.model_overrides or ''}, embedded wiki corpus, {args.batch}x{args.seq} "
        f"tokens per step, {args.sweep_tokens:,} training tokens per run, seed{'s' * (len(args.seeds) > 1)} {seeds}; "
        "the convergence study's schedule (10 % linear warm-up, cosine decay to 0.1 x lr), grad clip 1.0, no weight "
        "decay unless stated, fp32, "
        f"one process per run ({args.jobs} at a time, {args.threads} torch thread each), validation loss every "
        f"{min(args.eval_every_tokens, args.sweep_tokens):,} tokens on {args.eval_batches * args.batch} fixed windows. "
        "Final validation loss per lr; the best in bold. SWAN‡'s global lr drives the fallback rule (AdamW on "
        "embeddings, output head, norms) unless `fallback_lr` is given; its whitened matrices move at lr x alpha "
        "(0.05).",
        "", "```", command, "```", "",
        "| sweep | final val loss per lr | best |",
        "|---|---|---:|",
        f"| 1. AdamW | {study.cells(res['adamw']['results'], eta)} | η = {eta:g}{edge(res['adamw'])} |",
        f"| 2. SWAN‡, fallback at the global lr | {sweep(tied)}",
    ]
    if "at_eta" in res:
        fb, best_fb = res["fallback"], res["best_fallback_ratio"]
        on_edge = " (on the grid's edge)" if best_fb in (min(fb), max(fb)) else ""
        lines += [f"| 3. SWAN‡, fallback_lr = η | {sweep(res['at_eta'])}",
                  f"| 4. fallback_lr at lr {res['at_eta']['best']:g} | {study.cells(fb, best_fb, ' η')} | "
                  f"{best_fb:g} η{on_edge} |"]
    if any(len(p["curve"]) > 2 for p in res["adamw"]["points"].values()):
        target = res["adamw"]["results"][eta]
        own = study.tokens_to_reach(res["adamw"]["points"][eta]["curve"], target)
        lines += [
            "", f"Tokens to AdamW's best final loss ({target:.3f}, AdamW at η = {eta:g}): where the seed-mean "
            "validation curve first reaches it (linear interpolation between evaluations), and as a ratio to AdamW's "
            "own; below 1 is faster.", "",
            "| run | lr | final val loss | tokens to AdamW's best final loss |", "|---|---:|---:|---:|",
        ]
        names = {"adamw": "AdamW", "tied": "SWAN‡, fallback tied", "at_eta": "SWAN‡, fallback_lr = η"}
        for key, name in names.items():
            for lr, p in res.get(key, {}).get("points", {}).items():
                t = study.tokens_to_reach(p["curve"], target)
                reach = "not reached" if t is None else f"{t / 1e3:,.1f}K" + (f" ({t / own:.2f}x)" if own else "")
                convention = " (the convention: `adamw_lr=η`)" if key == "tied" and math.isclose(lr, 4 * eta) else ""
                lines.append(f"| {name}{convention} | {lr:g} = {lr / eta:.3g} η | {_loss(p)} | {reach} |")
    if "wd" in res:
        base = {"AdamW": res["adamw"]["points"][eta], "SWAN‡": tied["points"].get(4 * eta)}
        lines += [
            "", f"Weight decay at AdamW's η and the convention's SWAN‡ lr (4 η, fallback tied), λ = "
            f"{args.weight_decay:g}: AdamW decays its matrices other than the token embedding (not the vectors); SWAN "
            "decays every parameter by `p * (1 - lr_eff * wd)` (matrices at lr_eff = 0.2 η, fallback at 4 η).", "",
            "| optimizer | lr | weight decay | final val loss | vs no decay |", "|---|---:|---:|---:|---:|",
        ]
        lines += [f"| {name} | {(eta if name == 'AdamW' else 4 * eta):g} | 0 | {_loss(p)} | |"
                  for name, p in base.items() if p is not None]
        for w in res["wd"]:
            diff = "" if base[w["optimizer"]] is None else f"{w['final'] - base[w['optimizer']]['final']:+.3f}"
            lines.append(f"| {w['optimizer']} | {w['lr']:g} | {w['weight_decay']:g} | {_loss(w)} | {diff} |")
    lines += ["", _rule(args.name, res), "", f"![final validation loss against lr]({png.name})"]
    return "\n".join(lines)


def _rule(model: str, res: dict[str, Any]) -> str:
    """The starting point the sweeps support: the lowest loss of the tied sweep and of the fallback_lr sweep."""
    eta, tied = res["eta"], res["tied"]
    tied_loss, adamw = tied["results"][tied["best"]], res["adamw"]["results"][eta]
    head = f"**The rule this run gives** (`{model}`): from AdamW's tuned lr η, "
    if "at_eta" not in res:
        conv_loss = tied["results"].get(4 * eta)
        at4 = "" if conv_loss is None or tied["best"] == 4 * eta else f"; at the convention's 4 η: {conv_loss:.3f}"
        return (f"{head}start SWAN‡ at `lr` = {tied['best'] / eta:.3g} η with the fallback at that same lr (final val "
                f"loss {tied_loss:.3f}{at4}); AdamW alone {adamw:.3f}.")
    at_eta, fb, best_fb = res["at_eta"]["best"], res["fallback"], res["best_fallback_ratio"]
    if tied_loss <= fb[best_fb]:
        head += (f"start SWAN‡ at `lr` = {tied['best'] / eta:.3g} η with the fallback at that same lr, as the preset "
                 f"does (final val loss {tied_loss:.3f}); a separate `fallback_lr` did no better")
    else:
        head += (f"start SWAN‡ at `lr` = {at_eta / eta:.3g} η with `fallback_lr` = {best_fb:g} η (final val loss "
                 f"{fb[best_fb]:.3f}; tied at {tied['best'] / eta:.3g} η: {tied_loss:.3f})")
    return (f"{head}. The fallback rule (AdamW on embeddings, head and norms) wants more than η here: at `lr` = "
            f"{at_eta / eta:.3g} η, `fallback_lr` {study.cells(fb, unit=' η')}; AdamW alone {adamw:.3f}.")


def plot(png: Path, res: dict[str, Any]) -> None:
    """Final loss against lr / η per sweep; beside it the fallback_lr sweep or, without it, the validation curves."""
    from matplotlib.figure import Figure  # object API: Agg canvas, no pyplot

    eta = res["eta"]
    a, b = Figure(figsize=(10, 3.6), dpi=110).subplots(1, 2)
    names = {"adamw": "AdamW", "tied": "SWAN‡, fallback at lr", "at_eta": "SWAN‡, fallback_lr = η"}
    sweeps = {names[key]: res[key]["results"] for key in names if key in res}
    for label, results in sweeps.items():
        a.plot([lr / eta for lr in results], list(results.values()), "o-", label=label)
    ratios = sorted({lr / eta for results in sweeps.values() for lr in results})
    a.set(xscale="log", xlabel="lr / η (η: AdamW's best lr)", ylabel="final validation loss", title="lr sweeps")
    a.set_xticks(ratios, [f"{r:.3g}" for r in ratios])
    a.minorticks_off()
    a.legend()
    if "fallback" in res:
        b.plot(list(res["fallback"]), list(res["fallback"].values()), "o-", color="C2")
        b.set(xscale="log", xlabel="fallback_lr / η", title=f"fallback_lr at lr {res['at_eta']['best']:g}")
    else:  # AdamW at η, SWAN‡ at each lr of its sweep
        curves = [("AdamW, η", [res["adamw"]["points"][eta]["curve"]])]
        curves += [(f"SWAN‡, {lr / eta:.3g} η", [p["curve"]]) for lr, p in res["tied"]["points"].items()]
        study.curves(b, curves, res["adamw"]["results"][eta], "thousands")
        b.set_title("validation curves (seed means)")
    a.figure.tight_layout()
    a.figure.savefig(png)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    work, out = study.folders(args, f"lr-rule-{args.name}", "convergence.md")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    png = out.parent / f"lr_rule_{device}_{args.name}.png"
    res = run(args, work)
    plot(png, res)
    body = report(args, res, png, study.command("lr_rule.py", argv))
    print(body)
    what, name = ("Weight decay", args.model) if args.weight_decay > 0 else ("Starting lrs", args.name)
    title = f"{what} from AdamW's ({'GPU' if device == 'cuda' else 'CPU'}, {name})"
    study.measure.write_section(f"lr-rule-{device}-{args.name}", title, body)
    (work / "results.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
