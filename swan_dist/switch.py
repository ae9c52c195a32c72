"""Switching a run from AdamW to SWAN: the moments AdamW kept for the parameters SWAN leaves to its AdamW
fallback (embeddings, output head, norms, biases) carry over; those of the matrices SWAN whitens, which
SWAN never reads, are dropped; the param groups keep SWAN's hyper-parameters.

- :func:`state_from_adamw`: an AdamW state dict (torch's ``AdamW.state_dict()``, or the one
  ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` hands SWAN from
  ``get_optimizer_state_dict(model, adamw)``) as SWAN's state dict; ``SWAN.load_state_dict`` calls it
  whenever it is given an AdamW state dict.
- :func:`load_adamw_checkpoint`: the same from a ``torch.distributed.checkpoint`` folder holding AdamW's
  optimizer state dict (FSDP2 and other sharded runs), reading only the fallback parameters' moments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .selection import clean_name
from .summary import log_info

__all__ = ["is_adamw_state_dict", "state_from_adamw", "load_adamw_checkpoint"]

_SWAN_KEYS = ("use_swan", "whitening", "alpha")  # in every SWAN param group, in none of torch's optimizers'
_ADAM_KEYS = ("betas", "amsgrad")  # Adam's and AdamW's groups
_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_adamw_state_dict(state_dict: Any) -> bool:
    """Whether ``state_dict`` is an Adam/AdamW optimizer's (param groups with ``betas`` / ``amsgrad`` and
    none of SWAN's keys), not SWAN's own."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        return False
    groups = state_dict.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not groups or not all(isinstance(g, Mapping) for g in groups):
        return False
    if any(k in g for g in groups for k in _SWAN_KEYS):
        return False
    return any(k in g for g in groups for k in _ADAM_KEYS)


def _norm(name: str) -> str:
    """A parameter name as both optimizers may have seen it: without FSDP1 / checkpointing / compile
    components and DDP's ``module.`` prefix."""
    name = clean_name(name)
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _given_order(opt) -> list[tuple[str, Tensor, dict]]:
    """``(label, tensor, group)`` of every tensor in SWAN's param groups, in the order SWAN was given them
    (its groups split each given group in two; the summary's rows keep the given order)."""
    if opt.packs_parameters:
        raise ValueError(
            "swan_dist: this SWAN holds tensors that pack several parameters (FSDP1 FlatParameters, "
            "use_orig_params=False); an AdamW state dict cannot be matched to them by position or name: load it "
            "through torch.distributed.checkpoint (swan_dist.load_adamw_checkpoint, or set_optimizer_state_dict "
            "with get_optimizer_state_dict(model, adamw)'s state dict)")
    at: dict[str, tuple[str, Tensor, dict]] = {}
    for group, labels in zip(opt.param_groups, opt.group_labels()):
        for label, p in zip(labels, group["params"]):
            at[label] = (label, p, group)
    order = [at.pop(label) for label in opt.given_labels() if label in at]
    total = sum(len(g["params"]) for g in opt.param_groups)
    if len(order) != total:
        raise ValueError(f"swan_dist: cannot tell the order SWAN's {total} tensors were given in (parameters "
                         "named alike?); give SWAN and AdamW groups with param_names")
    return order


