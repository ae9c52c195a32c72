"""The elementwise side of a step: option validation (:mod:`.validation`), the fallback rules
(:mod:`.fallback`) and applying SWAN's updates (:mod:`.apply`)."""

from .apply import Missed, Pending, apply_many, apply_one, apply_stack, factors
from .fallback import run_fallback, run_fallbacks
from .validation import FALLBACKS, NONFINITE, SCALAR_KEYS, check_group, check_scalars, whiten_config

__all__ = ["FALLBACKS", "NONFINITE", "SCALAR_KEYS", "check_group", "check_scalars", "whiten_config", "run_fallback",
           "run_fallbacks", "factors", "apply_one", "apply_many", "apply_stack", "Missed", "Pending"]
