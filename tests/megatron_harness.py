"""Real megatron-core (0.16.1) training steps on CPU with gloo: a test-only helper, never part of swan_dist.

Inside a process that :func:`dist_utils.run_distributed` started (gloo already initialised)::

    install_cpu_shims()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    chunks, config = build_gpt(tp, pp, use_distributed_optimizer=True)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), chunks)
    loss = train_step(chunks, opt, dp_share(global_batch(0, 8, 16, 64), dp_rank, dp_size))
    weights = full_weights(chunks)  # TP=1 layout, same names for every TP / PP layout
    mains = full_weights(chunks, opt)  # the optimizer's fp32 main params (bf16 runs), same layout

megatron-core assumes CUDA. :func:`install_cpu_shims` rebinds ``torch`` in the few megatron modules of
the training path to a proxy (:data:`CPU_TORCH`) whose tensor factories put ``device="cuda"`` on the
CPU and whose ``torch.cuda`` answers the handful of calls made there; and inside the four megatron
functions that need it, it answers ``Tensor.type()`` with the CUDA type name and lets ``Tensor.cuda()``
leave a CPU tensor where it is. ``torch`` itself, swan_dist
and every other module are left untouched, so a device bug in the library under test still shows.
Line numbers below are megatron-core 0.16.1's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


# --------------------------------------------------------------------------- shims
def _cpu_device(device):
    if device is None or isinstance(device, bool):
        return device
    if isinstance(device, int) or (isinstance(device, str) and device.split(":")[0] == "cuda") or (
            isinstance(device, torch.device) and device.type == "cuda"):
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def make(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)
    return make


class _Stream:
    """torch.cuda.Stream / default_stream stand-in: work on the CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _noop(*args, **kwargs):
    return None


class _Proxy(types.ModuleType):
    """A module whose given names replace the real module's; every other name is the real one."""

    def __init__(self, real, **names):
        super().__init__(real.__name__)
        self.__dict__.update(names)
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


CPU_CUDA = _Proxy(
    torch.cuda,
    # a device for ``device=torch.cuda.current_device()``: rotary_pos_embedding.py:162,297;
    # param_and_grad_buffer.py:783,800,806 (the grad/param buffers); optimizer.py:1141;
    # distrib_optimizer.py:791,1077; p2p_communication.py:190-202,313,321 (PP shapes and buffers);
    # utils.py:631 (GlobalMemoryBuffer, the attention scores' buffer, dot_product_attention.py:189)
    current_device=lambda: torch.device("cpu"),
    Stream=_Stream,  # distributed_data_parallel.py:230 (overlap_grad_reduce: the communication stream)
    default_stream=lambda *a, **k: _Stream(),  # param_and_grad_buffer.py:422,529
    stream=lambda *a, **k: contextlib.nullcontext(),  # param_and_grad_buffer.py:417
    synchronize=_noop,  # p2p_communication.py:242,398; distributed_data_parallel.py:588,611
    empty_cache=_noop,  # distributed_data_parallel.py:594; optimizer.py:362
)

# ``device="cuda"`` in a factory makes a CPU tensor: optimizer.py:473,481,485,907 (found_inf, the
# overflow buffer, the loss scale); clip_grads.py:90,103,115,174,207 (grad norm, zeros count);
# schedules.py:596,983,2138 (token count); param_and_grad_buffer.py:768; transformer/utils.py:35 (the
# causal mask when attention_mask is None, fused_softmax.py:327)
CPU_TORCH = _Proxy(torch, cuda=CPU_CUDA, **{name: _on_cpu(getattr(torch, name)) for name in (
    "tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")})

# megatron modules whose global ``torch`` is CPU_TORCH (each lists its lines above)
_TORCH_USERS = (
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # 230: synchronize before a torch_dist save
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # 251-252: a tensor on current_device()
)

_CUDA_TYPE = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
              torch.bfloat16: "torch.cuda.BFloat16Tensor"}


