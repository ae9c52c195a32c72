"""Every collective of a step, in one place, with the bookkeeping each needs once: the agreement's
``all_reduce``/``all_gather``, the object gathers that name a mismatch or build a plan, the exchange's
``all_to_all_single`` and the step's closing status. Also which device they run on (:func:`comm_device`).

Tensors handed to a collective are let go of on the main thread. A process group's worker thread
(gloo's ``runLoop``) drops its reference to a finished work's tensors a moment after ``wait()``
returned. Where that is the tensor's last reference, freeing its Python object takes the GIL on the
worker thread. Should the interpreter be finalizing by then (a script's last step,
``destroy_process_group()`` and the end of the script, on a loaded machine), Python ends that thread
with ``pthread_exit`` inside a C++ destructor and the process aborts: ``terminate called without an
active exception`` (SIGABRT). The core of such an abort shows ``ProcessGroupGloo::runLoop`` destroying
an ``AsyncAllreduceWork`` through ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``.

So every collective here notes its tensors' use counts before it starts and, once it finished, keeps
a tensor the worker still references until it lets go (checked at every later collective, and at
interpreter exit, before finalization, by :func:`drain`), so the last reference is always dropped on
the main thread. In the common case the worker has let go already and nothing is kept.
"""

from __future__ import annotations

import atexit
import functools
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor


def is_fake(t: Tensor) -> bool:
    """Whether ``t`` is a fake tensor (``FakeTensorMode``: shapes and dtypes, no data), as when a step's
    memory is estimated for shapes that do not fit. Where the real step reads a value on the host (is
    every gradient finite?), a fake one has none to read and takes the common branch: every gradient and
    every update finite, the estimate's assumption; the branch's allocations are the real ones."""
    return isinstance(t, FakeTensor)


__all__ = ["is_fake", "all_reduce_max", "host_tensor", "pick", "assemble", "all_gather", "gather_objects", "start_all_to_all", "Transfer", "counts", "settle", "pending", "drain",
           "served_devices", "comm_device"]

_PENDING: list[tuple[Tensor, int]] = []  # (tensor, its use count before the collective)


def counts(*tensors: Tensor) -> list[int]:
    """The tensors' use counts, before a collective takes its references."""
    return [t._use_count() for t in tensors]


def settle(tensors: Sequence[Tensor], before: list[int]) -> None:
    """After a collective on ``tensors`` finished (its work handle dropped): keep those some other thread
    still references (use count above ``before``) until it lets go."""
    _PENDING.extend((t, n) for t, n in zip(tensors, before) if t._use_count() > n)
    prune()


def prune() -> int:
    """Forget the kept tensors no other thread references any more; returns how many are still kept."""
    _PENDING[:] = [(t, n) for t, n in _PENDING if t._use_count() > n]
    return len(_PENDING)


def pending() -> int:
    """How many tensors are kept for a worker thread that still references them."""
    return len(_PENDING)


@atexit.register
def drain(timeout: float = 10.0) -> None:
    """At interpreter exit (atexit runs before finalization, while threads may still take the GIL):
    wait, sleeping so a worker can run, until no other thread references a kept tensor."""
    deadline = time.monotonic() + timeout
    while prune() and time.monotonic() < deadline:
        time.sleep(0.001)


class Transfer:
    """A started collective: :meth:`wait` waits, drops the work handle and lets go of the tensors."""

    def __init__(self, work, tensors: Sequence[Tensor], before: list[int]) -> None:
        self.work, self.tensors, self.before = work, tuple(tensors), before

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        settle(self.tensors, self.before)
        self.tensors = ()


def _run(fn, tensors: Sequence[Tensor], *args, **kwargs) -> None:
    before = counts(*tensors)
    fn(*args, **kwargs)
    settle(tensors, before)


