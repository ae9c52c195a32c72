"""The Muon baseline of the reference trainer (``optimizer: muon``) and the convergence study's smoke mode
(``benchmarks/convergence.py --quick``)."""

import copy
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swan_dist.reference.baselines import MuonWithAdamW
from swan_dist.reference.config import load_config
from swan_dist.reference.loop import build_model
from swan_dist.reference.optim import build_optimizer, build_scheduler
from swan_dist.reference.train import main

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "train" / "smoke.yaml")
MUON = ["optimizer=muon", "lr=3e-3", "eval_every=2", "log_every=1"]


def _names(groups, keep) -> set[str]:
    return {n for g in groups if keep(g) for n in g["param_names"]}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exclude", [None, "[feed_forward.w2]"], ids=["default", "exclude"])
def test_muon_takes_exactly_the_matrices_swan_whitens(exclude):
    overrides = [] if exclude is None else [f"swan_options.exclude={exclude}"]
    model = build_model(load_config(SMOKE), vocab_size=512)
    swan = build_optimizer(load_config(SMOKE, ["optimizer=swan", *overrides]), model)
    muon = build_optimizer(load_config(SMOKE, ["optimizer=muon", *overrides]), model)
    assert isinstance(muon, MuonWithAdamW) and isinstance(muon, torch.optim.Optimizer)
    whitened = _names(swan.param_groups, lambda g: g["use_swan"])
    orthogonalised = _names(muon.param_groups, lambda g: g["optimizer"] == "muon")
    assert orthogonalised == whitened and len(whitened) == 2 * 7 - (0 if exclude is None else 2)
    rest = _names(muon.param_groups, lambda g: g["optimizer"] == "adamw")
    assert rest == {n for n, _ in model.named_parameters()} - whitened
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= rest
    (mg,) = [g for g in muon.param_groups if g["optimizer"] == "muon"]
    assert mg["adjust_lr_fn"] == "match_rms_adamw"  # so Muon takes AdamW's lr: one lr for all groups
    assert {g["lr"] for g in muon.param_groups} == {load_config(SMOKE).lr}
    assert all(g["betas"] == (0.9, 0.95) for g in muon.param_groups if g["optimizer"] == "adamw")


