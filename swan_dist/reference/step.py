"""One training step of the reference trainer (:func:`train_step`: gradient accumulation, clipping, the
optimizer and lr schedule, under every parallel strategy) and the validation loss (:func:`evaluate`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import TrainConfig
from .data import TextData, WindowSampler, eval_batches
from .parallel import DistEnv, all_reduce_sum


def _autocast(cfg: TrainConfig, env: DistEnv):
    """bf16 autocast; DeepSpeed keeps bf16 weights itself (its JSON's ``bf16``)."""
    enabled = cfg.dtype == "bfloat16" and cfg.parallel != "deepspeed"
    return torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate(model: nn.Module, data: TextData, cfg: TrainConfig, env: DistEnv) -> float:
    """Mean token loss over the fixed validation windows, shared between ranks and summed with all_reduce."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    for x, y in eval_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches, env.rank, env.world_size):
        with _autocast(cfg, env):
            _, loss = model(x.to(env.device), y.to(env.device))
        total[0] += loss.double() * y.numel()
        total[1] += y.numel()
    model.train()
    all_reduce_sum(total)
    return (total[0] / total[1]).item()


def _timed(fn: Callable[[], Any], clock: dict[str, float] | None, cfg: TrainConfig, env: DistEnv) -> None:
    """``fn()``; with a ``clock``, its seconds are added to ``clock["optimizer_seconds"]`` (on CUDA with
    ``time_optimizer``, synchronised before and after)."""
    if clock is None:
        fn()
        return
    sync = cfg.time_optimizer and env.device.type == "cuda"
    if sync:
        torch.cuda.synchronize(env.device)
    t = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize(env.device)
    clock["optimizer_seconds"] = clock.get("optimizer_seconds", 0.0) + time.perf_counter() - t


def _deepspeed_step(engine: nn.Module, sampler: WindowSampler, cfg: TrainConfig, env: DistEnv,
                    clock: dict[str, float] | None) -> torch.Tensor:  # fmt: skip
    """:func:`train_step` under DeepSpeed: the engine scales by grad_accum, clips, steps at the boundary."""
    mean_loss = torch.zeros((), device=env.device)
    for _ in range(cfg.grad_accum):
        x, y = next(sampler)
        _, loss = engine(x.to(env.device), y.to(env.device))
        engine.backward(loss)
        _timed(engine.step, clock, cfg, env)
        mean_loss += loss.detach().float() / cfg.grad_accum
    return mean_loss


def train_step(
    wrapped: nn.Module,
    sampler: WindowSampler,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: TrainConfig,
    env: DistEnv,
    clock: dict[str, float] | None = None,
) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns this rank's mean loss (detached).
    ``clock["optimizer_seconds"]`` (if given) accumulates the time spent in the optimizer step (under
    DeepSpeed: ``engine.step()`` at the accumulation boundary)."""
    from torch.distributed.fsdp import FSDPModule

    if cfg.parallel == "deepspeed":
        return _deepspeed_step(wrapped, sampler, cfg, env, clock)
    ddp = isinstance(wrapped, DistributedDataParallel)
    optimizer.zero_grad(set_to_none=True)  # before backward: SWAN(step_in_backward=True) updates from step one
    mean_loss = torch.zeros((), device=env.device)
    for micro in range(cfg.grad_accum):
        x, y = next(sampler)
        last = micro == cfg.grad_accum - 1
        if isinstance(wrapped, FSDPModule):
            wrapped.set_requires_gradient_sync(last)
        sync = wrapped.no_sync() if ddp and not last else nullcontext()
        with sync:  # gradients are reduced on the last micro-batch only
            with _autocast(cfg, env):
                _, loss = wrapped(x.to(env.device), y.to(env.device))
            (loss / cfg.grad_accum).backward()
        mean_loss += loss.detach() / cfg.grad_accum
    if cfg.grad_clip > 0:
        nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip)
    _timed(optimizer.step, clock, cfg, env)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return mean_loss
