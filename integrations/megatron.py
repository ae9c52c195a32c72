"""megatron-core: tensor-parallel layouts, fused matrices, the optimizer factory.

**Layouts.** ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding`` hold a block
of the logical matrix as a plain tensor, ``partition_dim`` telling which dim is cut over the
tensor-parallel group (Megatron's own attributes; for layers built without initialization, which do
not get them, :meth:`MegatronAdapter.prepare` records the dim from the module type):

- ``partition_dim=0`` (column-parallel: ``linear_qkv``, ``linear_fc1``, ``output_layer``): TP rank r
  holds rows ``[r·m/tp, (r+1)·m/tp)``, one range of the row-major order;
- ``partition_dim=1`` (row-parallel: ``linear_proj``, ``linear_fc2``): TP rank r holds column block r,
  one range of the column-block order (``Layout.col_splits``); the owner puts the blocks back along
  columns (SWAN is not transpose-equivariant, so a transpose would be wrong).

Every data-parallel replica holds the same block, so the engine's group is the TP x DP (x CP) group
of a pipeline stage and each matrix is whitened whole, once. With the distributed optimizer a rank
holds one contiguous range of its TP block's flattened fp32 main copy (:meth:`MegatronAdapter.adopt`).

**Fused matrices.** ``linear_qkv`` interleaves ``[q.. k v]`` per query group and a SwiGLU
``linear_fc1`` holds ``[gate_r; up_r]`` on TP rank r; both are whitened as their separate matrices
(Q, K, V; gate, up) by default: the piece carries the row pattern (``Piece.split``) and the owner
whitens each part of the assembled matrix apart. SWAN is row-permutation equivariant, so a part's
rows in TP order give the same update as in the TP=1 order.

**Factory.** :func:`get_swan_optimizer` takes ``get_megatron_optimizer``'s arguments and returns
Megatron's own objects (``ChainedOptimizer`` of ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``
/ ``DistributedOptimizer``) with :class:`swan_dist.SWAN` inside. The Megatron-LM ``--optimizer swan``
flag is :mod:`swan_dist.integrations.megatron_lm`; ``python -m swan_dist.integrations.megatron
pretrain_gpt.py ...`` runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any

import torch
from torch import Tensor, nn

from swan_dist.adapter import Adapter, Form, Member, Piece, flat_piece, tensor_piece
from swan_dist.layout import Layout

SHARD = "_swan_main_shard"  # on a model param under the distributed optimizer: (fp32 shard | None, start, end)
TP_DIM = "_swan_tp_dim"  # partition dim of a TP layer's weight built without Megatron's attributes
SPLIT, PARTS = "_swan_split", "_swan_parts"  # a fused matrix's row pattern (one period) and its parts' names
STACKED = "_swan_stacked"  # on GroupedMLP's weight1/weight2: (E, rows, cols) of the (in, out) stack in its memory
_OURS = (TP_DIM, SPLIT, PARTS, STACKED)


def _expert(tensor: Tensor) -> bool:
    return getattr(tensor, "allreduce", True) is False  # Megatron's mark on expert parameters


def _tp(tensor: Tensor) -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if _expert(tensor):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _dim(tensor: Tensor) -> int | None:
    if getattr(tensor, "tensor_model_parallel", False):
        return tensor.partition_dim
    return getattr(tensor, TP_DIM, None)


def mark_fused(model: nn.Module, split_qkv: bool = True, split_glu: bool = True) -> None:
    """Record on ``linear_qkv`` / gated ``linear_fc1`` weights the row pattern of their parts (or that
    they are whitened fused). Idempotent; :func:`get_swan_optimizer` calls it with its options."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import GroupedMLP

    for name, mod in model.named_modules():
        if isinstance(mod, GroupedMLP):
            _mark_grouped(name, mod, split_glu)
            continue
        w, split, parts = None, (), ""
        if isinstance(mod, SelfAttention) and getattr(mod, "linear_qkv", None) is not None:
            w, cfg = mod.linear_qkv.weight, mod.config
            heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
            if split_qkv and not getattr(cfg, "attention_output_gate", False) and heads % groups == 0:
                d = cfg.kv_channels
                split, parts = (heads // groups * d, d, d), "Q, K, V (per query group)"
        elif isinstance(mod, MLP) and mod.config.gated_linear_unit and getattr(mod, "linear_fc1", None) is not None:
            w = mod.linear_fc1.weight
            if split_glu and w is not None and w.shape[0] % 2 == 0:
                split, parts = (w.shape[0] // 2, w.shape[0] // 2), "gate, up (gated linear unit)"
        if isinstance(w, Tensor):
            setattr(w, SPLIT, split)
            setattr(w, PARTS, parts)


def _mark_grouped(name: str, mod: nn.Module, split_glu: bool) -> None:
    """The legacy GroupedMLP keeps its E local experts in one ``weight1`` ``(hidden, E·2f)`` and one
    ``weight2`` ``(E·f, hidden)``, read as ``view(E, hidden, -1)`` and ``view(E, -1, hidden)``: each expert's
    matrix is a contiguous block stored ``(in, out)``. Recorded here as that stack, so that each expert
    is whitened alone, transposed, gate and up of a gated ``weight1`` apart (as SequentialMLP's experts)."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_tensor_parallel_world_size() > 1:  # decided alike on every rank, before any collective
        raise ValueError(
            f"swan_dist: {name + '.weight1'!r} is the legacy GroupedMLP's stack of experts cut by expert tensor "
            "parallelism, which SWAN does not map; use --expert-tensor-parallel-size 1, or drop "
            "--moe-grouped-gemm (SequentialMLP, per-expert weights)")
    e, hidden = mod.num_local_experts, mod.config.hidden_size
    for w in (mod.weight1, mod.weight2):
        rows = hidden if w is mod.weight1 else w.shape[0] // e
        setattr(w, STACKED, (e, rows, w.numel() // (e * rows)))
    half = mod.weight1.shape[1] // (2 * e)
    gated = mod.config.gated_linear_unit and split_glu
    setattr(mod.weight1, SPLIT, (half, half) if gated else ())
    setattr(mod.weight1, PARTS, "gate, up (gated linear unit)" if gated else "")


def _copy_marks(dst: Tensor, src: Tensor) -> None:
    for key in _OURS:
        if hasattr(src, key):
            setattr(dst, key, getattr(src, key))


class MegatronAdapter(Adapter):
    name = "megatron"

    def prepare(self, model: nn.Module) -> None:
        if "megatron.core" not in sys.modules:
            return
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        dims = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))
        for mod in model.modules():
            w = getattr(mod, "weight", None)
            dim = next((d for cls, d in dims if isinstance(mod, cls)), None)
            if dim is not None and isinstance(w, Tensor) and not getattr(w, "tensor_model_parallel", False):
                setattr(w, TP_DIM, dim)
        if not any(hasattr(p, SPLIT) for p in model.parameters()):
            mark_fused(model)

    def claims(self, tensor: Tensor) -> bool:
        return (_dim(tensor) is not None or hasattr(tensor, STACKED)) and type(tensor).__name__ != "DTensor"

    def shape(self, tensor: Tensor) -> tuple[int, ...]:
        stacked = getattr(tensor, STACKED, None)
        if stacked is not None:  # GroupedMLP: its memory, as the rows of its E (in, out) matrices
            e, rows, cols = stacked
            return (e * rows, cols)
        _, size = _tp(tensor)
        dim = _dim(tensor)
        return tuple(s * size if d == dim else s for d, s in enumerate(tensor.shape))

    def form(self, module: nn.Module, param_name: str, shape: tuple[int, ...]) -> Form | None:
        stacked = getattr(getattr(module, param_name, None), STACKED, None)
        if stacked is None or param_name not in ("weight1", "weight2"):
            return None
        return Form(transposed=True, stack=stacked[0], whiten=True,
                    what=f"GroupedMLP experts ({param_name}, E={stacked[0]}), stored (in, out): whitened per expert, "
                         "transposed")

    def members(self, tensor: Tensor, name: str | None) -> list[Member]:
        return [Member(name, self.shape(tensor), tensor, parts=getattr(tensor, PARTS, ""))]

    def check(self, tensor: Tensor, name: str) -> None:
        if hasattr(tensor, STACKED):
            return
        if tensor.dim() not in (1, 2) or _dim(tensor) not in range(tensor.dim()):
            raise ValueError(f"swan_dist: Megatron parameter {name!r} of local shape {list(tensor.shape)} is cut on dim "
                             f"{_dim(tensor)}; SWAN maps 2-D weights cut on dim 0 or 1, and 1-D ones")

    @staticmethod
    def _layout(tensor: Tensor) -> Layout:
        _, size = _tp(tensor)
        if tensor.dim() == 2 and _dim(tensor) == 1 and size > 1:
            return Layout(tuple(tensor.shape[1] * k for k in range(1, size)))
        return Layout()

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        rank, _ = _tp(tensor)
        return [tensor_piece(name, tensor, shape=self.shape(tensor), lo=rank * tensor.numel(), grad=tensor.grad,
                             layout=self._layout(tensor), split=getattr(tensor, SPLIT, ()))]

    def adopt(self, originals, params, use_swan, index, group) -> list[Piece] | None:
        """The distributed optimizer replaced a group's parameters by this rank's fp32 shards (only
        those it has a range of): one piece per original, empty where this rank holds none of it."""
        if not originals or not all(hasattr(p, SHARD) for _, p in originals):
            return None
        out = []
        for name, p in originals:
            shard, start, end = getattr(p, SHARD)
            tp = self.claims(p)
            rank = _tp(p)[0] if tp else 0
            shape = self.shape(p) if tp else tuple(p.shape)
            layout = self._layout(p) if tp else Layout()
            if shard is None:  # this rank holds none of it
                shard = torch.empty(0, dtype=torch.float32, device=p.device)
            out.append(flat_piece(name, shape, rank * p.numel() + start, shard, layout=layout,
                                  split=getattr(p, SPLIT, ())))
        return out


# --------------------------------------------------------------------------- the optimizer factory
# OptimizerConfig fields swan_dist cannot serve, with what to do instead
_REFUSED = {
    "optimizer_cpu_offload": "SWAN keeps no moments to offload; drop --optimizer-cpu-offload",
    "use_precision_aware_optimizer": "SWAN's state is fp32 and only for fallback tensors; drop --use-precision-aware-optimizer",
}
SWAN_OPTIONS = dict(preset="swan_ddagger", alpha=None, whitening=None, ns_steps=None, beta=None, grad_norm=None,
                    whiten_dtype=None, fallback=None, mode="auto", bucket_mb=256.0, split_qkv=True, split_glu=True,
                    verbose=True)


def _swan_kwargs(config: Any, swan: dict | None) -> dict:
    """SWAN options: ``swan_<key>`` attributes of ``config`` (the Megatron-LM flags), then ``swan``."""
    out = {k: getattr(config, f"swan_{k}", v) for k, v in SWAN_OPTIONS.items()}
    unknown = set(swan or ()) - set(SWAN_OPTIONS)
    if unknown:
        raise ValueError(f"swan_dist: unknown SWAN option(s) {sorted(unknown)}; known: {sorted(SWAN_OPTIONS)}")
    out.update(swan or {})
    return out


def _swan_init_state(opt, config=None) -> None:
    """Megatron calls this before loading a checkpoint into empty state: SWAN's own (AdamW moments for
    the fallback tensors that keep them, nothing for SWAN matrices)."""
    opt.init_state()


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


_DIST_OPT: list = []
LEGACY_DIST_OPT_CHECKPOINT = (
    "swan_dist: Megatron's legacy checkpoint format (--ckpt-format torch: distrib_optim.pt, Adam moments gathered on "
    "DP rank 0) is not supported for SWAN under the distributed optimizer; use --ckpt-format torch_dist (the default), "
    "whose optimizer state swan_dist writes itself")
CKPT_NAME = "_swan_ckpt_name"  # on a model param: its name with wrappers dropped and global layer numbers


def _global_names(chunks) -> dict[Tensor, str]:
    """Each parameter's name without wrapper prefixes (DDP, Float16Module) and with transformer-layer
    indices made global (Megatron's 1-based ``layer_number``): the same name on every pipeline layout."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    out = {}
    for chunk in chunks:
        module = chunk
        while hasattr(module, "module"):
            module = module.module
        layers = {n: m.layer_number - 1 for n, m in module.named_modules()
                  if isinstance(m, TransformerLayer) and n.rsplit(".", 1)[-1].isdigit()}
        for name, p in module.named_parameters():
            parts = name.split(".")
            for i in range(len(parts) - 1, 0, -1):
                if ".".join(parts[:i]) in layers:
                    parts[i - 1] = str(layers[".".join(parts[:i])])
                    break
            out[p] = ".".join(parts)
    return out


def _distributed_optimizer_class():
    """Megatron's ``DistributedOptimizer`` for SWAN (built once, lazily), with a checkpoint format of
    its own (see :class:`SwanDistributedOptimizer`)."""
    if _DIST_OPT:
        return _DIST_OPT[0]
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    class SwanDistributedOptimizer(DistributedOptimizer):
        """The distributed optimizer around SWAN.

        Megatron 0.16's formats for it are Adam's (``exp_avg``/``exp_avg_sq`` over whole buckets, or
        gathered on DP rank 0), so this class writes its own through ``dist_checkpointing`` whatever
        ``distrib_optim_sharding_type`` asks for:

        - common (per model-parallel rank, as Megatron's): param groups' options, loss scaler, the
          TP/PP sizes;
        - per parameter, under its global name: this DP rank's contiguous range of the parameter as a
          1-D chunk of its full flattened tensor (TP blocks in TP-rank order), for the fp32 main copy
          of a bf16/fp16 parameter and the AdamW fallback's ``exp_avg``/``exp_avg_sq`` (SWAN matrices
          have none: nothing is written or allocated for them), and the fallback's step count.

        The chunks do not depend on the DP size, so a checkpoint reloads at another DP size; another
        TP or PP size is refused with what was saved.
        """

        def state_dict(self):
            return _dist_state_dict(self)

        def load_state_dict(self, state_dict):
            _dist_load_state_dict(self, state_dict)

        def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, sharding_type=None,
                               metadata=None, **_):
            return _dist_sharded_state_dict(self)

        def get_parameter_state_dp_zero(self, *args, **kwargs):
            raise ValueError(LEGACY_DIST_OPT_CHECKPOINT)

        load_parameter_state_from_dp_zero = save_parameter_state = load_parameter_state = get_parameter_state_dp_zero

    _DIST_OPT.append(SwanDistributedOptimizer)
    return SwanDistributedOptimizer


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


def _mp_layout() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()


def _param_group_identifier_keys() -> tuple[str, ...]:
    import megatron.core.optimizer.optimizer as oo

    return tuple(k for k in oo.param_group_identifier_keys if k != "use_swan")


def _dist_state_dict(dopt) -> dict:
    """The common part: param groups' options, the loss scaler, the (TP, PP) sizes."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in dopt.optimizer.param_groups]
    sd = {"optimizer": {"param_groups": groups}, "swan_layout": _mp_layout()}
    if dopt.grad_scaler:
        sd["grad_scaler"] = dopt.grad_scaler.state_dict()
    return sd


def _dist_load_state_dict(dopt, state_dict: dict) -> None:
    saved = state_dict.get("swan_layout")
    if saved is not None and tuple(saved) != _mp_layout():
        raise ValueError(f"swan_dist: this distributed-optimizer checkpoint was saved at (TP, PP) = "
                         f"{tuple(saved)} and is loaded at {_mp_layout()}; SWAN's distributed-optimizer "
                         "state reloads at another data-parallel size only")
    keys = (*_param_group_identifier_keys(), "use_swan")

    def ident(g):
        return tuple(g.get(k, g.get(f"pre_{k}")) for k in keys)

    by_ident = {ident(g): g for g in state_dict["optimizer"]["param_groups"]}
    for g in dopt.optimizer.param_groups:
        src = by_ident.get(ident(g))
        if src is None:
            raise ValueError(f"swan_dist: the checkpoint has no param group with {dict(zip(keys, ident(g)))}")
        g.update({k: v for k, v in src.items() if k not in ("params", "param_names")})
    dopt.optimizer.init_state()
    if dopt.grad_scaler and "grad_scaler" in state_dict:
        dopt.grad_scaler.load_state_dict(state_dict["grad_scaler"])
    loaded = state_dict.get("param_state")
    if loaded is None:
        return
    with torch.no_grad():
        for name, main, tensors, _, _ in _dist_param_entries(dopt):
            if not tensors:
                continue
            for k, t in tensors.items():
                t.copy_(loaded[name][k].view(-1))
            st = dopt.optimizer.state.get(main)
            if st and "step" in loaded[name]:
                st["step"].fill_(float(loaded[name]["step"]))


def _dist_sharded_state_dict(dopt) -> dict:
    """The common part as objects, and per parameter its 1-D chunks (fp32 main copy, fallback moments)
    and step count, for ``dist_checkpointing``."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dopt.optimizer.init_state()  # fallback moments exist before a first step too: the same keys always
    dp_rank, inst = dopt.data_parallel_group.rank(), dopt.distributed_optimizer_instance_id
    sd = {k: ShardedObject(f"optimizer.distributed.dp_group_idx_{dopt.data_parallel_group_idx}.{k}", v,
                           (1,), (0,), replica_id=(inst, 0, dp_rank)) for k, v in _dist_state_dict(dopt).items()}
    param_state = {}
    for name, main, tensors, (size, offset, tp_replica), writer in _dist_param_entries(dopt):
        entry = {k: ShardedTensor(f"optimizer.swan.{k}.{name}", t, t.dtype, tuple(t.shape), (size,), (offset,),
                                  axis_fragmentations=None, replica_id=(0, tp_replica, inst))
                 for k, t in tensors.items()}
        st = dopt.optimizer.state.get(main)
        if st and "step" in st:  # one writer: the DP rank holding the parameter's first element
            entry["step"] = ShardedObject(f"optimizer.swan.step.{name}", st["step"], (1,), (0,),
                                          replica_id=(0, tp_replica, inst, 0 if writer else 1))
        if entry:  # nothing at all for a SWAN matrix of an fp32 model
            param_state[name] = entry
    sd["param_state"] = param_state
    return sd


def _dist_param_entries(dopt):
    """Per model parameter this rank holds a range of: (global name, fp32 shard, {state key: flat
    tensor}, (full numel, offset of the range in it, TP replica index), holds element 0)."""
    from megatron.core import parallel_state as ps

    pairs = [(dopt.model_float16_groups, dopt.shard_fp32_from_float16_groups),
             (dopt.model_fp32_groups, dopt.shard_fp32_groups)]
    for model_groups, shard_groups in pairs:
        for model_group, shard_group in zip(model_groups, shard_groups):
            for p, main in zip(model_group, shard_group):
                _, start, _ = getattr(p, SHARD)
                if _dim(p) is not None:
                    tp_rank, tp = _tp(p)
                    where = (tp * p.numel(), tp_rank * p.numel() + start, 0)
                else:
                    where = (p.numel(), start, ps.get_tensor_model_parallel_rank())
                tensors = {"fp32_param": main.view(-1)} if p.dtype != torch.float32 else {}
                st = dopt.optimizer.state.get(main) or {}
                tensors.update({k: st[k].view(-1) for k in ("exp_avg", "exp_avg_sq") if k in st})
                yield getattr(p, CKPT_NAME), main, tensors, where, start == 0


@contextlib.contextmanager
def _group_keys_with_use_swan():
    """Megatron matches param groups on load by ``param_group_identifier_keys`` (optimizer.py:96, read
    at 383-435 and distrib_optimizer.py:737-764); SWAN splits each of Megatron's groups into a SWAN and
    a fallback group with equal keys, which that matching would merge (a size mismatch, or one group's
    options on the other). While a SWAN wrapper loads, ``use_swan`` is one of the keys."""
    import megatron.core.optimizer.distrib_optimizer as do
    import megatron.core.optimizer.optimizer as oo

    saved = (oo.param_group_identifier_keys, do.param_group_identifier_keys)
    oo.param_group_identifier_keys = do.param_group_identifier_keys = (*saved[0], "use_swan")
    try:
        yield
    finally:
        oo.param_group_identifier_keys, do.param_group_identifier_keys = saved


def _load_with_use_swan(wrapper) -> None:
    load = wrapper.load_state_dict

    def load_state_dict(state_dict, *args, **kwargs):
        with _group_keys_with_use_swan():
            return load(state_dict, *args, **kwargs)

    wrapper.load_state_dict = load_state_dict


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
    split_glu, verbose) or ``swan_<key>`` attributes on ``config``. ``config.lr``, ``weight_decay``,
    ``adam_beta1/2``, ``adam_eps`` keep their Megatron meaning (the betas and eps are the AdamW
    fallback's); Megatron's scheduler, clipping, loss scaling and checkpointing work unchanged.
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

    def factory(params, lr, weight_decay, betas, eps, **_):
        expert = any(g.get("is_expert_parallel") and g["params"] for g in params)
        opt = SWAN(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                   process_group=experts if expert else dense,
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
    for g in wrapper.optimizer._origin:
        for _, p in g:
            setattr(p, SHARD, (None, 0, 0))
    pairs = [(wrapper.model_float16_groups, wrapper.shard_fp32_from_float16_groups),
             (wrapper.model_fp32_groups, wrapper.shard_fp32_groups)]
    for model_groups, shard_groups in pairs:
        for model_group, shard_group in zip(model_groups, shard_groups):
            for p, shard in zip(model_group, shard_group):
                r = wrapper._get_model_param_range_map(p)["param"]
                setattr(p, SHARD, (shard, r.start, r.end))


def main() -> None:
    from swan_dist.integrations.megatron_lm import main as run

    run()


__all__ = ["MegatronAdapter", "get_swan_optimizer", "mark_fused", "SWAN_OPTIONS"]

if __name__ == "__main__":
    main()
