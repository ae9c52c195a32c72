"""FSDP1 (``FullyShardedDataParallel``): where each original parameter's piece lives in a rank's shard of
its unit's ``FlatParameter``. ``FlatParameter._shard_param_infos[i]`` gives, per original, this rank's
contiguous range of the flattened original (``intra_param_start_idx``, end index *inclusive*) and where
it sits in the local shard (``offset_in_shard``, ``numel_in_shard``); padding at the end of a shard
belongs to no original. That range is the engine's contract.

:func:`register` records what the optimizer and the parameter classifier need, so that they see the
original matrices, not flat tensors; ``swan_dist.tag_model`` (and so ``SWAN(model)`` and
``swan_dist.param_groups``) calls it.

- ``use_orig_params=True``: the optimizer gets the originals, each a 1-D view of its part of the shard
  (``(0,)`` with ``grad=None`` where the rank holds none of it). Each is tagged with its full shape and
  range, and with its FlatParameter.
- ``use_orig_params=False``: the optimizer gets FlatParameters only. Each is tagged with its originals
  (:class:`Original`: name, shape, range, offset in the shard). One FlatParameter mixes SWAN matrices and
  fallback parameters, so the optimizer keeps it in a fallback group and, each step, takes one
  :class:`FlatPiece` per original (:func:`flat_pieces`): SWAN matrices go to the engine, the fallback rule
  runs on the others' pieces with *compact* state, holding their elements only, so that SWAN matrices keep
  zero optimizer state here too.

Checkpoints go through torch's FSDP1 optimizer state dict (``FSDP.optim_state_dict``, which DCP's
``get_state_dict`` calls). It was written for optimizers whose state covers every trainable original of
a FlatParameter alike: with ``use_orig_params=True`` it rebuilds each rank's shard of every state tensor
by concatenating the state of *all* originals of the FlatParameter (``_allgather_orig_param_states``), so
an original without state (a SWAN matrix next to AdamW-managed biases and norms) leaves the shard short
and an ``AssertionError`` follows; with ``use_orig_params=False`` it expects state tensors shaped like the
FlatParameter's shard. The optimizer therefore presents its state in those shapes (:func:`dense_state`,
:func:`placeholder_state`): zeros for SWAN matrices, which reach the checkpoint as zero AdamW moments
(disk only), and are dropped again on load (:func:`compact_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from swan_dist.routing import RANGE_ATTR as RANGE
from swan_dist.routing import SHAPE_ATTR as SHAPE
from swan_dist.routing import Piece
from swan_dist.selection import clean_name

ORIGINALS = "_swan_originals"  # on a FlatParameter (use_orig_params=False): its Original records
FLAT = "_swan_flat"  # on an original parameter (use_orig_params=True): its FlatParameter
STEPS = "step_per_original"  # in checkpoints (use_orig_params=False): AdamW step count per fallback original


@dataclass
class Original:
    """One original parameter of a FlatParameter (``use_orig_params=False``), as this rank holds it:
    elements ``[lo, hi)`` of the flattened original, starting at ``offset`` in the local shard."""

    name: str  # full name, wrapper components removed
    shape: tuple[int, ...]
    lo: int
    hi: int
    offset: int
    module: nn.Module  # the module it belongs to, for the classifier (nn.Linear weight, ...)
    param_name: str
    embedding: bool  # an nn.Embedding weight, or tied with one


@dataclass
class FlatPiece(Piece):
    """One original's piece of a FlatParameter's local shard. A fallback original's ``slot = (j, a, b)``
    places it in the FlatParameter's compact fallback state: step count ``j`` (of ``counts``), elements
    ``[a, b)`` (of ``size``). A SWAN matrix has ``slot=None``: no state."""

    slot: tuple[int, int, int] | None
    counts: int
    size: int


def register(model: nn.Module) -> int:
    """Tag every FSDP1 unit's parameters in ``model`` (see the module docstring); returns how many
    original parameters were tagged."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    count = 0
    for prefix, module in model.named_modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FSDP) else None
        if handle is None:
            continue
        flat = handle.flat_param
        infos = flat._shard_param_infos
        if flat._params is not None:  # use_orig_params=True
            for param, shape, info in zip(flat._params, flat._shapes, infos):
                rng = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
                setattr(param, SHAPE, tuple(shape))
                setattr(param, RANGE, rng)
                setattr(param, FLAT, flat)
            count += len(flat._params)
            continue
        tied = {(id(s.prim_module), s.prim_param_name) for s in flat._shared_param_infos
                if isinstance(s.module, nn.Embedding)}
        originals = []
        for fqn, shape, info, pinfo in zip(flat._fqns, flat._shapes, infos, flat._param_infos):
            lo, hi, off = ((info.intra_param_start_idx, info.intra_param_end_idx + 1, info.offset_in_shard)
                           if info.in_shard else (0, 0, 0))
            originals.append(Original(
                clean_name(f"{prefix}.{fqn}" if prefix else fqn), tuple(shape), lo, hi, off, pinfo.module,
                pinfo.param_name,
                isinstance(pinfo.module, nn.Embedding) or (id(pinfo.module), pinfo.param_name) in tied,
            ))
        setattr(flat, ORIGINALS, tuple(originals))
        count += len(originals)
    return count