def all_reduce_max(tensor: Tensor, group) -> Tensor:
    """``all_reduce(MAX)`` of ``tensor`` in place (no host read: the caller reads it, or decides with it
    on the device)."""
    _run(dist.all_reduce, [tensor], tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def host_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str | None) -> Tensor:
    """A tensor of host ``values`` on ``device`` without waiting for the device: on an accelerator a
    pinned copy sent without blocking (a plain copy from pageable memory waits for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device or "cpu")
    if device.type == "cpu":
        return t
    if device.type == "meta":  # a step simulated from shapes alone (benchmarks/scale.py): nothing to pin
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pick(t: Tensor, idx: Sequence[int]) -> Tensor:
    """``t[idx]`` for host indices, sending nothing from the host in a steady step: a slice where ``idx`` is
    a run of consecutive indices, else a gather by an index tensor made once per index list and device and
    kept (:func:`_index`; a CUDA graph can hold the gather, not a copy of a host list made every step)."""
    if not idx:
        return t[:0]
    a = idx[0]
    if idx[-1] - a == len(idx) - 1 and all(i == a + k for k, i in enumerate(idx)):
        return t[a:a + len(idx)]
    if type(t) is not Tensor:  # a trace (FakeTensorMode) or a subclass: views, nothing kept
        return torch.stack([t[i] for i in idx])
    return t[_index(tuple(idx), t.device)]


def assemble(n: int, parts: Sequence[tuple[Sequence[int], Tensor]], fill: Tensor) -> Tensor:
    """A tensor of ``n`` rows: row ``i`` of ``parts``' ``values`` where ``i`` is in its ``idx`` (each a
    ``(idx, values)`` pair), ``fill`` (0-d, same dtype and device) elsewhere; as :func:`pick`, with index
    tensors made once."""
    if type(fill) is not Tensor:
        rows = [fill] * n
        for idx, values in parts:
            for i, v in zip(idx, values.unbind(0)):
                rows[i] = v
        return torch.stack(rows)
    out = fill.expand(n).clone()
    for idx, values in parts:
        out[_index(tuple(idx), out.device)] = values
    return out


@functools.lru_cache(maxsize=4096)
def _index(idx: tuple[int, ...], device: torch.device) -> Tensor:
    """An int64 index tensor of ``idx`` on ``device``, made once (a pinned copy sent without blocking) and
    kept for every later step with the same indices (a plan's, fixed between plan changes)."""
    return host_tensor(idx, torch.int64, device)


def all_gather(tensor: Tensor, group) -> Tensor:
    """Every rank's ``tensor`` (same shape everywhere), stacked in rank order, on the CPU."""
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    _run(dist.all_gather, [tensor, *out], out, tensor, group=group)
    return torch.stack(out).cpu()


def gather_objects(obj: Any, group) -> list:
    """Every rank's ``obj``, in rank order (pickled: for what is rare, a mismatch named or a plan built)."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def start_all_to_all(out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int], group) -> Transfer:
    """Start ``all_to_all_single`` with uneven splits (contiguous buffers, as gloo requires)."""
    before = counts(inp, out)
    work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    return Transfer(work, (inp, out), before)


# Device types each backend runs all_to_all / all_gather on. gloo's all_to_all is CPU-only, so a
# gloo group moves CUDA pieces to the CPU; "undefined" is ``init_process_group()`` without a backend,
# whose per-device backends torch creates lazily from its default map (cpu: gloo, cuda: nccl, ...).
_BACKEND_DEVICES = {"gloo": ("cpu",), "nccl": ("cuda",), "mpi": ("cpu",), "ucc": ("cpu", "cuda"),
                    "xccl": ("xpu",), "hccl": ("npu",),
                    "fake": ("cuda", "cpu")}  # torch's fake process group (one rank simulated, no communication)


def served_devices(backend: str) -> tuple[str, ...]:
    """The device types a process group's backend string serves, in preference order: ``"nccl"``,
    ``"gloo"``, combined ``"cuda:nccl,cpu:gloo"``, or ``"undefined"``."""
    backend = str(backend).lower()
    if backend == "undefined":
        return tuple(dict.fromkeys(dist.Backend.default_device_backend_map))
    out: list[str] = []
    for part in backend.split(","):
        dev, _, name = part.strip().rpartition(":")
        out += [dev] if dev else list(_BACKEND_DEVICES.get(name, ()))
    if not out:
        raise ValueError(f"swan_dist: process-group backend {backend!r} is unknown; pass SWAN(process_group=...) with a "
                         f"group of a known backend ({', '.join(_BACKEND_DEVICES)})")
    return tuple(dict.fromkeys(out))


def comm_device(backend: str, tensor_devices: Sequence[torch.device], current: dict[str, int] | None = None) -> torch.device:
    """Where the exchange's buffers (and so the owners' math and the step's collectives) live, decided
    from what every rank sees alike, so that all ranks use the same backend for the same collective: the
    first accelerator type the group serves that is available here (``current``: the current index per
    available accelerator type), at the index of this rank's pieces on it, else the current one
    (CPU-offloaded pieces move there and back); otherwise the CPU where the group serves it."""
    served = served_devices(backend)
    current = current or {}
    for t in served:
        if t != "cpu" and t in current:
            index = next((d.index for d in tensor_devices if d.type == t and d.index is not None), current[t])
            return torch.device(t, index)
    if "cpu" in served:
        return torch.device("cpu")
    return torch.device(served[0], 0)
