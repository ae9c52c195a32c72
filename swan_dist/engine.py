"""The step as an engine over a set of entries: :func:`run_step`.

Its input is any list of this rank's :class:`~swan_dist.records.Entry` (SWAN matrices and fallback
tensors; the same subset on every rank, by construction of the caller: the whole model for
``SWAN.step()``, one FSDP unit's parameters for an update made during backward) and an explicit
:class:`StepContext`. It agrees with the other ranks, runs the fallback rules, whitens (here, or on
owners through the exchange) and applies, and returns a :class:`StepResult`. Every rank issues the
same collectives in the same order whatever its data, and a fault on one rank is every rank's error
(docs/engine.md, "Failures"): the engine keeps it, issues the rest of the step's collectives, and
returns it in the result on every rank.

What the engine keeps between calls over the same set of entries (the last agreement, the hashes, the
plans) is an :class:`EngineMemo`, one per set, held by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .agreement import Hashes, StepAgreement, agree, gather_names, nonfinite_update, raise_rank_failure, skipped
from .collectives import all_reduce_max, comm_device
from .functional import is_fake
from .records import Entry
from .rules import run_fallbacks
from .whitening import Plans, explain, whiten_local

__all__ = ["run_step", "StepContext", "StepResult", "EngineMemo", "Deferred", "MODES"]

MODES = ("auto", "owner", "replicated", "local")


@dataclass(frozen=True)
class StepContext:
    """Where a step runs: the world size of ``group``, the communication ``device`` (``None`` at W=1), the
    resolved ``mode`` (``local`` at W=1) and the owners' bucket bound."""

    world: int
    group: dist.ProcessGroup | None
    device: torch.device | None
    mode: str
    bucket_mb: float

    @classmethod
    def of(cls, entries: Sequence[Entry], mode: str, bucket_mb: float,
           process_group: dist.ProcessGroup | None) -> StepContext:
        """The context of a step over ``entries``: ``mode`` (``auto`` is owner mode when distributed) and
        the device resolved once, from what every rank sees alike (:func:`~swan_dist.collectives.comm_device`)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
            return cls(1, process_group if dist.is_available() and dist.is_initialized() else None, None,
                       "local", bucket_mb)
        devices = list(dict.fromkeys(e.piece.param.device for e in entries))
        current = {"cuda": torch.cuda.current_device()} if torch.cuda.is_available() else {}
        device = comm_device(str(dist.get_backend(process_group)), devices, current)
        return cls(dist.get_world_size(process_group), process_group, device,
                   "owner" if mode == "auto" else mode, bucket_mb)


@dataclass
class EngineMemo:
    """What the engine keeps from one call to the next over one set of entries (never state)."""

    agreement: StepAgreement = field(default_factory=StepAgreement)
    hashes: Hashes = field(default_factory=Hashes)
    plans: Plans = field(default_factory=Plans)


class StepResult(NamedTuple):
    """What a step did on this rank, and what every rank raises where it failed."""

    whitened: int  # matrices this rank whitened
    skipped: tuple[str, ...]  # parameters skipped for a non-finite gradient (alike on every rank)
    nonfinite: tuple[str, ...]  # SWAN matrices whose update was not finite: applied nowhere
    failure: BaseException | None  # the error every rank raises (the same kind, naming the rank), or None


class Deferred:
    """``with Deferred(world) as d:`` keeps an exception raised inside (the first, in ``d.error``) where
    other ranks wait for this one's collectives (W > 1), so that it still issues every collective of the
    step and tells them at the next meeting point; at W = 1 it propagates."""

    def __init__(self, world: int) -> None:
        self.world, self.error = world, None

    def __enter__(self) -> Deferred:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or self.world == 1 or not isinstance(error, Exception):
            return False
        self.error = self.error or error
        return True


def run_step(entries: list[Entry], ctx: StepContext, memo: EngineMemo, groups: Sequence[dict], state: dict,
             failure: BaseException | None = None) -> StepResult:
    """Agree, run the fallback rules, whiten and apply SWAN's updates for ``entries`` on every rank of
    ``ctx.group``; ``groups`` are the param groups whose scalar options every rank must share, ``state``
    the fallback rules' state, ``failure`` what went wrong on this rank before (collecting its pieces):
    every rank then fails alike. Never raises for a rank's fault: it is the result's ``failure``."""
    done = StepResult(0, (), (), None)
    entries = [e for e in entries if e.record.use_swan] + [e for e in entries if not e.record.use_swan]
    try:  # SWAN's matrices first: an entry's index is its matrix index in the exchange
        flags, key = agree(entries, failure, ctx, memo, groups)
        skip, bad_grads = skipped(entries, flags)
        done = done._replace(skipped=tuple(bad_grads))
        nonfinite: list[str] = []
        late = Deferred(ctx.world)
        with late:
            whitened = _update(entries, skip, key, ctx, memo, state, nonfinite, late)
            done = done._replace(whitened=whitened)
        nonfinite = _close(ctx, late.error, nonfinite)
        if nonfinite:
            nonfinite_update(entries, nonfinite)
        return done._replace(nonfinite=tuple(nonfinite))
    except Exception as e:  # noqa: BLE001 - every rank reaches here alike (the agreement and _close decide)
        return done._replace(failure=e)


def _update(entries: list[Entry], skip: set[int], key: tuple | None, ctx: StepContext, memo: EngineMemo,
            state: dict, nonfinite: list[str], late: Deferred) -> int:
    """The fallback rules, then SWAN's matrices whitened and applied; returns the number of matrices this
    rank whitened. What fails here at W > 1 goes to ``late`` (the exchange's collectives all run
    regardless); names of matrices whose update was not finite go to ``nonfinite``."""
    swan = sum(e.record.use_swan for e in entries)  # entries[:swan], SWAN's matrices (run_step's order)
    with late:
        run_fallbacks(state, groups_of(entries), entries, skip)
    if ctx.mode == "local":
        mine = [e for i, e in enumerate(entries[:swan]) if i not in skip and e.piece.grad is not None]
        return whiten_local(mine, nonfinite) if late.error is None else 0
    if not swan:  # the agreed structure covers the entries: every rank returns here or none does
        return 0
    mine = entries[:swan]
    plan = memo.plans.get(key, mine, ctx.mode, ctx.bucket_mb, ctx.group, ctx.device)
    whitened, error = memo.plans.run(plan, mine, skip, ctx.device, nonfinite)
    late.error = late.error or error
    return whitened


def groups_of(entries: Sequence[Entry]) -> list[dict]:
    """The param groups of ``entries``, each once, in order of first appearance."""
    return list({id(e.group): e.group for e in entries}.values())


def _close(ctx: StepContext, late: BaseException | None, nonfinite: list[str]) -> list[str]:
    """The step's last collective: any rank's late failure or non-finite update reaches every rank (one
    ``all_reduce(MAX)`` of ``[failed, non-finite]``); raises that rank's error alike on every rank, else
    returns every rank's non-finite names."""
    if ctx.world == 1:
        if late is not None:
            raise late
        return nonfinite
    status = torch.tensor([late is not None, bool(nonfinite)], dtype=torch.int32, device=ctx.device)
    if is_fake(status):  # a fake step (torch's fake process group): this rank's own status, no values cross
        failed, bad = late is not None, False
        if late is not None:
            raise late
    else:
        failed, bad = all_reduce_max(status, ctx.group)
    if failed:
        raise_rank_failure(explain(late, ctx.bucket_mb), ctx.group)
    return gather_names(nonfinite, ctx.group) if bad else nonfinite
