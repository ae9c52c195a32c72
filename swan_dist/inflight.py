"""Tensors handed to collectives, let go of on the main thread.

A process group's worker thread (gloo's ``runLoop``) drops its reference to a finished work's tensors a
moment after ``wait()`` returned. Where that is the tensor's last reference, freeing its Python object
takes the GIL on the worker thread. Should the interpreter be finalizing by then (a script's last step,
``destroy_process_group()`` and the end of the script, on a loaded machine), Python ends that thread
with ``pthread_exit`` inside a C++ destructor and the process aborts: ``terminate called without an
active exception`` (SIGABRT, the job reported as failed). The core of such an abort shows
``ProcessGroupGloo::runLoop`` destroying an ``AsyncAllreduceWork`` through
``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``.

So every collective swan_dist issues notes its tensors' use counts before it starts
(:func:`counts`) and hands them to :func:`settle` once it finished: a tensor the worker still
references is kept here until it lets go (checked at every later settle, and at interpreter exit,
before finalization, by :func:`drain`), so the last reference is always dropped on the main thread.
In the common case the worker has let go already and nothing is kept.
"""

from __future__ import annotations

import atexit
import time

from torch import Tensor

_PENDING: list[tuple[Tensor, int]] = []  # (tensor, its use count before the collective)


def counts(*tensors: Tensor) -> list[int]:
    """The tensors' use counts, before a collective takes its references."""
    return [t._use_count() for t in tensors]


def settle(tensors: tuple[Tensor, ...] | list[Tensor], before: list[int]) -> None:
    """After a collective on ``tensors`` finished (and its work handle was dropped): keep those some
    other thread still references (use count above ``before``) until it lets go."""
    _PENDING.extend((t, n) for t, n in zip(tensors, before) if t._use_count() > n)
    prune()


def prune() -> int:
    """Forget the kept tensors no other thread references any more; returns how many are still kept."""
    _PENDING[:] = [(t, n) for t, n in _PENDING if t._use_count() > n]
    return len(_PENDING)


def pending() -> int:
    return len(_PENDING)


@atexit.register
def drain(timeout: float = 10.0) -> None:
    """At interpreter exit (atexit runs before finalization, while threads may still take the GIL):
    wait, sleeping so a worker can run, until no other thread references a kept tensor."""
    deadline = time.monotonic() + timeout
    while prune() and time.monotonic() < deadline:
        time.sleep(0.001)
