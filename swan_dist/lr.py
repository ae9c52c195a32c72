"""The lr convention: a tuned AdamW's settings turned into SWAN's (docs/convergence.md, "The lr convention").

From AdamW's tuned lr η (and its betas, eps, weight decay λ), :func:`from_adamw` gives SWAN's keyword arguments:

- the whitened matrices step at ``lr * alpha = 0.2 η``. SWAN's update has RMS 1 (the rescale sets its
  Frobenius norm to ``sqrt(mn)``), so each matrix entry moves by ``0.2 η`` a step: the update RMS that torch's
  Muon gives with ``adjust_lr_fn="match_rms_adamw"`` (``0.2 * sqrt(max(A, B))`` times the lr on an
  orthogonalized update of RMS ``1 / sqrt(max(A, B))``: "Moonshot's implementation ... matching RMS of
  AdamW", torch/optim/_muon.py);
- the fallback rule (AdamW on embeddings, output head, norms, biases) runs at ``4 η``: with SWAN‡'s alpha 0.05
  that is ``lr = 4 η`` with the fallback tied to it (no ``fallback_lr``), the best measured start
  (``benchmarks/lr_rule.py``, 2 seeds where run: ``tiny`` 4 η, ``small`` 2.5 η on its grid's edge, ``60m`` 4 η
  with AdamW's best η = 6e-4; a fallback held at η cost loss at ``tiny`` and ``small``);
- betas and eps carry over to the AdamW fallback as they are;
- weight decay ``5 λ``: SWAN's decoupled decay is ``p * (1 - lr_eff * wd)``, so the matrices (``lr_eff = 0.2 η``)
  decay by AdamW's own factor ``1 - η λ`` a step, as torch's Muon does with AdamW's λ (it decays by the lr before
  the RMS adjustment). The fallback (``lr_eff = 4 η``) then decays by ``1 - 20 η λ`` a step, and its weights'
  equilibrium norm (updates of RMS ∝ lr against decay ∝ lr·wd) comes within 10 % of AdamW's.

A preset with another alpha keeps both sizes: ``lr = 0.2 η / alpha`` and ``fallback_lr = 4 η`` where that differs
(SWAN-0, alpha 1: ``lr = 0.2 η``, ``fallback_lr = 4 η``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["from_adamw", "weight_decay_from_adamw", "torch_adamw_defaults", "MATRIX_RATIO", "FALLBACK_RATIO", "WARN_BELOW"]

MATRIX_RATIO = 0.2
"""The whitened matrices' lr (``lr * alpha``) over AdamW's lr η: torch's Muon ``match_rms_adamw`` update RMS."""

FALLBACK_RATIO = 4.0
"""The fallback rule's lr over AdamW's lr η (measured: docs/convergence.md, "Where to start the learning rates")."""

WARN_BELOW = 2e-5
"""SWAN warns when built with its matrices at ``lr * alpha`` below this (and above 0), unless the lr came from
``adamw_lr=``: the convention puts them there only for an AdamW lr below 1e-4, while an AdamW lr of 1e-4 to
4e-4 passed as SWAN‡'s own ``lr`` lands there (docs/convergence.md, "The lr convention")."""


def _number(key: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"swan_dist: {key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"swan_dist: {key} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")
    return value


def _alpha(preset: str | None, alpha: float | None) -> float:
    if alpha is not None:
        return _number("alpha", alpha, positive=True)
    from .defaults import BASE  # the base value a preset may leave unset
    from .presets import load_preset

    options = load_preset(preset)["optimizer"] if preset is not None else {}
    return _number("alpha", options.get("alpha", BASE["alpha"]), positive=True)


def weight_decay_from_adamw(weight_decay: float) -> float:
    """SWAN's ``weight_decay`` for an AdamW's λ: ``λ / MATRIX_RATIO`` (5 λ), so the matrices, at ``lr * alpha =
    0.2 η``, decay by AdamW's ``1 - η λ`` a step (docs/convergence.md, "The lr convention")."""
    return _number("weight_decay (AdamW's)", weight_decay, positive=False) / MATRIX_RATIO


def from_adamw(lr: float, betas: tuple[float, float] | None = None, weight_decay: float | None = None,
               eps: float | None = None, preset: str | None = "swan_ddagger", *,
               alpha: float | None = None) -> dict[str, Any]:
    """SWAN's keyword arguments for a tuned AdamW with learning rate ``lr`` (η), by the lr convention:
    ``lr * alpha = 0.2 η`` on the whitened matrices, ``4 η`` on the fallback rule (tied to ``lr`` with alpha
    0.05, else ``fallback_lr``), ``betas`` and ``eps`` as given, ``weight_decay`` 5x AdamW's.

    ``preset`` (and ``alpha``, if given, over the preset's) decide alpha; the result names the preset, so
    ``swan_dist.SWAN(model, **from_adamw(3e-4))`` is SWAN‡ with ``lr`` 1.2e-3 (matrices at 6e-5). ``betas``,
    ``weight_decay``, ``eps`` left ``None`` are torch's AdamW defaults ((0.9, 0.999), 1e-8 and 0.01, converted:
    0.05): the result always carries all three. ``SWAN(model, adamw_lr=η, ...)`` does the same inside the
    constructor, where a framework building SWAN gives its own AdamW's defaults instead
    (:func:`swan_dist.defaults.adamw_defaults`)."""
    eta = _number("adamw_lr (AdamW's lr)", lr, positive=True)
    a = _alpha(preset, alpha)
    out: dict[str, Any] = {"preset": preset}
    if alpha is not None:
        out["alpha"] = a
    swan_lr, fallback = MATRIX_RATIO * eta / a, FALLBACK_RATIO * eta
    if math.isclose(swan_lr, fallback, rel_tol=1e-9):
        out["lr"] = fallback  # tied: the fallback runs at lr itself
    else:
        out["lr"], out["fallback_lr"] = swan_lr, fallback
    torch_adamw = torch_adamw_defaults()
    betas = torch_adamw["betas"] if betas is None else betas
    out["betas"] = tuple(betas) if isinstance(betas, list) else betas
    out["eps"] = torch_adamw["eps"] if eps is None else eps
    out["weight_decay"] = weight_decay_from_adamw(torch_adamw["weight_decay"] if weight_decay is None else weight_decay)
    return out


def torch_adamw_defaults() -> dict[str, Any]:
    """``betas``, ``eps`` and ``weight_decay`` of ``torch.optim.AdamW()`` (torch 2.x: (0.9, 0.999), 1e-8, 0.01),
    read from its signature."""
    import inspect

    import torch

    params = inspect.signature(torch.optim.AdamW.__init__).parameters
    return {k: params[k].default for k in ("betas", "eps", "weight_decay")}