def originals(param: Tensor) -> tuple[Original, ...] | None:
    """A FlatParameter's originals; ``None`` for any other tensor. Raises for a FlatParameter that
    :func:`register` never saw (its originals' names are needed to classify them)."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    found = getattr(param, ORIGINALS, None)
    if found is None and isinstance(param, FlatParameter):
        raise ValueError(
            f"swan_dist: an FSDP1 FlatParameter (use_orig_params=False) holding {param._fqns[:3]} reached the "
            "optimizer unmapped; build SWAN from the FSDP root module (SWAN(model)) or call "
            "swan_dist.tag_model(model) first"
        )
    return found


def is_flat_piece(param: Tensor) -> bool:
    return hasattr(param, RANGE)


def flat_piece(param: Tensor) -> Piece:
    """This rank's piece of an original parameter under ``use_orig_params=True``."""
    lo, hi = getattr(param, RANGE)
    local = param.detach().reshape(-1)
    if local.numel() != hi - lo:
        raise ValueError(
            f"swan_dist: an FSDP1 parameter of shape {getattr(param, SHAPE)} holds {local.numel()} local "
            f"elements, its recorded range [{lo}, {hi}) says {hi - lo}: was the model re-sharded?"
        )
    grad = None if param.grad is None else param.grad.reshape(-1)
    return Piece(getattr(param, SHAPE), lo, hi, local, grad)


def _fallback_spans(flat: Tensor, use_swan: Sequence[bool]) -> list[tuple[int, int]]:
    """(offset in the shard, local numel) of each fallback original, in order: the compact layout."""
    return [(o.offset, o.hi - o.lo) for o, swan in zip(getattr(flat, ORIGINALS), use_swan) if not swan]


def flat_pieces(flat: Tensor, use_swan: Sequence[bool]) -> list[tuple[str, FlatPiece]]:
    """Every original's piece of this rank's shard of ``flat`` (views of the shard and its gradient),
    ``use_swan`` telling which originals are SWAN matrices (they get no compact state slot)."""
    origs = getattr(flat, ORIGINALS)
    if flat.numel() != flat._sharded_size.numel():
        raise ValueError(
            f"swan_dist: FlatParameter of {origs[0].name}, ... holds {flat.numel()} elements at step time, "
            f"its shard has {flat._sharded_size.numel()}: was the optimizer stepped while parameters were "
            "unsharded (inside summon_full_params, or between forward and backward)?"
        )
    local, grad = flat.detach(), flat.grad
    counts = sum(not s for s in use_swan)
    size = sum(n for _, n in _fallback_spans(flat, use_swan))
    out, j, a = [], 0, 0
    for o, swan in zip(origs, use_swan):
        n = o.hi - o.lo
        slot = None if swan else (j, a, a + n)
        if not swan:
            j, a = j + 1, a + n
        g = None if grad is None else grad.narrow(0, o.offset, n)
        out.append((o.name, FlatPiece(o.shape, o.lo, o.hi, local.narrow(0, o.offset, n), g, slot, counts, size)))
    return out


def dense_state(flat: Tensor, use_swan: Sequence[bool], state: dict) -> dict:
    """The compact fallback state of ``flat`` in FSDP1's layout: element states as long as the shard
    (zeros at SWAN matrices and padding) and one ``step`` for the FlatParameter (the largest count).
    The per-original counts (they differ after an original's update was skipped) ride along as a tuple,
    ``STEPS``, which FSDP1 copies to every original like any non-tensor state and gives back on load.
    A FlatParameter without state (SWAN matrices only, or a stateless rule) gets a zero step count:
    FSDP1 refuses to load an empty entry (``_flatten_optim_state_dict``), DCP's strict load a missing one."""
    if not state:
        return {"step": torch.tensor(0.0)}
    spans = _fallback_spans(flat, use_swan)
    out = {"step": state["step"].max(), STEPS: tuple(state["step"].tolist())}
    for key, value in state.items():
        if key != "step":
            dense = out[key] = value.new_zeros(flat.numel())
            a = 0
            for off, n in spans:
                dense[off: off + n] = value[a: a + n]
                a += n
    return out


def compact_state(flat: Tensor, use_swan: Sequence[bool], state: dict) -> dict:
    """Inverse of :func:`dense_state` (a loaded FSDP1 state of ``flat`` → compact fallback state)."""
    if set(state) <= {"step"}:  # the placeholder of a FlatParameter without state
        return {}
    spans = _fallback_spans(flat, use_swan)
    what = f"the FlatParameter holding {getattr(flat, ORIGINALS)[0].name}, ..."
    steps = state.get(STEPS, (float(state["step"]),) * len(spans))
    if len(steps) != len(spans):
        raise ValueError(
            f"swan_dist: loaded step counts of {what} are for {len(steps)} fallback originals, not {len(spans)}: "
            "an FSDP1 use_orig_params=False checkpoint loads into the same wrapping (FlatParameters) only"
        )
    out = {"step": torch.tensor(steps, dtype=torch.float32)}
    for key, value in state.items():
        if key in ("step", STEPS):
            continue
        if value.numel() != flat.numel():
            raise ValueError(f"swan_dist: loaded {key!r} of {what} has {value.numel()} elements, not {flat.numel()}")
        out[key] = torch.cat([value[off: off + n] for off, n in spans]) if spans else value[:0].clone()
    return out


def placeholder_state(param: Tensor, stateful: set[int]) -> dict | None:
    """Zero AdamW moments for a stateless original (``use_orig_params=True``) whose FlatParameter also
    holds an original with state (``id`` in ``stateful``): FSDP1's optimizer state dict needs every
    trainable original of a FlatParameter to have the same state tensors. ``None`` where not needed."""
    flat = getattr(param, FLAT, None)
    if flat is None or id(param) in stateful or not any(id(q) in stateful for q in flat._params):
        return None
    return {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
