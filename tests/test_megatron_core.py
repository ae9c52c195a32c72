"""megatron-core's own stack with SWAN from one call (``get_swan_optimizer``): a tiny GPTModel (local
layer spec, SwiGLU, GQA, RoPE) in Megatron DDP, the optimizer wrappers Megatron's factory builds, on
CPU with gloo (CUDA shims from ``megatron_lm_cpu``, test-only). TP=2, DP=2 with the distributed
optimizer and TP=2 x DP=2 with gradient accumulation equal the single-process run (TP=1, DP=1) on
the same initial weights (CPU initialization slices the TP=1 weights) and the same global batches."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(600)
LR, STEPS, VOCAB, SEQ, BATCH = 1e-2, 3, 128, 16, 4


def _model(tp: int, distopt: bool, bf16: bool):
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        tensor_model_parallel_size=tp, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope", share_embeddings_and_output_weights=False)
    if bf16:
        model = model.to(torch.bfloat16)
    return DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                      use_distributed_optimizer=distopt), model)


def _full(ddp) -> dict[str, torch.Tensor]:
    """Every parameter in the TP=1 layout (TP blocks gathered; SwiGLU fc1's [gate_r; up_r] reordered)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in ddp.module.named_parameters():
        t = p.detach().float().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            if name.endswith("linear_fc1.weight"):
                halves = [q.chunk(2) for q in parts]
                parts = [g for g, _ in halves] + [u for _, u in halves]
            t = torch.cat(parts, dim=p.partition_dim)
        out[name] = t
    return out


def _worker(rank, world, tp, distopt, bf16, micro):
    import megatron_lm_cpu as shim
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = shim._get_cpu_rng_state, shim._set_cpu_rng_state
    with shim.cuda_on_cpu():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            torch.manual_seed(1234)
            mrandom.model_parallel_cuda_manual_seed(1234)
            ddp = _model(tp, distopt, bf16)
            start = _full(ddp)
            from megatron.core.optimizer import OptimizerConfig  # (imported before seeding, it changes the init)
            from swan_dist.integrations.megatron import get_swan_optimizer

            opt = get_swan_optimizer(OptimizerConfig(lr=LR, weight_decay=0.1, bf16=bf16, use_distributed_optimizer=distopt,
                                                     clip_grad=0.0), [ddp], swan={"verbose": rank == 0, "bucket_mb": 0.01})
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            losses = []
            for step in range(STEPS):
                g = torch.Generator().manual_seed(100 + step)
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
                mine = tokens.chunk(dp)[dp_rank]
                ddp.zero_grad_buffer()
                opt.zero_grad()
                total = 0.0
                for chunk in mine.chunk(micro):  # gradient accumulation over micro-batches
                    pos = torch.arange(SEQ).expand(chunk.shape[0], SEQ)
                    loss = ddp(chunk[:, :-1], pos, None, labels=chunk[:, 1:]).float().mean() / micro
                    loss.backward()
                    total += float(loss)
                ddp.finish_grad_sync()
                ok, _, _ = opt.step()
                assert ok
                losses.append(total)
            inner = [w.optimizer for w in opt.chained_optimizers if w.optimizer is not None]
            return (ps.get_tensor_model_parallel_rank(), start, _full(ddp), losses,
                    sum(o.whitened_matrices for o in inner), [type(w).__name__ for w in opt.chained_optimizers],
                    inner[0].summary())
        finally:
            ps.destroy_model_parallel()


_REF: dict = {}


def _reference():
    if not _REF:
        _REF["run"] = run_distributed(_worker, 1, 1, False, False, 1, timeout=300)[0]
    return _REF["run"]


@pytest.mark.parametrize("world, tp, distopt, micro", [(2, 2, False, 1), (2, 1, True, 2), (4, 2, True, 2)],
                         ids=["tp2", "dp2-distopt-accum2", "tp2xdp2-distopt-accum2"])
def test_megatron_core_swan_equals_single_process(world, tp, distopt, micro):
    _, ref_start, ref_end, _, ref_whitened, kinds, summary = _reference()
    res = run_distributed(_worker, world, tp, distopt, False, micro, timeout=300)
    assert res[0][5] == (["SwanDistributedOptimizer"] if distopt else ["FP32Optimizer"])
    whitened = sum(r[4] for r in res)
    assert whitened == ref_whitened == STEPS * 2 * 7  # per layer: Q, K, V, linear_proj, gate, up, linear_fc2
    for _, start, end, *_ in res:
        for n, v in ref_end.items():
            assert torch.equal(start[n], ref_start[n]), n  # the same initial weights
            step = (v - ref_start[n]).abs().max()
            assert step > 1e-3, n  # moved
            assert (end[n] - v).abs().max() < 1e-3 * step + 1e-6, n
    assert "whitened as Q, K, V" in summary and "whitened as gate, up" in summary
    assert "embedding.word_embeddings.weight" in summary and "output_layer.weight" in summary
