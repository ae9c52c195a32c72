"""FSDP1 (``FullyShardedDataParallel``) with ``use_orig_params=True``: each original parameter is a 1-D
view of its part of the rank's FlatParameter shard (``(0,)`` with ``grad=None`` where the rank holds
none of it). That part is one contiguous range of the flattened original tensor,
``FlatParameter._shard_param_infos[i]`` (end index inclusive), which is the engine's contract.

:func:`register` records on every original parameter its full shape and that range, so the optimizer
and the parameter classifier see matrices, not flat views. ``swan_dist.tag_model`` (and so
``SWAN(model)`` and ``swan_dist.param_groups``) calls it. ``use_orig_params=False`` hands the
optimizer FlatParameters only; that layout is rejected with an error for now.
"""

from __future__ import annotations

from torch import Tensor, nn

from swan_dist.routing import RANGE_ATTR as RANGE
from swan_dist.routing import SHAPE_ATTR as SHAPE
from swan_dist.routing import Piece


def register(model: nn.Module) -> int:
    """Tag the original parameters of every FSDP1 unit in ``model``; returns how many were tagged."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    count = 0
    for module in model.modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FSDP) else None
        if handle is None:
            continue
        flat = handle.flat_param
        if flat._params is None:
            raise ValueError(
                "swan_dist: FSDP1 with use_orig_params=False hands the optimizer FlatParameters only "
                f"({', '.join(flat._fqns[:3])}, ...); wrap with use_orig_params=True"
            )
        for param, shape, info in zip(flat._params, flat._shapes, flat._shard_param_infos):
            rng = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            setattr(param, SHAPE, tuple(shape))
            setattr(param, RANGE, rng)
            count += 1
    return count


def is_flat_piece(param: Tensor) -> bool:
    return hasattr(param, RANGE)


def flat_piece(param: Tensor) -> Piece:
    lo, hi = getattr(param, RANGE)
    local = param.detach().reshape(-1)
    if local.numel() != hi - lo:
        raise ValueError(
            f"swan_dist: an FSDP1 parameter of shape {getattr(param, SHAPE)} holds {local.numel()} local "
            f"elements, its recorded range [{lo}, {hi}) says {hi - lo}: was the model re-sharded?"
        )
    grad = None if param.grad is None else param.grad.reshape(-1)
    return Piece(getattr(param, SHAPE), lo, hi, local, grad)