def _pairs(opt, sd: Mapping) -> tuple[list[tuple[Any, str, Tensor, dict]], str]:
    """``(key in sd["state"], SWAN label, SWAN tensor, SWAN group)`` for every parameter of AdamW's state
    dict, and how they were matched."""
    a_groups = list(sd["param_groups"])
    keys = [k for g in a_groups for k in g["params"]]
    if keys and all(isinstance(k, str) for k in keys):
        aligned = len(a_groups) == len(opt.param_groups) and all(
            len(a["params"]) == len(g["params"]) for a, g in zip(a_groups, opt.param_groups))
        if aligned:  # torch.distributed.checkpoint's set_optimizer_state_dict: FQNs laid out in SWAN's groups
            labels = [label for group in opt.group_labels() for label in group]
            tensors = [(p, g) for g in opt.param_groups for p in g["params"]]
            return [(k, lab, p, g) for k, lab, (p, g) in zip(keys, labels, tensors)], "by parameter name"
        names = keys
    elif all("param_names" in g and len(g["param_names"]) == len(g["params"]) for g in a_groups):
        names = [n for g in a_groups for n in g["param_names"]]
    else:
        names = None
    order = _given_order(opt)
    if names is not None and all(lab.startswith("<unnamed ") for lab, _, _ in order):
        names = None  # SWAN was given bare tensors: position it is
    if names is not None:
        by_name = {_norm(lab): (lab, p, g) for lab, p, g in order}
        missing = [n for n in names if _norm(n) not in by_name]
        if missing:
            raise ValueError(f"swan_dist: the AdamW state dict names {len(missing)} parameter(s) this SWAN does not "
                             f"hold (e.g. {missing[:3]}); SWAN holds e.g. {[lab for lab, _, _ in order[:3]]}")
        return [(k, *by_name[_norm(n)]) for k, n in zip(keys, names)], "by parameter name"
    if len(keys) != len(order):
        raise ValueError(
            f"swan_dist: the AdamW state dict has {len(keys)} parameters, this SWAN {len(order)}. Without names "
            "(param_names) they are matched by position: build SWAN over the same parameters, in the same order, "
            "as AdamW (SWAN(model) or SWAN(model.parameters()) after AdamW(model.parameters()))")
    return [(k, *o) for k, o in zip(keys, order)], "by position"


def _check_shape(key: Any, label: str, p: Tensor, st: Mapping, how: str) -> None:
    m = st.get("exp_avg")
    if isinstance(m, Tensor) and tuple(m.shape) != tuple(p.shape):
        raise ValueError(
            f"swan_dist: AdamW's parameter {key!r} has moments of shape {list(m.shape)} but SWAN's {label} (matched "
            f"{how}) is {list(p.shape)}: the two optimizers were not built over the same parameters in the same "
            "order. Build SWAN over the parameters AdamW was given, in AdamW's order, or give both param groups "
            "built from model.named_parameters() (torch then saves param_names)")


