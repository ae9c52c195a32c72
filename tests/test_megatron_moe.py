"""megatron-core MoE with expert parallelism and SWAN (``get_swan_optimizer``), on CPU with gloo: a tiny GPT
whose two layers are MoEs of 4 experts (top 2, SequentialMLP, the all-to-all token dispatcher; the CPU
settings of ``megatron_harness.MOE_CPU``). The expert-parallel runs start from the single-process model's
weights (each rank loads its own experts) and must equal it: EP=2 at W=2, and EP=2 x DP=2 with the
distributed optimizer and overlapped gradient reduction at W=4. Each expert matrix (gate and up of its
``linear_fc1`` apart) is whitened once per step, inside its expert-data-parallel group.

Not runnable here: MoE with dense TP > 1 (Megatron requires sequence parallelism there, whose LayerNorm
needs Transformer Engine)."""

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
    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    H.install_moe_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp, pipeline_model_parallel_size=pp)
    try:
        chunks, _ = H.build_gpt(tp, pp, experts=EXPERTS, moe=dict(expert_tensor_parallel_size=etp or tp), use_distributed_optimizer=distopt, overlap_grad_reduce=distopt,
                                init_weights=init, **SHAPE)
        opt = get_swan_optimizer(OptimizerConfig(lr=LR, min_lr=LR / 10, weight_decay=0.1, use_distributed_optimizer=distopt,
                                                 clip_grad=0.0), chunks, swan={"verbose": False, "bucket_mb": 0.001})
        inner = [w.optimizer for w in opt.chained_optimizers if w.optimizer is not None]
        start = H.full_weights(chunks, opt)
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        schedule = H.lr_schedule(opt, LR, STEPS, 0.1)  # a new lr every step, as in a real run
        losses = []
        for t in range(STEPS):
            losses.append(H.train_step(chunks, opt, H.dp_share(H.global_batch(t, BATCH, SEQ, VOCAB), dp_rank, dp)))
            schedule.step(1)
        return dict(start=start, end=H.full_weights(chunks, opt), losses=losses, lr_end=opt.param_groups[0]["lr"],
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
    assert LR / 10 <= ref["lr_end"] < LR  # the schedule moved the lr


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


def _etp_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    import megatron_harness as H
    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    ps.initialize_model_parallel(expert_tensor_parallel_size=2)
    try:
        chunks, _ = H.build_gpt(1, experts=EXPERTS, moe=dict(expert_tensor_parallel_size=2), **SHAPE)
        assert chunks[0].module.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.shape[0] == SHAPE["ffn"]
        try:
            get_swan_optimizer(OptimizerConfig(lr=LR), chunks, swan={"verbose": False})
        except ValueError as e:
            return str(e)
    finally:
        ps.destroy_model_parallel()


def test_expert_tensor_parallelism_without_expert_parallelism_is_refused_on_every_rank():
    """Expert TP=2 at EP=1 (dense TP=1): each rank holds half of each expert, yet Megatron marks experts
    dense then and averages their gradients over both ranks; refused on every rank, saying what to set."""
    for msg in run_distributed(_etp_worker, 2, timeout=200):
        assert msg is not None and "--expert-tensor-parallel-size" in msg and "expert-parallel size 1" in msg, msg


def test_expert_parallel_2_x_expert_tensor_parallel_2_equals_one_process(reference):
    """EP=2 x expert TP=2 at W=4 (dense TP=1, DP=4): each expert's fc1 cut by rows and fc2 by columns over
    the two ranks of its expert TP group; each expert matrix is whitened whole, once, inside that group,
    and the run equals one process. (The token all-gather over the expert TP group has a size per rank:
    the harness gives gloo the padded form NCCL does not need.)"""
    res = run_distributed(_worker, 4, 2, False, reference["start"], 1, 2, timeout=500)
    _assert_equal(res, reference)
    experts = [tuple(r["groups"][1]) for r in res]
    assert all(len(g) == 2 for g in experts) and sorted(set(experts)) == [(0, 1), (2, 3)], experts
    assert all(r["groups"][0] == [0, 1, 2, 3] for r in res)
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


def _copy_into_grouped(seq: dict, grp: dict, experts_local: int) -> None:
    """SequentialMLP's tensors (``seq``: name -> tensor) into the GroupedMLP model's (``grp``): dense ones by
    name; each local expert's fc1 / fc2 (out, in) into its block of weight1 / weight2, stored (in, out)."""
    for name, t in grp.items():
        if name.endswith(("experts.weight1", "experts.weight2")):
            prefix, w = name.rsplit(".", 1)
            fc = "linear_fc1" if w == "weight1" else "linear_fc2"
            blocks = [seq[f"{prefix}.local_experts.{j}.{fc}.weight"].t() for j in range(experts_local)]
            t.view(experts_local, *blocks[0].shape).copy_(torch.stack(blocks))
        else:
            t.copy_(seq[name])


def _grouped_worker(rank, world, ep, distopt, etp=1):
    """The same weights and gradients in a SequentialMLP model and a legacy GroupedMLP one (built here
    only: its forward needs the CUDA ``grouped_gemm`` package, whose presence is all its constructor
    asks), one optimizer step each; returns both models' weights, GroupedMLP's rearranged per expert."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.moe import grouped_gemm_util

    import megatron_harness as H
    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    grouped_gemm_util.grouped_gemm = object()
    ps.initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    try:
        seq_chunks, _ = H.build_gpt(1, experts=EXPERTS, use_distributed_optimizer=distopt, **SHAPE)
        grp_chunks, _ = H.build_gpt(1, experts=EXPERTS, grouped=True, use_distributed_optimizer=distopt,
                                    moe=dict(expert_tensor_parallel_size=etp), **SHAPE)
        seq_model, grp_model = seq_chunks[0].module, grp_chunks[0].module
        assert type(grp_model.decoder.layers[0].mlp.experts).__name__ == "GroupedMLP"
        seq, grp = dict(seq_model.named_parameters()), dict(grp_model.named_parameters())
        local = EXPERTS // ep
        with torch.no_grad():
            _copy_into_grouped({n: p.data for n, p in seq.items()}, {n: p.data for n, p in grp.items()}, local)
        cfg = OptimizerConfig(lr=LR, weight_decay=0.1, use_distributed_optimizer=distopt, clip_grad=0.0)
        try:
            opts = [get_swan_optimizer(cfg, c, swan={"verbose": False, "bucket_mb": 0.001})
                    for c in (seq_chunks, grp_chunks)]
        except ValueError as e:
            return dict(error=str(e))
        g = torch.Generator().manual_seed(7)  # the same gradients on every rank: a data-parallel mean
        grads = {n: torch.randn(p.shape, generator=g) for n, p in sorted(seq.items())}
        with torch.no_grad():
            for n, p in seq.items():
                p.main_grad.copy_(grads[n])
            _copy_into_grouped(grads, {n: p.main_grad for n, p in grp.items()}, local)
        for opt in opts:
            assert opt.step()[0]
        inner = [[w.optimizer for w in o.chained_optimizers if w.optimizer is not None] for o in opts]
        out = {}
        for n, p in grp.items():
            if n.endswith(("experts.weight1", "experts.weight2")):
                prefix, w = n.rsplit(".", 1)
                fc = "linear_fc1" if w == "weight1" else "linear_fc2"
                blocks = p.data.view(local, *seq[f"{prefix}.local_experts.0.{fc}.weight"].shape[::-1])
                out.update({f"{prefix}.local_experts.{j}.{fc}.weight": blocks[j].t().clone() for j in range(local)})
            else:
                out[n] = p.data.clone()
        return dict(seq={n: p.data.clone() for n, p in seq.items()}, grp=out,
                    whitened=[sum(o.whitened_matrices for o in i) for i in inner],
                    summary="\n".join(o.summary() for o in inner[1]))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("ep", [1, 2], ids=["ep1-dp2", "ep2"])
def test_legacy_grouped_mlp_equals_sequential_mlp(ep):
    """GroupedMLP (all local experts in one weight1 / weight2, each expert a block stored (in, out)) is
    whitened per expert, gate and up apart, transposed: one step from the same weights and gradients
    equals SequentialMLP's, with the distributed optimizer; at EP=1 x DP=2 its stacks are cut by the
    optimizer's shards and whitened on owners, at EP=2 each rank's experts by itself."""
    for r in run_distributed(_grouped_worker, 2, ep, True, timeout=300):
        assert set(r["grp"]) == set(r["seq"])
        for name, w in r["seq"].items():
            torch.testing.assert_close(r["grp"][name], w, rtol=1e-5, atol=1e-6, msg=name)
        assert r["whitened"][0] == r["whitened"][1] > 0
        assert "GroupedMLP experts (weight1, E=" in r["summary"] and "gate, up" in r["summary"], r["summary"]


def test_legacy_grouped_mlp_cut_by_expert_tensor_parallelism_is_refused_on_every_rank():
    for r in run_distributed(_grouped_worker, 4, 2, False, 2, timeout=300):  # EP=2 x expert TP=2
        assert "experts.weight1" in r["error"] and "--expert-tensor-parallel-size 1" in r["error"], r
