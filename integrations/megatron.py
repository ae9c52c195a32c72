"""Megatron-core tensor parallelism: ``ColumnParallelLinear`` / ``RowParallelLinear`` (and any parameter
Megatron tags ``tensor_model_parallel``) hold a block of the logical matrix as a plain tensor,
``partition_dim`` telling which dim is cut over the tensor-parallel group:

- ``partition_dim=0`` (column-parallel: ``linear_qkv``, ``linear_fc1``, ``output_layer``): TP rank r
  holds rows ``[r·m/tp, (r+1)·m/tp)``, one range of the row-major order;
- ``partition_dim=1`` (row-parallel: ``linear_proj``, ``linear_fc2``): TP rank r holds column block r,
  one range of the column-block order (``Layout.col_splits``); the owner puts the blocks back along
  columns (SWAN is not transpose-equivariant, so a transpose would be wrong).

Every data-parallel replica holds the same block (Megatron DDP all-reduces gradients), so the engine's
group is the whole TP x DP world and each matrix is whitened whole, once. ``partition_stride > 1``
(SwiGLU ``linear_fc1``: each rank holds ``[gate_r; up_r]``) concatenates to a row permutation of
``[gate; up]``, which SWAN whitens like ``[gate; up]`` (it is row-permutation equivariant).
"""

from __future__ import annotations

from torch import Tensor

from swan_dist.adapter import Adapter, Piece, tensor_piece
from swan_dist.routing import Layout


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


class MegatronTPAdapter(Adapter):
    name = "megatron-tp"

    def claims(self, tensor: Tensor) -> bool:
        return bool(getattr(tensor, "tensor_model_parallel", False)) and type(tensor).__name__ != "DTensor"

    def shape(self, tensor: Tensor) -> tuple[int, ...]:
        _, size = _tp()
        dim = tensor.partition_dim
        return tuple(s * size if d == dim else s for d, s in enumerate(tensor.shape))

    def check(self, tensor: Tensor, name: str) -> None:
        if tensor.dim() not in (1, 2) or tensor.partition_dim not in range(tensor.dim()):
            raise ValueError(f"swan_dist: Megatron parameter {name!r} of local shape {list(tensor.shape)} is cut on dim "
                             f"{tensor.partition_dim}; SWAN maps 2-D weights cut on dim 0 or 1, and 1-D ones")

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        rank, size = _tp()
        shape = self.shape(tensor)
        layout = Layout()
        if tensor.dim() == 2 and tensor.partition_dim == 1 and size > 1:
            width = tensor.shape[1]
            layout = Layout(tuple(width * k for k in range(1, size)))
        return [tensor_piece(name, tensor, shape=shape, lo=rank * tensor.numel(), grad=tensor.grad, layout=layout)]


__all__ = ["MegatronTPAdapter"]
