"""``swan_dist.swap``: a live torch ``AdamW`` (or ``Adam``) turned into SWAN over the same parameters, its param
groups, hyper-parameters (by the lr convention), fallback moments and lr scheduler carried.

- Each AdamW param group becomes SWAN's group(s) over the same tensors: its lr converted by the lr convention
  (:func:`swan_dist.from_adamw`: matrices at ``lr * alpha = 0.2 η``, the fallback rule at ``4 η``), its betas
  and eps as they are, its weight decay converted as ``adamw_lr=`` converts it
  (:func:`swan_dist.lr.weight_decay_from_adamw`); a no-decay group stays no-decay.
- The fallback parameters (embeddings, output head, norms, biases on the ``adamw`` rule) take the AdamW's
  ``exp_avg``, ``exp_avg_sq`` and ``step``, in memory: the tensors are handed over, not copied (the AdamW
  is spent; do not step it again). The matrices SWAN whitens drop theirs.
- ``scheduler=``: an lr scheduler built for the AdamW goes on driving SWAN, from the step it had reached
  (:func:`move_scheduler`).
- One INFO line on the ``swan_dist`` logger (rank 0) says what was carried and what was dropped.

What cannot be converted is refused before anything is built or changed (the AdamW, its state, the model
and the scheduler stay as they were): another optimizer class, ``amsgrad``, ``maximize``, Adam's L2
(coupled) weight decay, parameters that are not ``model``'s, tensors packing several parameters (FSDP1's
FlatParameters), and schedulers whose per-group state cannot be re-pointed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from .defaults import rank0
from .lr import MATRIX_RATIO, from_adamw, weight_decay_from_adamw
from .summary import log_info

__all__ = ["swap", "move_scheduler", "SCHEDULERS"]

_FROM_GROUPS = ("lr", "adamw_lr", "fallback_lr")  # come from each AdamW group: not overrides
_PER_GROUP = ("betas", "eps", "weight_decay")  # overrides that replace every group's value

SCHEDULERS = tuple(getattr(torch.optim.lr_scheduler, n) for n in (
    "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
    "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "SequentialLR", "ChainedScheduler"))
"""The lr schedulers :func:`move_scheduler` re-points: those whose per-group state is ``base_lrs``,
``_last_lr`` and (``LambdaLR``, ``MultiplicativeLR``) one function per group."""


def _refuse(msg: str) -> ValueError:
    return ValueError(f"swan_dist.swap: {msg}")


def _check_optimizer(optimizer: Any, overrides: dict[str, Any]) -> None:
    if not isinstance(optimizer, torch.optim.Adam):  # torch's AdamW is an Adam
        raise TypeError(
            f"swan_dist.swap: takes a torch.optim.AdamW or Adam, got {type(optimizer).__name__}; SWAN's AdamW fallback "
            "cannot continue another optimizer's state. Build SWAN afresh with your tuned lr read as an AdamW's: "
            "swan_dist.SWAN(model, adamw_lr=<lr>, betas=..., weight_decay=...) (docs/convergence.md#the-lr-convention)")
    for i, g in enumerate(optimizer.param_groups):
        if g.get("amsgrad"):
            raise _refuse(f"param group {i} has amsgrad=True; SWAN's AdamW fallback keeps no max_exp_avg_sq. Set "
                          "amsgrad=False on the AdamW's groups first (its max_exp_avg_sq is then unused), or build "
                          "swan_dist.SWAN(model, adamw_lr=<lr>) without its moments")
        if g.get("maximize"):
            raise _refuse(f"param group {i} has maximize=True; SWAN minimizes: negate the loss instead")
        decoupled = g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        if float(g.get("weight_decay", 0.0)) != 0.0 and not decoupled and "weight_decay" not in overrides:
            raise _refuse(
                f"param group {i} is Adam's L2 penalty (weight_decay={g['weight_decay']!r}, added to the gradient), "
                "which SWAN's decoupled decay cannot reproduce; give the decoupled decay you want as AdamW's "
                "swap(..., weight_decay=λ), or weight_decay=0")
    for key in _FROM_GROUPS:
        if key in overrides:
            raise _refuse(f"{key}= is taken from each AdamW param group's lr (converted by the lr convention); "
                          "change the AdamW groups' lr before swap, or SWAN's groups after it")
    for key in ("params", "model", "scheduler"):
        if key in overrides:
            raise _refuse(f"{key}= cannot be an override")


def _check_params(optimizer: Any, model: nn.Module | None) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"swan_dist.swap: model= is the nn.Module the AdamW trains, got {type(model).__name__}")
        own = {id(p) for p in model.parameters()}
        foreign = [i for i, p in enumerate(params) if id(p) not in own]
        if foreign:
            raise _refuse(
                f"{len(foreign)} of the AdamW's {len(params)} parameters are not parameters of the model given "
                f"(positions {foreign[:5]} over its groups); pass the model the AdamW was built on (the same "
                "wrapped or sharded module: DDP's, FSDP2's fully_shard'ed), or give the others their own optimizer")
    elif not all(g.get("param_names") for g in optimizer.param_groups):
        raise _refuse("the AdamW's param groups carry no parameter names, so SWAN cannot tell embeddings and the "
                      "output head (fallback rule) from the matrices it whitens; pass the model: "
                      "swan_dist.swap(optimizer, model)")
    flat = [i for i, p in enumerate(params) if getattr(p, "_is_flat_param", False) or hasattr(p, "ds_id")]
    if flat:
        raise _refuse(
            f"{len(flat)} tensors each pack several parameters (FSDP1 FlatParameters, use_orig_params=False, or "
            "DeepSpeed's); their moments cannot be split per parameter here. Build SWAN over the model and load the "
            "AdamW's fallback moments through torch.distributed.checkpoint (swan_dist.load_adamw_checkpoint), or use "
            "FSDP1 with use_orig_params=True")


def _number(v: Any) -> float:
    return float(v) if isinstance(v, Tensor) else v  # a tensor option (capturable AdamW) read once, here


def _groups(optimizer: Any, ratio: float, fb_ratio: float | None, overrides: dict[str, Any]) -> list[dict]:
    """SWAN's param groups (before its split into SWAN and fallback groups), one per AdamW group."""
    out = []
    for g in optimizer.param_groups:
        eta = _number(g["lr"])
        wd = float(_number(g["weight_decay"]))
        if wd != 0.0 and "weight_decay" in overrides:  # a group that decays takes the override (Adam's L2 too)
            wd = float(overrides["weight_decay"])
        ng = {"params": list(g["params"]), "lr": ratio * eta, "fallback_lr": None if fb_ratio is None else fb_ratio * eta,
              "betas": tuple(_number(b) for b in overrides.get("betas", g["betas"])),
              "eps": _number(overrides.get("eps", g["eps"])), "weight_decay": weight_decay_from_adamw(wd)}
        if g.get("param_names"):
            ng["param_names"] = list(g["param_names"])
        out.append(ng)
    return out


