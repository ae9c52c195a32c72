"""Updates made during backward (``SWAN(model, step_in_backward=True)``): each matrix and each fallback
tensor is updated as soon as its full gradient is ready, and its gradient freed, so a step never holds
every gradient (the paper's per-layer update).

A *unit* is a parameter in one process and one FSDP module's parameters under FSDP2 / HSDP; a unit is
ready when all its parameters have their full gradient (under FSDP2 the reduced shard: torch runs
post-accumulate-grad hooks on the sharded parameters after the module's reduce-scatter, and HSDP's
all-reduce, in the same order on every rank). The batches' closing statuses are read together when
backward ends (one host read per backward; a fault in any batch raised from backward on every rank). Ready units are stepped together (one
:func:`swan_dist.engine.run_step`) once they hold ``_BATCH_BYTES`` of gradients on a rank, counted from
the parameters' global shapes and shardings so that every rank batches alike, and the rest when
backward ends: fewer meetings of the ranks, and same-shape matrices of neighbouring blocks whitened as
one stack, for at most that many bytes of gradients held. Every rank issues each batch's agreement and
exchange in the same order, inside backward.

Updates happen only in a backward between ``zero_grad()`` and ``step()`` (the loop users write stays
``opt.zero_grad(); loss.backward(); opt.step()``): ``zero_grad()`` arms, ``step()`` steps what backward
left (units whose parameters did not all receive a gradient; nothing, in the usual case) and disarms, so
an evaluation backward elsewhere updates nothing. Under FSDP2 gradient accumulation
(``set_requires_gradient_sync(False)`` for all but the last micro-batch) no hook fires until the last
micro-batch; in one process a second backward before ``step()`` raises.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .adapter import adapter_for

__all__ = ["InBackward", "check_in_backward"]

_BATCH_BYTES = 16 << 20  # per rank: gradients of ready units held before they are stepped together

_REFUSED = {  # adapter name -> why no saving or no safe point, and what to do
    "replicated": "under DDP (or any replicated layout) every rank keeps every gradient in DDP's buckets until "
                  "the step, so updating during backward saves no memory",
    "deepspeed": "DeepSpeed ZeRO owns the gradients' partitions and steps its optimizer itself",
    "fsdp1-flat": "FSDP1 reduces a whole FlatParameter's gradient and runs no per-parameter hook after it",
    "fsdp1-orig": "FSDP1 reduces a whole FlatParameter's gradient and runs no per-parameter hook after it",
    "megatron": "Megatron's distributed data parallel reduces gradients in buckets that its optimizer steps",
}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_in_backward(params: Sequence[Tensor], model: nn.Module | None) -> list[list[Tensor]]:
    """The units of ``params`` for ``step_in_backward=True``, or ``ValueError`` naming what cannot take it
    (decided from what every rank sees alike): at W = 1 one unit per parameter; distributed, the FSDP2
    modules of ``model`` (every parameter a DTensor of some FSDP module)."""
    for p in params:
        name = adapter_for(p).name
        if name in _REFUSED and (name != "replicated" or _distributed()):
            raise ValueError(f"swan_dist: step_in_backward=True is refused here: {_REFUSED[name]}; build SWAN "
                             "with step_in_backward=False (the default)")
    if not _distributed():
        return [[p] for p in params]
    if model is None:
        raise ValueError("swan_dist: step_in_backward=True under torch.distributed needs the model, to step each "
                         "FSDP module's parameters once their gradients are reduced: pass SWAN(model, ...)")
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, int] = {}
    units: list[nn.Module] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for k, m in enumerate(units):  # pre-order: a nested FSDP module's parameters go to it
        for p in m.parameters():
            owner[id(p)] = k
    out: list[list[Tensor]] = [[] for _ in units]
    for p in params:
        if id(p) not in owner:
            raise ValueError("swan_dist: step_in_backward=True under torch.distributed needs every parameter in an "
                             "FSDP2 module (fully_shard); a parameter of shape "
                             f"{list(p.shape)} is not: shard it, or build SWAN with step_in_backward=False")
        out[owner[id(p)]].append(p)
    return [u for u in out if u]


def _local_bytes(p: Tensor) -> int:
    """The bytes of ``p``'s gradient on the rank holding the most of it, from its global shape and its
    sharding alone (the same number on every rank)."""
    shards = 1
    for dim, placement in enumerate(getattr(p, "placements", ())):
        if placement.is_shard():
            shards *= p.device_mesh.size(dim)
    return -(-p.numel() // shards) * p.element_size()


def _remove(handles: list) -> None:
    for h in handles:
        h.remove()


class InBackward:
    """The hooks and the window of one optimizer (see the module docstring)."""

    def __init__(self, opt, units: list[list[Tensor]]) -> None:
        self.opt, self.units = opt, units
        self.unit_of = {id(p): k for k, unit in enumerate(units) for p in unit}
        self.expected = [sum(p.requires_grad for p in unit) for unit in units]
        self.fired: list[set[int]] = [set() for _ in units]
        self.done: set[int] = set()
        self.armed = False
        self.warned = False  # of a step() after a backward outside the window (once)
        self.unit_bytes = [sum(_local_bytes(p) for p in unit if p.requires_grad) for unit in units]
        self.queued: list[int] = []
        self.queued_bytes = 0
        self.callback = False  # the end-of-backward callback is queued
        # the hooks hold this object weakly: a tensor's hooks are not traversed by Python's garbage
        # collector, so a strong reference from them (to self, then the optimizer, then every parameter) would
        # keep an optimizer the user dropped, and its model's parameters, alive for good
        ref = weakref.ref(self)

        def hook(p: Tensor) -> None:
            me = ref()
            if me is not None:
                me._hook(p)

        self.handles = [p.register_post_accumulate_grad_hook(hook) for unit in units for p in unit]
        weakref.finalize(self, _remove, self.handles)

    def arm(self) -> None:
        self.armed = True
        self.done.clear()
        self.queued.clear()
        self.queued_bytes = 0
        self.callback = False
        for f in self.fired:
            f.clear()

    def _hook(self, p: Tensor) -> None:
        if not self.armed:
            return
        k = self.unit_of[id(p)]
        if k in self.done or id(p) in self.fired[k]:
            raise RuntimeError(
                "swan_dist: a second backward reached a parameter already updated since zero_grad() "
                "(SWAN(step_in_backward=True) updates each parameter in the backward after zero_grad() and frees "
                "its gradient, so gradients cannot accumulate over backwards in one process); call step() and "
                "zero_grad() around each backward, accumulate under FSDP2 with set_requires_gradient_sync(False), "
                "or build SWAN with step_in_backward=False")
        self.fired[k].add(id(p))
        if len(self.fired[k]) < self.expected[k]:
            return
        if not self.callback:  # when backward ends: what is queued is stepped, every batch's status read
            self.callback = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        self.queued.append(k)
        self.queued_bytes += self.unit_bytes[k]
        if self.queued_bytes >= _BATCH_BYTES:
            self._flush()

    def _end(self) -> None:
        self.callback = False
        try:
            self._flush()
        finally:
            self.opt.settle_steps()

    def _flush(self) -> None:
        units, self.queued, self.queued_bytes = self.queued, [], 0
        if units:
            self._step_units(units)

    @torch.no_grad()
    def _step_units(self, ks: list[int]) -> None:
        params = [p for k in ks for p in self.units[k] if id(p) in self.fired[k]]
        self.done.update(ks)
        try:
            entries, failure = self.opt.collect_entries(params)
            # the memo is keyed by the batch's first unit (a batch from it has the same units from one
            # backward to the next; where it does not, the engine re-agrees): one memo per unit at most
            self.opt.step_entries(entries, failure, memo=("unit", ks[0]), defer=True)
        finally:
            for p in params:
                g = p.grad
                if g is not None and g.device.type == "cuda":  # a view of FSDP's per-unit reduce-scatter
                    # output, allocated on its stream: freed here, before backward ends, it must not be
                    # reused there while this stream's kernels may still read it
                    (g.to_local() if hasattr(g, "to_local") else g).record_stream(torch.cuda.current_stream())
                p.grad = None

    def finish(self) -> list[Tensor] | None:
        """At ``step()``: step the units backward left part-way (in unit order: alike on every rank) and
        return the parameters no unit step took (``step()`` steps them as usual; ``None``: every parameter,
        outside an armed window); disarm."""
        try:
            if not self.armed:
                if not self.warned and any(p.grad is not None for unit in self.units for p in unit):
                    self.warned = True
                    warnings.warn(
                        "swan_dist: SWAN(step_in_backward=True) ran this step() the ordinary way: no zero_grad() "
                        "came before its backward, which therefore kept every gradient (the ordinary step's "
                        "memory peak). Call opt.zero_grad() before loss.backward() from the first step on",
                        RuntimeWarning, stacklevel=4)
                return None
            self._flush()
            for k, fired in enumerate(self.fired):
                if fired and k not in self.done:
                    self._step_units([k])
            self.opt.settle_steps()
            return [p for k, unit in enumerate(self.units) if k not in self.done for p in unit]
        finally:
            self.armed = False
