"""swan_dist in torchtitan's own trainer (``torchtitan.train.main``, unmodified) on CPU with gloo, through
``tests/torchtitan_harness.py`` (device override and CPU shims there only) and the job configs of
``tests/torchtitan_configs.py`` (torchtitan's debug llama3 and deepseek_v3 models, SWAN selected by one entry).

Every run starts from one seed checkpoint (torchtitan's ``create_seed_checkpoint``) and sees the same global
batches, in float32 with the same clipping; the weights torchtitan's checkpointer saves after the last step must
equal the W=1 run's, for every layout at W=2 and at W=4:

- FSDP2: dp_shard 2 | dp_shard 4;
- PP=2 (interleaved: two model parts per rank): PP alone | PP 2 x FSDP2 2;
- TP=2: TP alone | FSDP2 2 x TP 2;
- EP on the MoE model: EP 2 over dp_shard 2 | EP 2 within dp_shard 4 (the experts FSDP-sharded over the other
  2, torchtitan's efsdp) and EP 4 over dp_shard 4;
- HSDP: W=4 only, by construction (replicate 2 x shard 2; at W=2 one of the two is 1: DDP or FSDP2).

A checkpoint saved at step 2 resumes to the same step 3 at W=2 and at W=4. Launches are shared (several jobs of
one world size per launch, ``---`` between them) to keep the import and start-up cost down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("triton")

from dist_utils import _free_port  # noqa: E402

pytestmark = pytest.mark.timeout(1800)
HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def launch(nproc: int, jobs: list[list[str]], root: str, ok: bool = True) -> str:
    args: list[str] = []
    for job in jobs:
        args += (["---"] if args else []) + job
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(_free_port()), os.path.join(HERE, "torchtitan_harness.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SWAN_TT_ASSETS": os.path.join(root, "assets"),
           "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env, cwd=root)
    out = p.stdout + p.stderr
    assert (p.returncode == 0) == ok, out[-6000:]
    return out


def job(root: str, name: str, config: str, *extra: str, seed: bool = True) -> list[str]:
    model = "dsv3" if config.startswith("dsv3") else "llama3"
    a = ["--module", "torchtitan_configs", "--config", config, "--dump_folder", os.path.join(root, name),
         "--checkpoint.folder", "ckpt", "--training.steps", str(STEPS)]
    if seed:
        a += ["--checkpoint.initial_load_path", os.path.join(root, f"seed_{model}", "ckpt", "step-0")]
    return a + list(extra)


def weights(root: str, name: str, step: int = STEPS) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(root, f"{name}-{step}.pt")
    dcp_to_torch_save(os.path.join(root, name, "ckpt", f"step-{step}"), out)
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def assert_same(root: str, name: str, ref: str, step: int = STEPS, atol: float = 2e-5) -> None:
    a, b = weights(root, name, step), weights(root, ref, step)
    assert a.keys() == b.keys() and len(a) > 10
    start = weights(root, "seed_" + ("dsv3" if ref.startswith("ref_dsv3") else "llama3"), 0)
    moved = 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-4, msg=lambda m: f"{name} vs {ref}: {k}: {m}")
        moved += not torch.equal(a[k], start[k])
    assert moved > len(a) // 2, f"{name}: only {moved} of {len(a)} tensors changed from the seed"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torchtitan_harness
    root = str(tmp_path_factory.mktemp("titan"))
    torchtitan_harness.make_assets(os.path.join(root, "assets"), seq_len=16)
    outs = {}
    seed = ["--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1"]
    outs[1] = launch(1, [job(root, "seed_llama3", "llama3_swan", *seed, seed=False),
                         job(root, "seed_dsv3", "dsv3_swan", *seed, seed=False),
                         job(root, "ref_llama3", "llama3_swan"),
                         job(root, "ref_dsv3", "dsv3_swan")], root)
    pp2, ep2, tp2 = (["--parallelism.pipeline_parallel_degree", "2"], ["--parallelism.expert_parallel_degree", "2"],
                     ["--parallelism.tensor_parallel_degree", "2"])
    outs[2] = launch(2, [job(root, "fsdp2_w2", "llama3_swan", "--checkpoint.interval", "2"),
                         job(root, "pp2_w2", "llama3_swan", *pp2),
                         job(root, "ep2_w2", "dsv3_swan", *ep2)], root)
    # resumes from fsdp2_w2's step 2: at W=2 and at W=4 (the data set gives every step the same global batch)
    for name in ("resume_w2", "resume_w4"):
        os.makedirs(os.path.join(root, name, "ckpt"))
        shutil.copytree(os.path.join(root, "fsdp2_w2", "ckpt", "step-2"), os.path.join(root, name, "ckpt", "step-2"))
    resume = ["--checkpoint.exclude_from_loading", "dataloader"]
    dp4 = ["--training.local_batch_size", "1"]  # global batch 4 over 4 data-parallel ranks
    outs[4] = launch(4, [job(root, "hsdp_w4", "llama3_swan", "--parallelism.data_parallel_replicate_degree", "2", *dp4),
                         job(root, "resume_w4", "llama3_swan", *resume, *dp4, seed=False),
                         job(root, "fsdp2_w4", "llama3_swan", *dp4),
                         job(root, "pp2_w4", "llama3_swan", *pp2, "--parallelism.data_parallel_shard_degree", "2"),
                         job(root, "ep2_w4", "dsv3_swan", *ep2, *dp4),  # efsdp 2: the experts FSDP-sharded too
                         job(root, "ep4_w4", "dsv3_swan", "--parallelism.expert_parallel_degree", "4", *dp4)], root)
    # FSDP2 + TP in a launch of its own: run after HSDP in one launch it did not finish within 15 minutes
    # (on a heavily loaded machine; alone it ran in under 2)
    outs[5] = launch(4, [job(root, "fsdp2_tp_w4", "llama3_swan", *tp2)], root)
    # TP alone at W=2 (first in its launch, as FSDP2 + TP is alone in its own)
    outs[3] = launch(2, [job(root, "tp2_w2", "llama3_swan", *tp2),
                         job(root, "resume_w2", "llama3_swan", *resume, seed=False)], root)
    return root, outs


@pytest.mark.parametrize("name", ["fsdp2_w2", "fsdp2_w4", "pp2_w2", "pp2_w4", "tp2_w2", "fsdp2_tp_w4", "hsdp_w4"])
def test_llama3_layouts_equal_w1(runs, name):
    assert_same(runs[0], name, "ref_llama3")


@pytest.mark.parametrize("name", ["ep2_w2", "ep2_w4", "ep4_w4"])
def test_moe_expert_parallel_equals_w1(runs, name):
    import re
    # torchtitan's grouped experts (E, out, in) are whitened per expert, not left to the fallback (SWAN's summary
    # in the output of the launch that ran the job)
    out = runs[1][int(name[-1])]
    assert re.search(r"SWAN\s+layers\.\*\.moe\.routed_experts\.inner_experts\.w2_EDF\s+x5\s+\[8, 256, 256\]", out)
    assert_same(runs[0], name, "ref_dsv3")


@pytest.mark.parametrize("name", ["resume_w2", "resume_w4"])
def test_checkpoint_resumes_at_same_and_other_world_size(runs, name):
    out = runs[1][4 if name.endswith("w4") else 3]
    assert "step 2" in out.lower() or "step-2" in out
    assert_same(runs[0], name, "ref_llama3")


# ---------------------------------------------------------------- in one process: the container itself


def _parts():
    torch.manual_seed(0)
    part = torch.nn.ModuleDict({"tok_embeddings": torch.nn.Embedding(16, 8), "wq": torch.nn.Linear(8, 8, bias=False),
                                "norm": torch.nn.LayerNorm(8)})
    return [part]


def test_one_entry_selects_swan_and_refuses_what_it_cannot_follow():
    from torchtitan.components.optimizer import ParamGroupConfig
    from swan_dist.integrations.torchtitan import SwanOptimizersContainer, TitanSWAN

    opt = SwanOptimizersContainer.Config(lr=1e-2).build(model_parts=_parts())
    assert len(opt) == 1 and isinstance(opt.swan, TitanSWAN)
    use = {n: g["use_swan"] for g in opt.swan.param_groups for n in g["param_names"]}
    assert use == {"wq.weight": True, "tok_embeddings.weight": False, "norm.weight": False, "norm.bias": False}
    # the user's param groups: SWAN for the matrices, torchtitan's AdamW for the rest
    mixed = SwanOptimizersContainer.Config(lr=1e-2, param_groups=[
        ParamGroupConfig(pattern=r"^wq\.", optimizer_name="SWAN"),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3, "fused": False})])
    built = mixed.build(model_parts=_parts())
    assert sorted(type(o).__name__ for o in built) == ["AdamW", "TitanSWAN"]
    with pytest.raises(ValueError, match="fused_opt_states_bf16.*for-loop"):
        SwanOptimizersContainer.Config(implementation="fused_opt_states_bf16").build(model_parts=_parts())
    with pytest.raises(ValueError, match="step_in_backward.*clips"):
        SwanOptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="SWAN", optimizer_kwargs={"step_in_backward": True})]).build(
            model_parts=_parts())


def test_config_without_lr_converts_torchtitans_adamw_and_an_adamw_lr_resolves_as_swan_does():
    """``Config()`` resolves through the lr convention from torchtitan's own AdamW (``default_adamw``: lr 8e-4, betas
    (0.9, 0.95), eps 1e-8, weight decay 0.1): matrices at 0.2 x 8e-4, the fallback at 4 x 8e-4, weight decay 0.5;
    ``adamw_lr`` (and ``swan_config(lr)``, ``default_adamw``'s counterpart) gives ``SWAN(adamw_lr=...)``'s lrs."""
    from torchtitan.components.optimizer import default_adamw
    from swan_dist import SWAN
    from swan_dist.integrations.torchtitan import SwanOptimizersContainer, swan_config

    def lrs(opt):
        swan = next(g for g in opt.param_groups if g["use_swan"])
        rest = next(g for g in opt.param_groups if not g["use_swan"])
        return (swan["lr"] * swan["alpha"], rest["lr"], swan["weight_decay"], rest["weight_decay"], *rest["betas"],
                rest["eps"])

    titan = default_adamw().param_groups[0].optimizer_kwargs
    assert (titan["lr"], tuple(titan["betas"]), titan["eps"], titan["weight_decay"]) == (8e-4, (0.9, 0.95), 1e-8, 0.1)
    got = lrs(SwanOptimizersContainer.Config().build(model_parts=_parts()).swan)
    assert got == pytest.approx((0.2 * 8e-4, 4 * 8e-4, 0.5, 0.5, 0.9, 0.95, 1e-8))
    eta = 3e-4
    plain = lrs(SWAN(_parts()[0], adamw_lr=eta, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, verbose=False))
    for config in (SwanOptimizersContainer.Config(adamw_lr=eta), swan_config(eta)):
        assert lrs(config.build(model_parts=_parts()).swan) == pytest.approx(plain)
    assert plain[:2] == pytest.approx((0.2 * eta, 4 * eta))
    with pytest.raises(ValueError, match="adamw_lr=0.0003 and lr=0.01"):
        SwanOptimizersContainer.Config(adamw_lr=eta, lr=0.01).build(model_parts=_parts())


def test_init_optim_state_step_is_harmless_and_state_round_trips():
    from torchtitan.components.optimizer.utils import init_optim_state
    from swan_dist.integrations.torchtitan import SwanOptimizersContainer

    parts = _parts()
    before = {n: p.detach().clone() for n, p in parts[0].named_parameters()}
    opt = SwanOptimizersContainer.Config(lr=1e-2, weight_decay=0.1).build(model_parts=parts)
    init_optim_state(opt.swan)  # torchtitan's zero-gradient lr=0 step
    for n, p in parts[0].named_parameters():
        assert torch.equal(p, before[n]), n
    assert opt.swan.state and all(p.grad is None for p in parts[0].parameters())
    sd = opt.state_dict()
    assert "param_groups.wq.weight.fused" in sd and "param_groups.wq.weight.lr" in sd
    assert "state.tok_embeddings.weight.exp_avg" in sd and not any(k.startswith("state.wq.") for k in sd)
    for p in parts[0].parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    trained = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state_dict().items()}
    fresh = SwanOptimizersContainer.Config(lr=1e-2, weight_decay=0.1).build(model_parts=_parts())
    fresh.load_state_dict(trained)
    for k, v in fresh.state_dict().items():
        assert (torch.equal(v, trained[k]) if isinstance(v, torch.Tensor) else v == trained[k]), k


def test_documented_cpu_command_runs(tmp_path):
    """docs/integrations/torchtitan.md's command (after ``<!-- torchtitan-command -->``) runs as written, with its
    /tmp folders moved into this test's."""
    import re
    import shlex
    root = os.path.dirname(HERE)
    with open(os.path.join(root, "docs", "integrations", "torchtitan.md")) as f:
        doc = f.read()
    cmd = re.search(r"<!-- torchtitan-command -->\n```bash\n(.*?)\n```", doc, re.S).group(1)
    cmd = cmd.replace("/tmp/swan_tt_assets", str(tmp_path / "assets")).replace("/tmp/swan_tt_run", str(tmp_path / "run"))
    env_part, _, rest = cmd.partition(" python ")
    argv = shlex.split(rest)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **dict(kv.split("=", 1) for kv in shlex.split(env_part))}
    p = subprocess.run([sys.executable, *argv[:argv.index("--nproc_per_node")], "--master-port", str(_free_port()),
                        *argv[argv.index("--nproc_per_node"):]], capture_output=True, text=True, timeout=600,
                       env=env, cwd=root)
    out = _strip(p.stdout + p.stderr)
    assert p.returncode == 0, out[-4000:]
    assert re.search(r"step:\s+3\s+loss", out), out[-3000:]


def _strip(text: str) -> str:
    import re
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
