"""SWAN presets (SWAN-0, SWAN†, SWAN‡) stored as YAML in ``configs/presets/`` and loaded by name."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["config_dir", "list_presets", "load_preset", "OPTIMIZER_KEYS", "SCHEDULE_KEYS"]

# Keys a preset's `optimizer:` section may set: exactly SWAN's keyword arguments that are hyper-parameters.
OPTIMIZER_KEYS = frozenset(
    {
        "lr", "alpha", "whitening", "ns_steps", "beta", "grad_norm", "whiten_dtype", "weight_decay",
        "fallback", "betas", "eps", "nonfinite", "fallback_lr",
    }
)
SCHEDULE_KEYS = frozenset({"warmup_ratio", "min_lr_ratio"})
_TOP_KEYS = frozenset({"name", "description", "optimizer", "schedule"})

_ALIASES = {
    "swan-0": "swan_0", "swan0": "swan_0",
    "swan†": "swan_dagger", "swan-dagger": "swan_dagger", "dagger": "swan_dagger",
    "swan‡": "swan_ddagger", "swan-ddagger": "swan_ddagger", "ddagger": "swan_ddagger",
}


def config_dir() -> Path:
    """The ``configs/`` folder: ``$SWAN_DIST_CONFIG_DIR``, the source checkout, or the installed copy."""
    env = os.environ.get("SWAN_DIST_CONFIG_DIR")
    candidates = [Path(env)] if env else []
    candidates += [
        Path(__file__).resolve().parent.parent / "configs",
        Path(sys.prefix) / "share" / "swan_dist" / "configs",
    ]
    for c in candidates:
        if (c / "presets").is_dir():
            return c
    raise FileNotFoundError(
        "swan_dist: no configs/presets folder found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); set SWAN_DIST_CONFIG_DIR"
    )


def list_presets() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "presets").glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """A preset by name (``swan_0``, ``swan_dagger``, ``swan_ddagger``, or an alias such as ``SWAN‡``)
    or by path to a YAML file. Returns ``{"name", "description", "optimizer": {...}, "schedule": {...}}``.
    Unknown keys raise ``ValueError`` naming the key and the file."""
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        key = _ALIASES.get(name.lower(), name.lower())
        path = config_dir() / "presets" / f"{key}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown SWAN preset {name!r}; available: {', '.join(list_presets())}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    _check_keys(data, _TOP_KEYS, str(path))
    data.setdefault("name", path.stem)
    data.setdefault("description", "")
    data["optimizer"] = dict(data.get("optimizer") or {})
    data["schedule"] = dict(data.get("schedule") or {})
    _check_keys(data["optimizer"], OPTIMIZER_KEYS, f"{path}: optimizer")
    _check_keys(data["schedule"], SCHEDULE_KEYS, f"{path}: schedule")
    return data


def _check_keys(d: Any, allowed: frozenset, where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(d).__name__}")
    bad = sorted(set(d) - allowed)
    if bad:
        raise ValueError(f"{where}: unknown key(s) {bad}; allowed: {sorted(allowed)}")
