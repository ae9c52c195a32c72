"""The defaults of SWAN's param groups: the base values, a preset's, the explicit arguments, and ``adamw_lr``
converted by the lr convention (:mod:`swan_dist.lr`), checked; and the warning for an AdamW-sized lr."""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch.distributed as dist

from .engine import MODES
from .lr import MATRIX_RATIO, WARN_BELOW, from_adamw, weight_decay_from_adamw
from .presets import OPTIMIZER_KEYS, load_preset
from .rules import check_group
from .whitening import EXCHANGE_DTYPES

__all__ = ["BASE", "resolve", "check_engine", "adamw_group_decay", "adamw_defaults", "pair", "rank0"]

# Hyper-parameters with a meaning independent of any preset. lr has no default without a preset.
BASE = dict(
    alpha=1.0, whitening="nsds", ns_steps=2, beta=0.4, grad_norm="rms", whiten_dtype="auto",
    weight_decay=0.0, fallback="adamw", betas=(0.9, 0.999), eps=1e-8, nonfinite="skip", fallback_lr=None,
)
assert set(BASE) | {"lr"} == OPTIMIZER_KEYS


def resolve(preset: str | None, explicit: dict[str, Any],
            adamw_lr: float | str | None = None) -> tuple[str | None, dict[str, Any]]:
    """(the preset's name, the groups' defaults): the base values, the preset's, the explicit arguments
    given (not None), with ``adamw_lr`` SWAN's lr, fallback_lr and weight decay converted from AdamW's
    (:func:`swan_dist.from_adamw`), checked."""
    converted = None if adamw_lr is None else _from_adamw_lr(preset, explicit, adamw_lr)
    defaults: dict[str, Any] = dict(BASE)
    name = None
    if preset is not None:
        p = load_preset(preset)
        name = p["name"]
        defaults.update(p["optimizer"])
    defaults.update({k: v for k, v in explicit.items() if v is not None})
    if converted is not None:
        defaults.update(converted)  # fallback_lr None (tied) over a preset's too
    if "lr" not in defaults:
        raise ValueError("SWAN: lr is required when no preset is given (or adamw_lr=, a tuned AdamW's lr)")
    defaults["betas"] = pair(defaults["betas"])
    check_group(defaults)
    if converted is None:
        _warn_adamw_sized(defaults)
    return name, defaults


def _from_adamw_lr(preset: str | None, explicit: dict[str, Any], adamw_lr: float | str) -> dict[str, Any]:
    """lr, fallback_lr (None: tied) and, where given, weight_decay from AdamW's lr (``"auto"`` or
    ``"learning_rate"``: the learning_rate
    of the transformers Trainer building this optimizer) and AdamW's weight decay."""
    for key in ("lr", "fallback_lr"):
        if explicit.get(key) is not None:
            raise ValueError(
                f"swan_dist: adamw_lr={adamw_lr!r} and {key}={explicit[key]!r} were both given: adamw_lr is a tuned "
                f"AdamW's lr, from which SWAN's lr and fallback_lr follow (swan_dist.from_adamw; "
                f"docs/convergence.md#the-lr-convention); give adamw_lr or {key}, not both")
    from .integrations.huggingface import TRAINER_LR, trainer_args

    if adamw_lr in TRAINER_LR:
        args = trainer_args()
        if args is None:
            raise ValueError(f"swan_dist: adamw_lr={adamw_lr!r} takes the learning_rate of the transformers Trainer "
                             "that builds this optimizer (in a DeepSpeed JSON under the Trainer: \"adamw_lr\": "
                             "\"learning_rate\"); none does here: give adamw_lr as a number")
        adamw_lr = args.learning_rate
    framework = adamw_defaults()
    given = {k: framework[k] if explicit.get(k) is None else explicit[k] for k in ("betas", "eps", "weight_decay")}
    conv = from_adamw(adamw_lr, **given, preset=preset, alpha=explicit.get("alpha"))
    return {"lr": conv["lr"], "fallback_lr": conv.get("fallback_lr"),
            **{k: conv[k] for k in ("betas", "eps", "weight_decay")}}


def adamw_defaults() -> dict[str, Any]:
    """``betas``, ``eps`` and ``weight_decay``: the AdamW defaults ``adamw_lr=`` takes where the caller gave
    none, those of the framework building this SWAN: the transformers Trainer's arguments (``adam_beta1/2``,
    ``adam_epsilon``, ``weight_decay``), DeepSpeed's AdamW (its JSON ``"type": "AdamW"``), else torch's AdamW."""
    from .integrations.deepspeed import deepspeed_adamw_defaults, engine_module
    from .integrations.huggingface import trainer_args
    from .lr import torch_adamw_defaults

    args = trainer_args()
    if args is not None:
        return {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon, "weight_decay": args.weight_decay}
    return deepspeed_adamw_defaults() if engine_module() is not None else torch_adamw_defaults()


def check_engine(mode: str, bucket_mb: Any, capturable: Any, exchange_dtype: Any = "auto") -> None:
    """The optimizer's engine options (not param-group options), checked at construction."""
    if exchange_dtype not in EXCHANGE_DTYPES:
        raise ValueError(f"swan_dist: exchange_dtype must be one of {EXCHANGE_DTYPES}, got {exchange_dtype!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 < bucket_mb < float("inf"):
        raise ValueError(f"swan_dist: bucket_mb must be a positive number of MB, got {bucket_mb!r}")
    if not isinstance(capturable, bool):
        raise TypeError(f"swan_dist: capturable must be True or False, got {capturable!r}")


def adamw_group_decay(params: Iterable[Any]) -> list:
    """With ``adamw_lr``, a param group's own ``weight_decay`` is AdamW's too (the Trainer's decay group):
    converted as :func:`swan_dist.from_adamw` converts the argument's."""
    return [{**g, "weight_decay": weight_decay_from_adamw(g["weight_decay"])}
            if isinstance(g, dict) and isinstance(g.get("weight_decay"), (int, float))
            and not isinstance(g.get("weight_decay"), bool) else g for g in params]


def _warn_adamw_sized(defaults: dict[str, Any]) -> None:
    """Warn (rank 0, at construction) when SWAN's own lr puts the whitened matrices where only an AdamW lr
    below 1e-4 would by the lr convention: most likely an AdamW lr given as SWAN's."""
    lr, alpha = float(defaults["lr"]), float(defaults["alpha"])
    if 0 < lr * alpha < WARN_BELOW and rank0():
        swan = from_adamw(lr, alpha=alpha, preset=None)
        got = f"lr {swan['lr']:.3g}" + (f", fallback_lr {swan['fallback_lr']:.3g}" if "fallback_lr" in swan else "")
        warnings.warn(
            f"swan_dist: SWAN's lr={lr:g} puts the whitened matrices at lr x alpha = {lr * alpha:.3g} (alpha {alpha:g}), "
            f"below {WARN_BELOW:g}, where the lr convention puts them only for an AdamW lr under 1e-4. If {lr:g} is "
            f"your AdamW lr, give SWAN(..., adamw_lr={lr:g}) or take swan_dist.from_adamw({lr:g}) ({got}; matrices "
            f"at {lr * MATRIX_RATIO:.3g}): docs/convergence.md#the-lr-convention", UserWarning, stacklevel=4)


def pair(betas: Any) -> Any:
    """A list of two betas as the tuple torch's own optimizers keep (anything else is left to validation)."""
    return tuple(betas) if isinstance(betas, list) else betas


def rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
