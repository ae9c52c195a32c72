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

import warnings
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from torch import Tensor

from .agreement import Hashes, StepAgreement, agree, gather_names, nonfinite_grads, nonfinite_update, raise_rank_failure
from .collectives import all_reduce_max, comm_device, is_fake, pick
from .records import Entry, GradCode
from .rules import Missed, run_fallbacks
from .whitening import Plans, explain, whiten_local

__all__ = ["run_step", "settle", "Closing", "StepContext", "StepResult", "Report", "EngineMemo", "Deferred", "MODES"]

MODES = ("auto", "owner", "replicated", "local")


@dataclass(frozen=True)
class StepContext:
    """Where a step runs: the world size of ``group``, the communication ``device`` (``None`` at W=1), the
    resolved ``mode`` (``local`` at W=1), the owners' bucket bound and the exchange's dtype choice
    (:func:`~swan_dist.whitening.exchange_dtypes`)."""

    world: int
    group: dist.ProcessGroup | None
    device: torch.device | None
    mode: str
    bucket_mb: float
    exchange_dtype: str = "auto"

    @classmethod
    def of(cls, entries: Sequence[Entry], mode: str, bucket_mb: float,
           process_group: dist.ProcessGroup | None, exchange_dtype: str = "auto") -> StepContext:
        """The context of a step over ``entries``: ``mode`` (``auto`` is owner mode when distributed) and
        the device resolved once, from what every rank sees alike (:func:`~swan_dist.collectives.comm_device`)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
            return cls(1, process_group if dist.is_available() and dist.is_initialized() else None, None,
                       "local", bucket_mb, exchange_dtype)
        devices = list(dict.fromkeys(e.piece.param.device for e in entries))
        current = {"cuda": torch.cuda.current_device()} if torch.cuda.is_available() else {}
        device = comm_device(str(dist.get_backend(process_group)), devices, current)
        return cls(dist.get_world_size(process_group), process_group, device,
                   "owner" if mode == "auto" else mode, bucket_mb, exchange_dtype)


@dataclass
class EngineMemo:
    """What the engine keeps from one call to the next over one set of entries (never state)."""

    agreement: StepAgreement = field(default_factory=StepAgreement)
    hashes: Hashes = field(default_factory=Hashes)
    plans: Plans = field(default_factory=Plans)
    swan: int = 0  # SWAN matrices of the set, as last agreed (a rank stepping blind runs that plan)


class StepResult(NamedTuple):
    """What a step did on this rank, and what every rank raises where it failed."""

    whitened: int  # matrices this rank whitened
    skipped: tuple[str, ...]  # parameters skipped for a non-finite gradient (alike on every rank)
    nonfinite: tuple[str, ...]  # SWAN matrices whose update was not finite: applied nowhere
    failure: BaseException | None  # the error every rank raises (the same kind, naming the rank), or None
    report: Report | None = None  # in one process: skipped / nonfinite, known once the device has run
    closing: Closing | None = None  # W > 1 with ``defer``: the status, read by :func:`settle`


class Report:
    """A one-process step's counts of non-finite gradients and updates, copied to the host without
    waiting for the device (a pinned copy and an event on an accelerator); :meth:`ready` tells, without
    blocking, whether the copy landed; :meth:`resolve` reads it (waiting if asked before) and, only where
    a count is not zero, reads which parameters and warns as the step would have."""

    def __init__(self, counts: Tensor, named: list[tuple[str, str]], codes: Tensor, missed: Missed,
                 now: bool = False) -> None:
        self.named, self.codes, self.missed, self.event = named, codes, missed, None
        # a step captured in a CUDA graph copies nothing: its counts stay on the device, rewritten by each
        # replay, and are read when asked (resolve())
        self.lazy = counts.is_cuda and not now and torch.cuda.is_current_stream_capturing()
        if now or self.lazy:  # read at once (a host read: that option's price), or when asked
            self.host = counts
            return
        self.host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=counts.is_cuda)
        self.host._swan_host_copy = True  # read on the host once the copy landed: no device wait
        self.host.copy_(counts, non_blocking=counts.is_cuda)
        if counts.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return not self.lazy and (self.event is None or self.event.query())

    def resolve(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(skipped for a non-finite gradient, whose update was not finite)."""
        if self.event is not None:
            self.event.synchronize()
        n_grads, n_updates = self.host.tolist()
        skipped = nonfinite_grads(self.named, self.codes.tolist()) if n_grads else []
        bad = self.missed.names() if n_updates else []
        if bad:
            nonfinite_update(self.named, bad)
        return tuple(skipped), tuple(bad)


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
             failure: BaseException | None = None, defer: bool = False) -> StepResult:
    """Agree, run the fallback rules, whiten and apply SWAN's updates for ``entries`` on every rank of
    ``ctx.group``; ``groups`` are the param groups whose scalar options every rank must share, ``state``
    the fallback rules' state, ``failure`` what went wrong on this rank before (collecting its pieces):
    every rank then fails alike. Never raises for a rank's fault: it is the result's ``failure``.

    What is updated is decided on the device: each entry is applied where its agreed gradient code is
    finite and the step's agreement held (``nonfinite="skip_step"`` / ``"raise"``: and no gradient of
    such a group is non-finite); the rest is left bit for bit unchanged. In one process nothing is read
    on the host (what was skipped comes in the result's :class:`Report`; ``"raise"`` reads it at once);
    at W > 1 the closing status is the step's one host read. Where it says the agreement did not hold
    (a rank's layout changed, or it failed), the step changed nothing and runs again after a full
    agreement, which raises where ranks really differ. ``defer`` (steps made during backward): at W > 1
    the status is issued but left unread in the result's ``closing``, for :func:`settle`."""
    entries = [e for e in entries if e.record.use_swan] + [e for e in entries if not e.record.use_swan]
    try:  # SWAN's matrices first: an entry's index is its matrix index in the exchange
        for _ in range(2):
            done = _run(entries, ctx, memo, groups, state, failure, defer)
            if done is not None:
                return done
        raise RuntimeError("swan_dist: the ranks' step agreement did not hold twice in a row")
    except Exception as e:  # noqa: BLE001 - every rank reaches here alike (the agreement and _close decide)
        return StepResult(0, (), (), e)


