"""SWAN's whitening of its matrices and applying the updates: on this rank alone (every matrix whole
here, :func:`whiten_local`), or through the owner/replicated exchange, whose plans :class:`Plans` builds
and caches by layout. This is where SWAN's per-matrix computation and cost model are handed to the
planner and the exchange (:func:`swan_compute`, :func:`swan_cost`), which know nothing of SWAN.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .adapter import adapter_for
from .collectives import gather_objects, pick
from .exchange import Exchange
from .functional import WhitenConfig, resolve_dtype, swan_update, whiten_flops
from .layout import matrices_in, part_shapes, update_canonical
from .plan import Matrix, Plan, build_plan
from .records import Entry
from .rules import Missed, Pending, apply_stack

__all__ = ["whiten_local", "Plans", "explain", "swan_compute", "swan_cost", "swan_plan", "swan_exchange",
           "exchange_dtype_of", "exchange_dtypes", "EXCHANGE_DTYPES"]

# Bounds on stacks and held updates; measurements behind them: docs/benchmarks.md, "Engine constants".
_MAX_BATCH_BYTES = 256 << 20  # largest stack of same-shape gradients whitened in one call (accelerators)
_CPU_BATCH_BYTES = 16 << 20  # the same on the CPU
_CPU_PASS_BYTES = 1 << 20  # memory-pass-only work on the CPU (whitening "none", applying updates)
_CPU_EXCHANGE_STACK_BYTES = 4 << 20  # the owner engine's stacks on the CPU
_FLUSH_BYTES = 32 << 20  # updates handed back by the exchange held before they are applied together


def swan_compute(stack: Tensor, cfg: WhitenConfig) -> tuple[Tensor, Tensor]:
    """SWAN's update of a stack of same-shape gradients, and which of them came out finite."""
    return swan_update(stack, cfg)


def swan_cost(spec: Matrix) -> float:
    """The cost model the planner balances owners on: FLOPs of SWAN's whitening of one matrix (a stack's
    every matrix, a fused matrix's every part)."""
    stack = spec.numel // max(1, spec.shape[-2] * spec.shape[-1]) if spec.numel else 0
    return stack * sum(whiten_flops(part, spec.cfg) for part in part_shapes(spec.shape[-2:], spec.split))


def swan_plan(specs: Sequence[Matrix], ranges, mode: str = "owner", bucket_bytes: int = 256 << 20) -> Plan:
    """:func:`~swan_dist.plan.build_plan` on SWAN's cost model."""
    return build_plan(specs, ranges, mode, bucket_bytes, cost=swan_cost)


def swan_exchange(plan: Plan, rank: int, group, device: torch.device, dtypes: Sequence[torch.dtype],
                  **options) -> Exchange:
    """:class:`~swan_dist.exchange.Exchange` running SWAN's computation (``options``: phases, stacks)."""
    return Exchange(plan, rank, group, device, dtypes, compute=swan_compute, **options)


EXCHANGE_DTYPES = ("auto", "bf16", "fp32", "param")


def exchange_dtype_of(choice: str, cfg: WhitenConfig | None, param_dtype: torch.dtype,
                      device: torch.device) -> torch.dtype:
    """The dtype a matrix's gradient and update pieces travel in between its holders and its owner
    (``SWAN(exchange_dtype=...)``), the owner whitening on ``device``: ``auto`` the whitening dtype where
    that is bf16 (SWAN‡ on GPUs: the owner whitens in bf16, what a finer dtype would carry is dropped
    there), else the parameter's dtype; ``bf16``, ``fp32``; ``param`` the parameter's dtype. Updates are
    applied in the parameter's dtype."""
    if choice == "bf16":
        return torch.bfloat16
    if choice == "fp32":
        return torch.float32
    if choice == "auto" and cfg is not None and resolve_dtype(cfg, device) == torch.bfloat16:
        return torch.bfloat16
    return param_dtype


def exchange_dtypes(entries: Sequence[Entry], choice: str, device: torch.device) -> list[torch.dtype]:
    """:func:`exchange_dtype_of` for each entry's matrix."""
    return [exchange_dtype_of(choice, e.record.cfg, e.piece.param.dtype, device) for e in entries]


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