class _CudaTypeNames(TorchFunctionMode):
    """``Tensor.type()`` (no argument) names a CPU fp32/fp16/bf16 tensor by its CUDA type, the only
    types Megatron's checks accept; ``Tensor.cuda()`` (no argument) leaves a CPU tensor where it is;
    every other call is unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            name = _CUDA_TYPE.get(args[0].dtype)
            if name is not None:
                return name
        return func(*args, **kwargs)


def _with_cuda_type_names(fn):
    if getattr(fn, "_cpu_shim", False):
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _CudaTypeNames():
            return fn(*args, **kwargs)
    run._cpu_shim = True
    return run


def install_cpu_shims() -> None:
    """The CPU shims for this process (idempotent). See the module docstring and each shim's lines."""
    for name in _TORCH_USERS:
        importlib.import_module(name).torch = CPU_TORCH
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    # Tensor.type() checks: optimizer.py:671,690 (Float16OptimizerWithFloat16Params.__init__);
    # distrib_optimizer.py:361,420 (_build_model_and_main_param_groups, from __init__), 582 (__init__);
    # clip_grads.py:167 (clip_grad_by_total_norm_fp32, called by that name at optimizer.py:215,1324)
    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    optimizer.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    # Tensor.cuda(): language_module.py:244 (PP > 1 with tied embeddings: the embedding-group all-reduce
    # that makes the last stage's output_layer copy equal the first stage's embedding)
    LanguageModule.setup_embeddings_and_output_layer = _with_cuda_type_names(
        LanguageModule.setup_embeddings_and_output_layer)


class _MoEStream(_Stream):
    def record_event(self, *args, **kwargs):  # token_dispatcher.py:895, then .synchronize() at :899
        return self

    def synchronize(self):
        pass


_MOE_STREAM = _MoEStream()


def _all_gather_v(outputs, input_, group=None, async_op=False):
    """``dist.all_gather`` into outputs of a size per rank (mappings.py:150: the expert-TP token gather
    under EP > 1), which NCCL takes and gloo refuses: each piece padded to the largest along dim 0."""
    if len({o.shape for o in outputs}) == 1:
        return dist.all_gather(outputs, input_, group=group, async_op=async_op)
    most = max(o.shape[0] for o in outputs)
    pad = input_.new_zeros((most, *input_.shape[1:]))
    pad[: input_.shape[0]] = input_
    padded = [torch.empty_like(pad) for _ in outputs]
    dist.all_gather(padded, pad, group=group)
    for o, q in zip(outputs, padded):
        o.copy_(q[: o.shape[0]])


def _reduce_scatter_v(output, inputs, group=None, op=dist.ReduceOp.SUM, async_op=False):
    """``dist.reduce_scatter`` of inputs of a size per rank (mappings.py:193, the gather's backward), which
    gloo does not offer: the whole concatenation all-reduced, this rank's piece kept (more bytes, same sums)."""
    whole = torch.cat([t.reshape(t.shape[0], -1) for t in inputs])
    dist.all_reduce(whole, op=op, group=group)
    start = sum(t.shape[0] for t in inputs[: dist.get_rank(group)])
    output.copy_(whole[start : start + output.shape[0]].view_as(output))


MOE_TORCH = _Proxy(CPU_TORCH, cuda=_Proxy(CPU_CUDA, current_stream=lambda *a, **k: _MOE_STREAM,
                                          Stream=lambda *a, **k: _MOE_STREAM),
                   distributed=_Proxy(dist, all_gather=_all_gather_v, reduce_scatter=_reduce_scatter_v))


def install_moe_shims() -> None:
    """The CPU shims of MoE layers (idempotent), on top of :func:`install_cpu_shims`. Without Transformer
    Engine ``moe_utils.te_general_gemm`` is never bound (moe_utils.py:22-39) though the router's
    ``RouterGatingLinearFunction`` tests it (:1192, :1225): bound to None it takes its own torch.mm path.
    ``torch`` of the router (router.py:90: the weight moved to ``current_device()``), the token
    dispatcher (:445, :871-899: a side stream and its events), moe_utils (:998) and the TP mappings of
    the expert all-to-all (mappings.py:91-181, 442) is a proxy that keeps tensors on the CPU. The
    all-to-all dispatcher hands ``all_to_all_single`` split sizes converted by ``maybe_move_tensor_to_cpu``
    (moe_utils.py:1077-1100), which turns only CUDA tensors into numpy: CPU ones are given too.
    The mappings' uneven all-gather and reduce-scatter (expert TP > 1 with EP > 1) run padded on gloo.
    Flags that need Transformer Engine or CUDA: ``moe_router_fusion``, ``moe_permute_fusion``,
    ``moe_grouped_gemm`` (GroupedMLP needs the CUDA ``grouped_gemm`` package), the ``flex`` dispatcher."""
    install_cpu_shims()
    mu = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(mu, "te_general_gemm"):
        mu.te_general_gemm = None
    for name in ("megatron.core.transformer.moe.router", "megatron.core.transformer.moe.token_dispatcher",
                 "megatron.core.transformer.moe.moe_utils", "megatron.core.tensor_parallel.mappings"):
        importlib.import_module(name).torch = MOE_TORCH
    td = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    if not getattr(td.maybe_move_tensor_to_cpu, "_cpu_shim", False):
        orig = td.maybe_move_tensor_to_cpu

        def to_host(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy()
            return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)
        to_host._cpu_shim = True
        td.maybe_move_tensor_to_cpu = to_host


