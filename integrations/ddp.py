"""DDP (and any replicated data parallelism, ZeRO-0 included): every rank holds the whole tensor,
so each parameter is one piece ``[0, numel)`` of itself. In ``owner`` mode the owner whitens and the
update reaches every other rank; nothing is sent towards the owner, which already has the gradient."""

from __future__ import annotations

from torch import Tensor

from swan_dist.routing import Piece


def replicated_piece(param: Tensor) -> Piece:
    """A plain tensor as a piece of itself."""
    return Piece(
        tuple(param.shape), 0, param.numel(), param.detach().view(-1),
        None if param.grad is None else param.grad.view(-1),
    )
