"""SWAN presets (SWAN-0, SWAN†, SWAN‡) stored as YAML in the package (``swan_dist/configs/presets/``,
package data) and loaded by name."""

from __future__ import annotations

import os
from importlib import resources
from importlib.resources.abc import Traversable
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


def config_dir() -> Traversable:
    """Where the presets are read: ``$SWAN_DIST_CONFIG_DIR`` (a folder holding ``presets/*.yaml``) where it
    is set, else the package's own ``configs/`` (package data, read through :mod:`importlib.resources`, so
    a wheel, ``pip install .`` or ``--target`` install finds it as a checkout does)."""
    env = os.environ.get("SWAN_DIST_CONFIG_DIR")
    if env:
        if not (Path(env) / "presets").is_dir():
            raise FileNotFoundError(f"swan_dist: SWAN_DIST_CONFIG_DIR={env!r} has no presets/ folder; "
                                    "unset it to use the presets installed with swan_dist")
        return Path(env)
    found = resources.files("swan_dist") / "configs"
    if not (found / "presets").is_dir():
        raise FileNotFoundError(f"swan_dist: the installed package has no configs/presets ({found}): "
                                "reinstall swan_dist, or set SWAN_DIST_CONFIG_DIR")
    return found


def _preset_files() -> dict[str, Traversable]:
    return {f.name[: -len(".yaml")]: f for f in (config_dir() / "presets").iterdir() if f.name.endswith(".yaml")}


def list_presets() -> list[str]:
    return sorted(_preset_files())


def load_preset(name: str) -> dict[str, Any]:
    """A preset by name (``swan_0``, ``swan_dagger``, ``swan_ddagger``, or an alias such as ``SWAN‡``)
    or by path to a YAML file. Returns ``{"name", "description", "optimizer": {...}, "schedule": {...}}``.
    Unknown keys raise ``ValueError`` naming the key and the file."""
    path: Traversable = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        key = _ALIASES.get(name.lower(), name.lower())
        files = _preset_files()
        if key not in files:
            raise ValueError(f"unknown SWAN preset {name!r}; available: {', '.join(sorted(files))}")
        path = files[key]
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    _check_keys(data, _TOP_KEYS, str(path))
    data.setdefault("name", path.name.rsplit(".", 1)[0])
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
