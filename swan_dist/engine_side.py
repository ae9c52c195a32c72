"""The optimizer as the engine sees it: this rank's entries for a step, one step of the engine over them,
the statuses and reports of steps settled later, and the plans the engine keeps per set of entries.

:class:`EngineSide` is a part of :class:`swan_dist.SWAN` (its base), kept apart so that each reads in one
sitting: ``optimizer.py`` holds the ``torch.optim.Optimizer`` surface (groups, state dicts, ``step``), this
module what a step hands to :func:`swan_dist.engine.run_step` and keeps from it. It reads the fields
``SWAN.__init__`` sets: ``param_groups``, ``state``, ``process_group``, ``mode``, ``bucket_mb``,
``exchange_dtype``, ``_origin``, ``_packed``, ``_forms``, ``_collector``, ``_book``, ``_memos``.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from .adapter import step_key
from .collect import Holdings
from .engine import Deferred, EngineMemo, StepContext, StepResult, run_step
from .records import Entry
from .rules import check_scalars

__all__ = ["EngineSide"]


@functools.cache
def _eagerly(fn):
    """``fn`` run eagerly where torch.compile traces its caller (made on first use: ``torch.compiler.disable``
    imports torch._dynamo, which ``import swan_dist`` does not)."""
    return torch.compiler.disable(fn)


class EngineSide:
    """Entries, engine steps and the engine's memos of a :class:`swan_dist.SWAN` (see the module)."""

    def _holdings(self) -> Holdings:
        return Holdings(self.param_groups, self.state, self._origin, self._packed, self._forms)

    def collect_entries(self, params: Iterable[Tensor] | None = None) -> tuple[list[Entry], BaseException | None]:
        """This rank's entries (one per logical parameter: group, piece, record) for a step over every
        parameter, or over those of ``params`` (tensors of this optimizer's groups), and what failed here
        while collecting them (the scalar options are checked first), which :meth:`step_entries` announces
        to every rank. At W = 1 a failure is raised at once."""
        if torch.compiler.is_compiling():  # host bookkeeping: run eagerly (traced, each per-parameter helper
            return _eagerly(EngineSide._collect)(self, params)  # was a frame compiled anew per parameter)
        return self._collect(params)

    def _collect(self, params: Iterable[Tensor] | None) -> tuple[list[Entry], BaseException | None]:
        world = self._world()
        deferred = Deferred(world)
        with deferred:
            for g in self.param_groups:  # a scheduler or the user may have set them since
                check_scalars(g)
            return self._collector.collect(self._holdings(), self.process_group,
                                           None if params is None else {id(p) for p in params}), None
        return [], deferred.error

    def step_entries(self, entries: list[Entry], failure: BaseException | None = None, memo: object = "all",
                     defer: bool = False) -> StepResult:
        """One step of the engine (:func:`swan_dist.engine.run_step`) over ``entries`` (the same set on
        every rank), with this optimizer's context and the engine's memo for ``memo`` (a key naming the
        set); raises on every rank alike where a rank failed. The entries' gradients are let go of."""
        kept = self._memo(memo)
        try:
            ctx = StepContext.of(entries, self.mode, self.bucket_mb, self.process_group, self.exchange_dtype)
            result = run_step(entries, ctx, kept, self.param_groups, self.state, failure, defer)
        finally:
            for e in entries:  # a non-contiguous matrix: its contiguous copy's update back into it
                if e.piece.staged is not None and e.record.use_swan:
                    e.piece.staged.copy_(e.piece.param.view(e.piece.staged.shape))
            self._collector.release(entries, everything=memo == "all" or (isinstance(memo, tuple) and memo[0] == "part"))
            kept.hashes.clear()
        self._book.add(result)
        if result.failure is not None:
            raise result.failure
        return result

    def settle_steps(self) -> None:
        """Read the statuses of the steps made with ``defer=True`` since the last call (updates made during
        backward at W > 1: one host read for all of them) and raise, warn and count as each step would
        have, alike on every rank (:func:`swan_dist.engine.settle`)."""
        self._book.settle()

    def poll_reports(self, wait: bool = False) -> None:
        """In one process, what steps skipped for non-finite values is counted on the device and copied to
        the host without waiting: each step looks at the copies that landed (on the CPU, its own at once),
        warns and adds to :attr:`nonfinite_skips`; ``wait=True`` waits for every copy (a host read)."""
        self._book.poll(wait)

    @property
    def nonfinite_skips(self):
        """Per parameter name, the steps that left it out for a non-finite gradient or update (complete once
        :meth:`poll_reports` with ``wait=True`` returned)."""
        return self._book.nonfinite_skips

    @property
    def whitened_matrices(self) -> int:
        """Matrices whitened so far (SWAN's work done, for accounting)."""
        return self._book.whitened

    def _part(self) -> object:
        """The memo of a step over the groups the optimizer holds now: ``"all"``; where a framework steps
        parts in turn, each part its own, named alike on every rank: ZeRO-3's sub-groups by their ds_ids
        (:func:`~swan_dist.adapter.step_key`), ZeRO-1/2's param groups (one ``step()`` each, the others
        taken out of ``param_groups``) by the groups themselves (dicts that live as long as the optimizer)."""
        part = step_key([p for g in self.param_groups for p in g["params"]])
        if part is not None:
            return ("part", part)
        groups = tuple(map(id, self.param_groups))
        first = self.__dict__.setdefault("_groups_stepped", groups)
        return "all" if groups == first else ("part", groups)

    def _memo(self, key: object) -> EngineMemo:
        if key not in self._memos:
            self._memos[key] = EngineMemo()
        return self._memos[key]

    def _world(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    @property
    def exchange(self):
        """The :class:`~swan_dist.exchange.Exchange` the last distributed step over every parameter ran
        (its ``plan``: owners, buckets, ranges); ``None`` before one, or without ``torch.distributed``.
        Plans are cached per layout and are never state."""
        return self.plans.last

    @property
    def plans(self):
        """The plans the engine built for steps over every parameter (:class:`swan_dist.whitening.Plans`:
        ``cache``, ``built``, ``last``)."""
        return self._memo("all").plans

    def plans_for(self, memo: object):
        """The plans the engine built for the steps over the set of entries named ``memo``."""
        return self._memo(memo).plans
