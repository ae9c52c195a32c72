"""DeepSpeed: ``"optimizer": {"type": "SWAN", "params": {...}}`` in the JSON config.

DeepSpeed resolves an unknown optimizer type as ``getattr(torch.optim, type)(model_parameters,
**params)``, so ``import swan_dist`` makes ``torch.optim.SWAN`` exist, and ZeRO's list of tested
optimizers gets SWAN appended when a SWAN is built with DeepSpeed loaded (no
``zero_allow_untested_optimizer`` needed).

Where the pieces live (ZeRO-1/2, and bf16 at any stage): DeepSpeed replaces each param group's
parameters by one flat fp32 partition of the group; every original (low-precision) parameter ``lp``
links to its part of it through ``lp._hp_mapping`` (``None`` where this rank holds none of it):
``lp_fragment_address`` is the contiguous range of the flattened parameter, ``hp_fragment_address``
where it sits in the partition. SWAN splits its groups into SWAN and fallback groups, so a SWAN
group's partition holds matrices only; the fallback rule runs elementwise on the fallback partition.
ZeRO-3 partitions each parameter alone and steps one sub-group at a time (:func:`zero3_pieces`).
:func:`replaced_pieces` is the one entry point the optimizer calls for a group whose tensors
DeepSpeed replaced.

The engine's model is tagged (``swan_dist.tag_model``) when the engine builds SWAN from its JSON
(:func:`engine_module`), so the bare parameters DeepSpeed passes keep their names and rules.

``"params"`` are SWAN's keyword arguments: ``"lr"`` is SWAN's own global lr (under the Transformers Trainer
``"lr": "auto"`` is its ``learning_rate``, taken as SWAN's); ``"adamw_lr"`` is a tuned AdamW's lr, converted by
the lr convention (:func:`swan_dist.from_adamw`), ``"learning_rate"`` under the Trainer for its ``learning_rate``
(Accelerate refuses an ``"auto"`` it does not fill itself).
:class:`DeepSpeedAdapter` is how the optimizer reaches all of this.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from swan_dist.adapter import Adapter, Piece, StateSlot, flat_piece, tensor_piece

# Where DeepSpeed's wrappers keep their fp32 master weights (ZeRO-1/2, ZeRO-3, bf16, fp16).
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition",
                 "fp32_groups")


def master_weights(wrapper) -> list:
    """The fp32 master tensors a DeepSpeed optimizer wrapper holds, in its own (nested) lists."""
    return [getattr(wrapper, attr) for attr in _MASTER_ATTRS if hasattr(wrapper, attr)]


def register_type(cls: type) -> None:
    """Make ``"type": "SWAN"`` resolve (DeepSpeed looks the name up in ``torch.optim``)."""
    if getattr(torch.optim, cls.__name__, None) is not cls:
        setattr(torch.optim, cls.__name__, cls)


def deepspeed_adamw_defaults() -> dict[str, Any]:
    """``betas``, ``eps`` and ``weight_decay`` of the AdamW a DeepSpeed JSON's ``"type": "AdamW"`` builds without
    them (``FusedAdam``; ``DeepSpeedCPUAdam`` under offload has the same: (0.9, 0.999), 1e-8, 0 in 0.19), read
    from its signature."""
    import inspect

    from deepspeed.ops.adam import FusedAdam

    params = inspect.signature(FusedAdam.__init__).parameters
    return {k: params[k].default for k in ("betas", "eps", "weight_decay")}


def allow_in_zero(cls: type) -> None:
    """Add ``cls`` to ZeRO's supported optimizers, if DeepSpeed is loaded."""
    if "deepspeed" not in sys.modules:
        return
    from deepspeed.runtime.zero import utils

    if cls not in utils.ZERO_SUPPORTED_OPTIMIZERS:
        utils.ZERO_SUPPORTED_OPTIMIZERS.append(cls)


