"""Where to start SWAN‡'s lrs from a tuned AdamW lr η: short sweeps of the convergence study's runs, optionally
weight decay; the lr-rule-<device>-<name> section of docs/convergence.md and its plot (the flags: docs/convergence.md).

    python benchmarks/lr_rule.py --jobs 2     # tiny (default): about 30 min on 2 CPU cores
    python benchmarks/lr_rule.py --quick      # smoke: a few steps per run, temporary files
"""

import json
import math
from pathlib import Path
from typing import Any

import torch

import study  # this folder is the script's: on sys.path
from study import Arm

TIED = Arm("swan_ddagger", "SWAN‡", "swan", "swan_ddagger")
NAMES = {"adamw": "AdamW", "tied": "SWAN‡, fallback tied", "at_eta": "SWAN‡, fallback_lr = η"}  # the sweeps of lrs


def parse(argv: list[str] | None) -> Any:
    ap = study.parser(__doc__, weight_decay=0.0, name="")
    ap.add_argument("--seeds", type=study.listed(int), default=[0], help="every point with each; the value: the mean")
    ap.add_argument("--fallback-ratios", type=study.listed(float), default=[0.25, 0.5, 1.0, 2.0, 4.0])  # in η
    ap.add_argument("--swan-ratios", type=study.listed(float), help="SWAN‡'s lr grid in η (default: --swan-lrs)")
    ap.add_argument("--tied-only", action="store_true", help="sweeps 1 and 2 only (no fallback_lr sweeps)")
    ap.add_argument("--wd-ratios", type=study.listed(float), default=[1.0, 5.0], help="SWAN‡'s decays, in λ")
    args = study.parse(ap, argv)
    args.name = args.name or args.model
    return args


def run(args: Any, work: Path) -> dict[str, Any]:
    """The sweeps: AdamW's best lr η; SWAN‡'s lr with the fallback tied to it and (unless --tied-only) at η, then
    fallback_lr around η at the best of those; with --weight-decay, AdamW and SWAN‡ at the convention with it."""
    with study.Study(args, work, args.seeds, min(args.eval_every_tokens, args.sweep_tokens)) as runs:
        adamw = Arm("adamw", "AdamW", "adamw")
        res = {"adamw": runs.sweep(adamw, runs.grid(adamw, study.grid_of(args, adamw))), "seeds": args.seeds}
        eta = res["eta"] = res["adamw"]["best"]
        swan_grid = [r * eta for r in args.swan_ratios] if args.swan_ratios else study.grid_of(args, TIED)
        res["tied"] = runs.sweep(TIED, runs.grid(TIED, swan_grid))
        if not args.tied_only:
            at_eta = Arm("ddagger_fallback_eta", "SWAN‡, fallback_lr = η", "swan", "swan_ddagger",
                         {"fallback_lr": eta})
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
        f"Reference LLaMA `{args.model}`{args.model_overrides or ''}, {args.batch}x{args.seq} tokens per step, "
        f"{args.sweep_tokens:,} training tokens per run, seed{'s' * (len(args.seeds) > 1)} {seeds}, {args.jobs} runs "
        f"at a time ({args.threads} torch thread each), validation loss every "
        f"{min(args.eval_every_tokens, args.sweep_tokens):,} tokens on {args.eval_batches * args.batch} fixed windows.",
        "", "```", command, "```", "", "| sweep | final val loss per lr | best |", "|---|---|---:|",
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
        lines += ["", f"Tokens to AdamW's best final loss ({target:.3f}, AdamW at η = {eta:g}):", "",
                  "| run | lr | final val loss | tokens to AdamW's best final loss |", "|---|---:|---:|---:|"]
        for key, name in NAMES.items():
            for lr, p in res.get(key, {}).get("points", {}).items():
                t = study.tokens_to_reach(p["curve"], target)
                reach = "not reached" if t is None else f"{t / 1e3:,.1f}K" + (f" ({t / own:.2f}x)" if own else "")
                convention = " (the convention: `adamw_lr=η`)" * (key == "tied" and math.isclose(lr, 4 * eta))
                lines.append(f"| {name}{convention} | {lr:g} = {lr / eta:.3g} η | {_loss(p)} | {reach} |")
    if "wd" in res:
        base = {"AdamW": res["adamw"]["points"][eta], "SWAN‡": tied["points"].get(4 * eta)}
        lines += ["", f"Weight decay λ = {args.weight_decay:g} at AdamW's η and SWAN‡'s 4 η (fallback tied):", "",
                  "| optimizer | lr | weight decay | final val loss | vs no decay |", "|---|---:|---:|---:|---:|"]
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
    head = f"**The rule this run gives** (`{model}`): from AdamW's tuned lr η, start SWAN‡ at `lr` = "
    tied_at, tail = f"{tied['best'] / eta:.3g} η", f"; AdamW alone {adamw:.3f}."
    if "at_eta" not in res:
        conv = tied["results"].get(4 * eta)
        at4 = "" if conv is None or tied["best"] == 4 * eta else f"; at the convention's 4 η: {conv:.3f}"
        return f"{head}{tied_at} with the fallback at that same lr (final val loss {tied_loss:.3f}{at4}){tail}"
    at_eta, fb, best_fb = res["at_eta"]["best"], res["fallback"], res["best_fallback_ratio"]
    if tied_loss <= fb[best_fb]:
        return (f"{head}{tied_at} with the fallback at that same lr, as the preset does (final val loss "
                f"{tied_loss:.3f}); a separate `fallback_lr` did no better{tail}")
    return (f"{head}{at_eta / eta:.3g} η with `fallback_lr` = {best_fb:g} η (final val loss {fb[best_fb]:.3f}; tied "
            f"at {tied_at}: {tied_loss:.3f}){tail}")


def plot(png: Path, res: dict[str, Any]) -> None:
    """Final loss against lr / η per sweep; beside it the fallback_lr sweep or, without it, the validation curves."""
    from matplotlib.figure import Figure  # object API: Agg canvas, no pyplot

    eta = res["eta"]
    a, b = Figure(figsize=(10, 3.6), dpi=110).subplots(1, 2)
    sweeps = {name: res[key]["results"] for key, name in NAMES.items() if key in res}
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
    args = parse(argv)
    work, out = study.folders(args, f"lr-rule-{args.name}", "convergence.md")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    png = out.parent / f"lr_rule_{device}_{args.name}.png"
    res = run(args, work)
    plot(png, res)
    what, name = ("Weight decay", args.model) if args.weight_decay > 0 else ("Starting lrs", args.name)
    title = f"{what} from AdamW's ({'GPU' if device == 'cuda' else 'CPU'}, {name})"
    body = report(args, res, png, study.measure.provenance()["command"])
    study.measure.publish(f"lr-rule-{device}-{args.name}", title, body, write=not args.no_write)
    (work / "results.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