# MoE settings that run on the CPU with gloo (see install_moe_shims); no load balancing loss, so that the
# gradients of a data-parallel run are those of one process on the whole batch
MOE_CPU = dict(moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
               moe_router_load_balancing_type="none", moe_router_dtype="fp32", moe_permute_fusion=False,
               moe_router_fusion=False, add_bias_linear=False)


# --------------------------------------------------------------------------- model
def build_gpt(tp: int, pp: int = 1, *, seed: int = 1234, bf16: bool = False, gated: bool = True, heads: int = 4,
              query_groups: int = 2, hidden: int = 32, ffn: int = 64, layers: int = 2, vocab: int = 64,
              seq: int = 16, tied: bool = True, use_distributed_optimizer: bool = False,
              overlap_grad_reduce: bool = False, init_weights: dict | None = None, experts: int = 0,
              moe: dict | None = None, grouped: bool = False):
    """A tiny GPTModel (local layer spec: LayerNorm, linear biases; SwiGLU when ``gated``; GQA; RoPE; no dropout; embeddings and
    output layer tied when ``tied``) wrapped in Megatron DDP (fp32 grad reduction), for the model-parallel
    state already initialised with this ``tp``/``pp``. Returns ``([chunk], config)``.

    Weights are Megatron's own CPU initialisation (use_cpu_initialization: every rank draws the full
    TP=1 matrix from the CPU generator seeded with ``seed`` and keeps its slice), so a TP=2 model holds
    exact slices of the TP=1 model of the same seed. Pipeline stages draw only their own layers, so at
    ``pp > 1`` the layout differs from PP=1: pass ``init_weights`` (``full_weights`` of a PP=1 model) to
    load the same weights into any layout (loaded before the optimizer makes its fp32 copies).

    ``experts`` > 0: every layer's MLP is a MoE of that many experts (SequentialMLP, the settings of
    :data:`MOE_CPU` updated by ``moe``), spread over the expert-parallel size already initialised;
    ``grouped``: the legacy GroupedMLP instead (built here only: its forward needs the CUDA ``grouped_gemm``
    package, which the caller marks present).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    assert ps.get_tensor_model_parallel_world_size() == tp and ps.get_pipeline_model_parallel_world_size() == pp
    install_moe_shims() if experts else install_cpu_shims()
    # tensor_parallel/random.py:244-277: tracker.fork() (embedding and attention dropout, both 0 here)
    # reads the CUDA generator; the inference tracker's fork is a no-op (random.py:321-336)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=query_groups, kv_channels=hidden // heads, gated_linear_unit=gated,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype, params_dtype=dtype, bf16=bf16,
        use_cpu_initialization=True, perform_initialization=True, init_method_std=0.02,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=False,
        **(dict(num_moe_experts=experts, moe_ffn_hidden_size=ffn, expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
                **{**MOE_CPU, **(moe or {}), **(dict(moe_grouped_gemm=True) if grouped else {})}) if experts else {}))
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped) if experts else get_gpt_layer_local_spec()
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=vocab, max_sequence_length=seq, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=tied,
                     position_embedding_type="rope")
    if bf16:  # as Megatron-LM's get_model: bf16 parameters, fp32 logits
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
                                               use_distributed_optimizer=use_distributed_optimizer)
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    if init_weights is not None:
        set_full_weights([model], init_weights)
    return [model], config


# --------------------------------------------------------------------------- data and steps
def global_batch(step: int, global_batch_size: int, seq: int, vocab: int, seed: int = 0) -> dict:
    """Random tokens for ``step`` (the same on every rank): next-token labels, causal mask (None)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randint(0, vocab, (global_batch_size, seq + 1), generator=g)
    return dict(tokens=x[:, :-1].contiguous(), labels=x[:, 1:].contiguous(),
                position_ids=torch.arange(seq).expand(global_batch_size, seq).contiguous(), attention_mask=None)


