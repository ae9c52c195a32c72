"""DTensor parameters: FSDP2 (``fully_shard``), tensor parallelism (``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``) and both on a 2-D mesh (torchtitan's FSDP + TP), HSDP.

A rank's local tensor is a *box* of the global tensor: an index range per dim. The placements on the
mesh decide the boxes of every mesh coordinate alike on every rank, so each rank computes all of them
(torch's own offset computation, per coordinate) and checks that they tile the tensor as a grid:

- ``Shard(0)`` (FSDP2, column-parallel TP, both): row ranges: plain row-major order, each box one range;
- ``Shard(1)`` (row-parallel TP) with or without ``Shard(0)`` on the data-parallel dim: column blocks,
  numbered block after block (``Layout.col_splits``), each box one range of that order;
- ``_StridedShard(0)`` on the data-parallel dim over ``Shard(0)`` TP (``fully_shard`` after
  ``ColwiseParallel``): row ranges again, at the offsets torch computes;
- ``Replicate`` anywhere: replicas hold the same range;
- a 3-D expert stack cut on its expert dim and on its rows (expert parallelism with FSDP over the
  rows, torchtitan's ``(Shard(0), Shard(1))``): a grid of cells (``Layout.lead_splits``), each
  rank's cell one range; each expert is whitened as its own matrix.

Anything else (``Partial``, a strided layout whose shards are not index ranges, boxes that do not
tile) is refused when SWAN is built, with the parameter's name and placements, on every rank.
Gradients must carry the parameter's placements.
"""

from __future__ import annotations

import importlib
import itertools
import math
import sys
from functools import cache, lru_cache

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from swan_dist.adapter import Adapter, Piece, tensor_piece
from swan_dist.layout import Layout

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim


def _is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor. A DTensor exists only once ``torch.distributed.tensor`` is imported, so
    this imports nothing: ``import swan_dist`` leaves DTensor's modules (and its private ones) unloaded."""
    dt = sys.modules.get("torch.distributed.tensor")
    return dt is not None and isinstance(tensor, dt.DTensor)


@cache
def _private(module: str, name: str):
    """torch's private ``module.name``, imported on first use: DTensor offers no public way to compute a
    shard's box nor to name the strided placement, and a private name may move in any torch release. An
    upgrade that moves it fails here, naming the torch version and what is missing."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"swan_dist: torch {torch.__version__} has no {module}.{name}, which swan_dist's DTensor "
                          "adapter needs (FSDP2, tensor parallelism); pin torch to a version swan_dist supports") from e


def _strided_shard() -> type:
    """torch's private ``_StridedShard`` placement (``fully_shard`` over a tensor-parallel ``Shard``)."""
    return _private("torch.distributed.tensor.placement_types", "_StridedShard")


def _local_shape_and_offset(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int],
                            placements: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the shard at mesh coordinate ``coord``: torch's own computation, the
    private ``_compute_local_shape_and_global_offset``, because every rank needs every coordinate's box and
    the variant that takes a ``DeviceMesh`` answers for this rank's coordinate only."""
    utils = importlib.import_module("torch.distributed.tensor._utils")
    if not hasattr(utils, "_compute_local_shape_and_global_offset") and hasattr(
            utils, "compute_local_shape_and_global_offset"):  # torch < 2.7: only this rank's coordinate
        return utils.compute_local_shape_and_global_offset(shape, _At(mesh_shape, coord), placements)
    compute = _private("torch.distributed.tensor._utils", "_compute_local_shape_and_global_offset")
    try:
        with unset_fake_temporarily():  # index arithmetic on small tensors: real ones, also in a fake step
            return compute(shape, mesh_shape, coord, placements)
    except TypeError as e:
        raise RuntimeError(f"swan_dist: torch {torch.__version__}'s torch.distributed.tensor._utils."
                           "_compute_local_shape_and_global_offset(global_shape, mesh_shape, my_coordinate, "
                           f"placements) failed ({e}): its signature may have changed in this version; pin "
                           "torch to a version swan_dist supports") from e


class _At:
    """A mesh of ``mesh_shape`` seen from ``coord``: what torch 2.6's ``compute_local_shape_and_global_offset``
    asks of a ``DeviceMesh`` (``get_coordinate``, ``ndim``, ``size``)."""

    def __init__(self, mesh_shape: tuple[int, ...], coord: list[int]) -> None:
        self.shape, self.coord, self.ndim = tuple(mesh_shape), list(coord), len(mesh_shape)

    def get_coordinate(self) -> list[int]:
        return self.coord

    def size(self, dim: int | None = None) -> int:
        return math.prod(self.shape) if dim is None else self.shape[dim]


