"""Framework adapters for swan_dist (installed as ``swan_dist.integrations``).

Each adapter only answers, for every managed matrix: which contiguous piece of it this rank holds,
where that piece's gradient is, and where its update goes. The math lives in
``swan_dist.functional``; the optimizer in ``swan_dist.optimizer``.
"""

from __future__ import annotations

from torch import Tensor

from swan_dist.routing import Piece

from torch import nn

from . import deepspeed, fsdp1
from .ddp import replicated_piece
from .fsdp2 import dtensor_piece, is_dtensor


def prepare(model: nn.Module) -> None:
    """Let adapters record what they need on a wrapped model's parameters (FSDP1's flat views)."""
    fsdp1.register(model)
    deepspeed.register(model)


def locate(param: Tensor, name: str) -> Piece:
    """This rank's piece of ``param`` (the one question every adapter answers)."""
    if is_dtensor(param):
        return dtensor_piece(param, name)
    if fsdp1.is_flat_piece(param):
        return fsdp1.flat_piece(param)
    return replicated_piece(param)
