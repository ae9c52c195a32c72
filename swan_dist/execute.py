"""Whitening SWAN's matrices and applying their updates: on this rank alone (every matrix whole here),
or through the owner/replicated exchange (:class:`swan_dist.routing.Exchange`), whose plans are cached
by the layout (:class:`Plans`): records, every rank's ranges, mode and bucket bound, never a scalar
option, so that an lr schedule builds nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .functional import swan_update
from .pieces import Entry
from .routing import Exchange, MatrixSpec, build_plan, matrices_in, update_canonical
from .rules import Pending, apply_stack

__all__ = ["whiten_local", "Plans", "explain"]

# Largest stack of same-shape gradients whitened in one batched call (bounds transient memory). On the
# CPU, 16 MiB stacks of the `small` model's matrices whitened 15-25 % faster than 1 MiB ones (two threads,
# while a stack of one still ran as a batch of one); 4 MiB gave the same single-process step since
# (84.5 vs 85.2 ms, medians of four alternating runs). Work that is only memory passes (whitening
# "none", applying updates) runs in cache-sized sets instead: 16 MiB made the lean step's 64x64
# matrices 10-30 % slower.
_MAX_BATCH_BYTES = 256 << 20
_CPU_BATCH_BYTES = 16 << 20
_CPU_PASS_BYTES = 1 << 20
# The owner engine's stacks on the CPU. In replicated mode a phase holds a share of every matrix, and
# 4 MiB stacks instead of whole (shape, config) groups made the `small` model's replicated DDP step
# 10-15 % faster at W=2 (176-187 vs 205-224 ms, alternating runs: glibc faults large fresh buffers in
# again each step); owner mode's phases already keep its stacks near that size (no change measured).
_CPU_EXCHANGE_STACK_BYTES = 4 << 20
# Bytes of updates the exchange hands back that are held before they are applied together (on the CPU,
# _CPU_PASS_BYTES): a bound on what they keep alive beyond the exchange's own buffers.
_FLUSH_BYTES = 32 << 20


def explain(failure: BaseException | None, bucket_mb: float) -> BaseException | None:
    """An owner's out-of-memory error, with what bounds the owner's memory and what to do."""
    if not isinstance(failure, torch.OutOfMemoryError):
        return failure
    out = torch.OutOfMemoryError(
        f"{failure}\nswan_dist: out of memory in the optimizer step. In owner mode each owner assembles up to "
        f"bucket_mb={bucket_mb:g} MB of full fp32 matrices per bucket (a larger matrix alone) plus its whitening "
        "workspace (an m x m Gram and iterate per matrix): pass a smaller SWAN(bucket_mb=...), e.g. half")
    out.__cause__ = failure
    return out


def whiten_local(entries: Sequence[Entry], nonfinite: list[str]) -> int:
    """Every matrix whole on this rank: whiten here, batched over same shape and config, the updates
    applied per stack with foreach kernels; a matrix whose update came out non-finite is not applied and
    its name added to ``nonfinite``. Returns the number of matrices whitened."""
    batches: defaultdict = defaultdict(list)
    for e in entries:
        g, r = e.piece.grad, e.record
        batches[(r.shape, g.dtype, g.device, r.cfg, r.split)].append(e)
    whitened = 0
    for (shape, _, device, cfg, split), chunk_all in batches.items():
        numel = torch.Size(shape).numel()
        cpu_bound = _CPU_PASS_BYTES if cfg.method == "none" else _CPU_BATCH_BYTES
        bound = cpu_bound if device.type == "cpu" else _MAX_BATCH_BYTES
        per = max(1, bound // max(1, 4 * numel))
        for k in range(0, len(chunk_all), per):
            chunk = chunk_all[k: k + per]
            rows = torch.stack([e.piece.grad for e in chunk])
            upd, ok = update_canonical(rows, [e.record.layout for e in chunk], shape, split,
                                       lambda x: swan_update(x, cfg))
            if not bool(ok.all()):
                keep = ok.tolist()
                nonfinite += [e.record.name for e, good in zip(chunk, keep) if not good]
                chunk, upd = [e for e, good in zip(chunk, keep) if good], upd[ok]
            if chunk:
                apply_stack([e.group for e in chunk], [e.piece.param for e in chunk], upd)
            whitened += len(chunk_all[k: k + per]) * matrices_in(shape, split)
    return whitened


class Plans:
    """The exchange per layout key, built on first use (one ``all_gather_object`` of the ranges and
    :func:`~swan_dist.routing.build_plan`) and cached: ZeRO-3 steps each sub-group alone, each with its
    plan; at most 64 kept (layouts that keep changing, re-sharding, do not grow without bound)."""

    def __init__(self) -> None:
        self.last: Exchange | None = None  # the last plan run (for inspection and benchmarks)
        self.cache: dict[tuple, Exchange] = {}
        self.built = 0  # plans built so far

    def get(self, key: tuple, entries: Sequence[Entry], mode: str, bucket_mb: float, group,
            device: torch.device) -> Exchange:
        plan = self.cache.get(key)
        if plan is not None and plan.device == device:
            return plan
        specs = [MatrixSpec(e.record.name, e.record.shape, e.record.cfg, e.record.layout, e.record.split)
                 for e in entries]
        ranges: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranges, [(e.piece.lo, e.piece.hi) for e in entries], group=group)
        built = build_plan(specs, ranges, mode, int(bucket_mb * 2**20))
        plan = Exchange(built, dist.get_rank(group), group, device, [e.piece.param.dtype for e in entries],
                        stack_bytes=_CPU_EXCHANGE_STACK_BYTES if device.type == "cpu" else None)
        if len(self.cache) >= 64:
            self.cache.clear()
        self.cache[key] = plan
        self.built += 1
        return plan

    def run(self, plan: Exchange, entries: Sequence[Entry], skip: set[int], device: torch.device,
            nonfinite: list[str]) -> tuple[int, BaseException | None]:
        """Whiten the matrices of ``entries`` (but those at the indices in ``skip``) on their owners and
        apply each update piece here; a piece that arrives non-finite (its owner's update was, or its owner
        failed) is not applied and its name added to ``nonfinite``. Returns the number of matrices this
        rank whitened and what failed here (every collective of the step was issued all the same)."""
        self.last = plan
        pending = Pending(_CPU_PASS_BYTES if device.type == "cpu" else _FLUSH_BYTES, nonfinite)

        def on_update(m: int, u: Tensor) -> None:
            pending.add(entries[m].group, entries[m].piece.param, u, entries[m].record.name)

        whitened = plan.run([e.piece.grad for e in entries], skip, on_update)
        failure = plan.failure
        if failure is None:
            try:
                pending.flush()
            except Exception as e:  # noqa: BLE001 - announced by the caller
                failure = e
        return whitened, failure