def dp_share(batch: dict, dp_rank: int, dp_size: int) -> dict:
    """Data-parallel rank ``dp_rank``'s contiguous block of the global batch's rows."""
    return {k: None if v is None else v.chunk(dp_size)[dp_rank] for k, v in batch.items()}


def train_step(model_chunks, optimizer, batch: dict, num_microbatches: int = 1) -> float:
    """One Megatron iteration on this DP rank's ``batch``: zero the grad buffers, forward/backward
    through ``get_forward_backward_func()`` (the loss is the mean token loss of each microbatch; the
    schedule averages microbatches, DDP averages DP ranks), ``optimizer.step()``. Returns the loss
    averaged over the DP ranks, on every rank (broadcast from the last pipeline stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    config.grad_scale_func = optimizer.scale_loss
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    rows, seq = batch["tokens"].shape
    micro = rows // num_microbatches
    assert micro * num_microbatches == rows, (rows, num_microbatches)
    data = iter([{k: None if v is None else v[i * micro:(i + 1) * micro] for k, v in batch.items()}
                 for i in range(num_microbatches)])

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])

        def loss_func(per_token):
            loss = per_token.float().mean()
            # a copy: the schedule divides the returned loss by num_microbatches in place (schedules.py:269)
            return loss, {"loss": loss.detach().clone()}
        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=model_chunks, num_microbatches=num_microbatches,
        seq_length=seq, micro_batch_size=micro, forward_only=False)
    success, _grad_norm, _zeros = optimizer.step()
    assert success, "optimizer step skipped (inf/nan gradients)"
    loss = torch.tensor(sum(float(d["loss"]) for d in losses) / num_microbatches if losses else 0.0)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(loss, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / ps.get_data_parallel_world_size()


def lr_schedule(optimizer, lr: float, steps: int, wd: float):
    """Megatron's own scheduler as Megatron-LM builds it: one warm-up step from lr/10, then cosine decay
    to the config's ``min_lr`` (each param group carries the config's ``lr`` and ``min_lr``) over ``steps``, weight decay ``wd`` constant (times each group's ``wd_mult``); ``.step(1)``
    after each iteration sets every param group's lr (a new value each step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=lr / 10, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=1,
                                   lr_decay_steps=max(steps, 2), lr_decay_style="cosine", start_wd=wd, end_wd=wd,
                                   wd_incr_steps=max(steps, 2), wd_incr_style="constant")


# --------------------------------------------------------------------------- weights
def _named_params(model_chunks):
    """(global name, param) of this stage: wrapper prefixes stripped, layer indices made global, and
    expert indices too (local expert j of expert-parallel rank r is expert r * local experts + j)."""
    from megatron.core import parallel_state as ps

    for chunk in model_chunks:
        gpt = chunk
        while hasattr(gpt, "module"):  # DDP, Float16Module
            gpt = gpt.module
        offset = gpt.decoder.layers[0].layer_number - 1 if len(gpt.decoder.layers) else 0
        for name, p in gpt.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            if "local_experts" in parts:
                i = parts.index("local_experts") + 1
                local = len(gpt.decoder.layers[0].mlp.experts.local_experts)
                parts[i] = str(ps.get_expert_model_parallel_rank() * local + int(parts[i]))
            yield ".".join(parts), p


def _is_expert(p) -> bool:
    """An expert weight under expert parallelism: reduced over the expert data-parallel group."""
    return not getattr(p, "allreduce", True)


def _is_tied_copy(name, p) -> bool:
    """The last stage's copy of a tied embedding (language_module.py:214-224); PP=1 has no such param."""
    return name == "output_layer.weight" and getattr(p, "shared_embedding", False)


def _tp_layout(p):
    if not getattr(p, "tensor_model_parallel", False):
        return None
    return p.partition_dim, getattr(p, "partition_stride", 1)


