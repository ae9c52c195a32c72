"""DDP (and any replicated data parallelism, ZeRO-0 included, or no wrapper at all): every rank holds
the whole tensor, so each parameter is one piece ``[0, numel)`` of itself. In ``owner`` mode the owner
whitens and the update reaches every other rank; nothing is sent towards the owner, which already
has the gradient."""

from __future__ import annotations

from torch import Tensor

from swan_dist.adapter import Adapter, Piece, tensor_piece


class ReplicatedAdapter(Adapter):
    name = "replicated"

    def claims(self, tensor: Tensor) -> bool:
        return True

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        return [tensor_piece(name, tensor, grad=tensor.grad)]