def _run(entries: list[Entry], ctx: StepContext, memo: EngineMemo, groups: Sequence[dict], state: dict,
         failure: BaseException | None, defer: bool = False) -> StepResult | None:
    """One try of :func:`run_step`; ``None`` where the agreement did not hold (nothing was updated)."""
    agreed = agree(entries, failure, ctx, memo, groups)
    named = [(e.record.name, e.group["nonfinite"]) for e in entries]
    wanted = agreed.codes == int(GradCode.FINITE)
    strict = [i for i, (_, mode) in enumerate(named) if mode != "skip"]
    if strict:  # skip_step / raise: a non-finite gradient there leaves the whole step out
        wanted &= ~(pick(agreed.codes, strict) == int(GradCode.NONFINITE)).any()
    if agreed.held is not None:
        wanted &= agreed.held
    missed = Missed()
    late = Deferred(ctx.world)
    with late:
        if agreed.blind:  # this rank's entries are not what was agreed: it updates nothing
            wanted = None
        whitened = _update(entries, agreed.key, ctx, memo, state, wanted, missed, late)
    n_grads = (agreed.codes == int(GradCode.NONFINITE)).sum(dtype=torch.int32)
    counts = torch.stack([n_grads, missed.count(n_grads.device)])
    if ctx.world == 1:
        if late.error is not None:
            raise late.error
        if is_fake(counts):  # a trace (FakeTensorMode): no values to report
            return StepResult(whitened, (), (), None)
        now = any(mode == "raise" for _, mode in named)  # that option's price: one read per step
        report = Report(counts, named, agreed.codes, missed, now)
        return StepResult(whitened, *report.resolve(), None) if now else StepResult(whitened, (), (), None, report)
    return _close(ctx, memo, late.error or failure, agreed, counts, named, missed, whitened, defer)


