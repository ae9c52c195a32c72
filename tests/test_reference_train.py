import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swan_dist.reference.config import load_config
from swan_dist.reference.optim import build_optimizer, build_scheduler
from swan_dist.reference.outputs import weights_digest
from swan_dist.reference.train import main

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "train" / "smoke.yaml")


def _check_outputs(out: Path, summary: dict) -> list[dict]:
    for name in ("metrics.jsonl", "loss_curve.png", "summary.json", "config.yaml"):
        assert (out / name).is_file(), name
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "val_loss" in rows[0]
    assert rows[-1]["step"] == summary["steps"] and "val_loss" in rows[-1] and "train_loss" in rows[-1]
    assert all(r["tokens"] == r["step"] * summary["tokens"] // summary["steps"] for r in rows)
    return rows


@pytest.mark.timeout(30)
def test_config_overrides_and_errors(tmp_path):
    cfg = load_config(SMOKE, ["steps=7", "model.n_layers=3", "lr=1e-3", "data=[a.txt, b/*.txt]"])
    assert cfg.steps == 7 and cfg.model == {"size": "tiny", "n_layers": 3}
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float)  # YAML reads 1e-3 as a string
    assert cfg.data == ["a.txt", "b/*.txt"]
    assert load_config(None, ["model=small"]).model == {"size": "small"}
    with pytest.raises(ValueError, match="stepz"):
        load_config(SMOKE, ["stepz=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="learning_rate"):
        load_config(bad)
    with pytest.raises(ValueError, match="n_layer"):
        load_config(SMOKE, ["model.n_layer=2"])
    with pytest.raises(ValueError, match="optimizer"):
        load_config(SMOKE, ["optimizer=sgd"])
    cfg = load_config(SMOKE, ["optimizer=swan", "swan_options.grad_norm=mean", "swan_options.ns_stepz=3"])
    with pytest.raises(ValueError, match="ns_stepz"):
        build_optimizer(cfg, torch.nn.Linear(4, 4))
    cfg = load_config(SMOKE, ["optimizer=swan", "lr=0.1", "swan_options.grad_norm=mean", "fallback=sign"])
    opt = build_optimizer(cfg, torch.nn.Linear(4, 4))
    assert opt.param_groups[0]["grad_norm"] == "mean" and opt.param_groups[1]["fallback"] == "sign"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", sorted((REPO / "configs" / "train").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_is_valid(path):
    cfg = load_config(path)
    if cfg.optimizer == "swan":  # its preset exists and the optimizer accepts the options
        build_optimizer(cfg, torch.nn.Linear(4, 4))


@pytest.mark.timeout(30)
def test_lr_schedule_warmup_then_cosine():
    cfg = load_config(SMOKE, ["steps=100", "warmup_ratio=0.1", "min_lr_ratio=0.2", "lr=1.0"])
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight], "lr": 1.0}, {"params": [model.bias], "lr": 0.5}])
    sched = build_scheduler(cfg, opt)
    lrs = []
    for _ in range(100):
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert math.isclose(lrs[0][0], 0.1) and math.isclose(lrs[9][0], 1.0)  # linear warm-up over 10 steps
    assert all(a[0] <= b[0] for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a[0] >= b[0] for a, b in zip(lrs[10:], lrs[11:]))  # then monotone decay
    assert math.isclose(lrs[55][0], 0.2 + 0.8 * 0.5, rel_tol=1e-6)  # cosine midpoint
    assert lrs[-1][0] >= 0.2 and math.isclose(lrs[-1][0], 0.2, abs_tol=1e-3)
    assert all(math.isclose(b, 0.5 * a) for a, b in lrs)  # every group is scaled


def _run(tmp_path: Path, *overrides: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "run"
    summary = main(["--config", SMOKE, "--set", f"out_dir={out}", "steps=40", "eval_every=20", *overrides])
    rows = _check_outputs(out, summary)
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0, summary
    return summary, rows


@pytest.mark.timeout(120)
def test_single_process_adamw_learns(tmp_path):
    summary, rows = _run(tmp_path, "optimizer=adamw", "lr=3e-3")
    assert summary["optimizer"] == "adamw" and summary["preset"] is None and summary["world_size"] == 1
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val == sorted(val, reverse=True)


@pytest.mark.timeout(120)
def test_single_process_swan_ddagger_learns(tmp_path):
    summary, _ = _run(tmp_path, "optimizer=swan", "preset=swan_ddagger", "lr=null")
    assert summary["optimizer"] == "swan" and summary["preset"] == "swan_ddagger"


@pytest.mark.timeout(60)
def test_ddp_world_size_one_in_process(tmp_path):
    out = tmp_path / "ddp1"
    summary = main(["--config", SMOKE, "--set", f"out_dir={out}", "parallel=ddp", "steps=4", "grad_accum=2",
                    "save_model=true"])  # fmt: skip
    _check_outputs(out, summary)
    assert summary["parallel"] == "ddp" and summary["world_size"] == 1
    assert not torch.distributed.is_initialized()  # the trainer cleaned up its process group
    state = torch.load(out / "model.pt")
    assert not any(k.startswith("module.") for k in state)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2", "fsdp1", "fsdp1:flat", "deepspeed:zero0", "deepspeed:zero1", "deepspeed:zero2",
                                      "deepspeed:zero3", "deepspeed:zero3_offload"])
def test_torchrun_two_process(tmp_path, parallel):
    parallel, _, variant = parallel.partition(":")
    ds_json = variant if parallel == "deepspeed" else ""
    out = tmp_path / parallel
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "swan_dist.reference.train", "--config", SMOKE,
        "--set", f"out_dir={out}", f"parallel={parallel}", "optimizer=swan", "lr=null", "steps=20", "eval_every=10",
        "grad_accum=2", "save_model=true", "swan_mode=owner",
    ]  # fmt: skip
    if ds_json:
        cmd.append(f"deepspeed_config={REPO / 'configs' / 'deepspeed' / ds_json}.json")
    if variant == "flat":
        cmd.append("fsdp1_use_orig_params=false")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    _check_outputs(out, summary)
    assert summary["world_size"] == 2 and summary["parallel"] == parallel
    assert summary["tokens"] == 20 * 2 * 2 * 8 * 64  # steps * ranks * grad_accum * batch * seq_len
    digests = summary["weights_sha1"]
    assert len(digests) == 2 and digests[0] == digests[1], "ranks ended with different weights"
    assert weights_digest(torch.load(out / "model.pt")) == digests[0]  # the digest is of the saved weights
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    # owner mode: each SWAN matrix (7 per block) whitened once per optimizer step, across both ranks
    n_layers = summary["model"].get("n_layers", 4) if isinstance(summary["model"], dict) else 4
    assert summary["whitened_matrices"] == 20 * 7 * n_layers
    # AdamW state (2 fp32 moments) for the fallback tensors only: embeddings, head, norms; none for SWAN
    dim, vocab = 128, 8192
    fallback = 2 * vocab * dim + (2 * n_layers + 1) * dim
    copies = 2 if parallel == "ddp" or ds_json == "zero0" else 1  # replicated, or sharded over the 2 ranks
    assert copies * 8 * fallback <= summary["optimizer_state"] <= copies * 8 * fallback + 4096, summary
    if ds_json and ds_json != "zero0":  # DeepSpeed's fp32 master partitions, counted apart
        assert 4 * summary["n_params"] <= summary["master_weights"] <= 4 * summary["n_params"] + 4096