def whiten_local(entries: Sequence[Entry], wanted: Tensor, missed: Missed) -> int:
    """Every matrix whole on this rank: whiten here, batched over same shape and config, the updates
    applied per stack with foreach kernels where ``wanted`` (a bool per entry, on the device) is set and
    the update came out finite (others counted in ``missed``); decided on the device. Returns the number
    of matrices whitened."""
    batches: defaultdict = defaultdict(list)
    for i, e in enumerate(entries):
        g, r = e.piece.grad, e.record
        batches[(r.shape, g.dtype, g.device, r.cfg, r.split)].append(i)
    whitened = 0
    for (shape, _, device, cfg, split), chunk_all in batches.items():
        numel = torch.Size(shape).numel()
        cpu_bound = _CPU_PASS_BYTES if cfg.method == "none" else _CPU_BATCH_BYTES
        bound = cpu_bound if device.type == "cpu" else _MAX_BATCH_BYTES
        per = max(1, bound // max(1, 4 * numel))
        for k in range(0, len(chunk_all), per):
            idx = chunk_all[k: k + per]
            chunk = [entries[i] for i in idx]
            # one matrix: a view of its gradient, no copy (torch.stack copies even one)
            rows = chunk[0].piece.grad.unsqueeze(0) if len(chunk) == 1 else torch.stack([e.piece.grad for e in chunk])
            upd, ok = update_canonical(rows, [e.record.layout for e in chunk], shape, split,
                                       lambda x: swan_compute(x, cfg))
            want = pick(wanted, idx)
            want = want.to(ok.device)
            missed.add([e.record.name for e in chunk], want & ~ok)
            apply_stack([e.group for e in chunk], [e.piece.param for e in chunk], upd, want & ok)
            whitened += len(chunk) * matrices_in(shape, split)
    return whitened


def _every_ranks_ranges(entries: Sequence[Entry], group) -> list[list[tuple[int, int]]]:
    """Per rank of ``group`` the ranges of ``entries`` it holds: gathered (one ``all_gather_object``), or,
    under torch's fake process group (nothing crosses: one rank simulated to estimate a step's memory),
    from what each adapter knows of the other ranks' layout (:meth:`~swan_dist.adapter.Adapter.peer_ranges`)."""
    mine = [(e.piece.lo, e.piece.hi) for e in entries]
    if str(dist.get_backend(group)) != "fake":
        return gather_objects(mine, group)
    world = dist.get_world_size(group)
    per = []
    for e in entries:
        known = adapter_for(e.piece.target).peer_ranges(e.piece.target, e.piece, world)
        if known is None:
            raise NotImplementedError(f"swan_dist: under torch's fake process group the other ranks' pieces of "
                                      f"{e.record.name!r} cannot be known here (its layout is not a function of the "
                                      "rank): a fake step supports whole tensors and DTensors on a 1-D mesh")
        per.append(known)
    return [[p[r] for p in per] for r in range(world)]


class Plans:
    """The exchange per layout key, built on first use (one gather of every rank's ranges and
    :func:`~swan_dist.plan.build_plan`) and cached: ZeRO-3 steps each sub-group alone, each with its
    plan; at most 64 kept (layouts that keep changing, re-sharding, do not grow without bound)."""

    def __init__(self) -> None:
        self.last: Exchange | None = None  # the last plan run (for inspection and benchmarks)
        self.cache: dict[tuple, Exchange] = {}
        self.built = 0  # plans built so far

    def get(self, key: tuple, entries: Sequence[Entry], mode: str, bucket_mb: float, group,
            device: torch.device, exchange_dtype: str = "auto") -> Exchange:
        plan = self.cache.get(key)
        if plan is not None and plan.device == device:
            return plan
        specs = [e.record for e in entries]  # records are what the planner plans with
        ranges = _every_ranks_ranges(entries, group)
        with unset_fake_temporarily():  # the planner's index tables: host data, real also in a fake step
            built = swan_plan(specs, ranges, mode, int(bucket_mb * 2**20))
        plan = swan_exchange(built, dist.get_rank(group), group, device, exchange_dtypes(entries, exchange_dtype, device),
                             stack_bytes=_CPU_EXCHANGE_STACK_BYTES if device.type == "cpu" else None)
        if len(self.cache) >= 64:
            self.cache.clear()
        self.cache[key] = plan
        self.built += 1
        return plan

    def run(self, plan: Exchange, entries: Sequence[Entry], wanted: Tensor | None, device: torch.device,
            missed: Missed) -> tuple[int, BaseException | None]:
        """Whiten the matrices of ``entries`` on their owners and apply each update piece here where
        ``wanted`` (a bool per entry, on the device) is set and its owner's update was finite (others
        counted in ``missed``). ``wanted=None``: this rank takes part without updating anything (it knows
        its entries are not what was agreed: it sends zeros and applies nothing). Returns the number of
        matrices this rank whitened and what failed here (every collective of the step was issued all the
        same)."""
        self.last = plan
        pending = Pending(_CPU_PASS_BYTES if device.type == "cpu" else _FLUSH_BYTES, missed)
        if wanted is None:
            return plan.run([None] * len(plan.plan.specs), set(), lambda m, u, finite: None), plan.failure
        want = wanted.to(device).unbind(0)

        def on_update(m: int, u: Tensor, finite: Tensor) -> None:
            pending.add(entries[m].group, entries[m].piece.param, u, entries[m].record.name, finite, want[m])

        whitened = plan.run([e.piece.grad for e in entries], set(), on_update)
        failure = plan.failure
        if failure is None:
            try:
                pending.flush()
            except Exception as e:  # noqa: BLE001 - announced by the caller
                failure = e
        return whitened, failure