def full_weights(model_chunks, optimizer=None) -> dict[str, torch.Tensor]:
    """name -> full fp32 weight in the TP=1 layout, the same names for every TP/PP layout, on every rank.

    TP shards are gathered along ``partition_dim``; a strided shard (SwiGLU ``linear_fc1``, stride 2:
    rank r holds [gate_r; up_r], mlp.py:107-133) is reassembled as [gate; up]. Pipeline stages are
    gathered over the pipeline group, layer names renumbered globally; the last stage's copy of a tied
    embedding is left out (its values equal the embedding's after every step: see :func:`tied_copy`).

    With ``optimizer`` (Megatron's, as built for these chunks) the values are the optimizer's fp32 main
    params instead of the model's (which are their bf16 roundings in a bf16 run): a
    ``Float16OptimizerWithFloat16Params``'s fp32 copies, or a ``DistributedOptimizer``'s fp32 shards
    gathered over the data-parallel group. A collective: every rank of the model calls it."""
    from megatron.core import parallel_state as ps

    mains, sharded = _main_params(optimizer) if optimizer is not None else ({}, False)
    out, experts = {}, {}
    for name, p in _named_params(model_chunks):
        if _is_tied_copy(name, p):
            continue
        expert = _is_expert(p)
        if expert:
            dp_group, tp_group = ps.get_expert_data_parallel_group(), ps.get_expert_tensor_parallel_group()
            tp = ps.get_expert_tensor_parallel_world_size()
        else:
            dp_group, tp_group = ps.get_data_parallel_group(with_context_parallel=True), ps.get_tensor_model_parallel_group()
            tp = ps.get_tensor_model_parallel_world_size()
        if sharded:  # this rank's range of p's flattened TP block (zeros elsewhere), summed over DP
            local = mains.get(id(p), torch.zeros(p.numel()))
            dist.all_reduce(local, group=dp_group)
            local = local.view(p.shape)
        else:
            local = mains.get(id(p), p).detach().float().clone()  # a copy even when already fp32
        layout = _tp_layout(p)
        if layout is not None and tp > 1:
            dim, stride = layout
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local, group=tp_group)
            local = torch.cat([s.chunk(stride, dim)[j] for j in range(stride) for s in shards], dim)
        (experts if expert else out)[name] = local
    if experts:  # every expert-parallel rank's experts
        ranks = [None] * ps.get_expert_model_parallel_world_size()
        dist.all_gather_object(ranks, experts, group=ps.get_expert_model_parallel_group())
        out.update({k: v for held in ranks for k, v in held.items()})
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, out, group=ps.get_pipeline_model_parallel_group())
        out = {k: v for stage in stages for k, v in stage.items()}
    return out


def _main_params(optimizer) -> tuple[dict[int, torch.Tensor], bool]:
    """id(model param) -> its fp32 main param (flattened and zero outside this rank's range under the
    distributed optimizer), and whether the optimizer is the distributed one."""
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params

    mains, sharded = {}, False
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(wrapper, DistributedOptimizer):
            sharded = True
            for model_groups, shard_groups in ((wrapper.model_float16_groups, wrapper.shard_fp32_from_float16_groups),
                                               (wrapper.model_fp32_groups, wrapper.shard_fp32_groups)):
                for model_group, shard_group in zip(model_groups, shard_groups):
                    for p, shard in zip(model_group, shard_group):
                        r = wrapper._get_model_param_range_map(p)["param"]
                        flat = torch.zeros(p.numel())
                        flat[r.start:r.end] = shard.detach().float().view(-1)
                        mains[id(p)] = flat
        elif isinstance(wrapper, Float16OptimizerWithFloat16Params):
            for model_group, main_group in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups):
                mains.update({id(p): main for p, main in zip(model_group, main_group)})
    return mains, sharded


def tied_copy(model_chunks) -> torch.Tensor | None:
    """The last pipeline stage's copy of a tied embedding (``output_layer.weight``), TP-gathered; None
    on other stages or without one. A collective over the TP group where the copy exists."""
    from megatron.core import parallel_state as ps

    for name, p in _named_params(model_chunks):
        if _is_tied_copy(name, p):
            local = p.detach().float().clone()
            if ps.get_tensor_model_parallel_world_size() > 1:
                shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
                dist.all_gather(shards, local, group=ps.get_tensor_model_parallel_group())
                local = torch.cat(shards, p.partition_dim)
            return local
    return None


def set_full_weights(model_chunks, weights: dict[str, torch.Tensor]) -> None:
    """Load ``full_weights``-style TP=1 tensors into this rank's slices (the inverse of ``full_weights``)."""
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, p in _named_params(model_chunks):
            full = weights["embedding.word_embeddings.weight" if _is_tied_copy(name, p) else name]
            if _is_expert(p):
                r, tp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
            else:
                r, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
            layout = _tp_layout(p)
            if layout is not None and tp > 1:
                dim, stride = layout
                full = torch.cat([c.chunk(tp, dim)[r] for c in full.chunk(stride, dim)], dim)
            p.copy_(full)
