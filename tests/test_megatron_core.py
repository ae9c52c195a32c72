"""megatron-core's own training stack with SWAN from one call (``get_swan_optimizer``), on CPU with gloo
(``megatron_harness``: a tiny GPTModel with the local layer spec, SwiGLU, GQA, RoPE and tied embeddings
in Megatron DDP, trained through Megatron's pipeline schedule; CUDA shims in that file, test-only).

Every layout equals the single-process SWAN run (TP=1, PP=1, DP=1) on the same initial weights and
global batches, to 1e-3 of each tensor's change over the run: TP=2; DP=2 with the distributed
optimizer, and again with overlap_grad_reduce and 4 micro-batches of gradient accumulation; TP=2 x
DP=2; PP=2 (the last stage's tied output layer stays the first stage's embedding); PP=2 x DP=2. bf16
with fp32 main params (Float16OptimizerWithFloat16Params at TP=2, the distributed optimizer at DP=2)
equals the single-process bf16 run to a tenth of the last step, which a run one step short is not.

One spawned job per layout runs all of that layout's cases (built one after another in the same
processes) and is cached, like the single-process reference, for the test process.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(600)
LR, STEPS, BATCH, SEQ, VOCAB, LAYERS = 1e-2, 3, 8, 16, 64, 2
PER_LAYER = 7  # matrices whitened per layer and step: Q, K, V, linear_proj, gate, up, linear_fc2
# bf16: SGD as the fallback. AdamW turns the tiny, bf16-rounded gradients of embeddings and biases into
# ±lr steps whose signs rounding decides (Adam's behaviour, not SWAN's); see test_deepspeed.py
BF16 = {"bf16": True, "swan": {"fallback": "sgd"}}


def _run(tp, pp, init, *, distopt=False, overlap=False, micro=1, bf16=False, tied=True, steps=STEPS, swan=None):
    """One model of this layout trained ``steps`` steps with SWAN: what this rank sees of it (weights
    are the optimizer's fp32 main params, whole, in the TP=1 layout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    import megatron_harness as H
    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    chunks, _ = H.build_gpt(tp, pp, bf16=bf16, use_distributed_optimizer=distopt, overlap_grad_reduce=overlap,
                            tied=tied, vocab=VOCAB, seq=SEQ, layers=LAYERS, init_weights=init if tied else None)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the start-up summary: each pipeline stage's first rank
        opt = get_swan_optimizer(OptimizerConfig(lr=LR, weight_decay=0.1, bf16=bf16, use_distributed_optimizer=distopt,
                                                 clip_grad=0.0), chunks,
                                 swan={"bucket_mb": 0.01, **(swan or {})})
    inner = [w.optimizer for w in opt.chained_optimizers if w.optimizer is not None]
    out = dict(kinds=[type(w).__name__ for w in opt.chained_optimizers], summary=inner[0].summary(),
               group=sorted(dist.get_process_group_ranks(inner[0].process_group)),
               stage=ps.get_pipeline_model_parallel_rank(), start=H.full_weights(chunks, opt), losses=[],
               printed=printed.getvalue())
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    for step in range(steps):
        if step == steps - 1:
            out["short"] = H.full_weights(chunks, opt)  # one step short of the end
        batch = H.dp_share(H.global_batch(step, BATCH, SEQ, VOCAB), dp_rank, dp)
        out["losses"].append(H.train_step(chunks, opt, batch, micro))
    out.update(end=H.full_weights(chunks, opt), whitened=sum(o.whitened_matrices for o in inner),
               embedding=H.full_weights(chunks)["embedding.word_embeddings.weight"], tied=H.tied_copy(chunks))
    return out


def _worker(rank, world, tp, pp, init, runs):
    """Every run of one layout, in one process launch. ``init=None`` (the reference): Megatron's own
    seeded initialisation, whose weights the job's later runs then start from."""
    from megatron.core import parallel_state as ps

    import megatron_harness as H

    H.install_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        out = []
        for kwargs in runs:
            out.append(_run(tp, pp, init, **kwargs))
            init = out[0]["start"] if init is None else init
        return out
    finally:
        ps.destroy_model_parallel()


# name: (processes, TP, PP, runs); the reference is the one whose init is Megatron's own
JOBS = {
    "reference": (1, 1, 1, [{}, BF16, {"tied": False, "steps": 0}]),  # the untied model: its summary only
    "tp2": (2, 2, 1, [{}, BF16]),
    "dp2": (2, 1, 1, [{"distopt": True}, {"distopt": True, "overlap": True, "micro": 4},
                      {**BF16, "distopt": True, "micro": 2}]),
    "tp2xdp2": (4, 2, 1, [{"distopt": True, "micro": 2}]),
    "tp2xdp4": (8, 2, 1, [{"distopt": True, "micro": 2}]),  # W=8
    "pp2": (2, 1, 2, [{"micro": 4}]),  # 4 micro-batches on 2 stages: the 1F1B schedule
    "pp2xdp2": (4, 1, 2, [{"distopt": True, "overlap": True, "micro": 4}]),
}
_DONE: dict = {}


def _job(name: str) -> list[list[dict]]:
    """[run][rank] results of a job (run once per test process)."""
    if name not in _DONE:
        world, tp, pp, runs = JOBS[name]
        init = None if name == "reference" else _job("reference")[0][0]["start"]
        _DONE[name] = [list(r) for r in zip(*run_distributed(_worker, world, tp, pp, init, runs, timeout=300))]
    return _DONE[name]


def _ref(run: int = 0) -> dict:
    return _job("reference")[run][0]


def _assert_equal_to_reference(results, ref=None):
    """fp32: every rank's weights after the run equal the single-process run's to 1e-3 of the change."""
    ref = ref or _ref()
    for res in results:
        assert res["start"].keys() == ref["start"].keys()
        for n, v in ref["end"].items():
            assert torch.equal(res["start"][n], ref["start"][n]), n  # the same initial weights
            change = (v - ref["start"][n]).abs().max()
            assert change > 1e-4, n  # it moved
            err = (res["end"][n] - v).abs().max()
            assert err < 1e-3 * change, (n, float(err), float(change))
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def _assert_whitened_once_per_step(results):
    """Summed over ranks, SWAN whitened each matrix exactly once per optimizer step (the counter of
    the inner swan_dist.SWAN optimizers: Q, K, V and gate, up counted apart)."""
    assert sum(r["whitened"] for r in results) == STEPS * LAYERS * PER_LAYER


def test_tp2_equals_single_process():
    fp32 = _job("tp2")[0]
    assert fp32[0]["kinds"] == ["FP32Optimizer"]
    _assert_equal_to_reference(fp32)
    _assert_whitened_once_per_step(fp32)
    assert all(r["group"] == [0, 1] for r in fp32)  # the matrices' owners: the TP group
    assert fp32[0]["summary"] == _ref()["summary"]  # full logical shapes, the same rules


def test_dp2_distributed_optimizer_with_overlap_and_accumulation_equals_single_process():
    """DP=2 with the distributed optimizer; and with overlap_grad_reduce and 4 micro-batches of
    gradient accumulation per step: whitened once per optimizer step, on the accumulated gradient."""
    plain, accumulated, _ = _job("dp2")
    for results in (plain, accumulated):
        assert results[0]["kinds"] == ["SwanDistributedOptimizer"]
        _assert_equal_to_reference(results)
        _assert_whitened_once_per_step(results)
        assert all(r["group"] == [0, 1] for r in results)


def test_tp2_x_dp2_distributed_optimizer_equals_single_process():
    (res,) = _job("tp2xdp2")
    assert res[0]["kinds"] == ["SwanDistributedOptimizer"]
    _assert_equal_to_reference(res)
    _assert_whitened_once_per_step(res)
    assert all(r["group"] == [0, 1, 2, 3] for r in res)


def test_tp2_x_dp4_distributed_optimizer_at_eight_ranks_equals_single_process():
    """W=8: the distributed optimizer's buffer split 4 ways inside each TP rank's DP group (uneven
    shards of every matrix), one owner per matrix over all 8 ranks."""
    (res,) = _job("tp2xdp4")
    assert len(res) == 8 and res[0]["kinds"] == ["SwanDistributedOptimizer"]
    _assert_equal_to_reference(res)
    _assert_whitened_once_per_step(res)
    assert all(r["group"] == list(range(8)) for r in res)


@pytest.mark.parametrize("name", ["pp2", "pp2xdp2"])
def test_pipeline_parallel_equals_single_process(name):
    """PP=2 (FP32Optimizer) and PP=2 x DP=2 (distributed optimizer, overlap_grad_reduce), 4 micro-batches
    each: each stage's matrices are whitened by that stage's own ranks (its TP x DP group), and the last
    stage's copy of the tied embedding (output_layer) equals the first stage's embedding after the steps."""
    (res,) = _job(name)
    dp = len(res) // 2
    assert res[0]["kinds"] == ["SwanDistributedOptimizer" if dp > 1 else "FP32Optimizer"]
    _assert_equal_to_reference(res)
    _assert_whitened_once_per_step(res)
    for stage in (0, 1):
        mine = [r for r in res if r["stage"] == stage]
        assert sum(r["whitened"] for r in mine) == STEPS * PER_LAYER  # its one layer, whitened by its ranks
        ranks = sorted(rank for rank, r in enumerate(res) if r["stage"] == stage)
        assert all(r["group"] == ranks for r in mine), (stage, [r["group"] for r in mine], ranks)
        # the stage's first rank prints its own layers' summary, saying which stage it is
        assert res[ranks[0]]["printed"].startswith(f"pipeline stage {stage} of 2: swan_dist.SWAN"), res[ranks[0]]
        assert res[ranks[0]]["printed"].count("swan_dist.SWAN") == 1
        assert all(res[r]["printed"] == "" for r in ranks[1:])
    embedding = next(r["embedding"] for r in res if r["stage"] == 0)
    assert not torch.equal(embedding, _ref()["start"]["embedding.word_embeddings.weight"])
    for r in res:
        assert (r["tied"] is not None) == (r["stage"] == 1)
        if r["stage"] == 1:
            assert torch.equal(r["tied"], embedding)
            assert _rows(r["summary"])["module.output_layer.weight"][0] == "fallback:adamw"


def test_bf16_fp32_main_params_equal_single_process_bf16_within_a_tenth_of_a_step():
    """bf16 model, fp32 main params (Float16OptimizerWithFloat16Params at TP=2, the distributed
    optimizer at DP=2 with 2 micro-batches): the main params after the run equal the single-process
    bf16 run's to a tenth of its last step (bf16 rounding of the split matmuls and partial gradients is
    all that separates them), and are about a whole step away from that run one step short.

    Measured (max |diff| / max |last step| per tensor): SWAN matrices within 0.02, SGD-managed tensors
    within 0.06 (tiny-gradient biases); one step short: 0.99 or more."""
    ref = _ref(1)
    assert ref["kinds"] == ["Float16OptimizerWithFloat16Params"]
    for results, kind in ((_job("tp2")[1], "Float16OptimizerWithFloat16Params"),
                          (_job("dp2")[2], "SwanDistributedOptimizer")):
        assert results[0]["kinds"] == [kind]
        _assert_whitened_once_per_step(results)
        for res in results:
            for n, v in ref["end"].items():
                assert torch.equal(res["start"][n], ref["start"][n]), n  # the bf16-rounded initial weights
                last = (v - ref["short"][n]).abs().max()
                err = (res["end"][n] - v).abs().max()
                assert err < 0.1 * last, (kind, n, float(err / last))
                assert (res["end"][n] - ref["short"][n]).abs().max() > 0.5 * last, (kind, n)  # a dropped step shows
    assert not torch.equal(ref["end"]["embedding.word_embeddings.weight"],
                           _ref(0)["end"]["embedding.word_embeddings.weight"])  # bf16 is not the fp32 run


def _rows(summary: str) -> dict[str, tuple[str, str, str]]:
    """The start-up summary's table: name -> (rule, shape, reason)."""
    out = {}
    for line in summary.splitlines()[1:]:
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2].startswith("x") and parts[2][1:].isdigit():
            rule, name, _, rest = parts
            shape, reason = rest.split("]", 1)
            out[name] = (rule, shape + "]", reason.strip())
    return out