def _sources(swan: Any, optimizer: Any) -> list[int]:
    """For each SWAN param group, the index of the AdamW group it came from (each AdamW group gives SWAN one
    or two groups, in order; an empty one gives one empty group)."""
    where = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    out, last = [], -1
    for g in swan.param_groups:
        last = where[id(g["params"][0])] if g["params"] else last + 1
        out.append(last)
    return out


def _tree(scheduler: Any) -> list[Any]:
    out = [scheduler]
    for s in getattr(scheduler, "_schedulers", ()):
        out += _tree(s)
    return out


def _check_scheduler(scheduler: Any, optimizer: Any, ratios: set[float]) -> None:
    for s in _tree(scheduler):
        if type(s) not in SCHEDULERS:
            raise _refuse(
                f"cannot move a {type(s).__name__} onto SWAN (moved: {', '.join(c.__name__ for c in SCHEDULERS)}); "
                "build it again over the SWAN returned (its groups' initial_lr are the converted ones), or leave "
                "scheduler= out")
        if s.optimizer is not optimizer:
            raise _refuse(f"the scheduler ({type(s).__name__}) drives another optimizer than the one swapped")
        if getattr(s, "eta_min", 0) and len(ratios) > 1:
            raise _refuse(f"{type(s).__name__}'s eta_min={s.eta_min} is one lr for every group, but this preset "
                          "scales SWAN's matrices and fallback apart (fallback_lr); use eta_min=0 or a LambdaLR")


def move_scheduler(scheduler: Any, swan: Any, sources: list[int], ratios: list[float]) -> None:
    """Re-point ``scheduler`` (and the schedulers a ``SequentialLR`` / ``ChainedScheduler`` holds) from the AdamW
    to ``swan``: SWAN group ``i`` takes the place of AdamW group ``sources[i]``, its lrs ``ratios[i]`` times
    that group's (``base_lrs``, the last lrs, ``eta_min``), its ``lr_lambdas`` that group's. The step count
    goes on, so the next ``scheduler.step()`` sets the lrs the AdamW would have had, converted."""
    for s in _tree(scheduler):
        for key in ("base_lrs", "_last_lr"):
            if hasattr(s, key):
                setattr(s, key, [r * getattr(s, key)[i] for i, r in zip(sources, ratios)])
        if hasattr(s, "lr_lambdas"):
            s.lr_lambdas = [s.lr_lambdas[i] for i in sources]
        if getattr(s, "eta_min", 0):
            s.eta_min = ratios[0] * s.eta_min
        s.optimizer = swan
    _track_steps(swan)


