"""Counting host reads: calls of torch.Tensor's value-reading methods (each a wait for the device on a
GPU), split by who made them: swan_dist's code (the library and its integrations) or anything else (torch,
a framework). A tensor marked ``_swan_host_copy`` is a host buffer filled by a copy the step does not wait
for (swan_dist.engine.Report): reading it waits for nothing and is not counted. For tests and benchmarks
(``with HostReads() as reads: opt.step()``); on a GPU, ``torch.cuda.set_sync_debug_mode`` also sees the
waits that no Python method makes."""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch

METHODS = ("item", "tolist", "__bool__", "nonzero", "cpu", "numpy", "__int__", "__float__", "__index__")
_OURS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d) + os.sep
              for d in ("swan_dist", "integrations"))  # the library and its integrations (installed beside it)


class HostReads:
    """``with HostReads() as reads:`` counts; ``reads.ours`` / ``reads.others`` are Counters of
    ``file:line method`` -> calls."""

    def __init__(self) -> None:
        self.ours: Counter = Counter()
        self.others: Counter = Counter()

    @property
    def n_ours(self) -> int:
        return sum(self.ours.values())

    @property
    def n_all(self) -> int:
        return self.n_ours + sum(self.others.values())

    def __enter__(self) -> HostReads:
        self._saved = {m: getattr(torch.Tensor, m) for m in METHODS}
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, self._wrap(m, orig))
        return self

    def _wrap(self, name, orig):
        reads = self

        def counted(t, *a, **k):
            if not getattr(t, "_swan_host_copy", False):
                f = sys._getframe(1)
                where = f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} {name}"
                (reads.ours if f.f_code.co_filename.startswith(_OURS) else reads.others)[where] += 1
            return orig(t, *a, **k)

        return counted

    def __exit__(self, *exc) -> None:
        for m, orig in self._saved.items():
            setattr(torch.Tensor, m, orig)