def test_summary_names_megatron_parameters_and_splits():
    """The inner SWAN's start-up summary names Megatron's parameters: linear_qkv whitened as Q, K, V,
    a gated linear_fc1 as gate, up (at their full TP=1 shapes), linear_proj / linear_fc2 whitened,
    and the embedding and (untied) output layer on the fallback, saying why."""
    rows = _rows(_ref(2)["summary"])
    layer = "module.decoder.layers.*."
    assert rows[layer + "self_attention.linear_qkv.weight"] == (
        "SWAN", "[64, 32]", "2-D weight of ColumnParallelLinear; whitened as Q, K, V (per query group)")
    assert rows[layer + "mlp.linear_fc1.weight"] == (
        "SWAN", "[128, 32]", "2-D weight of ColumnParallelLinear; whitened as gate, up (gated linear unit)")
    assert rows[layer + "self_attention.linear_proj.weight"] == ("SWAN", "[32, 32]", "2-D weight of RowParallelLinear")
    assert rows[layer + "mlp.linear_fc2.weight"] == ("SWAN", "[32, 64]", "2-D weight of RowParallelLinear")
    for name in ("module.embedding.word_embeddings.weight", "module.output_layer.weight"):
        assert rows[name] == ("fallback:adamw", "[64, 32]", "embedding or output head (name)"), name
    assert all(rule == "SWAN" or "bias/norm" in why or "embedding" in why for rule, _, why in rows.values())
    assert sum(rule == "SWAN" for rule, _, _ in rows.values()) == 4


