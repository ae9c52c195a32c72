"""Updates made during backward (``SWAN(model, step_in_backward=True)``): each matrix and each fallback
tensor is updated as soon as its full gradient is ready, and its gradient freed, so a step never holds
every gradient (the paper's per-layer update).

A *unit* is what the engine steps at once (:func:`swan_dist.engine.run_step` over its entries): in one
process, the parameters whose gradients became ready since the last unit, up to ``_BATCH_BYTES`` of
gradients (same-shape matrices of a block are then whitened as one stack; the rest at the end of
backward); under FSDP2 / HSDP, one FSDP module's parameters, stepped when the last of them has its
reduced gradient (torch runs post-accumulate-grad hooks on the sharded parameters after the
unit's reduce-scatter, and HSDP's all-reduce, in the same order on every rank), so every rank issues
the unit's agreement and exchange in the same order, inside backward.

Updates happen only in a backward between ``zero_grad()`` and ``step()`` (the loop users write stays
``opt.zero_grad(); loss.backward(); opt.step()``): ``zero_grad()`` arms, ``step()`` steps what backward
left (units whose parameters did not all receive a gradient; nothing, in the usual case) and disarms, so
an evaluation backward elsewhere updates nothing. Under FSDP2 gradient accumulation
(``set_requires_gradient_sync(False)`` for all but the last micro-batch) no hook fires until the last
micro-batch; in one process a second backward before ``step()`` raises.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .adapter import adapter_for

__all__ = ["InBackward", "check_in_backward"]

_BATCH_BYTES = 16 << 20  # one process: gradients held before they are stepped together (a bound, per step)

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
        self.batch = not _distributed()  # one process: units (parameters) stepped in batches
        self.queued: list[int] = []
        self.queued_bytes = 0
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
        if not self.batch:
            self._step_units([k])
            return
        if not self.queued:  # the first of this backward: the rest are stepped when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        self.queued.append(k)
        self.queued_bytes += p.grad.numel() * p.grad.element_size()
        if self.queued_bytes >= _BATCH_BYTES:
            self._flush()

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
            self.opt.step_entries(entries, failure, memo="backward" if self.batch else ("unit", ks[0]))
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
                return None
            self._flush()
            for k, fired in enumerate(self.fired):
                if fired and k not in self.done:
                    self._step_units([k])
            return [p for k, unit in enumerate(self.units) if k not in self.done for p in unit]
        finally:
            self.armed = False