def _update(entries: list[Entry], key: tuple | None, ctx: StepContext, memo: EngineMemo, state: dict,
            wanted: Tensor | None, missed: Missed, late: Deferred) -> int:
    """The fallback rules, then SWAN's matrices whitened and applied where ``wanted`` (``None``: this
    rank updates nothing, yet issues every collective); returns the number of matrices this rank whitened.
    What fails here at W > 1 goes to ``late`` (the exchange's collectives all run regardless); matrices
    whose update was not finite are counted in ``missed``."""
    swan = sum(e.record.use_swan for e in entries)  # entries[:swan], SWAN's matrices (run_step's order)
    if wanted is not None:
        with late:
            run_fallbacks(state, groups_of(entries), entries, set(), wanted)
    if ctx.mode == "local":
        if wanted is None or late.error is not None:
            return 0
        idx = [i for i, e in enumerate(entries[:swan]) if e.piece.grad is not None]
        mine = [entries[i] for i in idx]
        return whiten_local(mine, pick(wanted, idx) if mine else wanted, missed)
    if wanted is not None:
        memo.swan = swan
    if not memo.swan:  # the agreed structure has no matrix: every rank returns here or none does
        return 0
    plan = memo.plans.get(key, entries[:swan], ctx.mode, ctx.bucket_mb, ctx.group, ctx.device, ctx.exchange_dtype)
    whitened, error = memo.plans.run(plan, entries[:swan], wanted, ctx.device, missed)
    late.error = late.error or error
    return whitened


def groups_of(entries: Sequence[Entry]) -> list[dict]:
    """The param groups of ``entries``, each once, in order of first appearance."""
    return list({id(e.group): e.group for e in entries}.values())


class Closing:
    """A step's closing status at W > 1 (``all_reduce(MAX)`` of ``[failed, agreement not held, non-finite
    gradients, non-finite updates]``, issued), to be read: at once (:func:`run_step`), or, for steps made
    during backward, all of a backward's together (:func:`settle`): one host read either way."""

    def __init__(self, ctx: StepContext, memo: EngineMemo, late: BaseException | None, agreed, status: Tensor,
                 named: list[tuple[str, str]], missed: Missed, whitened: int) -> None:
        self.ctx, self.memo, self.late, self.agreed, self.status = ctx, memo, late, agreed, status
        self.named, self.missed, self.whitened = named, missed, whitened

    def outcome(self, values: Sequence[int]) -> StepResult | None:
        """From the status's values (alike on every rank): raises a rank's error alike on every rank;
        ``None`` where the agreement did not hold (the step updated nothing); else the result, with every
        rank's non-finite names read only where there were some."""
        failed, changed, n_grads, n_updates = values
        if failed:
            raise_rank_failure(explain(self.late, self.ctx.bucket_mb), self.ctx.group)
        if changed:
            self.memo.agreement.agreed = None
            return None
        skipped = nonfinite_grads(self.named, self.agreed.codes.tolist()) if n_grads else []
        bad = gather_names(self.missed.names(), self.ctx.group) if n_updates else []
        if bad:
            nonfinite_update(self.named, bad)
        return StepResult(self.whitened, tuple(skipped), tuple(bad), None)


def _close(ctx: StepContext, memo: EngineMemo, late: BaseException | None, agreed, counts: Tensor,
           named: list[tuple[str, str]], missed: Missed, whitened: int, defer: bool) -> StepResult | None:
    """The step's last collective, and (unless ``defer``) its one host read: :meth:`Closing.outcome`."""
    held = torch.ones((), dtype=torch.bool, device=counts.device) if agreed.held is None else agreed.held
    flags = torch.full((1,), int(late is not None), dtype=torch.int32, device=counts.device)
    status = all_reduce_max(torch.cat([flags, (~held).to(torch.int32).reshape(1), counts]), ctx.group)
    if is_fake(status):  # a trace (torch's fake process group): the status issued, its values never known
        if late is not None:
            raise late
        return StepResult(whitened, (), (), None)
    closing = Closing(ctx, memo, late, agreed, status, named, missed, whitened)
    if defer:
        return StepResult(whitened, (), (), None, closing=closing)
    return closing.outcome(closing.status.tolist())


def settle(closings: Sequence[Closing]) -> list[StepResult]:
    """The outcomes of steps whose status was left to read (made during one backward): their statuses
    read together (one host read), then each step's outcome in order, alike on every rank (the first
    failure raised on every rank). A step whose agreement did not hold updated nothing: every rank warns
    naming it, and the next step over its entries agrees anew."""
    if not closings:
        return []
    values = torch.stack([c.status for c in closings]).tolist()
    out = []
    for c, v in zip(closings, values):
        r = c.outcome(v)
        if r is None:
            warnings.warn(f"swan_dist: the ranks' step agreement did not hold for {[n for n, _ in c.named][:4]} "
                          "(a layout or structure option changed during backward): not updated this step; "
                          "agreed again at the next", RuntimeWarning)
            r = StepResult(c.whitened, (), (), None)
        out.append(r)
    return out