REFUSED = {"optimizer_cpu_offload": "--optimizer-cpu-offload",
           "use_precision_aware_optimizer": "--use-precision-aware-optimizer"}


def _refusal_worker(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    import megatron_harness as H
    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    H.install_cpu_shims()
    ps.initialize_model_parallel()
    try:
        chunks, _ = H.build_gpt(1, use_distributed_optimizer=True)
        errors = {}
        for field in REFUSED:
            config = OptimizerConfig(lr=LR, use_distributed_optimizer=True)
            setattr(config, field, True)  # (after __post_init__, which wants Transformer Engine for the second)
            try:
                get_swan_optimizer(config, chunks)
            except ValueError as e:
                errors[field] = str(e)
        return errors
    finally:
        ps.destroy_model_parallel()


def test_configurations_swan_cannot_serve_are_refused_on_every_rank():
    for errors in run_distributed(_refusal_worker, 2, timeout=120):
        assert errors.keys() == REFUSED.keys(), errors
        assert all(field in errors[field] and flag in errors[field] for field, flag in REFUSED.items()), errors


def _from_adamw_worker(rank, world, eta, wd):
    """SWAN's groups under Megatron's scheduler (no warm-up, cosine to min_lr = eta / 10, constant weight decay),
    built from ``OptimizerConfig(lr=eta, weight_decay=wd)`` with ``from_adamw`` and without; and the refusal of an
    alpha whose convention leaves the fallback apart from SWAN's lr."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    import megatron_harness as H
    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    H.install_cpu_shims()
    ps.initialize_model_parallel()
    try:
        out = {}
        for adamw in (True, False):
            chunks, _ = H.build_gpt(1, use_distributed_optimizer=True)
            opt = get_swan_optimizer(OptimizerConfig(lr=eta, min_lr=eta / 10, weight_decay=wd, adam_beta2=0.95,
                                                     adam_eps=1e-10, use_distributed_optimizer=True), chunks,
                                     swan={"from_adamw": adamw, "verbose": False})
            sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=eta, min_lr=eta / 10, lr_warmup_steps=0,
                                            lr_decay_steps=4, lr_decay_style="cosine", start_wd=wd, end_wd=wd,
                                            wd_incr_steps=4, wd_incr_style="constant")
            swan = next(w.optimizer for w in opt.chained_optimizers if w.optimizer is not None)
            rows = []
            for _ in range(2):  # at the start (max_lr) and after the decay (min_lr)
                rows.append(sorted({(g["use_swan"], g["lr"] * (g["alpha"] if g["use_swan"] else 1.0), g["weight_decay"])
                                    for g in swan.param_groups if g["params"] and g["wd_mult"] > 0}))
                sched.step(4)
            out[adamw] = rows
            out["betas", adamw] = {(g["betas"], g["eps"]) for g in swan.param_groups}  # --adam-beta1/2, --adam-eps
        chunks, _ = H.build_gpt(1, use_distributed_optimizer=True)
        try:
            get_swan_optimizer(OptimizerConfig(lr=eta, use_distributed_optimizer=True), chunks,
                               swan={"from_adamw": True, "preset": "swan_0", "verbose": False})
            out["swan_0"] = None
        except ValueError as e:
            out["swan_0"] = str(e)
        return out
    finally:
        ps.destroy_model_parallel()


def test_from_adamw_converts_megatrons_lr_schedule_and_weight_decay():
    """``swan={"from_adamw": True}`` (Megatron-LM: ``--swan-from-adamw``): ``config.lr`` (``--lr``), ``min_lr`` and
    ``weight_decay`` are AdamW's; Megatron's scheduler then writes SWAN(adamw_lr=eta)'s matrix and fallback lr into
    the groups (0.2 eta and 4 eta at max_lr, a tenth at min_lr) and 5x the weight decay. Without it ``--lr`` is
    SWAN's own lr. Both take Megatron's betas and eps (``--adam-beta1/2``, ``--adam-eps``). SWAN-0 (alpha 1: the
    fallback apart) is refused, naming the flag."""
    from swan_dist.integrations.megatron_lm import add_arguments

    eta, wd = 3e-4, 0.1
    out = run_distributed(_from_adamw_worker, 1, eta, wd, timeout=200)[0]
    for scale, row in zip((1.0, 0.1), out[True]):
        assert [u for u, _, _ in row] == [False, True], row
        assert [lr for _, lr, _ in row] == pytest.approx([4 * eta * scale, 0.2 * eta * scale]), row
        assert [w for _, _, w in row] == pytest.approx([5 * wd, 5 * wd]), row
    for converted, own in zip(out[True], out[False]):  # SWAN's own --lr: 4x lower lrs, the decay as given
        assert [lr / 4 for _, lr, _ in converted] == pytest.approx([lr for _, lr, _ in own])
        assert [w for _, _, w in own] == pytest.approx([wd, wd])
    assert out["betas", True] == out["betas", False] == {((0.9, 0.95), 1e-10)}, out
    assert "--swan-from-adamw" in out["swan_0"] and "fallback" in out["swan_0"], out["swan_0"]
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=["adam", "sgd"])
    add_arguments(parser)
    assert parser.parse_args(["--optimizer", "swan", "--swan-from-adamw"]).swan_from_adamw is True
    assert parser.parse_args([]).swan_from_adamw is False
