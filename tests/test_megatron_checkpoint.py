"""Megatron ``dist_checkpointing`` (torch_dist) with SWAN from ``get_swan_optimizer``: a tiny GPTModel
(tests/megatron_harness.py, CPU, gloo) trains 4 steps at DP=2 and saves after step 2; the checkpoint
resumed at DP=2 ends bit-identical to the uninterrupted run, and (fp32) at DP=1 within reduction-order
noise. With the distributed optimizer swan_dist writes its own format (SWAN matrices contribute no
state; fallback moments, fp32 main params of a bf16 model and step counts per parameter range);
without it, Megatron's own format for FP32Optimizer / Float16OptimizerWithFloat16Params."""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(600)
LR, STEPS, SAVE_AT, BATCH, SEQ, VOCAB = 1e-2, 4, 2, 4, 16, 64
META = {"distrib_optim_sharding_type": "dp_reshardable"}  # what Megatron-LM passes by default


def _save(chunks, opt, path):
    from megatron.core import dist_checkpointing

    model_sd = chunks[0].module.sharded_state_dict()  # (DDP would prefix "module.")
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=META)}, path)


def _load(chunks, opt, path):
    from megatron.core import dist_checkpointing

    model_sd = chunks[0].module.sharded_state_dict()  # (DDP would prefix "module.")
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=META)}
    loaded = dist_checkpointing.load(sd, path)
    chunks[0].module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def _worker(rank, world, distopt, bf16, path, resume, ep=1):
    """``resume=False``: train STEPS steps, saving after SAVE_AT; else load and train the rest. Returns
    the fp32 main weights (TP=1 layout) this rank holds at the end. ``ep`` > 1: every MLP a MoE of 4
    experts, EP of them per rank group."""
    import megatron_harness as h
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    h.install_cpu_shims()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        chunks, _ = h.build_gpt(1, bf16=bf16, use_distributed_optimizer=distopt, vocab=VOCAB, seq=SEQ,
                                experts=4 if ep > 1 else 0)
        opt = get_swan_optimizer(OptimizerConfig(lr=LR, weight_decay=0.1, bf16=bf16, use_distributed_optimizer=distopt,
                                                 clip_grad=0.0), chunks, swan={"verbose": False})
        start = SAVE_AT if resume else 0
        if resume:
            _load(chunks, opt, path)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        for step in range(start, STEPS):
            h.train_step(chunks, opt, h.dp_share(h.global_batch(step, BATCH, SEQ, VOCAB), dp_rank, dp))
            if not resume and step + 1 == SAVE_AT:
                _save(chunks, opt, path)
        return h.full_weights(chunks, opt)
    finally:
        ps.destroy_model_parallel()


def _saved_keys(path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("distopt, bf16", [(True, False), (True, True), (False, False)],
                         ids=["distopt", "distopt-bf16", "ddp"])
def test_megatron_checkpoint_resumes_at_dp2_and_dp1(tmp_path, distopt, bf16):
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    full = run_distributed(_worker, 2, distopt, bf16, path, False, timeout=300)[0]
    keys = _saved_keys(path)
    if distopt:  # swan_dist's format: fallback moments only, per parameter; none for SWAN matrices
        moments = {k for k in keys if k.startswith("optimizer.swan.exp_avg.")}
        assert "optimizer.swan.exp_avg.embedding.word_embeddings.weight" in moments, sorted(keys)
        assert "optimizer.swan.exp_avg_sq.decoder.layers.1.self_attention.linear_qkv.bias" in keys
        assert not [k for k in moments if k.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight",
                                                       "linear_fc2.weight"))], sorted(moments)
        assert ("optimizer.swan.fp32_param.decoder.layers.0.mlp.linear_fc1.weight" in keys) == bf16
    else:  # Megatron's own: an AdamW moment per fallback tensor, none for SWAN matrices
        moments = {k for k in keys if "exp_avg" in k}
        assert any("word_embeddings" in k for k in moments), sorted(keys)
        assert not [k for k in moments if "linear_qkv.weight" in k or "linear_fc2.weight" in k], sorted(moments)
    # bf16 at DP=1 computes gradients over the whole batch in bf16, which the AdamW fallback turns into
    # +-lr steps on tiny gradients: the other DP size is checked in fp32, bf16 resumes bit-identically at DP=2
    for world in (2,) if bf16 else (2, 1):
        resumed = run_distributed(_worker, world, distopt, bf16, path, True, timeout=300)[0]
        assert resumed.keys() == full.keys()
        for n, v in full.items():
            if world == 2:
                assert torch.equal(resumed[n], v), n
            else:  # DP=1 sums the same gradients in another order
                assert torch.allclose(resumed[n], v, rtol=1e-4, atol=1e-6), (n, (resumed[n] - v).abs().max())


def _merged(per_rank: list[dict]) -> dict:
    out: dict = {}
    for weights in per_rank:
        out.update(weights)  # each expert on the ranks of its EP rank; dense weights alike on every rank
    return out


def test_megatron_moe_checkpoint_resumes_at_ep2_x_dp2_and_ep2_x_dp1(tmp_path):
    """MoE (4 experts, EP=2) with the distributed optimizer: saved at W=4 (EP=2 x DP=2), resumed at the
    same layout bit-identically and at W=2 (EP=2, expert DP 1) within reduction-order noise; the expert
    matrices keep no state in the checkpoint."""
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    full = _merged(run_distributed(_worker, 4, True, False, path, False, 2, timeout=400))
    assert sum("local_experts" in n for n in full) == 2 * 4 * 2  # layers x experts x (fc1, fc2): all present
    keys = _saved_keys(path)
    assert not [k for k in keys if "exp_avg" in k and "local_experts" in k], sorted(keys)
    # two chained optimizers (dense, experts): keys under chained_<i>.; fallback moments for the embedding
    assert any(k.startswith("chained_0.optimizer.swan.exp_avg.") and "word_embeddings" in k for k in keys), sorted(keys)
    for world in (4, 2):
        resumed = _merged(run_distributed(_worker, world, True, False, path, True, 2, timeout=400))
        assert resumed.keys() == full.keys()
        for n, v in full.items():
            if world == 4:
                assert torch.equal(resumed[n], v), n
            else:
                assert torch.allclose(resumed[n], v, rtol=1e-4, atol=1e-6), (n, (resumed[n] - v).abs().max())
