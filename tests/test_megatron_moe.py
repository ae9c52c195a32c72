"""megatron-core MoE with expert parallelism and SWAN (``get_swan_optimizer``), on CPU with gloo: a tiny GPT
whose two layers are MoEs of 4 experts (top 2, SequentialMLP, the all-to-all token dispatcher; the CPU
settings of ``megatron_harness.MOE_CPU``). The expert-parallel runs start from the single-process model's
weights (each rank loads its own experts) and must equal it: EP=2 at W=2, and EP=2 x DP=2 with the
distributed optimizer and overlapped gradient reduction at W=4. Each expert matrix (gate and up of its
``linear_fc1`` apart) is whitened once per step, inside its expert-data-parallel group.

Not runnable here: MoE with dense TP > 1 (Megatron requires sequence parallelism there, whose LayerNorm
needs Transformer Engine) and expert TP > 1 (its token all-gather has rank-dependent sizes, which gloo's
all_gather refuses); SWAN's expert group covers them (the expert TP x expert DP ranks)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(600)
LR, STEPS, BATCH, SEQ, VOCAB, EXPERTS = 0.05, 3, 8, 8, 32, 4
SHAPE = dict(hidden=16, ffn=32, heads=4, query_groups=2, layers=2, vocab=VOCAB, seq=SEQ)
PER_STEP = 2 * (4 + 1 + EXPERTS * 3)  # per layer: Q, K, V, proj; the router; each expert's gate, up, fc2


def _worker(rank, world, ep, distopt, init, tp=1, etp=None, pp=1):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    import megatron_harness as H
    from swan_dist.integrations.megatron import get_swan_optimizer

    H.install_moe_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, pipeline_model_parallel_size=pp)
    try:
        chunks, _ = H.build_gpt(tp, pp, experts=EXPERTS, moe=dict(expert_tensor_parallel_size=etp or tp), use_distributed_optimizer=distopt, overlap_grad_reduce=distopt,
                                init_weights=init, **SHAPE)
        opt = get_swan_optimizer(OptimizerConfig(lr=LR, weight_decay=0.1, use_distributed_optimizer=distopt,
                                                 clip_grad=0.0), chunks, swan={"verbose": False, "bucket_mb": 0.001})
        inner = [w.optimizer for w in opt.chained_optimizers if w.optimizer is not None]
        start = H.full_weights(chunks, opt)
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        losses = [H.train_step(chunks, opt, H.dp_share(H.global_batch(t, BATCH, SEQ, VOCAB), dp_rank, dp))
                  for t in range(STEPS)]
        return dict(start=start, end=H.full_weights(chunks, opt), losses=losses,
                    whitened=sum(o.whitened_matrices for o in inner), kinds=[type(w).__name__ for w in opt.chained_optimizers],
                    groups=[sorted(dist.get_process_group_ranks(o.process_group)) for o in inner],
                    stage=ps.get_pipeline_model_parallel_rank(),
                    summary=inner[-1].summary())
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def reference():
    (ref,) = run_distributed(_worker, 1, 1, False, None, timeout=300)
    return ref


def _assert_equal(res, ref):
    for r in res:
        assert set(r["end"]) == set(ref["end"])
        for name, w in ref["end"].items():
            assert not torch.equal(w, ref["start"][name]), name  # every weight moved
            torch.testing.assert_close(r["end"][name], w, rtol=1e-4, atol=2e-5, msg=name)
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert ref["whitened"] == STEPS * PER_STEP


def test_expert_parallel_2_equals_one_process(reference):
    res = run_distributed(_worker, 2, 2, False, reference["start"], timeout=400)
    _assert_equal(res, reference)
    # the dense optimizer over both ranks, each rank's expert optimizer over itself (its experts are its own)
    assert [r["groups"] for r in res] == [[[0, 1], [0]], [[0, 1], [1]]]
    assert sum(r["whitened"] for r in res) == STEPS * PER_STEP  # each matrix once per step
    assert "local_experts" in res[0]["summary"]


def test_expert_parallel_2_x_data_parallel_2_distributed_optimizer_equals_one_process(reference):
    res = run_distributed(_worker, 4, 2, True, reference["start"], timeout=500)
    _assert_equal(res, reference)
    assert all(r["kinds"] == ["SwanDistributedOptimizer", "SwanDistributedOptimizer"] for r in res), res[0]["kinds"]
    # experts of EP rank 0 on ranks 0 and 2, of EP rank 1 on ranks 1 and 3: each whitened once, by one of them
    assert [r["groups"][1] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert sum(r["whitened"] for r in res) == STEPS * PER_STEP


def test_expert_parallel_2_x_pipeline_2_distributed_optimizer_equals_one_process(reference):
    """PP=2 x (DP=2 with EP=2 inside it) at W=4: each stage holds one MoE layer, each of its ranks two of
    the four experts; the stages together equal one process, every matrix whitened once per step."""
    res = run_distributed(_worker, 4, 2, True, reference["start"], 1, None, 2, timeout=500)
    stages = [[r for r in res if r["stage"] == s] for s in (0, 1)]
    assert [len(s) for s in stages] == [2, 2]
    end: dict[str, torch.Tensor] = {}
    for r in res:
        for name, w in r["end"].items():
            if name in end:
                assert torch.equal(end[name], w), name  # a weight two ranks hold (dense, DP) is the same
            end[name] = w
    assert set(end) == set(reference["end"])
    for name, w in reference["end"].items():
        assert not torch.equal(w, reference["start"][name]), name
        torch.testing.assert_close(end[name], w, rtol=1e-4, atol=2e-5, msg=name)
    for r in res:
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert r["kinds"] == ["SwanDistributedOptimizer", "SwanDistributedOptimizer"]
    # dense matrices over the stage's two ranks; the expert optimizer over each rank alone (EP = DP here)
    assert [r["groups"] for r in res] == [[[0, 1], [0]], [[0, 1], [1]], [[2, 3], [2]], [[2, 3], [3]]]
    assert sum(r["whitened"] for r in res) == STEPS * PER_STEP


def _grouped_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.moe import grouped_gemm_util

    import megatron_harness as H
    from swan_dist.integrations.megatron import get_swan_optimizer

    grouped_gemm_util.grouped_gemm = object()  # GroupedMLP's constructor asks only that its CUDA package exists
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    try:
        chunks, _ = H.build_gpt(1, experts=EXPERTS, grouped=True, **SHAPE)
        assert type(chunks[0].module.decoder.layers[0].mlp.experts).__name__ == "GroupedMLP"
        try:
            get_swan_optimizer(OptimizerConfig(lr=LR), chunks, swan={"verbose": False})
        except ValueError as e:
            return str(e)
        return None
    finally:
        ps.destroy_model_parallel()


def test_legacy_grouped_mlp_is_refused_on_every_rank_naming_the_stack():
    """GroupedMLP holds all local experts in one weight1/weight2: whitened whole it would mix the experts,
    so the optimizer is refused (before any collective) naming the stack and what to use instead."""
    for msg in run_distributed(_grouped_worker, 2, timeout=200):
        assert msg is not None and "decoder.layers.0.mlp.experts.weight1" in msg and "drop --moe-grouped-gemm" in msg