def _step(value: Any) -> Tensor:
    """AdamW's step as an fp32 scalar tensor, where AdamW kept it (the AdamW fallback moves it to its
    parameter's device at its first step if needed); a plain number (older checkpoints) on the CPU."""
    if isinstance(value, Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return value.detach().to(torch.float32).reshape(()).clone()
    return torch.tensor(float(value), dtype=torch.float32)


def _rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _hyper(groups: list[Mapping]) -> str:
    keys = ("lr", "betas", "eps", "weight_decay")
    seen = {k: sorted({str(g[k]) for g in groups if k in g}) for k in keys}
    return ", ".join(f"{k}={'/'.join(v)}" for k, v in seen.items() if v)


def state_from_adamw(optimizer, adamw_state_dict: Mapping) -> dict[str, Any]:
    """SWAN's state dict (``optimizer.state_dict()``'s layout, its param groups) from the state dict of a
    torch ``AdamW`` or ``Adam`` over the same parameters; what ``SWAN.load_state_dict`` loads when given one.

    - Fallback parameters with the ``adamw`` rule (embeddings, output head, norms, biases) take AdamW's
      ``exp_avg``, ``exp_avg_sq`` and ``step``; SWAN's AdamW fallback continues from them.
    - Matrices SWAN whitens drop theirs (SWAN keeps no state for them), as do parameters on the stateless
      ``sign`` / ``sgd`` fallback; ``amsgrad``'s ``max_exp_avg_sq`` is dropped too.
    - Hyper-parameters stay SWAN's (lr, betas, eps, weight decay: AdamW's are not read).

    Parameters are matched by name where the state dict has names (groups built from
    ``model.named_parameters()``: torch >= 2.6 saves ``param_names``; the FQNs that
    ``set_optimizer_state_dict(model, swan, get_optimizer_state_dict(model, adamw))`` passes), otherwise by
    position: torch's state dict numbers parameters over its groups in order, so SWAN must have been built
    over the same parameters in the same order (``AdamW(model.parameters())`` then ``SWAN(model)``; AdamW
    given decay / no-decay groups without names cannot be matched). A moment whose shape differs from its
    match's is an error. One line at INFO on the ``swan_dist`` logger (rank 0) says what was taken and
    dropped."""
    if not is_adamw_state_dict(adamw_state_dict):
        raise ValueError("swan_dist.state_from_adamw: not an AdamW/Adam state dict (param groups with betas and "
                         "none of SWAN's keys)")
    pairs, how = _pairs(optimizer, adamw_state_dict)
    astate = adamw_state_dict["state"]
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    taken, matrices, stateless, amsgrad = [], 0, 0, False
    for key, label, p, group in pairs:
        st = astate.get(key) or {}
        _check_shape(key, label, p, st, how)
        if not all(k in st for k in _MOMENTS):
            continue  # no state yet (never stepped): SWAN starts it at zero, as AdamW would
        amsgrad |= "max_exp_avg_sq" in st
        if group["use_swan"]:
            matrices += 1
        elif group["fallback"] != "adamw":
            stateless += 1
        else:
            state[index[id(p)]] = {"step": _step(st.get("step", 0)), "exp_avg": st["exp_avg"],
                                   "exp_avg_sq": st["exp_avg_sq"]}
            taken.append(label)
    groups = torch.optim.Optimizer.state_dict(optimizer)["param_groups"]  # SWAN's own, parameters numbered
    if _rank0():
        extra = f", of {stateless} tensors on the stateless fallback" if stateless else ""
        log_info(f"swan_dist.SWAN: loaded an AdamW state dict (parameters matched {how}): exp_avg, exp_avg_sq and "
                 f"step of {len(taken)} fallback tensors taken; the moments of {matrices} matrices whitened by "
                 f"SWAN dropped{extra}{'; max_exp_avg_sq (amsgrad) dropped' if amsgrad else ''}; "
                 f"hyper-parameters kept SWAN's (AdamW's {_hyper(adamw_state_dict['param_groups'])} not used)")
    return {"state": state, "param_groups": groups}


def load_adamw_checkpoint(model: torch.nn.Module, optimizer, checkpoint_id: Any = None, *, key: str | None = "optim",
                          **load_kwargs: Any) -> None:
    """Load into SWAN ``optimizer`` (over ``model``) the moments of its AdamW-fallback parameters from a
    ``torch.distributed.checkpoint`` that holds an AdamW optimizer state dict saved FQN-keyed (from
    ``get_optimizer_state_dict`` / ``get_state_dict``) under ``key`` (``dcp.save({"model": ..., "optim":
    osd})``: ``"optim"``; ``None`` when the optimizer state dict was the checkpoint's top level). Collective:
    every rank calls it. Under FSDP2 and other sharded layouts each rank reads its shard, resharded if the
    world size changed.

    Only the fallback parameters' ``exp_avg``, ``exp_avg_sq`` and ``step`` are read (the matrices' moments
    are not: SWAN keeps none); param groups keep SWAN's hyper-parameters. The model's weights are not
    touched (load them as usual). ``load_kwargs`` go to ``torch.distributed.checkpoint.load``
    (``no_dist=True`` in one process without a process group, ``storage_reader``, ``planner``).
    A SWAN checkpoint is read alike (its fallback moments)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)  # SWAN's layout: the fallback's entries are AdamW's
    wanted = {fqn: st for fqn, st in osd["state"].items() if st}
    dcp.load({key: {"state": wanted}} if key else {"state": wanted}, checkpoint_id=checkpoint_id, **load_kwargs)
    set_optimizer_state_dict(model, optimizer, {"state": osd["state"], "param_groups": osd["param_groups"]})
    if _rank0():
        empty = len(osd["state"]) - len(wanted)
        log_info(f"swan_dist.SWAN: loaded from an AdamW checkpoint ({checkpoint_id}): exp_avg, exp_avg_sq and step "
                 f"of {len(wanted)} fallback tensors; {empty} tensors (matrices whitened by SWAN, stateless "
                 "fallback) read nothing; hyper-parameters kept SWAN's")
