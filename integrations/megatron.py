"""megatron-core: the adapter for its tensor-parallel layouts and fused matrices.

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

The rest of the Megatron integration, by part: the optimizer factory
(:mod:`swan_dist.integrations.megatron_factory`, :func:`get_swan_optimizer`), the distributed
optimizer's checkpoint format (:mod:`swan_dist.integrations.megatron_checkpoint`) and the Megatron-LM
``--optimizer swan`` flag (:mod:`swan_dist.integrations.megatron_lm`; ``python -m
swan_dist.integrations.megatron pretrain_gpt.py ...`` runs it too).
"""

from __future__ import annotations

import sys

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


def main() -> None:
    from swan_dist.integrations.megatron_lm import main as run

    run()


__all__ = ["MegatronAdapter", "mark_fused"]

if __name__ == "__main__":
    main()
