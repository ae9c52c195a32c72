"""Validation of a param group's options: at construction every option, at every step the scalars a
scheduler or a user may have changed (before anything is updated)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from torch import Tensor

from ..functional import WhitenConfig

__all__ = ["FALLBACKS", "NONFINITE", "SCALAR_KEYS", "check_group", "check_scalars", "whiten_config"]

FALLBACKS = ("adamw", "sign", "sgd")
NONFINITE = ("skip", "skip_step", "raise")
# Options a scheduler or a user may change between steps: they never rebuild a plan, and every rank
# must agree on them (checked inside the step's one collective).
SCALAR_KEYS = ("lr", "alpha", "weight_decay", "eps", "betas", "nonfinite")


def whiten_config(group: dict) -> WhitenConfig:
    return WhitenConfig(
        method=group["whitening"], steps=int(group["ns_steps"]), beta=float(group["beta"]),
        grad_norm=group["grad_norm"], dtype=group["whiten_dtype"],
    )


def _real(group: dict, key: str, low: float = 0.0, high: float = math.inf, open_high: bool = False,
          read: bool = True) -> None:
    """``group[key]`` is a real number in range; a tensor's value is checked only where ``read`` (a host
    read: at construction, not in the step, where ``capturable=True`` keeps ``lr`` on the device)."""
    value = group[key]
    if isinstance(value, Tensor) and value.numel() != 1:  # torch's optimizers: a ValueError
        raise ValueError(f"swan_dist: Tensor {key} must be 1-element, got shape {tuple(value.shape)}")
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)) or (
            isinstance(value, Tensor) and value.is_complex()):
        raise TypeError(f"swan_dist: {key} must be a real number, got {value!r} ({type(value).__name__})")
    if isinstance(value, Tensor) and not read:
        return
    v = float(value)
    if not math.isfinite(v) or v < low or v > high or (open_high and v >= high):
        bound = f"[{low}, {high})" if open_high else f"[{low}, {high}]" if math.isfinite(high) else f">= {low}"
        raise ValueError(f"swan_dist: {key} must be finite and {bound}, got {value!r}")


def _scalar_view(value: Any, key: str) -> Any:
    """A 1-element tensor of any shape as a 0-d view of its storage (an in-place fill of either reaches the
    other); a tensor of more elements raises ``ValueError``, as torch's optimizers do."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if value.numel() != 1:
        raise ValueError(f"swan_dist: Tensor {key} must be 1-element, got shape {tuple(value.shape)}")
    return value.view(())


def check_scalars(group: dict, read: bool = False) -> None:
    """Raise ``ValueError``/``TypeError`` naming the key if a scalar option is not a finite number in its
    range (lr, alpha, weight_decay, eps >= 0; each beta in [0, 1)), or ``nonfinite`` is unknown. Cheap:
    called for every group at every step, before anything is updated (a scheduler may set them); a
    tensor's value only where ``read``. An option given as a 1-element tensor of any shape (torch's
    optimizers take ``torch.tensor([1e-3])`` as an lr) is kept as a 0-d view of it first."""
    for key in ("lr", "alpha", "weight_decay", "eps"):
        group[key] = _scalar_view(group[key], key)
        _real(group, key, read=read)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"swan_dist: betas must be a pair (beta1, beta2), got {betas!r}")
    if any(isinstance(b, Tensor) and b.dim() != 0 for b in betas):
        group["betas"] = betas = tuple(_scalar_view(b, f"betas[{i}]") for i, b in enumerate(betas))
    for i, b in enumerate(betas):
        _real({f"betas[{i}]": b}, f"betas[{i}]", 0.0, 1.0, open_high=True, read=read)
    if group["nonfinite"] not in NONFINITE:
        raise ValueError(f"swan_dist: nonfinite must be one of {NONFINITE}, got {group['nonfinite']!r}")


def check_group(group: dict) -> None:
    """Every option of a param group, at construction (the scalars again at every step)."""
    if isinstance(group["ns_steps"], bool) or not isinstance(group["ns_steps"], numbers.Integral):
        raise TypeError(f"swan_dist: ns_steps must be an int, got {group['ns_steps']!r}")
    _real(group, "beta")
    whiten_config(group)  # raises ValueError naming the bad value
    if group.get("fallback_lr") is not None:
        group["fallback_lr"] = _scalar_view(group["fallback_lr"], "fallback_lr")
        _real(group, "fallback_lr")
    if group["fallback"] not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {group['fallback']!r}")
    if not isinstance(group.get("split_fused", True), bool):
        raise ValueError(f"split_fused must be True or False, got {group['split_fused']!r}")
    check_scalars(group, read=True)

