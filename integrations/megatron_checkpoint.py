"""megatron-core: the distributed optimizer's checkpoint format for SWAN.

Megatron 0.16's formats for its distributed optimizer are Adam's; :func:`_distributed_optimizer_class`
builds the ``DistributedOptimizer`` subclass that writes SWAN's own (see its docstring), the names it
writes parameters under (:func:`_global_names`: the same on every pipeline layout), and the matching of
SWAN's param groups on load. The legacy format (``--ckpt-format torch``) is refused with
:data:`LEGACY_DIST_OPT_CHECKPOINT`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .megatron import SHARD, _dim, _tp

_DIST_OPT: list = []
LEGACY_DIST_OPT_CHECKPOINT = (
    "swan_dist: Megatron's legacy checkpoint format (--ckpt-format torch: distrib_optim.pt, Adam moments gathered on "
    "DP rank 0) is not supported for SWAN under the distributed optimizer; use --ckpt-format torch_dist (the default), "
    "whose optimizer state swan_dist writes itself")
CKPT_NAME = "_swan_ckpt_name"  # on a model param: its name with wrappers dropped and global layer numbers


def _swan_init_state(opt, config=None) -> None:
    """Megatron calls this before loading a checkpoint into empty state: SWAN's own (AdamW moments for
    the fallback tensors that keep them, nothing for SWAN matrices)."""
    opt.init_state()


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


__all__ = ["LEGACY_DIST_OPT_CHECKPOINT"]
