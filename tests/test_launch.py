"""launch/ scripts: a real two-"node" job on loopback (two torchrun agents, c10d rendezvous) with FSDP2
+ SWAN agrees with a single-node two-process run."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--set", "parallel=fsdp2", "optimizer=swan", "lr=null", "steps=8", "eval_every=4", "save_model=true",
        "swan_mode=owner"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = {**os.environ, "PYTHON": sys.executable, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    for k in ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID"):
        env.pop(k, None)
    return env


def _run_nodes(cmd: list[str], node_envs: list[dict[str, str]]) -> str:
    """Start ``cmd`` once per "node" (its environment) at the same time; every node must succeed.
    Returns the nodes' outputs, joined."""
    nodes = [subprocess.Popen(cmd, env=_env(**e), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for e in node_envs]
    try:
        outs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outs)
    return "\n".join(outs)


def _summaries(tmp_path) -> tuple[dict, dict]:
    return tuple(json.loads((tmp_path / run / "summary.json").read_text()) for run in ("single", "multi"))


@pytest.mark.timeout(300)
def test_two_node_loopback_matches_single_node(tmp_path):
    smoke = str(REPO / "configs" / "train" / "smoke.yaml")
    single = subprocess.run(
        ["bash", str(REPO / "launch" / "torchrun_single.sh"), smoke, "--", *ARGS, f"out_dir={tmp_path / 'single'}"],
        env=_env(NPROC="2"), capture_output=True, text=True, timeout=240,
    )
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-3000:]
    port = _port()
    _run_nodes(["bash", str(REPO / "launch" / "torchrun_multinode.sh"), smoke, "--", *ARGS, f"out_dir={tmp_path / 'multi'}"],
               [dict(NNODES="2", NODE_RANK=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NPROC_PER_NODE="1",
                     RDZV_ID=f"test{port}") for n in range(2)])
    a, b = _summaries(tmp_path)
    assert b["world_size"] == 2 and b["whitened_matrices"] == a["whitened_matrices"] == 8 * 7 * 2
    assert abs(a["final_val_loss"] - b["final_val_loss"]) < 1e-4
    wa, wb = torch.load(tmp_path / "single" / "model.pt"), torch.load(tmp_path / "multi" / "model.pt")
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-5), k


DS_ARGS = ["--set", "parallel=deepspeed", f"deepspeed_config={REPO / 'configs' / 'deepspeed' / 'zero2.json'}",
           "optimizer=swan", "lr=null", "steps=6", "eval_every=3", "save_model=true"]


@pytest.mark.timeout(300)
def test_deepspeed_launcher_hostfile_two_nodes_matches_one_node(tmp_path):
    """launch/deepspeed.sh: one node with 2 processes, and a hostfile of two 1-slot "nodes" each started
    with NO_SSH=1 and its NODE_RANK (DeepSpeed's --no_ssh mode), reach the same weights under ZeRO-2."""
    smoke = str(REPO / "configs" / "train" / "smoke.yaml")
    script = str(REPO / "launch" / "deepspeed.sh")
    single = subprocess.run(["bash", script, smoke, "--", *DS_ARGS, f"out_dir={tmp_path / 'single'}"],
                            env=_env(NPROC="2", MASTER_PORT=str(_port())), capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-3000:]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    port = _port()
    _run_nodes(["bash", script, smoke, "--", *DS_ARGS, f"out_dir={tmp_path / 'multi'}"],
               [dict(HOSTFILE=str(hostfile), NO_SSH="1", NODE_RANK=str(n), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)) for n in range(2)])
    a, b = _summaries(tmp_path)
    assert a["parallel"] == b["parallel"] == "deepspeed" and a["world_size"] == b["world_size"] == 2
    assert b["whitened_matrices"] == a["whitened_matrices"] == 6 * 7 * 2
    assert abs(a["final_val_loss"] - b["final_val_loss"]) < 1e-5
    wa, wb = torch.load(tmp_path / "single" / "model.pt"), torch.load(tmp_path / "multi" / "model.pt")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


RESTART_ARGS = ["--set", "parallel=fsdp2", "optimizer=swan", "lr=null", "steps=8", "eval_every=4", "log_every=2",
                "save_model=true", "swan_mode=owner", "checkpoint_every=3", "dist_timeout_s=60"]  # fmt: skip


@pytest.mark.timeout(300)
def test_two_node_restart_after_sigkill_matches_uninterrupted(tmp_path):
    """Two torchrun agents (c10d rendezvous, --max-restarts 1, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as
    docs/launch.md says for several nodes): the process on "node" 1 SIGKILLs itself after step 5, both
    agents restart their workers, which resume from step_3 and end with the uninterrupted two-node
    run's weights bit for bit."""
    smoke = str(REPO / "configs" / "train" / "smoke.yaml")
    for run, kill in (("ref", None), ("faulted", "1:5")):
        port = _port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
               "--max-restarts", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
               "--rdzv_id", f"restart{port}", "-m", "swan_dist.reference.train", "--config", smoke, *RESTART_ARGS,
               f"out_dir={tmp_path / run}"]  # fmt: skip
        extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **({"SWAN_DIST_FAULT_KILL": kill} if kill else {})}
        log = _run_nodes(cmd, [extra, extra])
        if kill:
            assert "rank 1: SWAN_DIST_FAULT_KILL, SIGKILL at step 5" in log, log[-4000:]
            assert f"resumed from {tmp_path / run / 'checkpoints' / 'step_3'} (step 3" in log, log[-4000:]
        else:
            assert "resumed from" not in log
    rows = {run: (tmp_path / run / "metrics.jsonl").read_text().splitlines() for run in ("ref", "faulted")}
    assert [json.loads(r)["step"] for r in rows["faulted"]] == [json.loads(r)["step"] for r in rows["ref"]]
    assert sorted(p.name for p in (tmp_path / "faulted" / "checkpoints").iterdir()) == ["step_3", "step_6"]
    wa, wb = torch.load(tmp_path / "ref" / "model.pt"), torch.load(tmp_path / "faulted" / "model.pt")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