@lru_cache(maxsize=4096)
def _grid(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> tuple[Layout, dict] | str:
    """(layout, {mesh coordinate: canonical range}) of a DTensor layout, or why it is refused."""
    from torch.distributed.tensor import Replicate, Shard

    for pl in placements:
        if not isinstance(pl, (Shard, _strided_shard(), Replicate)):
            return f"placement {pl} is not supported (only Shard, _StridedShard and Replicate)"
    boxes: dict[tuple[int, ...], Box] = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        size, start = _local_shape_and_offset(shape, mesh_shape, list(coord), placements)
        boxes[coord] = tuple((int(a), int(a) + int(s)) for a, s in zip(start, size))
    full = [b for b in boxes.values() if all(hi > lo for lo, hi in b)]
    # a grid: per dim the distinct index ranges partition [0, n), and every combination is some box
    cuts = []
    for d, n in enumerate(shape):
        spans = sorted({b[d] for b in full})
        if not spans or spans[0][0] != 0 or spans[-1][1] != n or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            return "its shards do not tile the tensor as index ranges (uneven or strided layout)"
        cuts.append(spans)
    if len(set(full)) != math.prod(len(c) for c in cuts):
        return "its shards do not tile the tensor as a grid"
    layout = Layout(tuple(lo for lo, _ in cuts[-1][1:])) if len(shape) >= 2 else Layout()
    if len(shape) == 3 and len(cuts[0]) > 1 and len(cuts[1]) > 1:  # experts and their rows both cut: a grid
        layout = Layout(layout.col_splits, lead_splits=tuple(lo for lo, _ in cuts[0][1:]),
                        row_splits=tuple(lo for lo, _ in cuts[1][1:]))
    ranges = {}
    for coord, box in boxes.items():
        if not all(hi > lo for lo, hi in box):
            ranges[coord] = (0, 0)
            continue
        rng = box[0] if len(shape) < 2 else layout.box_range(shape, [lo for lo, _ in box], [hi - lo for lo, hi in box])
        if rng is None:
            return f"the shard {box} is not one contiguous range of the matrix's canonical order"
        ranges[coord] = rng
    return layout, ranges


class DTensorAdapter(Adapter):
    name = "dtensor"

    def claims(self, tensor: Tensor) -> bool:
        return _is_dtensor(tensor)

    def _grid(self, p: Tensor, name: str) -> tuple[Layout, dict]:
        found = _grid(tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.placements))
        if isinstance(found, str):
            raise ValueError(
                f"swan_dist: parameter {name!r} (shape {list(p.shape)}) has placements {tuple(p.placements)} on a "
                f"{tuple(p.device_mesh.shape)} mesh: {found}. SWAN supports Shard(0), Shard(1), _StridedShard(0) over "
                "Shard(0) and Replicate (FSDP2, Colwise/RowwiseParallel, FSDP2 + TP)"
            )
        return found

    def check(self, tensor: Tensor, name: str) -> None:
        self._grid(tensor, name)

    def local(self, tensor: Tensor) -> Tensor:
        # Shard / Replicate only (checked above; a gradient carries the parameter's placements): an
        # elementwise update of the local shard is the update of those elements of the whole tensor
        return tensor.to_local() if _is_dtensor(tensor) else tensor

    def peer_ranges(self, tensor: Tensor, piece: Piece, world: int) -> list[tuple[int, int]] | None:
        mesh = tensor.device_mesh  # a 1-D mesh over the whole group: rank r at coordinate (r,)
        if mesh.ndim != 1 or mesh.size() != world:
            return None
        _, ranges = self._grid(tensor, piece.name)
        return [ranges[(r,)] for r in range(world)]

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        layout, ranges = self._grid(tensor, name)
        coord = tensor.device_mesh.get_coordinate()
        lo, hi = (0, 0) if coord is None else ranges[tuple(coord)]
        local = tensor.to_local()
        if local.numel() != hi - lo:
            raise ValueError(f"swan_dist: parameter {name!r} holds {local.numel()} local elements, its placements say "
                             f"{hi - lo}")
        grad = tensor.grad
        if _is_dtensor(grad):
            if grad.placements != tensor.placements:
                raise ValueError(f"swan_dist: the gradient of {name!r} has placements {grad.placements}, the parameter "
                                 f"{tensor.placements}; reduce it to the parameter's placements before step()")
            grad = grad.to_local()
        return [tensor_piece(name, tensor, lo=lo, local=local, grad=grad, layout=layout)]
