"""Optimizer memory on this rank: what the optimizer keeps (state) and what a framework wrapper keeps
(fp32 master copies), reported separately so that SWAN's saving is measured, not assumed."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def client_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` inside framework wrappers (DeepSpeed's ZeRO and mixed-precision
    optimizers keep it as ``.optimizer``)."""
    inner, hops = optimizer, 0
    while not isinstance(inner, torch.optim.Optimizer):
        inner, hops = getattr(inner, "optimizer", None), hops + 1
        if inner is None or hops > 4:
            raise TypeError(f"no torch.optim.Optimizer inside {type(optimizer).__name__}")
    return inner


def _tensors(value: Any) -> list[Tensor]:
    """The tensors in nested containers, DTensors as their local shards (the bytes this rank holds)."""
    if isinstance(value, Tensor):
        return [value.to_local() if hasattr(value, "to_local") else value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(tensors: list[Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()) if t.numel() else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def state_bytes(optimizer: Any) -> dict[str, int]:
    """``{"optimizer_state": ..., "master_weights": ...}`` in bytes on this rank: the tensors in the
    client optimizer's ``state`` (for SWAN: the fallback rule's only; SWAN matrices keep none), and the
    fp32 master copies a wrapper such as DeepSpeed ZeRO holds (0 without one)."""
    inner = client_optimizer(optimizer)
    masters: list[Tensor] = []
    if inner is not optimizer:  # a framework's wrapper: its master copies (DeepSpeed's, the one such wrapper)
        from swan_dist.integrations.deepspeed import master_weights

        masters = _tensors(master_weights(optimizer))
    return {"optimizer_state": _nbytes(_tensors(dict(inner.state))), "master_weights": _nbytes(masters)}
