"""swan_dist: the SWAN optimizer (SGD with Whitening And Normalization) for sharded, multi-node training."""

from .functional import WhitenConfig, grad_norm, rescale, swan_update, whiten
from .lr import from_adamw
from .optimizer import FALLBACKS, SWAN, StepRecord
from .presets import list_presets, load_preset
from .selection import Rule, classify, param_groups, tag_model
from .swap import swap
from .switch import load_adamw_checkpoint, state_from_adamw

from .integrations.deepspeed import register_type as _register_type
from .integrations.huggingface import SWANFactory

_register_type(SWAN)  # DeepSpeed JSON: "optimizer": {"type": "SWAN"}

__version__ = "0.1.0"

__all__ = [
    "SWAN", "FALLBACKS", "StepRecord", "WhitenConfig", "grad_norm", "whiten", "rescale", "swan_update",
    "load_preset", "list_presets", "param_groups", "tag_model", "classify", "Rule",
    "SWANFactory", "state_from_adamw", "load_adamw_checkpoint", "from_adamw", "swap",
]
