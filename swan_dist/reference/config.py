"""The reference trainer's configuration: :class:`TrainConfig` (every key, its default, and the checks that
reject a bad value naming the key), read from YAML with ``key=value`` overrides by :func:`load_config`; and
the DeepSpeed JSON those keys complete (:func:`deepspeed_json`).

Of the trainer's modules this one imports only :mod:`.model`: the others import it, never the reverse."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .model import model_config

# The parallel strategies (:data:`.parallel.PARALLEL` wraps the model for each).
STRATEGIES = ("none", "ddp", "fsdp2", "fsdp1", "deepspeed")
# Strategies under which every rank's optimizer sees whole matrices (Muon orthogonalises a whole matrix;
# FSDP1/FSDP2/ZeRO hand it shards, and torch's Muon has no engine that gathers them as SWAN's does).
MUON_PARALLEL = ("none", "ddp")


@dataclass
class TrainConfig:
    model: dict[str, Any] = field(default_factory=lambda: {"size": "tiny"})  # size + LlamaConfig overrides
    data: str | list[str] = "wiki"  # built-in corpus name, or text files / globs / directories
    vocab_size: int = 8192
    val_fraction: float = 0.02
    seq_len: int = 128
    batch_size: int = 16  # sequences per rank and micro-step
    grad_accum: int = 1
    steps: int = 250
    optimizer: str = "swan"  # swan | adamw | muon (baseline: torch's Muon on SWAN's matrices, AdamW on the rest)
    preset: str = "swan_ddagger"  # SWAN preset (swan_0, swan_dagger, swan_ddagger)
    lr: float | None = None  # None: the preset's lr (swan) or 1e-3 (adamw, muon)
    weight_decay: float = 0.0
    fallback: str = "adamw"  # optimizer for parameters SWAN does not handle
    warmup_ratio: float | None = None  # None: the preset's schedule (swan) or 0.1 (adamw, muon)
    min_lr_ratio: float | None = None  # cosine decays to min_lr_ratio * lr; None as above
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_every: int = 50
    eval_batches: int = 8  # the validation set is eval_batches * batch_size fixed windows
    log_every: int = 10
    out_dir: str = "runs/default"
    save_model: bool = True  # rank 0 writes out_dir/model.pt (state dict of the unwrapped model)
    seed: int = 0
    parallel: str = "none"  # none | ddp | fsdp2 | fsdp1 | deepspeed
    deepspeed_config: str | None = None  # parallel: deepspeed: a DeepSpeed JSON (configs/deepspeed/)
    fsdp1_use_orig_params: bool = True  # parallel: fsdp1: False hands the optimizer FlatParameters
    swan_mode: str = "auto"  # SWAN engine: auto (owner when world > 1) | owner | replicated | local
    bucket_mb: float = 256.0  # SWAN engine: full fp32 matrices one owner assembles per bucket
    swan_options: dict[str, Any] = field(default_factory=dict)  # more swan_dist.SWAN keyword arguments
    step_in_backward: bool = False  # SWAN updates each parameter during backward, gradients freed (none, fsdp2)
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 (autocast)
    checkpoint_every: int = 0  # save out_dir/checkpoints/step_N every this many steps; 0: never
    keep_checkpoints: int = 2  # complete checkpoints kept (older ones are deleted); 0: keep all
    resume: str = "auto"  # auto: the latest complete checkpoint in out_dir, if any | never | a path
    init_from: str | None = None  # a fresh start from another run's checkpoint (weights; AdamW moments for SWAN)
    dist_timeout_s: float = 300.0  # process-group timeout: a rank whose peers died fails within it
    time_optimizer: bool = False  # summary's optimizer_s exact on CUDA (synchronises around each step)

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            self.model = {"size": self.model}
        if "vocab_size" in self.model:
            raise ValueError("model.vocab_size comes from the tokenizer; set the top-level vocab_size instead")
        overrides = {k: v for k, v in self.model.items() if k != "size"}
        model_config(self.model.get("size", "tiny"), **overrides)  # validates size and option names
        for name in ("val_fraction", "lr", "weight_decay", "warmup_ratio", "min_lr_ratio", "grad_clip",
                     "dist_timeout_s"):
            value = getattr(self, name)
            if value is not None:  # YAML reads "1e-3" (no dot) as a string
                setattr(self, name, float(value))
        choices = {
            "optimizer": ("swan", "adamw", "muon"), "parallel": STRATEGIES, "backend": ("auto", "gloo", "nccl"),
            "swan_mode": ("auto", "owner", "replicated", "local"),
            "device": ("auto", "cpu", "cuda"), "dtype": ("float32", "bfloat16"),
        }  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"config {name}={getattr(self, name)!r}; choose from {list(allowed)}")
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "eval_batches", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"config {name} must be >= 1")
        for name in ("checkpoint_every", "keep_checkpoints"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"config {name} must be an integer >= 0")
        if self.dist_timeout_s <= 0:
            raise ValueError("config dist_timeout_s must be > 0")
        self.resume = str(self.resume)
        if not self.resume:
            raise ValueError("config resume: auto, never, or a checkpoint path")
        if self.init_from is not None:
            self.init_from = str(self.init_from)
            if self.init_from in ("", "auto", "never"):
                raise ValueError(f"config init_from={self.init_from!r}: a checkpoint path (a step_N folder, a "
                                 "checkpoints/ folder or an out_dir), or null")
            if self.parallel == "deepspeed":
                raise ValueError("config init_from reads a torch.distributed.checkpoint (parallel none, ddp, fsdp2 "
                                 "or fsdp1); DeepSpeed's engine loads only its own checkpoints: use another parallel")
        if self.optimizer == "muon" and self.parallel not in MUON_PARALLEL:
            raise ValueError(f"config optimizer=muon (the torch.optim.Muon baseline) needs whole matrices on every "
                             f"rank: parallel={self.parallel!r} hands the optimizer shards (FSDP) or builds its own "
                             f"(DeepSpeed); use parallel in {list(MUON_PARALLEL)}, or optimizer=swan")
        if self.step_in_backward:
            self._check_in_backward()
        if (self.parallel == "deepspeed") != (self.deepspeed_config is not None):
            raise ValueError("config deepspeed_config is required with parallel: deepspeed, and only then")
        if self.deepspeed_config is not None:
            deepspeed_json(self)  # the file exists, parses, and agrees with the trainer's keys


    def _check_in_backward(self) -> None:
        """``step_in_backward``: SWAN only, one process or FSDP2, no global-norm clipping."""
        if self.optimizer != "swan":
            raise ValueError(f"config step_in_backward=true is SWAN's (optimizer=swan), not optimizer={self.optimizer!r}")
        if self.parallel not in ("none", "fsdp2"):
            raise ValueError(f"config step_in_backward=true runs in one process or under FSDP2, not parallel="
                             f"{self.parallel!r} (its gradients are kept or reduced whole until the step): use "
                             "parallel=fsdp2, or step_in_backward=false")
        if self.grad_clip > 0:
            raise ValueError(f"config step_in_backward=true updates each parameter during backward, so grad_clip="
                             f"{self.grad_clip:g} would clip no gradient (global-norm clipping needs every gradient "
                             "at once): set grad_clip=0, or step_in_backward=false")
        if self.grad_accum > 1 and self.parallel == "none":
            raise ValueError("config step_in_backward=true with grad_accum > 1 needs parallel=fsdp2 (one process "
                             "updates at every backward): set grad_accum=1, or step_in_backward=false")


# Keys of the DeepSpeed JSON that the trainer's own config decides.
_DS_FROM_TRAINER = {
    "train_micro_batch_size_per_gpu": "batch_size", "gradient_accumulation_steps": "grad_accum",
    "gradient_clipping": "grad_clip",
}


def deepspeed_json(cfg: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed config for ``cfg``: the JSON file, with batch size, accumulation, clipping and bf16
    from the trainer's keys, and the optimizer block filled from the trainer's where the JSON leaves
    keys out. A JSON value that contradicts the trainer's is an error naming both keys."""
    path = Path(cfg.deepspeed_config)
    if not path.exists():
        raise ValueError(f"config deepspeed_config: {path} does not exist")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config deepspeed_config: {path} is not valid JSON: {e}") from None
    for key, trainer_key in _DS_FROM_TRAINER.items():
        if key in ds and ds[key] != getattr(cfg, trainer_key):
            raise ValueError(f"{path}: {key}={ds[key]!r} contradicts the trainer's {trainer_key}={getattr(cfg, trainer_key)!r}")
        ds[key] = getattr(cfg, trainer_key)
    bf16 = ds.setdefault("bf16", {})
    if bf16.setdefault("enabled", cfg.dtype == "bfloat16") != (cfg.dtype == "bfloat16"):
        raise ValueError(f"{path}: bf16.enabled={bf16['enabled']!r} contradicts the trainer's dtype={cfg.dtype!r}")
    opt = ds.setdefault("optimizer", {"type": "SWAN" if cfg.optimizer == "swan" else "AdamW"})
    if str(opt.get("type", "")).lower() != cfg.optimizer:
        raise ValueError(f"{path}: optimizer.type={opt.get('type')!r} but the trainer's optimizer={cfg.optimizer!r}")
    params = opt.setdefault("params", {})
    if cfg.optimizer == "swan":
        filled = {"preset": cfg.preset, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "fallback": cfg.fallback,
                  "mode": cfg.swan_mode, "bucket_mb": cfg.bucket_mb, **cfg.swan_options}
    else:
        filled = {"lr": cfg.lr if cfg.lr is not None else 1e-3, "betas": [0.9, 0.95], "weight_decay": cfg.weight_decay}
    for key, value in filled.items():
        if value is not None:
            params.setdefault(key, value)
    ds.setdefault("steps_per_print", 10**9)
    return ds


def _set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = tree.setdefault(key, {})
        if isinstance(node, str) and key == "model":  # `model: tiny` shorthand
            node = tree[key] = {"size": node}
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {dotted!r}: {key!r} is not a section")
        tree = node
    tree[leaf] = value


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config and apply ``key=value`` overrides (values parsed as YAML, keys may be dotted)."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not of the form key=value")
        _set_key(raw, key.strip(), yaml.safe_load(value))
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}{f' in {path}' if path else ''}; valid keys: {sorted(known)}")
    if isinstance(raw.get("deepspeed_config"), str) and path is not None:
        raw["deepspeed_config"] = _find_relative(raw["deepspeed_config"], Path(path))
    return TrainConfig(**raw)


def _find_relative(name: str, yaml_path: Path) -> str:
    """A relative path as written (from the working directory), else from the YAML's folder or one of
    its parents (``configs/deepspeed/zero2.json`` written in ``configs/train/x.yaml`` finds the repo's)."""
    if Path(name).is_absolute() or Path(name).exists():
        return name
    for folder in yaml_path.resolve().parents:
        if (folder / name).exists():
            return str(folder / name)
    return name
