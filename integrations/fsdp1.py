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
  piece per original (:func:`flat_pieces`): SWAN matrices go to the engine, the fallback rule
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

import gc
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn

from swan_dist.adapter import Adapter, Member, Piece, StateSlot, flat_piece, tensor_piece
from swan_dist.selection import clean_name

SHAPE = "_swan_shape"  # on an original parameter (use_orig_params=True): its full shape
RANGE = "_swan_range"  # ... and the range [lo, hi) of its flattened form this rank holds
ORIGINALS = "_swan_originals"  # on a FlatParameter (use_orig_params=False): its Original records
FLAT = "_swan_flat"  # on an original parameter (use_orig_params=True): its FlatParameter
STEPS = "step_per_original"  # in checkpoints (use_orig_params=False): AdamW step count per fallback original


def _is_flat_param(tensor: Tensor) -> bool:
    """An FSDP1 ``FlatParameter``, told by FSDP1's private flag ``_is_flat_param`` (which its own
    ``isinstance`` check reads) so that claiming a tensor imports no FSDP module."""
    return getattr(tensor, "_is_flat_param", False)


def _is_fsdp_flattened(tensor: Tensor) -> bool:
    """A tensor FSDP1 manages (a FlatParameter, or an original parameter under ``use_orig_params=True``),
    told by FSDP1's private flag ``_fsdp_flattened``."""
    return getattr(tensor, "_fsdp_flattened", False)


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


def register(model: nn.Module) -> int:
    """Tag the FSDP1 FlatParameters that hold ``model``'s parameters (see the module docstring); returns
    how many original parameters were tagged.

    ``model`` may be an FSDP unit (the root or any other), a module that contains units, or a module
    *inside* a unit (the module a unit wraps, as Lightning's ``FSDPStrategy`` hands a LightningModule
    its own ``configure_optimizers``, or any deeper one). FlatParameters are found in three ways:

    - the FSDP units among ``model.named_modules()``;
    - ``use_orig_params=False``: FSDP1 registers each unit's FlatParameter as ``_flat_param`` of the module
      it wraps, so a module inside a unit sees it among its own parameters;
    - ``use_orig_params=True``: an original parameter carries ``_fsdp_flattened`` but FSDP1 keeps no link
      from it (nor from its module) to its FlatParameter or unit. For originals that no unit found above
      holds, the FlatParameters whose ``_params`` list them are looked up once, in one pass over the
      objects Python's garbage collector tracks (:func:`_enclosing_flats`), only in this case.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    count, seen = 0, set()
    for prefix, module in model.named_modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FSDP) else None
        if handle is not None and id(handle.flat_param) not in seen:
            seen.add(id(handle.flat_param))
            count += _register_flat(handle.flat_param, prefix)
    for name, p in model.named_parameters():
        if _is_flat_param(p) and id(p) not in seen:  # the unit wrapping `model` (or a module in it)
            seen.add(id(p))
            count += _register_flat(p, name.rpartition(".")[0])
    loose = [p for p in model.parameters() if _is_fsdp_flattened(p) and not _is_flat_param(p) and not hasattr(p, RANGE)]
    if loose:
        for flat in _enclosing_flats(loose):
            if id(flat) not in seen:
                seen.add(id(flat))
                count += _register_flat(flat, "")
    return count


def outside_flats(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``use_orig_params=False``, ``model`` a module *below* the one an FSDP unit wraps: the unit's
    FlatParameter is a parameter of neither, and the originals of ``model``'s modules are plain tensors,
    views of it (FSDP1's unflattened views: their ``_base`` is the FlatParameter). Each such FlatParameter
    whose originals all lie in ``model`` is tagged with names relative to ``model`` and returned, so that
    ``SWAN(model)`` manages it; one that also packs parameters outside ``model`` is refused (it is stepped
    whole: SWAN cannot own part of it while something else steps the rest)."""
    inside = {id(p) for p in model.parameters()}
    where = {id(m): name for name, m in model.named_modules()}
    found: dict[int, Tensor] = {}
    for m in model.modules():
        for value in vars(m).values():
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                base = value._base
                if (base is not None and _is_flat_param(base) and base._params is None
                        and id(base) not in inside):
                    found.setdefault(id(base), base)
    out = []
    for flat in found.values():
        infos = [*flat._param_infos, *flat._shared_param_infos]
        names = [clean_name(f"{where[id(i.module)]}.{i.param_name}" if where.get(id(i.module)) else i.param_name)
                 for i in infos if id(i.module) in where]
        if len(names) != len(infos):
            away = [clean_name(f"{i.module_name}.{i.param_name}" if i.module_name else i.param_name)
                    for i in infos if id(i.module) not in where]
            raise ValueError(
                f"swan_dist: an FSDP1 FlatParameter (use_orig_params=False) of a unit around this module packs its "
                f"parameters {names[:4]} together with {away[:4]} (names in that unit) from outside it, and is "
                "stepped whole; SWAN(module) cannot manage part of it. Build SWAN from a module that holds all "
                "of them (the FSDP root: SWAN(fsdp_model)), give this module an FSDP unit of its own "
                "(auto_wrap_policy), or use use_orig_params=True"
            )
        _register_flat(flat, "", where)
        out.append((f"<FlatParameter of an enclosing FSDP unit: {names[0]}, ...>", flat))
    return out


