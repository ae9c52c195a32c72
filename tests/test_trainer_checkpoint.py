"""The reference trainer's checkpoints: periodic atomic saves, resume from the latest complete one, and
a torchrun restart after a rank is SIGKILLed, each ending with the uninterrupted run's weights."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swan_dist.reference.config import load_config
from swan_dist.reference.train import main

REPO = Path(__file__).resolve().parents[1]
SMOKE = str(REPO / "configs" / "train" / "smoke.yaml")
TIMING = ("elapsed", "tok_per_s")  # wall-clock fields, the only ones allowed to differ


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a / "model.pt"), torch.load(b / "model.pt")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir())


@pytest.mark.timeout(30)
def test_checkpoint_config_keys():
    cfg = load_config(SMOKE)
    assert (cfg.checkpoint_every, cfg.keep_checkpoints, cfg.resume, cfg.dist_timeout_s) == (0, 2, "auto", 300.0)
    for bad in ("checkpoint_every=-1", "keep_checkpoints=1.5", "dist_timeout_s=0", "resume=''"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            load_config(SMOKE, [bad])
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        main(["--config", SMOKE, "--set", "resume=/nonexistent/ckpt"])


SINGLE = ["optimizer=swan", "lr=null", "steps=8", "eval_every=3", "log_every=2", "checkpoint_every=3",
          "save_model=true"]  # fmt: skip


@pytest.mark.timeout(120)
def test_single_process_resume_is_bit_identical(tmp_path):
    """Saves at 3 and 6 (keep 2); a run holding only step_3 (a stale .tmp beside it, a metrics file with
    rows logged after the checkpoint) resumes from it: weights, metric rows, whitening count equal the
    uninterrupted run's; its next save removes the .tmp and prunes to keep_checkpoints=1."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    sa = main(["--config", SMOKE, "--set", f"out_dir={a}", *SINGLE])
    assert _steps(a) == [3, 6]
    assert sorted(p.name for p in (a / "checkpoints" / "step_3").iterdir()) == ["dcp", "meta.json", "rank_0.pt"]
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_3", b / "checkpoints" / "step_3")
    (b / "checkpoints" / "step_7.tmp").mkdir()  # a crash while saving: ignored, then cleaned up
    (b / "checkpoints" / "step_7.tmp" / "meta.json").write_text("{}")
    lines = (a / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text("\n".join(lines[:4]) + '\n{"step": 5, "junk": 1}\n')  # rows past step 3
    sb = main(["--config", SMOKE, "--set", f"out_dir={b}", *SINGLE, "keep_checkpoints=1"])
    _same_weights(a, b)
    assert _rows(a) == _rows(b)
    assert sb["whitened_matrices"] == sa["whitened_matrices"] == 8 * 7 * 2 and sb["tokens"] == sa["tokens"]
    assert sb["final_val_loss"] == sa["final_val_loss"] and sb["initial_val_loss"] == sa["initial_val_loss"]
    assert _steps(b) == [6]  # the stale .tmp removed, step_3 pruned
    # resume from an explicit path into another out_dir; then `never` starts afresh and clears old ones
    main(["--config", SMOKE, "--set", f"out_dir={c}", *SINGLE, f"resume={a / 'checkpoints' / 'step_3'}",
          "checkpoint_every=0"])  # fmt: skip
    _same_weights(a, c)
    assert not (c / "checkpoints").exists()
    with pytest.raises(ValueError, match="at step 6, past this run's steps=5"):
        main(["--config", SMOKE, "--set", f"out_dir={c}", *SINGLE, f"resume={a}", "steps=5"])
    main(["--config", SMOKE, "--set", f"out_dir={b}", *SINGLE, "resume=never", "steps=2", "checkpoint_every=0"])
    assert not (b / "checkpoints").exists() and _rows(b)[-1]["step"] == 2


def _torchrun(tmp_path: Path, out: Path, args: list[str], kill: str | None = None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *(["--max-restarts", "1"] if kill else []),
           "-m", "swan_dist.reference.train", "--config", SMOKE, "--set", f"out_dir={out}", *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("SWAN_DIST_FAULT_KILL", None)
    if kill:
        env["SWAN_DIST_FAULT_KILL"] = kill
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


DIST = ["optimizer=swan", "lr=null", "steps=8", "eval_every=4", "log_every=2", "checkpoint_every=3",
        "save_model=true", "swan_mode=owner", "grad_accum=2", "dist_timeout_s=60"]  # fmt: skip
CASES = {
    "ddp": ["parallel=ddp"],
    "fsdp2": ["parallel=fsdp2"],
    "fsdp1": ["parallel=fsdp1"],
    "deepspeed_zero2": ["parallel=deepspeed", f"deepspeed_config={REPO / 'configs' / 'deepspeed' / 'zero2.json'}"],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_restart_resumes_bit_identically(tmp_path, case):
    """torchrun --max-restarts 1: rank 1 SIGKILLs itself after step 5 (first attempt only); the job
    restarts, resumes from step_3, and ends with the uninterrupted run's weights and metric rows bit for
    bit. Then the step_6 checkpoint resumed at world size 1: DDP/FSDP2 continue through DCP's
    resharding; DeepSpeed refuses with the reason."""
    args = [*CASES[case], *DIST]
    ref, faulted = tmp_path / "ref", tmp_path / "faulted"
    _torchrun(tmp_path, ref, args)
    log = _torchrun(tmp_path, faulted, args, kill="1:5")
    assert "rank 1: SWAN_DIST_FAULT_KILL, SIGKILL at step 5" in log, log[-4000:]  # (which failure torchrun
    # reports first, rank 1's SIGKILL or rank 0's broken collective, is a race)
    assert f"resumed from {faulted / 'checkpoints' / 'step_3'} (step 3" in log, log[-4000:]
    _same_weights(ref, faulted)
    assert _rows(ref) == _rows(faulted)
    sr, sf = (json.loads((d / "summary.json").read_text()) for d in (ref, faulted))
    assert sr["whitened_matrices"] == sf["whitened_matrices"] == 8 * 7 * 2
    assert sf["weights_sha1"][0] == sf["weights_sha1"][1] == sr["weights_sha1"][0]
    assert _steps(faulted) == [3, 6]

    one = tmp_path / "one"
    resume = [f"resume={ref / 'checkpoints'}", "checkpoint_every=0"]
    if case.startswith("deepspeed"):
        with pytest.raises(ValueError, match="world size 2; this run has 1.*ds_universal"):
            main(["--config", SMOKE, "--set", f"out_dir={one}", *args, *resume])
        return
    s1 = main(["--config", SMOKE, "--set", f"out_dir={one}", *args, *resume])
    upto6 = [r for r in _rows(ref) if r["step"] <= 6]
    assert s1["world_size"] == 1 and _rows(one)[: len(upto6)] == upto6 and _rows(one)[-1]["step"] == 8
    assert s1["tokens"] == sr["tokens"] - 2 * 2 * 2 * 8 * 64 + 2 * 2 * 8 * 64  # steps 7-8 at one rank
    assert s1["whitened_matrices"] == sr["whitened_matrices"]
    assert abs(s1["final_val_loss"] - sr["final_val_loss"]) < 0.05, (s1["final_val_loss"], sr["final_val_loss"])


@pytest.mark.timeout(150)
def test_surviving_rank_fails_instead_of_hanging(tmp_path):
    """Two processes started without torchrun (nobody stops the survivor): rank 1 SIGKILLs itself after
    step 3; rank 0, in the next collective, fails (gloo's broken connection, or at the latest
    dist_timeout_s) rather than hanging."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "SWAN_DIST_FAULT_KILL": "1:3"}  # fmt: skip
    base.pop("TORCHELASTIC_RESTART_COUNT", None)
    cmd = [sys.executable, "-m", "swan_dist.reference.train", "--config", SMOKE, "--set", f"out_dir={tmp_path / 'run'}",
           "parallel=ddp", "optimizer=swan", "lr=null", "steps=8", "dist_timeout_s=30"]  # fmt: skip
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9, outs[1][-2000:]
    assert procs[0].returncode not in (0, None), outs[0][-2000:]
    assert time.monotonic() - start < 100


@pytest.mark.timeout(120)
def test_step_in_backward_resumes_bit_identically_and_refuses_clipping(tmp_path):
    """--set step_in_backward=true (updates made during backward, grad_clip=0): a run resumed from its
    step_3 checkpoint ends with the uninterrupted run's weights and metric rows bit for bit, and lands
    where the ordinary step does; with grad_clip > 0, another parallel layout or optimizer it is refused
    naming the key."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    sib = [*SINGLE, "steps=6", "grad_clip=0", "step_in_backward=true"]
    sa = main(["--config", SMOKE, "--set", f"out_dir={a}", *sib])
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_3", b / "checkpoints" / "step_3")
    sb = main(["--config", SMOKE, "--set", f"out_dir={b}", *sib])
    _same_weights(a, b)
    assert _rows(a) == _rows(b) and sb["final_val_loss"] == sa["final_val_loss"]
    main(["--config", SMOKE, "--set", f"out_dir={c}", *SINGLE, "steps=6", "grad_clip=0"])  # the ordinary step
    wa, wc = torch.load(a / "model.pt"), torch.load(c / "model.pt")
    assert max((wa[k] - wc[k]).abs().max().item() for k in wa) < 1e-5
    for bad, words in [("grad_clip=1.0", "grad_clip"), ("parallel=ddp", "parallel='ddp'"),
                       ("optimizer=adamw", "optimizer='adamw'")]:
        with pytest.raises(ValueError, match=words):
            load_config(SMOKE, ["optimizer=swan", "step_in_backward=true", "grad_clip=0", bad])


class _RunsCode:
    """Unpickling this calls ``Path.touch(marker)``: what a crafted checkpoint could do with any callable."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.timeout(30)
def test_rank_file_is_read_with_weights_only_and_a_file_that_would_run_code_is_refused(tmp_path):
    import pickle

    from swan_dist.reference import checkpoint

    marker = tmp_path / "ran"
    torch.save({"scheduler": {"base_lrs": [0.1]}, "loss_steps": 2, "x": _RunsCode(marker)}, tmp_path / "rank_0.pt")
    with pytest.raises(pickle.UnpicklingError, match="rank_0.pt: refused"):
        checkpoint.read_rank_file(tmp_path / "rank_0.pt")
    assert not marker.exists()
    torch.load(tmp_path / "rank_0.pt", weights_only=False)  # the same file, unpickled without the guard, runs it
    assert marker.exists()


@pytest.mark.timeout(150)
def test_swan_starts_from_an_adamw_checkpoint_with_init_from(tmp_path, caplog):
    """An AdamW run's checkpoint (its rank file read with weights_only=True) starts a SWAN run
    (``init_from``): the SWAN run's step 0 has the AdamW run's weights (the same validation loss) and its
    loss keeps falling; resuming the AdamW checkpoint into a SWAN run is refused, naming init_from, as is
    init_from inside an out_dir that resume=never clears."""
    a, b = tmp_path / "adamw", tmp_path / "swan"
    common = ["steps=6", "eval_every=3", "log_every=2", "save_model=true"]
    sa = main(["--config", SMOKE, "--set", f"out_dir={a}", *common, "optimizer=adamw", "lr=3e-3", "checkpoint_every=6"])
    step = a / "checkpoints" / "step_6"
    rank = torch.load(step / "rank_0.pt", weights_only=True)
    assert set(rank) == {"scheduler", "sampler", "torch_rng", "cuda_rng", "loss_sum", "loss_steps"}
    assert json.loads((step / "meta.json").read_text())["optimizer"] == "adamw"
    # SWAN's lr for AdamW's 3e-3: swan_dist.from_adamw(3e-3), 4x
    with caplog.at_level(logging.INFO, logger="swan_dist"):
        sb = main(["--config", SMOKE, "--set", f"out_dir={b}", *common, "optimizer=swan", "lr=0.012", f"init_from={a}"])
    loaded = [r.getMessage() for r in caplog.records if "from an AdamW checkpoint" in r.getMessage()]
    assert len(loaded) == 1 and "step of 7 fallback tensors; 14 tensors" in loaded[0], loaded  # 2 layers x 7 matrices
    assert sb["initial_val_loss"] == sa["final_val_loss"]  # the AdamW run's weights
    rows = _rows(b)
    assert rows[0]["step"] == 0 and sb["final_val_loss"] < sb["initial_val_loss"] - 0.05, rows
    with pytest.raises(ValueError, match="written with optimizer: adamw.*init_from="):
        main(["--config", SMOKE, "--set", f"out_dir={a}", *common, "optimizer=swan"])
    with pytest.raises(ValueError, match="resume=never deletes"):
        main(["--config", SMOKE, "--set", f"out_dir={a}", *common, "optimizer=swan", "resume=never", f"init_from={step}"])
    assert step.is_dir()
    with pytest.raises(ValueError, match="init_from"):
        load_config(SMOKE, ["init_from=auto"])
    with pytest.raises(FileNotFoundError, match="config init_from=.*no complete checkpoint"):
        main(["--config", SMOKE, "--set", f"out_dir={tmp_path / 'c'}", *common, f"init_from={tmp_path / 'none'}"])


@pytest.mark.timeout(300)
def test_init_from_a_one_process_adamw_checkpoint_under_fsdp2(tmp_path):
    """init_from reshards: an AdamW checkpoint written in one process starts SWAN under FSDP2 at W=2 (torchrun):
    its step 0 has the AdamW run's weights, and its loss falls."""
    a, b = tmp_path / "adamw", tmp_path / "swan"
    common = ["steps=4", "eval_every=4", "log_every=2"]
    sa = main(["--config", SMOKE, "--set", f"out_dir={a}", *common, "optimizer=adamw", "lr=3e-3", "checkpoint_every=4"])
    log = _torchrun(tmp_path, b, [*common, "optimizer=swan", "lr=0.012", "parallel=fsdp2", f"init_from={a}"])
    assert "init_from" in log and "exp_avg, exp_avg_sq and step of 7 fallback tensors" in log, log[-3000:]
    sb = json.loads((b / "summary.json").read_text())
    assert sb["world_size"] == 2 and abs(sb["initial_val_loss"] - sa["final_val_loss"]) < 1e-4
    assert sb["final_val_loss"] < sb["initial_val_loss"], sb