def _track_steps(opt: Any) -> None:
    """Mark ``opt.step`` as torch's lr schedulers mark the optimizer they are built on (so a scheduler's step
    knows the optimizer stepped first, and does not warn)."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    def wrapper(*args, **kwargs):
        opt._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper


def swap(optimizer: torch.optim.Optimizer, model: nn.Module | None = None, *, scheduler: Any = None,
         **overrides: Any):
    """SWAN over the parameters of the torch ``AdamW`` (or ``Adam``) ``optimizer``, whatever its param groups,
    converting each group by the lr convention and carrying the fallback parameters' moments in memory.

    Args:
        optimizer: a live ``torch.optim.AdamW`` or ``Adam`` (not DeepSpeed's or Megatron's wrappers: their routes
            are in docs/optimizer.md, "Swapping a live AdamW").
        model: the ``nn.Module`` the AdamW trains (wrapped or sharded as it is: DDP, ``fully_shard``): SWAN
            classifies each tensor by its module type and name (embeddings, the head, norms and biases on the
            fallback rule). Optional only where the AdamW's groups carry ``param_names``.
        scheduler: an lr scheduler built for ``optimizer``; it is moved onto the SWAN and goes on from its step
            (:data:`SCHEDULERS` lists those that can be).
        overrides: SWAN's keyword arguments (``preset``, ``alpha``, ``fallback``, ``whiten_dtype``, ``mode``,
            ``verbose``, ...). ``betas`` and ``eps`` replace every group's; ``weight_decay`` is AdamW's λ for
            every group that decays (no-decay groups stay at 0). ``lr``, ``adamw_lr`` and ``fallback_lr`` are
            refused: the lrs come from the AdamW's groups.

    Raises ``TypeError``/``ValueError`` naming the fix, with nothing changed, for what cannot be converted.
    """
    from .optimizer import SWAN

    _check_optimizer(optimizer, overrides)
    _check_params(optimizer, model)
    preset = overrides.pop("preset", "swan_ddagger")
    unit = from_adamw(1.0, preset=preset, alpha=overrides.get("alpha"))
    ratio, fb_ratio = unit["lr"], unit.get("fallback_lr")
    if scheduler is not None:
        _check_scheduler(scheduler, optimizer, {ratio, fb_ratio or ratio})
    verbose = overrides.pop("verbose", True)
    groups = _groups(optimizer, ratio, fb_ratio, overrides)
    for key in _PER_GROUP:
        overrides.pop(key, None)
    with warnings.catch_warnings():  # a small converted lr is the convention's, not an AdamW lr given as SWAN's
        warnings.filterwarnings("ignore", message=r"swan_dist: SWAN's lr=", category=UserWarning)
        swan = SWAN(groups, lr=groups[0]["lr"], preset=preset, fallback_lr=groups[0]["fallback_lr"], model=model,
                    verbose=False, **overrides)
    sources = _sources(swan, optimizer)
    initial = [g.get("initial_lr") for g in optimizer.param_groups]
    taken, dropped, stateless = 0, 0, 0
    for g, src in zip(swan.param_groups, sources):
        r = ratio if g["use_swan"] or fb_ratio is None else fb_ratio
        if initial[src] is not None:  # a scheduler's base: converted as the lr is
            g["initial_lr"] = r * _number(initial[src])
        for p in g["params"]:
            st = optimizer.state.get(p) or {}
            if "exp_avg" not in st or "exp_avg_sq" not in st:
                continue
            if g["use_swan"]:
                dropped += 1
            elif g["fallback"] != "adamw":
                stateless += 1
            else:
                step = st.get("step", 0)
                step = step.detach().to(torch.float32).reshape(()).clone() if isinstance(step, Tensor) else \
                    torch.tensor(float(step), dtype=torch.float32)
                swan.state[p] = {"step": step, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
                taken += 1
    if scheduler is not None:
        move_scheduler(scheduler, swan, sources,
                       [ratio if g["use_swan"] or fb_ratio is None else fb_ratio for g in swan.param_groups])
    if rank0():
        if verbose:
            log_info(swan.summary())
        fb = f"{ratio:g}x" if fb_ratio is None else f"{fb_ratio:g}x"
        log_info(
            f"swan_dist.swap: SWAN ({swan.preset}) from {type(optimizer).__name__}'s {len(optimizer.param_groups)} "
            f"param groups: lr converted (matrices at lr x alpha = {MATRIX_RATIO:g}x, "
            f"fallback at {fb} AdamW's), betas and eps as they were, weight decay "
            f"{weight_decay_from_adamw(1.0):g}x AdamW's per group; exp_avg, exp_avg_sq and step of {taken} fallback "
            f"tensors carried; the moments of {dropped} matrices whitened by SWAN dropped"
            + (f", of {stateless} tensors on the stateless fallback dropped" if stateless else "")
            + ("; the lr scheduler moved" if scheduler is not None else ""))
    return swan