def building_engine():
    """The DeepSpeed engine that is building this optimizer from its JSON ``"type"`` (a caller up the stack,
    ``DeepSpeedEngine._configure_basic_optimizer``), if any."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed.runtime.engine import DeepSpeedEngine

    # only the engine's own frames are asked for their locals: reading a frame's f_locals keeps a snapshot of
    # them on the frame, so asking every caller's would hold what they had (a model later deleted) while they run
    methods = {f.__code__ for f in vars(DeepSpeedEngine).values() if hasattr(f, "__code__")}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in methods:
            engine = frame.f_locals.get("self")
            if isinstance(engine, DeepSpeedEngine):
                return engine
        frame = frame.f_back
    return None


def engine_module() -> nn.Module | None:
    """The model of the DeepSpeed engine that is building this optimizer from its JSON ``"type"``, if
    any: DeepSpeed hands the optimizer bare parameters, and its engine holds the module that knows their names."""
    engine = building_engine()
    return None if engine is None else engine.module


WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


def convert_warmup(engine, optimizer) -> None:
    """With ``"adamw_lr"`` in the JSON's SWAN params, the lrs of a ``WarmupLR`` / ``WarmupDecayLR`` in its
    ``"scheduler"`` are AdamW's too: both write one ``warmup_max_lr`` into every param group (``WarmupDecayLR``'s
    default 0.001), which would put SWAN's matrix and fallback groups at AdamW's lr (or 0.001). Here each group's
    warm-up ends at its own converted lr (``warmup_max_lr`` left out, or equal to ``adamw_lr``) and starts at
    ``warmup_min_lr`` converted alike; a ``warmup_max_lr`` other than ``adamw_lr`` is an error naming the fix.
    ``WarmupCosineLR`` scales each group's own lr by ratios and needs nothing. Called while the engine builds SWAN,
    before it builds the scheduler; the engine's scheduler params are replaced, the caller's config untouched."""
    name, params = engine.scheduler_name(), engine.scheduler_params()
    eta = (engine.optimizer_params() or {}).get("adamw_lr")
    if name not in WARMUP_SCHEDULERS or eta is None:
        return
    from swan_dist.defaults import rank0
    from swan_dist.integrations.huggingface import TRAINER_LR, trainer_args
    from swan_dist.summary import log_info

    eta = float(trainer_args().learning_rate if eta in TRAINER_LR else eta)
    params = dict(params or {})
    lrs = [float(g["lr"]) for g in optimizer.param_groups]  # converted from eta at construction
    peak, low = params.get("warmup_max_lr"), params.get("warmup_min_lr", 0.0)
    for key, value in (("warmup_max_lr", peak), ("warmup_min_lr", low)):
        if isinstance(value, (list, tuple)):
            raise ValueError(f"swan_dist: the DeepSpeed scheduler {name}'s {key} is a list ({value!r}); with \"adamw_lr\" "
                             f"give one number, AdamW's (SWAN converts it for each of its param groups)")
    if peak is not None and not math.isclose(float(peak), eta, rel_tol=1e-6):
        raise ValueError(
            f"swan_dist: the DeepSpeed scheduler {name} has warmup_max_lr={peak!r} and the SWAN params adamw_lr={eta!r}: "
            f"{name} writes warmup_max_lr into every param group, so it would replace the lrs converted from adamw_lr. "
            f"Leave warmup_max_lr out (each SWAN group then warms up to its own converted lr) or set it to adamw_lr "
            f"({eta!r}); or use WarmupCosineLR, which scales each group's own lr")
    params["warmup_max_lr"] = lrs
    params["warmup_min_lr"] = [float(low) * lr / eta for lr in lrs]
    engine._config.scheduler_params = params  # DeepSpeed's private config: what _scheduler_from_config reads next
    if rank0():
        def show(values: list[float]) -> str:
            return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"
        log_info(f"swan_dist: DeepSpeed's {name} with adamw_lr={eta:g}: each SWAN param group warms up from "
                 f"{show(params['warmup_min_lr'])} to its converted lr {show(lrs)} (warmup_max_lr and warmup_min_lr "
                 "read as AdamW's)")


def replaced_pieces(originals: list[tuple[str, Tensor]], params: list[Tensor], use_swan: bool, index: int,
                    group) -> list[Piece] | None:
    """Pieces for a param group whose tensors DeepSpeed replaced (``None``: not DeepSpeed's doing):

    - nothing: ZeRO-3 emptied the group while it steps another sub-group;
    - one flat fp32 partition: a SWAN group's matrices (ZeRO-1/2 ``_hp_mapping``, or ZeRO-3's
      per-parameter partitions), or a fallback group's partition as one elementwise tensor.

    (One-to-one fp32 copies, bf16 without ZeRO, are adopted like any same-shape replacement.)
    """
    zero3 = any(hasattr(p, "ds_id") for _, p in originals)
    if not zero3 and not any(_hp_linked(p) for _, p in originals):
        return None
    if not params:
        return [] if zero3 else None
    if len(params) != 1 or not _partition(params[0], zero3):
        return None
    flat = params[0]
    if not use_swan:
        return [tensor_piece(f"<flat partition of fallback group {index}>", flat, grad=flat.grad)]
    return zero3_pieces(originals, flat, group) if zero3 else partition_pieces(originals, flat)


def _partition(flat: Tensor, zero3: bool) -> bool:
    """Whether ``flat`` is one of DeepSpeed's flat partitions: a plain 1-D tensor (not a subclass such as
    another framework's DTensor), under ZeRO-3 carrying its sub-group's ``ds_id``."""
    if type(flat) not in (Tensor, nn.Parameter) or flat.dim() != 1:
        return False
    return not zero3 or "_" in str(getattr(flat, "ds_id", ""))


def zero3_pieces(originals: list[tuple[str, Tensor]], flat: Tensor, group) -> list[Piece]:
    """ZeRO-3: this rank's piece of each parameter of the sub-group whose fp32 partition is ``flat``.

    ZeRO-3 cuts every parameter alone into ``W`` partitions of ``ceil(numel / W)`` elements (the last
    padded) and steps one sub-group (consecutive parameters of a group) at a time, with the group's
    other sub-groups emptied. ``flat`` carries ``ds_id = "<first ds_id>_<last ds_id>"`` of its
    sub-group and concatenates each member's partition.
    """
    first, _, last = str(getattr(flat, "ds_id", "")).partition("_")
    ids = [str(getattr(p, "ds_id", None)) for _, p in originals]
    if first not in ids or last not in ids:
        raise ValueError(
            f"swan_dist: a ZeRO-3 partition (ds_id={getattr(flat, 'ds_id', None)!r}) does not match the "
            "parameters this SWAN group was built with"
        )
    members = originals[ids.index(first) : ids.index(last) + 1]
    sizes = [p.partition_numel() for _, p in members]
    if sum(sizes) != flat.numel():
        raise ValueError(
            f"swan_dist: ZeRO-3 partition of {flat.numel()} elements, its {len(members)} parameters hold {sum(sizes)}"
        )
    out, offset = [], 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    for (name, p), size in zip(members, sizes):
        pg = getattr(p, "ds_process_group", None)
        if world > 1 and dist.get_world_size(pg) != world:
            raise ValueError(
                f"swan_dist: ZeRO-3 partitions {name!r} over {dist.get_world_size(pg)} ranks but SWAN's "
                f"process_group has {world}; pass SWAN(process_group=...) ZeRO's partition group"
            )
        # a partition past the end (W > numel / ceil(numel / W): padding only) holds nothing
        lo = min((dist.get_rank(pg) if world > 1 else 0) * size, p.ds_numel)
        n = min(size, p.ds_numel - lo)
        out.append(flat_piece(name, p.ds_shape, lo, flat, offset, n))
        offset += size
    return out


def partition_pieces(originals: list[tuple[str, Tensor]], flat: Tensor) -> list[Piece]:
    """This rank's piece of each original parameter inside the flat fp32 partition ``flat``."""
    out = []
    for name, lp in originals:
        if not _hp_linked(lp):
            raise ValueError(
                f"swan_dist: parameter {name!r} was replaced by a flat partition but carries no DeepSpeed "
                "_hp_mapping; this framework layout is not supported"
            )
        lo, start, n = _hp_fragment(lp)
        out.append(flat_piece(name, getattr(lp, "ds_shape", lp.shape), lo, flat, start, n))
    return out


