"""The optimizer and lr schedule a reference run trains with: SWAN or a baseline (:func:`build_optimizer`),
warm-up then cosine decay (:func:`build_scheduler`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from .baselines import build_adamw, build_muon

if TYPE_CHECKING:
    from .config import TrainConfig


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SWAN (parameter groups classified by swan_dist), AdamW, or the Muon baseline (:class:`~.baselines.MuonWithAdamW`)
    for ``model`` (not a DDP wrapper)."""
    if cfg.optimizer == "swan":
        import swan_dist

        # in backward, SWAN needs the model (its FSDP modules are the units it steps)
        groups = model if cfg.step_in_backward else swan_dist.param_groups(model, fallback=cfg.fallback)
        extra = {"fallback": cfg.fallback, "step_in_backward": True} if cfg.step_in_backward else {}
        try:
            return swan_dist.SWAN(groups, preset=cfg.preset, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  mode=cfg.swan_mode, bucket_mb=cfg.bucket_mb, **extra, **cfg.swan_options)
        except TypeError as e:
            raise ValueError(f"config swan_options {sorted(cfg.swan_options)}: {e}") from None
    lr = cfg.lr if cfg.lr is not None else 1e-3
    if cfg.optimizer == "muon":
        return build_muon(cfg, model, lr)
    return build_adamw(model, lr, cfg.weight_decay)


def schedule_ratios(cfg: TrainConfig) -> tuple[float, float]:
    """(warmup_ratio, min_lr_ratio): the config's, else the SWAN preset's schedule, else (0.1, 0.1)."""
    defaults = {"warmup_ratio": 0.1, "min_lr_ratio": 0.1}
    if cfg.optimizer == "swan":
        import swan_dist

        defaults.update(swan_dist.load_preset(cfg.preset).get("schedule", {}))
    warmup = cfg.warmup_ratio if cfg.warmup_ratio is not None else defaults["warmup_ratio"]
    min_ratio = cfg.min_lr_ratio if cfg.min_lr_ratio is not None else defaults["min_lr_ratio"]
    return float(warmup), float(min_ratio)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over warmup_ratio * steps, then cosine decay to min_lr_ratio; scales every group."""
    warmup_ratio, min_ratio = schedule_ratios(cfg)
    warmup = int(warmup_ratio * cfg.steps)

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

