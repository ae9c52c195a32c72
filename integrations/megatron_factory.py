"""megatron-core: the optimizer factory.

:func:`get_swan_optimizer` takes ``get_megatron_optimizer``'s arguments and returns Megatron's own
objects (``ChainedOptimizer`` of ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` /
``DistributedOptimizer``) with :class:`swan_dist.SWAN` inside: Megatron's factory builds them while
its module globals ``Adam`` and ``DistributedOptimizer`` stand for SWAN and the distributed optimizer of
:mod:`swan_dist.integrations.megatron_checkpoint`. The Megatron-LM ``--optimizer swan`` flag is
:mod:`swan_dist.integrations.megatron_lm`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn

from .megatron import SHARD, _copy_marks, mark_fused
from .megatron_checkpoint import (CKPT_NAME, _distributed_optimizer_class, _global_names, _load_with_use_swan,
                                  _swan_init_state)

# OptimizerConfig fields swan_dist cannot serve, with what to do instead
_REFUSED = {
    "optimizer_cpu_offload": "SWAN keeps no moments to offload; drop --optimizer-cpu-offload",
    "use_precision_aware_optimizer": "SWAN's state is fp32 and only for fallback tensors; drop --use-precision-aware-optimizer",
}
SWAN_OPTIONS = dict(preset="swan_ddagger", alpha=None, whitening=None, ns_steps=None, beta=None, grad_norm=None,
                    whiten_dtype=None, fallback=None, mode="auto", bucket_mb=256.0, split_qkv=True, split_glu=True,
                    verbose=True, from_adamw=False)


def _swan_kwargs(config: Any, swan: dict | None) -> dict:
    """SWAN options: ``swan_<key>`` attributes of ``config`` (the Megatron-LM flags), then ``swan``."""
    out = {k: getattr(config, f"swan_{k}", v) for k, v in SWAN_OPTIONS.items()}
    unknown = set(swan or ()) - set(SWAN_OPTIONS)
    if unknown:
        raise ValueError(f"swan_dist: unknown SWAN option(s) {sorted(unknown)}; known: {sorted(SWAN_OPTIONS)}")
    out.update(swan or {})
    return out


def _from_adamw(groups: list[dict], lr: float, opts: dict) -> list[dict]:
    """Megatron's param groups with ``lr`` (``config.lr``, ``--lr``) read as AdamW's (``from_adamw``): each group's
    ``max_lr``/``min_lr`` (which Megatron's scheduler writes into ``lr`` every step) times SWAN's lr over AdamW's
    (4 with alpha 0.05), its ``wd_mult`` (on the scheduler's weight decay) times 5, as :func:`swan_dist.from_adamw`
    converts them. Refused where the convention's fallback lr is not SWAN's lr (alpha other than 0.05): the
    scheduler writes one lr per group."""
    from swan_dist.lr import MATRIX_RATIO, from_adamw

    conv = from_adamw(lr, preset=opts.get("preset"), alpha=opts.get("alpha"))
    if "fallback_lr" in conv:
        raise ValueError(
            f"swan_dist: from_adamw (--swan-from-adamw) under Megatron needs the fallback tied to SWAN's lr (alpha 0.05, "
            f"as swan_ddagger and swan_dagger have): with this preset/alpha the lr convention puts the matrices at "
            f"{conv['lr']:.3g} and the fallback at {conv['fallback_lr']:.3g}, and Megatron's scheduler writes one lr into "
            "each param group; use swan_ddagger or swan_dagger, or give SWAN's own --lr without from_adamw")
    scale, wd_scale = conv["lr"] / lr, 1.0 / MATRIX_RATIO
    out = []
    for g in groups:
        g = dict(g)
        for key in ("max_lr", "min_lr"):
            if g.get(key) is not None:
                g[key] = g[key] * scale
        g["wd_mult"] = g.get("wd_mult", 1.0) * wd_scale
        out.append(g)
    return out


@contextlib.contextmanager
def _build_with(factory):
    """Megatron's factory builds its inner optimizer as ``Adam(**kwargs)`` and the distributed optimizer
    checks ``isinstance(optimizer, Adam)``: during the call both names stand for SWAN."""
    import megatron.core.optimizer as mo
    import megatron.core.optimizer.distrib_optimizer as do
    from swan_dist import SWAN

    saved = (mo.Adam, mo.USING_PYTORCH_OPTIMIZER, do.Adam, mo.DistributedOptimizer)
    mo.Adam, mo.USING_PYTORCH_OPTIMIZER, do.Adam = factory, False, SWAN
    mo.DistributedOptimizer = _distributed_optimizer_class()
    try:
        yield
    finally:
        mo.Adam, mo.USING_PYTORCH_OPTIMIZER, do.Adam, mo.DistributedOptimizer = saved


def _expert_parallel() -> bool:
    """Whether expert weights are held by other ranks than the dense ones: expert parallelism, or an expert
    tensor-parallel size other than the dense one (Megatron then builds a separate expert optimizer)."""
    from megatron.core import parallel_state as ps

    return (ps.get_expert_model_parallel_world_size() > 1
            or ps.get_expert_tensor_parallel_world_size() != ps.get_tensor_model_parallel_world_size())


_EXPERT_GROUPS: dict[tuple, Any] = {}


def _expert_group():
    """The ranks holding pieces of this rank's expert matrices: those of its pipeline stage with its
    expert-parallel rank (its expert tensor-parallel x expert data-parallel ranks), where each expert is
    whitened once on an owner. megatron-core names no such group: made once per layout, by every rank
    (``new_group`` is collective), the groups in one order everywhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank())
    key = (dist.get_world_size(), ps.get_pipeline_model_parallel_world_size(),
           ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
    if key not in _EXPERT_GROUPS:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        members: dict[tuple, list[int]] = {}
        for rank, k in enumerate(everyone):
            members.setdefault(tuple(k), []).append(rank)
        made = {k: dist.new_group(ranks) for k, ranks in sorted(members.items())}
        _EXPERT_GROUPS[key] = made[mine]
    return _EXPERT_GROUPS[key]



def _wrappers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _refuse_unsupported(config, chunks: list) -> None:
    """Configurations SWAN cannot serve, refused before any collective (decided from what every rank
    sees alike), each naming the flag and what to use instead."""
    from megatron.core import parallel_state as ps

    for key, why in _REFUSED.items():
        if getattr(config, key, False):
            raise ValueError(f"swan_dist: OptimizerConfig.{key}=True is not supported with SWAN: {why}")
    if chunks and getattr(getattr(chunks[0], "ddp_config", None), "use_megatron_fsdp", False):
        raise ValueError("swan_dist: Megatron FSDP (use_megatron_fsdp / --use-megatron-fsdp) is not supported with "
                         "SWAN; use --use-distributed-optimizer (ZeRO-1 style shards) instead")
    etp, tp = ps.get_expert_tensor_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    moe = any(getattr(getattr(c, "config", None), "num_moe_experts", None) for c in chunks)
    if moe and ps.get_expert_model_parallel_world_size() == 1 and etp != tp:
        raise ValueError(
            f"swan_dist: expert tensor-parallel size {etp} differs from the tensor-parallel size {tp} at "
            "expert-parallel size 1: Megatron then marks the experts as dense and reduces their gradients over the "
            "dense data-parallel ranks, which hold other slices of them; set --expert-tensor-parallel-size to the "
            "tensor-parallel size, or use --expert-model-parallel-size > 1")


def get_swan_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups: bool = True,
                       pg_collection=None, dump_param_to_param_group_map=None, *, swan: dict | None = None):
    """``megatron.core.optimizer.get_megatron_optimizer`` with SWAN as the inner optimizer.

    Same arguments; SWAN's options come from ``swan`` (keys of ``SWAN_OPTIONS``: preset, alpha,
    whitening, ns_steps, beta, grad_norm, whiten_dtype, fallback, mode, bucket_mb, split_qkv,
    split_glu, verbose, from_adamw) or ``swan_<key>`` attributes on ``config``. ``config.lr`` (with its
    ``min_lr``) is SWAN's global lr and ``weight_decay`` SWAN's; with ``from_adamw=True`` both are a tuned
    AdamW's, converted by the lr convention (:func:`swan_dist.from_adamw`: every group's ``max_lr`` and
    ``min_lr`` times 4, its ``wd_mult`` times 5). ``adam_beta1/2``, ``adam_eps`` are the AdamW fallback's;
    Megatron's scheduler, clipping, loss scaling and checkpointing work unchanged.
    Returns Megatron's ``ChainedOptimizer``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import DistributedOptimizer, Float16OptimizerWithFloat16Params, get_megatron_optimizer
    from swan_dist import SWAN, tag_model

    chunks = list(model_chunks)
    _refuse_unsupported(config, chunks)
    opts = _swan_kwargs(config, swan)
    split_qkv, split_glu = opts.pop("split_qkv"), opts.pop("split_glu")
    for chunk in chunks:
        mark_fused(chunk, split_qkv, split_glu)
    tag_model(chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks))
    dense = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    experts = _expert_group() if _expert_parallel() else dense  # made here: a collective on every rank
    built: list[SWAN] = []
    verbose, stages = opts.pop("verbose"), ps.get_pipeline_model_parallel_world_size()
    adamw = bool(opts.pop("from_adamw"))

    def factory(params, lr, weight_decay, betas, eps, **_):
        expert = any(g.get("is_expert_parallel") and g["params"] for g in params)
        # from_adamw: lr and weight_decay are AdamW's; SWAN converts its defaults, the groups their schedule
        lrs = dict(adamw_lr=lr) if adamw else dict(lr=lr)
        opt = SWAN(_from_adamw(params, lr, opts) if adamw else params, **lrs, weight_decay=weight_decay,
                   betas=tuple(betas), eps=eps, process_group=experts if expert else dense,
                   verbose=False, **{k: v for k, v in opts.items() if v is not None})
        built.append(opt)
        if verbose and torch.distributed.get_rank(dense) == 0:  # each pipeline stage's first rank: its own layers
            stage = f"pipeline stage {ps.get_pipeline_model_parallel_rank()} of {stages}: " if stages > 1 else ""
            print(f"{stage}{opt.summary()}", flush=True)
        return opt

    with _build_with(factory):
        optimizer = get_megatron_optimizer(dataclasses.replace(config, optimizer="adam"), chunks, config_overrides,
                                           use_gloo_process_groups, pg_collection, dump_param_to_param_group_map)
    for p, name in _global_names(chunks).items():
        setattr(p, CKPT_NAME, name)
    for wrapper in _wrappers(optimizer):
        if getattr(wrapper, "optimizer", None) is None:
            continue
        wrapper.init_state_fn = _swan_init_state
        _load_with_use_swan(wrapper)
        if isinstance(wrapper, DistributedOptimizer):
            _mark_shards(wrapper)
        elif isinstance(wrapper, Float16OptimizerWithFloat16Params):
            for model_group, main_group in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    _copy_marks(main, p)
    return optimizer


def _mark_shards(wrapper) -> None:
    """Record on each model parameter its fp32 shard under the distributed optimizer and the range of
    its TP-local flattened tensor the shard covers; parameters this rank holds no range of get ``None``."""
    for p in wrapper.optimizer.given_tensors():
        setattr(p, SHARD, (None, 0, 0))
    pairs = [(wrapper.model_float16_groups, wrapper.shard_fp32_from_float16_groups),
             (wrapper.model_fp32_groups, wrapper.shard_fp32_groups)]
    for model_groups, shard_groups in pairs:
        for model_group, shard_group in zip(model_groups, shard_groups):
            for p, shard in zip(model_group, shard_group):
                r = wrapper._get_model_param_range_map(p)["param"]
                setattr(p, SHARD, (shard, r.start, r.end))



__all__ = ["get_swan_optimizer", "SWAN_OPTIONS"]
