"""What an optimizer's steps did, kept from step to step without reading the device: :class:`StepBook`.

Each engine step (:func:`swan_dist.engine.run_step`) returns a :class:`~swan_dist.engine.StepResult`;
the book adds it up: the matrices whitened, the parameters skipped for non-finite values (``nonfinite_skips``),
and the record of the last ``step()`` (:class:`~swan_dist.summary.StepRecord`). What the device has not
told yet stays on its way: a one-process step's :class:`~swan_dist.engine.Report` (counts copied without
waiting, looked at when they landed: :meth:`StepBook.poll`) and, for updates made during backward at
W > 1, the steps' closing statuses (read together: :meth:`StepBook.settle`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from torch import Tensor

from .engine import StepResult, settle
from .summary import StepLog, StepRecord

__all__ = ["StepBook", "group_rates"]


def _held(value: Any) -> Any:
    """A param group's scalar as a step used it: a tensor (a scheduler may change it in place) copied on its
    device, never read on the host."""
    return value.detach().clone() if isinstance(value, Tensor) else value


def group_rates(groups: Sequence[dict], origin: Sequence[Sequence], packed: dict) -> list[tuple]:
    """Per param group, what :meth:`StepBook.end_step` keeps of a step: (lr, alpha, SWAN matrices, use_swan).
    The matrices are counted as the group was built (``origin``: its (name, parameter) pairs): its tensors
    for a SWAN group, the SWAN members of its packed tensors (an FSDP1 FlatParameter) for a fallback group."""
    rates = []
    for i, g in enumerate(groups):
        given = origin[i] if i < len(origin) else [(None, p) for p in g["params"]]
        if g["use_swan"]:
            matrices = len(given)
        else:
            matrices = sum(sum(packed.get(p, ())) for _, p in given if p is not None) if packed else 0
        rates.append((_held(g["lr"]), _held(g["alpha"]), matrices, bool(g["use_swan"])))
    return rates


class StepBook:
    """The counts of every step so far, the step under way, and the last step's record (resolved when read)."""

    _KEPT = ("nonfinite_skips", "whitened", "steps")  # pickled; what is on its way is not

    def __init__(self) -> None:
        self.nonfinite_skips: Counter[str] = Counter()  # complete once poll(wait=True) returned
        self.whitened = 0  # matrices whitened so far
        self.steps = 0  # step() calls
        self._transient()

    def _transient(self) -> None:
        self.log = StepLog()  # the step under way (updates made during backward included)
        self.last: tuple[int, StepLog, list] | StepRecord | None = None  # the last step, resolved when read
        self.reports: list = []  # one-process steps whose counts are on their way to the host
        self.closings: list = []  # steps made during backward at W > 1 whose status is still to read

    def __getstate__(self) -> dict:
        return {k: self.__dict__[k] for k in self._KEPT}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._transient()

    def add(self, result: StepResult) -> None:
        """One engine step's result (its failure already raised by the caller)."""
        self.whitened += result.whitened
        self.nonfinite_skips.update(result.skipped + result.nonfinite)
        self.log.add(result.whitened, result.skipped, result.nonfinite, result.report)
        if result.report is not None and not result.report.lazy:  # (a captured step's: read when asked)
            self.reports.append(result.report)
        if result.closing is not None:
            self.closings.append(result.closing)
        self.poll()

    def settle(self) -> None:
        """Read the statuses of the steps left to read (one host read for all) and raise, warn and count as
        each step would have, alike on every rank (:func:`swan_dist.engine.settle`)."""
        closings, self.closings = self.closings, []
        for r in settle(closings):
            self.nonfinite_skips.update(r.skipped + r.nonfinite)
            self.log.add(0, r.skipped, r.nonfinite)  # its matrices were counted when it ran

    def poll(self, wait: bool = False) -> None:
        """Look at the one-process reports whose copies landed (on the CPU, at once), oldest first: warn and
        count their skips; ``wait=True`` waits for every copy (a host read)."""
        while self.reports and (wait or self.reports[0].ready()):
            report = self.reports.pop(0)
            skipped, nonfinite = report.outcome = report.resolve()  # kept for its step's record
            self.nonfinite_skips.update(skipped + nonfinite)

    def end_step(self, rates: Sequence[tuple[object, object, int, bool]]) -> None:
        """Close the step under way as the last step; ``rates``: per param group (lr, alpha, SWAN matrices,
        use_swan) as the step used them (host values, or tensors copied on their device)."""
        self.steps += 1
        self.last, self.log = (self.steps, self.log, list(rates)), StepLog()

    def last_record(self) -> StepRecord | None:
        """The last step's :class:`~swan_dist.summary.StepRecord`, waiting for its reports where they have
        not landed (a host read, made when asked)."""
        last = self.last
        if last is None or isinstance(last, StepRecord):
            return last
        step, log, rates = last
        if log.pending():
            self.poll(wait=True)
            for r in log.reports:  # a step captured in a CUDA graph: its counts as the last replay left them
                if not hasattr(r, "outcome"):
                    r.outcome = r.resolve()
        self.last = log.record(step, rates)
        return self.last
