"""Running a plan on this rank (:class:`Exchange`): gradients to owners, the per-matrix computation
(passed in: the exchange knows nothing of SWAN), updates and their finite flags back."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..collectives import Transfer, pick, start_all_to_all
from ..layout import matrices_in, update_canonical
from ..plan import Plan
from .schedule import MAX_PHASES, PHASE_BYTES, Splits, Step, build_steps

__all__ = ["Exchange", "Compute", "OnUpdate", "coarser"]

def coarser(dtype: torch.dtype | None, than: torch.dtype) -> bool:
    """Whether ``dtype`` (``None``: no dtype) keeps fewer significant bits than ``than``: a value of
    ``than`` sent in it is rounded."""
    return dtype is not None and dtype != than and torch.finfo(dtype).eps > torch.finfo(than).eps


Compute = Callable[[Tensor, Hashable], tuple[Tensor, Tensor]]  # (stack, cfg) -> (updates, finite per matrix)
OnUpdate = Callable[[int, Tensor, Tensor], None]  # (matrix, this rank's flat update piece, finite: 0-d bool)


class Exchange:
    """Runs a :class:`~swan_dist.plan.Plan` on this rank.

    ``grads[m]`` is this rank's flat gradient piece of matrix m (``hi - lo`` elements in the matrix's
    canonical order, on any device; ``None`` counts as zeros), ``skip`` the matrices nobody computes this
    step (decided identically on every rank). ``dtypes[m]`` is the dtype matrix m's gradient and update
    pieces travel in (a phase whose matrices differ in it sends fp32); where it is coarser than a
    gradient, the owner rounds what it holds to it too, and where it is coarser than the update, the
    owner hands itself its pieces rounded as its peers receive them: every holder of an element applies
    the same value and the update does not depend on which rank owns the matrix. ``compute(stack, cfg)`` maps a stack of same-shape full
    gradients to their updates and which of them are finite (it must not write into ``stack``, which may
    be a view of a local gradient). ``on_update(m, piece, finite)`` receives this rank's flat piece of each
    computed update, on ``device`` (the communication device), and whether the owner's update was finite;
    nothing writes into the pieces until :meth:`run` returns. Every rank issues the same collectives in the
    same order whatever its data.

    Phase p+1's gradients travel while phase p is computed and phase p's updates return while phase p+1
    is (:mod:`.schedule`), so only the first phase's gradients and the last phase's updates are waited
    for. Each element of a full gradient is copied once, into the stack it is whitened in: what this rank
    holds straight from its gradient (while the phase's gradients travel), the rest from the receive
    buffer; a matrix alone in its stack that this rank holds whole, contiguous and in fp32 (DDP) is
    whitened from its gradient itself. Each update piece a peer needs is written once, straight into the
    send buffer. A collective that moves nothing on any rank is not issued.
    """

    def __init__(self, plan: Plan, rank: int, group: dist.ProcessGroup | None, device: torch.device,
                 dtypes: Sequence[torch.dtype], compute: Compute, phase_bytes: int | None = PHASE_BYTES,
                 max_phases: int = MAX_PHASES, stack_bytes: int | None = None) -> None:
        self.plan, self.rank, self.group, self.device = plan, rank, group, device
        self.dtypes, self.compute = list(dtypes), compute
        self.bytes_sent = 0  # by this rank, both directions, since construction
        self.failure: BaseException | None = None  # what failed here in the last run (see run)
        self._mine = list(plan.ranges[rank])  # this rank's (lo, hi) per matrix
        self.stack_bytes = stack_bytes
        self.steps = build_steps(plan, rank, self.dtypes, stack_bytes, phase_bytes, max_phases)

    def transient_bound(self, held_bytes: int = 0) -> dict[str, int]:
        """The bytes a step of this plan adds on this rank at most (docs/engine.md, "Memory a step adds"),
        from its schedule, with its parts at the phase where the sum is largest: phase k's stacks of full
        fp32 matrices (``matrices``); the gradient buffers (sent and received) of phases k and k+1, whose
        transfer is in flight while k is computed (``grad_buffers``); the update buffers of phases k-1 and k
        (``update_buffers``); one stack's whitening workspace, 3x the stack plus two fp32 Grams per matrix
        (``workspace``); and ``held_bytes`` of update pieces held before they are applied, with the stack
        update they are views of (``held``)."""
        plan, steps = self.plan, self.steps

        def stack(ms: list[int]) -> int:
            return 4 * len(ms) * plan.specs[ms[0]].numel

        def gram(ms: list[int]) -> int:
            return 4 * len(ms) * min(plan.specs[ms[0]].shape) ** 2

        def moved(k: int, grads: bool) -> int:
            if not 0 <= k < len(steps):
                return 0
            st = steps[k]
            splits = st.grads if grads else st.updates
            return st.dtype.itemsize * (sum(splits.send) + sum(splits.recv))

        best = {"total": 0}
        for k, st in enumerate(steps):
            largest = max((stack(ms) for ms in st.stacks), default=0)
            parts = {"matrices": sum(stack(ms) for ms in st.stacks),
                     "grad_buffers": moved(k, True) + moved(k + 1, True),
                     "update_buffers": moved(k - 1, False) + moved(k, False),
                     "workspace": max((3 * stack(ms) + 2 * gram(ms) for ms in st.stacks), default=0),
                     "held": held_bytes + largest if st.stacks else 0}
            parts["total"] = sum(parts.values())
            if parts["total"] > best["total"]:
                best = parts
        return best

    def _start(self, inp: Tensor | list[Tensor], splits: Splits, dtype: torch.dtype,
               moves: bool) -> tuple[Transfer | None, Tensor]:
        """Start the all_to_all of ``inp`` (pieces packed by destination into one buffer, one copy, or a
        packed buffer); returns ``(transfer, received buffer)``, no transfer where no rank sends anything."""
        if not moves:
            return None, torch.empty(0, dtype=dtype, device=self.device)
        if isinstance(inp, Tensor):
            pass
        elif not inp:
            inp = torch.empty(0, dtype=dtype, device=self.device)
        elif len(inp) == 1 and inp[0].dtype == dtype and inp[0].device == self.device:
            inp = inp[0].contiguous()  # nothing writes into gradients during the step
        else:
            inp = torch.cat([p.to(self.device, dtype) for p in inp])  # .to: no copy where it is already so
        out = torch.empty(sum(splits.recv), dtype=dtype, device=self.device)
        self.bytes_sent += inp.numel() * inp.element_size()
        return start_all_to_all(out, inp, splits.recv, splits.send, self.group), out

    def run(self, grads: Sequence[Tensor | None], skip: set[int], on_update: OnUpdate) -> int:
        """One step; returns the number of matrices this rank whitened.

        An exception raised here while assembling, computing or handing back updates (an owner out of
        memory, a failing ``on_update``) is kept in :attr:`failure`, not raised: this rank then computes
        and hands back nothing more, fills what it owed its peers with NaN (flags included: they skip
        those updates) and still issues every collective of the step, so that no peer waits for it; the
        caller announces the failure to every rank."""
        my = self._mine
        self.failure = None

        def grad_piece(m: int, lo: int, hi: int) -> Tensor:
            g = grads[m]
            if g is None or m in skip:
                return torch.zeros(hi - lo, dtype=self.dtypes[m], device=self.device)
            return g[lo - my[m][0]: hi - my[m][0]]

        def start_forward(st: Step):
            return self._start([grad_piece(*seg) for seg in st.grads_out], st.grads, st.dtype, st.moves.grads)

        whitened = 0
        incoming = start_forward(self.steps[0]) if self.steps else None
        returning = None  # the previous phase's updates, on their way
        for k, st in enumerate(self.steps):
            transfer, recv = incoming
            incoming = start_forward(self.steps[k + 1]) if k + 1 < len(self.steps) else None
            send, done = self._phase(st, transfer, recv, grads, skip, on_update)
            whitened += done
            started = self._start(send, st.updates, st.dtype, st.moves.updates)
            if returning is not None:
                self._receive(*returning, skip, on_update)
            returning = (*started, st)
        if returning is not None:
            self._receive(*returning, skip, on_update)
        return whitened

    def _phase(self, st: Step, transfer: Transfer | None, recv: Tensor, grads: Sequence[Tensor | None],
               skip: set[int], on_update: OnUpdate) -> tuple[Tensor, int]:
        """One phase's computation on this rank: its stacks assembled (what it holds while the gradients
        travel, then the received rest), computed, its own pieces handed to ``on_update`` and its peers'
        written into the returned send buffer with their flags; and the number of matrices whitened."""
        my, whitened, stacks = self._mine, 0, []
        try:
            if self.failure is None:
                stacks = [(ms, self._own_part(st, ms, grads)) for ms in
                          ([m for m in ms if m not in skip] for ms in st.stacks) if ms]
        except Exception as e:  # noqa: BLE001 - kept for the caller; the collectives go on
            self.failure = e
        if transfer is not None:
            transfer.wait()
        send = torch.empty(sum(st.updates.send), dtype=st.dtype, device=self.device)
        try:
            for ms, stack in stacks if self.failure is None else ():
                for row, m in zip(stack, ms):  # the received rest
                    for lo, hi, off, _ in st.grads_in.get(m, ()):
                        row[lo:hi].copy_(recv[off: off + hi - lo])
                spec = self.plan.specs[ms[0]]
                whitened += len(ms) * matrices_in(spec.shape, spec.split)
                upd, ok = update_canonical(stack, [self.plan.specs[m].layout for m in ms], spec.shape, spec.split,
                                           lambda x: self.compute(x, spec.cfg))
                rounded = st.moves.updates and coarser(st.dtype, upd.dtype)  # as its peers receive it
                for m, u, finite in zip(ms, upd, ok.unbind(0)):
                    lo, hi = my[m]
                    if hi > lo:
                        on_update(m, u[lo:hi].to(st.dtype) if rounded else u[lo:hi], finite)
                    for lo, hi, off, flag in st.updates_out.get(m, ()):
                        send[off: off + hi - lo].copy_(u[lo:hi])
                        send[flag: flag + 1].copy_(finite.reshape(1))  # on the device: no host read
        except Exception as e:  # noqa: BLE001
            self.failure = e
        if self.failure is not None:  # owed updates: zeros flagged not finite (a receiver skips them)
            send.zero_()
        for m in skip:  # skipped matrices keep their (zero-filled) place
            for lo, hi, off, flag in st.updates_out.get(m, ()):
                send[off: off + hi - lo].zero_()
                send[flag] = 0.0
        return send, whitened

    def _own_part(self, st: Step, ms: list[int], grads: Sequence[Tensor | None]) -> Tensor:
        """The stack ``(len(ms), numel)`` of the full fp32 gradients of ``ms`` in canonical order, with
        what this rank holds written from its gradients (the rest comes from the received buffer); a
        matrix alone that this rank holds whole, contiguous and in fp32: a view of its gradient."""
        numel = self.plan.specs[ms[0]].numel
        my = self._mine
        sent = st.dtype if st.moves.grads else None  # peers' pieces arrive in it: this rank's rounded alike
        if len(ms) == 1:
            g = grads[ms[0]]
            if (g is not None and st.own[ms[0]] == [(0, numel)] and g.dtype == torch.float32
                    and not coarser(sent, g.dtype) and g.device == self.device and g.is_contiguous()):
                return g.view(1, numel)
        stack = torch.empty(len(ms), numel, dtype=torch.float32, device=self.device)
        for row, m in zip(stack, ms):
            g, base = grads[m], my[m][0]
            for lo, hi in st.own[m]:
                if g is None:
                    row[lo:hi].zero_()
                elif coarser(sent, g.dtype):
                    row[lo:hi].copy_(g[lo - base: hi - base].to(sent))
                else:
                    row[lo:hi].copy_(g[lo - base: hi - base])
        return stack

    def _receive(self, transfer: Transfer | None, recv: Tensor, st: Step, skip: set[int],
                 on_update: OnUpdate) -> None:
        """This rank's pieces of a phase's updates from their owners, each with its owner's flag."""
        if transfer is not None:
            transfer.wait()
        if self.failure is not None or not st.updates_in:  # this rank hands back nothing more
            return
        try:
            slots = [(m, s) for m, ss in st.updates_in.items() if m not in skip for s in ss]
            if not slots:
                return
            flags = (pick(recv, [s.flag for _, s in slots]) == 1.0).unbind(0)
            for (m, (lo, hi, off, _)), flag in zip(slots, flags):
                on_update(m, recv[off: off + hi - lo], flag)
        except Exception as e:  # noqa: BLE001 - kept for the caller
            self.failure = e
