"""FSDP2 (``fully_shard``): parameters are DTensors sharded on dim 0 (``Shard(0)``), possibly uneven or
empty, on a 1-D mesh or a 2-D mesh whose other dim replicates (HSDP). A rank's local shard is rows
``[r0, r1)`` of the full tensor, i.e. the contiguous range ``[r0·row, r1·row)`` of its flattened form.
Gradients are DTensors with the parameter's placements."""

from __future__ import annotations

import math

from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from swan_dist.routing import Piece


def is_dtensor(param: Tensor) -> bool:
    return isinstance(param, DTensor)


def dtensor_piece(param: DTensor, name: str) -> Piece:
    """This rank's contiguous piece of a row-sharded (or replicated) DTensor parameter."""
    for pl in param.placements:
        if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)):
            raise ValueError(
                f"swan_dist: parameter {name!r} has placements {param.placements}; SWAN's owner engine "
                "needs each rank's piece to be contiguous (Shard(0) or Replicate on every mesh dim)"
            )
    local = param.to_local()
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    row = math.prod(param.shape[1:])
    lo = min(offset[0] * row, param.numel()) if local.numel() else 0
    grad = param.grad
    if grad is not None:
        grad = grad.to_local() if isinstance(grad, DTensor) else grad
        grad = grad.reshape(-1)
    return Piece(tuple(param.shape), lo, lo + local.numel(), local.detach().view(-1), grad)