def _enclosing_flats(params: Sequence[Tensor]) -> list[Tensor]:
    """The FlatParameters (``use_orig_params=True``) whose original parameters include any of ``params``.

    FSDP1 records no back-reference from an original parameter, nor from a wrapped module, to its
    FlatParameter or FSDP unit (``FlatParamHandle`` and the unit point down only), so they are found in
    one pass over ``gc.get_objects()`` (about 0.1 s per 250k tracked objects). :func:`register` calls it
    once, and only for flattened originals that no FSDP unit inside the given module holds."""
    want = {id(p) for p in params}
    found = []
    for obj in gc.get_objects():
        if (isinstance(obj, Tensor) and _is_flat_param(obj)
                and getattr(obj, "_params", None) is not None and any(id(q) in want for q in obj._params)):
            found.append(obj)
    return found


def _register_flat(flat: Tensor, prefix: str, where: dict[int, str] | None = None) -> int:
    """Tag one FlatParameter (``prefix``: the name, in the model given to :func:`register`, of the module
    whose parameter names its ``_fqns`` are relative to; or ``where``: each original's module's name in
    that model, by ``id``); returns how many originals it holds."""
    infos = flat._shard_param_infos
    if flat._params is not None:  # use_orig_params=True
        for param, shape, info in zip(flat._params, flat._shapes, infos):
            rng = (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            setattr(param, SHAPE, tuple(shape))
            setattr(param, RANGE, rng)
            setattr(param, FLAT, flat)
        return len(flat._params)
    tied = {(id(s.prim_module), s.prim_param_name) for s in flat._shared_param_infos
            if isinstance(s.module, nn.Embedding)}
    found = []
    for fqn, shape, info, pinfo in zip(flat._fqns, flat._shapes, infos, flat._param_infos):
        lo, hi, off = ((info.intra_param_start_idx, info.intra_param_end_idx + 1, info.offset_in_shard)
                       if info.in_shard else (0, 0, 0))
        if where is not None:
            fqn = f"{where[id(pinfo.module)]}.{pinfo.param_name}" if where[id(pinfo.module)] else pinfo.param_name
        found.append(Original(
            clean_name(f"{prefix}.{fqn}" if prefix else fqn), tuple(shape), lo, hi, off, pinfo.module,
            pinfo.param_name,
            isinstance(pinfo.module, nn.Embedding) or (id(pinfo.module), pinfo.param_name) in tied,
        ))
    setattr(flat, ORIGINALS, tuple(found))
    return len(found)


def originals(param: Tensor) -> tuple[Original, ...] | None:
    """A FlatParameter's originals; ``None`` for any other tensor. Raises for a FlatParameter that
    :func:`register` never saw (its originals' names are needed to classify them)."""
    from torch.distributed.fsdp._flat_param import FlatParameter

    found = getattr(param, ORIGINALS, None)
    if found is None and isinstance(param, FlatParameter):
        raise ValueError(
            f"swan_dist: an FSDP1 FlatParameter (use_orig_params=False) holding {param._fqns[:3]} reached the "
            "optimizer unmapped; build SWAN from a module that holds it (SWAN(fsdp_model), or SWAN(self) in a "
            "LightningModule) or call swan_dist.tag_model(module) first"
        )
    return found


def _fallback_spans(flat: Tensor, use_swan: Sequence[bool]) -> list[tuple[int, int]]:
    """(offset in the shard, local numel) of each fallback original, in order: the compact layout."""
    return [(o.offset, o.hi - o.lo) for o, swan in zip(getattr(flat, ORIGINALS), use_swan) if not swan]


def flat_pieces(flat: Tensor, use_swan: Sequence[bool]) -> list[Piece]:
    """Every original's piece of this rank's shard of ``flat`` (views of the shard and its gradient),
    ``use_swan`` telling which originals are SWAN matrices. A fallback original's state lives in the
    FlatParameter's *compact* state: its own step count and its elements only (SWAN matrices: none)."""
    origs = getattr(flat, ORIGINALS)
    if flat.numel() != flat._sharded_size.numel():
        raise ValueError(
            f"swan_dist: FlatParameter of {origs[0].name}, ... holds {flat.numel()} elements at step time, "
            f"its shard has {flat._sharded_size.numel()}: was the optimizer stepped while parameters were "
            "unsharded (inside summon_full_params, or between forward and backward)?"
        )
    counts = sum(not s for s in use_swan)
    size = sum(n for _, n in _fallback_spans(flat, use_swan))
    out, j, a = [], 0, 0
    for o, swan in zip(origs, use_swan):
        n = o.hi - o.lo
        slot = StateSlot(flat) if swan else StateSlot(flat, j, a, a + n, size, counts)
        if not swan:
            j, a = j + 1, a + n
        out.append(flat_piece(o.name, o.shape, o.lo, flat, o.offset, n, slot))
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


class FlatParamAdapter(Adapter):
    """``use_orig_params=False``: a FlatParameter stands for its originals, each classified and stepped
    alone; its state is kept compact and shown to FSDP1's checkpoint code in the FlatParameter's layout."""

    name = "fsdp1-flat"

    def prepare(self, model: nn.Module) -> list[tuple[str, Tensor]]:
        register(model)  # both flavours: FlatParameters' originals, and original parameters' ranges
        return outside_flats(model)  # use_orig_params=False, `model` below the module a unit wraps

    def claims(self, tensor: Tensor) -> bool:
        return _is_flat_param(tensor)

    def members(self, tensor: Tensor, name: str | None) -> list[Member]:
        return [Member(o.name, o.shape, o, o.module, o.param_name, o.embedding) for o in originals(tensor)]

    def shape(self, tensor: Tensor) -> tuple[int, ...]:
        return (sum(math.prod(o.shape) for o in originals(tensor)),)

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        return flat_pieces(tensor, rules)

    def export_state(self, tensor: Tensor, state: dict, rules: tuple[bool, ...], stateful: set[int]) -> dict:
        return dense_state(tensor, rules, state)

    def import_state(self, tensor: Tensor, state: dict, rules: tuple[bool, ...]) -> dict:
        return compact_state(tensor, rules, state)


class OrigParamAdapter(Adapter):
    """``use_orig_params=True``: each original parameter is a flat view of its part of the shard; the
    range it holds was recorded by :func:`register`."""

    name = "fsdp1-orig"

    def claims(self, tensor: Tensor) -> bool:
        return hasattr(tensor, RANGE) or _is_fsdp_flattened(tensor)

    def shape(self, tensor: Tensor) -> tuple[int, ...]:
        return getattr(tensor, SHAPE, None) or tuple(tensor.shape)

    def check(self, tensor: Tensor, name: str) -> None:
        if not hasattr(tensor, RANGE):
            raise ValueError(
                f"swan_dist: {name} is a flattened shard of an FSDP1 (FullyShardedDataParallel) parameter given "
                "without its module, so its name, shape and layout are unknown. Pass a module that holds it: the FSDP "
                "root, SWAN(fsdp_model), or any module inside it (SWAN(self) in a LightningModule), or call "
                "swan_dist.tag_model(module) before SWAN(module.parameters())"
            )

    def pieces(self, tensor: Tensor, name: str, rules: tuple[bool, ...]) -> list[Piece]:
        lo, hi = getattr(tensor, RANGE)
        if tensor.numel() != hi - lo:
            raise ValueError(
                f"swan_dist: FSDP1 parameter {name!r} of shape {getattr(tensor, SHAPE)} holds {tensor.numel()} local "
                f"elements, its recorded range [{lo}, {hi}) says {hi - lo}: was the model re-sharded?"
            )
        return [tensor_piece(name, tensor, shape=getattr(tensor, SHAPE), lo=lo, grad=tensor.grad)]

    def export_state(self, tensor: Tensor, state: dict, rules: tuple[bool, ...], stateful: set[int]) -> dict:
        placeholder = placeholder_state(tensor, stateful)
        return state if placeholder is None else placeholder