@pytest.mark.timeout(30)
def test_muon_state_dict_and_scheduler_cover_both_optimizers():
    torch.manual_seed(0)
    cfg = load_config(SMOKE, ["optimizer=muon", "steps=4"])
    model = build_model(cfg, vocab_size=512)
    opt = build_optimizer(cfg, model)
    sched = build_scheduler(cfg, opt)
    x = torch.randint(0, 512, (2, 16))
    for _ in range(2):
        model(x, x)[1].backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    kinds = {k for s in opt.state.values() for k in s}
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"} <= kinds  # Muon's and AdamW's state, one dict
    assert len({g["lr"] for g in opt.param_groups}) == 1 and opt.param_groups[0]["lr"] != opt.param_groups[0]["initial_lr"]
    twin = build_model(cfg, vocab_size=512)
    twin.load_state_dict(model.state_dict())
    opt2 = build_optimizer(cfg, twin)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: loading keeps the tensors it is given
    for o, m in ((opt, model), (opt2, twin)):  # one more step on each: identical weights
        m(x, x)[1].backward()
        o.step()
    for (n, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.timeout(30)
def test_muon_trainer_runs_and_resumes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    sa = main(["--config", SMOKE, "--set", f"out_dir={a}", *MUON, "steps=3", "checkpoint_every=2"])
    assert sa["optimizer"] == "muon" and sa["whitened_matrices"] is None
    assert all(math.isfinite(sa[k]) for k in ("final_val_loss", "final_train_loss", "initial_val_loss"))
    assert sa["final_val_loss"] < sa["initial_val_loss"]
    # state: Muon's momentum (one per whitened matrix) + AdamW's two moments on the rest, fp32
    model = build_model(load_config(SMOKE), vocab_size=8192)
    matrices = [p for n, p in model.named_parameters() if ".attention." in n or ".feed_forward." in n]
    rest = [p for n, p in model.named_parameters() if not (".attention." in n or ".feed_forward." in n)]
    assert sa["optimizer_state"] == 4 * (sum(p.numel() for p in matrices) + 2 * sum(p.numel() for p in rest) + len(rest))
    (b / "checkpoints").mkdir(parents=True)  # resume from step 2 through the trainer's DCP checkpoint
    shutil.copytree(a / "checkpoints" / "step_2", b / "checkpoints" / "step_2")
    sb = main(["--config", SMOKE, "--set", f"out_dir={b}", *MUON, "steps=3", "checkpoint_every=2"])
    assert sb["weights_sha1"] == sa["weights_sha1"] and sb["final_val_loss"] == sa["final_val_loss"]


@pytest.mark.timeout(30)
def test_muon_refused_where_the_optimizer_sees_shards():
    for parallel in ("fsdp2", "fsdp1"):
        with pytest.raises(ValueError, match=f"optimizer=muon.*parallel='{parallel}'"):
            load_config(SMOKE, ["optimizer=muon", f"parallel={parallel}"])
    with pytest.raises(ValueError, match="optimizer=muon.*parallel='deepspeed'"):
        load_config(SMOKE, ["optimizer=muon", "parallel=deepspeed",
                            f"deepspeed_config={REPO / 'configs' / 'deepspeed' / 'zero2.json'}"])
    assert load_config(SMOKE, ["optimizer=muon", "parallel=ddp"]).optimizer == "muon"
    with pytest.raises(ValueError, match="nothing for Muon"):
        build_optimizer(load_config(SMOKE, ["optimizer=muon"]), torch.nn.Embedding(4, 4))


def _study():
    spec = importlib.util.spec_from_file_location("convergence_bench", REPO / "benchmarks" / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    # benchmarks/ on sys.path would make later tests' `import megatron` find benchmarks/megatron.py
    assert str(REPO / "benchmarks") not in sys.path
    return module


@pytest.mark.timeout(30)
def test_tokens_to_reach_interpolates():
    study = _study().study
    curve = [(0, 9.0), (100, 6.0), (200, 5.0), (300, 4.0)]
    assert study.tokens_to_reach(curve, 5.5) == 150.0
    assert study.tokens_to_reach(curve, 4.0) == 300.0
    assert study.tokens_to_reach(curve, 3.9) is None
    assert study.step(2e-3, up=True) == pytest.approx(5e-3)
    assert study.step(1e-2, up=False) == pytest.approx(5e-3)


def _quick(tmp_path, *extra, timeout=80):
    """``convergence.py --quick`` in a subprocess, with 1 thread per run; the finished process."""
    out, work = tmp_path / "bench.md", tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "convergence.py"), "--quick", "--out", str(out),
                           "--work-dir", str(work), *extra], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.timeout(90)