def _hp_linked(p: Tensor) -> bool:
    """Whether ``p`` carries DeepSpeed's link to its part of a flat fp32 partition (ZeRO-1/2, bf16): the
    private attribute ``_hp_mapping``, read only here and in :func:`_hp_fragment`."""
    return hasattr(p, "_hp_mapping")


def _hp_fragment(lp: Tensor) -> tuple[int, int, int]:
    """(start in the flattened ``lp``, start in the flat partition, numel) of this rank's contiguous part of
    the low-precision parameter ``lp``, from DeepSpeed's private ``lp._hp_mapping``; ``(0, 0, 0)`` where this
    rank holds none of it (the mapping is ``None``)."""
    mapping = lp._hp_mapping
    if mapping is None:
        return 0, 0, 0
    return mapping.lp_fragment_address.start, mapping.hp_fragment_address.start, mapping.lp_fragment_address.numel


class DeepSpeedAdapter(Adapter):
    """ZeRO-3 partitioned parameters (full shape in ``ds_shape``), the flat partitions ZeRO puts in
    place of a group's parameters, and the engine lookup for ``"optimizer": {"type": "SWAN"}``."""

    name = "deepspeed"

    def claims(self, tensor: Tensor) -> bool:
        return hasattr(tensor, "ds_shape")

    def shape(self, tensor: Tensor) -> tuple[int, ...]:
        return tuple(tensor.ds_shape)

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        # outside DeepSpeed's step (which swaps in its partitions) a ZeRO-3 parameter holds nothing here
        return [Piece(name, self.shape(tensor), 0, 0, tensor.detach().reshape(-1)[:0], None, tensor, None, StateSlot(tensor))]

    def adopt(self, originals, params, use_swan, index, group):
        return replaced_pieces(originals, params, use_swan, index, group)

    def name_bare(self, params):
        return engine_module()

    def step_key(self, params):
        # ZeRO-3 steps one sub-group at a time, its flat partition in place of its group's parameters and
        # the others emptied: the sub-groups' ds_ids ("<first>_<last>", alike on every rank) name the part
        ids = tuple(str(p.ds_id) for p in params if "_" in str(getattr(p, "ds_id", "")))
        return ids or None

    def optimizer_built(self, optimizer) -> None:
        allow_in_zero(type(optimizer))
        engine = building_engine()
        if engine is not None:
            convert_warmup(engine, optimizer)