def test_convergence_quick_with_two_jobs(tmp_path, monkeypatch):
    out, work = tmp_path / "bench.md", tmp_path / "runs"
    proc = _quick(tmp_path, "--jobs", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "expected runtime: about" in proc.stdout and "2 at a time (--jobs 2" in proc.stdout
    text = out.read_text()
    assert "<!-- begin:convergence-cpu-tiny -->" in text and "<!-- end:convergence-cpu-tiny -->" in text
    assert "ran on" in text and "--quick" in text and "--jobs 2" in text and "](convergence_cpu_tiny.png)" in text
    assert "2 runs at a time (`--jobs 2`)" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    # a row per optimizer in the main table and in the sweep table; SWAN‡ also heads the ablation table
    for label, n in (("SWAN‡", 3), ("SWAN†", 2), ("SWAN-0", 2), ("AdamW (baseline)", 2), ("Muon (baseline)", 2)):
        assert sum(r.startswith(f"| {label} |") for r in rows) == n, label
    for label in ("SWAN‡, NSDS 1 step", "SWAN‡ without GradNorm", "SWAN‡ without whitening"):
        assert sum(r.startswith(f"| {label}") for r in rows) == 1, label
    assert (tmp_path / "convergence_cpu_tiny.png").read_bytes()[:4] == b"\x89PNG"

    # every run once, the records in the order --jobs 1 gives them
    bench = _study()
    args = bench.parse(["--quick"])
    expected = [f"calibrate/{a.key}" for a in bench.MAIN]
    expected += [f"sweep/{a.key}/lr{lr:g}" for a in bench.SWEPT for lr in bench.study.grid_of(args, a)]
    expected += [f"main/{a.key}/seed{s}" for s in args.seeds for a in bench.MAIN]
    expected += [f"ablation/{a.key}/seed{s}" for s in args.ablation_seeds for a in bench.ABLATIONS]
    record = json.loads((work / "results.json").read_text())
    assert [r["tag"] for r in record["runs"]] == expected
    assert {k: s["n"] for k, s in record["stats"].items()} == {
        **{a.key: len(args.seeds) for a in bench.MAIN}, **{a.key: len(args.ablation_seeds) for a in bench.ABLATIONS}}

    # the same numbers as --jobs 1: two runs that followed others in a worker, again through Study in this process
    by_tag = {r["tag"]: r for r in record["runs"]}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sequential = bench.study.Study(args, tmp_path / "jobs1")
        for tag in ("main/muon/seed1", "ablation/ddagger_no_whitening/seed0"):
            r = by_tag[tag]
            again = sequential.submit(bench.BY_KEY[r["arm"]], r["lr"], args.tokens, r["seed"], tag,
                                      args.eval_every_tokens)()  # the record: trained now, in this process
            again = json.loads(json.dumps(again))  # tuples to lists, as results.json has them
            for key in ("lr", "seed", "tokens", "steps", "curve", "final_val_loss", "optimizer_state", "n_params"):
                assert again[key] == r[key], (tag, key)
            assert [x for x in again["sets"] if not x.startswith("out_dir=")] == [
                x for x in r["sets"] if not x.startswith("out_dir=")]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(60)
def test_convergence_jobs_stops_at_a_failed_run(tmp_path):
    work = tmp_path / "runs"
    (work / "calibrate" / "swan_ddagger" / "metrics.jsonl").mkdir(parents=True)  # the trainer cannot write it
    proc = _quick(tmp_path, "--jobs", "2", timeout=50)  # no hang: pending runs cancelled, running ones stopped
    assert proc.returncode != 0
    log = work / "calibrate" / "swan_ddagger" / "log.txt"
    assert f"run calibrate/swan_ddagger failed; its log: {log}" in proc.stderr, proc.stderr[-3000:]
    assert "IsADirectoryError" in proc.stderr and log.is_file()
    assert not (work / "results.json").exists()


@pytest.mark.timeout(120)
def test_lr_rule_quick_writes_its_section_json_and_plot(tmp_path):
    """``benchmarks/lr_rule.py --quick``: the four sweeps run, the fallback_lr of sweeps 3 and 4 reaches the
    trainer, and the section, its JSON and its plot are written."""
    out, work = tmp_path / "convergence.md", tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lr_rule.py"), "--quick", "--jobs", "2",
                           "--fallback-ratios", "0.5,2", "--out", str(out), "--work-dir", str(work)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "<!-- begin:lr-rule-cpu-tiny -->" in text and "**The rule this run gives**" in text
    res = json.loads((work / "results.json").read_text())
    eta = res["adamw"]["best"]
    assert eta in (2e-3, 5e-3) and set(res["fallback"]) == {"0.5", "2.0"}
    configs = {r["tag"]: r["sets"] for r in res["runs"]}
    assert f"swan_options.fallback_lr={eta}" in configs[f"sweep/ddagger_fallback_eta/lr{res['at_eta']['best']:g}"]
    assert f"swan_options.fallback_lr={2 * eta}" in next(v for k, v in configs.items() if k.endswith("/x2"))
    assert not any("fallback_lr" in s for k, v in configs.items() if k.startswith("sweep/swan_ddagger") for s in v)
    record = json.loads((tmp_path / "results" / "lr-rule-cpu-tiny.json").read_text())
    assert record["script"] == "benchmarks/lr_rule.py" and record["tables"][0]["header"][0] == "sweep"
    assert (tmp_path / "lr_rule_cpu_tiny.png").read_bytes()[:4] == b"\x89PNG"
