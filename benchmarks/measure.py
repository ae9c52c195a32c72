"""What every benchmark measures with: timing by rounds, peak memory (resident ``VmHWM``; live tensors by
MemTracker, also traced on fake tensors), spawned ranks, and the report: a
section of docs/benchmarks.md with its provenance stamp and its tables as JSON in docs/results/."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

_DOCS = Path(__file__).resolve().parent.parent / "docs"
DOC = _DOCS / "benchmarks.md"  # the page write_section writes (convergence.md for the convergence scripts)
HEADER = (
    "# Benchmarks\n\n"
    "Every figure here is written by a script under `benchmarks/`, measured side by side in one run; "
    "each section says when and on what device. Re-run the script to refresh its section.\n"
)


def _commit() -> str:
    """The checkout's commit, with ``+changes`` where the working tree differs from it (other than in
    what benchmarks write, docs/benchmarks.md and docs/results/: an earlier benchmark of the same session)."""
    root = DOC.parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                f":!{DOC.relative_to(root)}", f":!{(DOC.parent / 'results').relative_to(root)}"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" +changes" if dirty else "")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _gpu() -> str | None:
    """The GPU the measuring process saw (CUDA device 0), or None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def provenance() -> dict[str, str | None]:
    script = Path(sys.argv[0]).name
    return {"date": datetime.date.today().isoformat(), "script": f"benchmarks/{script}",
            "command": " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, sys.argv[1:])]),
            "commit": _commit(), "cpu": _cpu(), "gpu": _gpu()}


def stamp(prov: dict[str, str | None] | None = None) -> str:
    """When, by which script and command, at which commit, on which CPU (and GPU) the section was measured."""
    p = prov or provenance()
    gpu = f", GPU {p['gpu']}" if p["gpu"] else ", no GPU"
    return (f"_Measured {p['date']} by `{p['script']}` (`{p['command']}`), commit {p['commit']}, "
            f"host CPU {p['cpu']}{gpu}._")


def tables(body: str) -> list[dict[str, list]]:
    """Every Markdown table in ``body``: its header cells and rows of cells, as written."""
    out, lines = [], body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1].replace("|", "").strip()) <= set("-: "):
            cells = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
            header, rows, i = cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            out.append({"header": header, "rows": rows})
        else:
            i += 1
    return out


def write_section(key: str, title: str, body: str) -> None:
    """Section ``key`` of ``DOC`` replaced by ``title``, the stamp and ``body`` (text after its end marker kept);
    its JSON record beside. From a checkout with uncommitted changes it is left in /tmp/<key>.md instead
    (``SWAN_BENCH_ALLOW_CHANGES=1``: written, stamped ``+changes``): measure from a clean ``git worktree``."""
    prov = provenance()
    if (prov["commit"].endswith("+changes") and DOC.parent == _DOCS
            and os.environ.get("SWAN_BENCH_ALLOW_CHANGES") != "1"):
        side = Path("/tmp") / f"{key}.md"
        side.write_text(f"## {title}\n\n{stamp(prov)}\n\n{body}\n")
        raise SystemExit(f"{DOC.name}: section {key!r} not written: the checkout has uncommitted changes (commit "
                         f"{prov['commit']}); it is in {side}. Commit, then measure (SWAN_BENCH_ALLOW_CHANGES=1 "
                         "writes it stamped +changes)")
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"<!-- begin:{key} -->\n## {title}\n\n{stamp(prov)}\n\n{body}\n<!-- end:{key} -->"
    pattern = re.compile(rf"<!-- begin:{re.escape(key)} -->.*?<!-- end:{re.escape(key)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    results = DOC.parent / "results"
    results.mkdir(exist_ok=True)
    record = {"section": key, "title": title, **prov, "tables": tables(body), "markdown": body}
    (results / f"{key}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def publish(key: str, title: str, text: str, write: bool = True) -> None:
    """``text`` printed and, with ``write``, made section ``key`` of the docs page (:func:`write_section`)."""
    print(text, flush=True)
    if write:
        write_section(key, title, text)


def mib(b: float | None) -> str:
    """Bytes as whole MiB (2^20) with thousands separators; ``-`` for none."""
    return "-" if b is None else f"{b / 2**20:,.0f}"


def row(*cells) -> str:
    """A Markdown table row."""
    return "| " + " | ".join(map(str, cells)) + " |"


_STAMP = re.compile(r"_Measured (?P<date>\S+) by `(?P<script>[^`]+)` "
                    r"\((?:`(?P<command>[^`]*)`|command not recorded)\), "
                    r"commit (?P<commit>[^,]+), (?:host CPU (?P<cpu>[^,]+), )?(?P<device>[^.]*)\.?_")


def parser(doc: str, **options) -> argparse.ArgumentParser:
    """A script's command line: ``doc`` (its docstring) as the description, one option per keyword typed as its
    default (int, float or str; ``query_groups=4`` is ``--query-groups 4``) and ``--no-write``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in options.items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/ as it is")
    return ap


# ------------------------------------------------------------------------------------------ processes
def spawn(fn: Callable, world: int, *args) -> list:
    """``fn(rank, world, *args)`` in ``world`` spawned processes (one thread each, torchrun's environment set:
    ``MASTER_ADDR``/``PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; ``fn`` starts its process group); the
    JSON results, in rank order."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_spawned, args=(world, port, out, fn, args), nprocs=world, start_method="spawn")
        return [json.loads((Path(out) / f"{r}.json").read_text()) for r in range(world)]


def _spawned(rank: int, world: int, port: int, out: str, fn: Callable, args: tuple) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    (Path(out) / f"{rank}.json").write_text(json.dumps(fn(rank, world, *args)))


# ------------------------------------------------------------------------------------------ time
def median_time(step: Callable[[], object], steps: int, warmup: int = 0, sync: Callable[[], object] = lambda: None,
                before: Callable[[int], object] = lambda k: None) -> tuple[float, list[float]]:
    """``step()`` timed ``steps`` times after ``warmup`` untimed calls: (median seconds, every time).
    ``sync`` waits for the device (and peers) before each clock read; ``before(k)`` runs untimed before
    call k (a scheduler's step, new gradients)."""
    times = []
    for k in range(warmup + steps):
        before(k)
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def turns(calls: dict[str, Callable[[], object]], steps: int, warmup: int = 0,
          sync: Callable[[], object] = lambda: None, before: Callable[[str, int], object] = lambda name, k: None,
          after: Callable[[str, float], object] = lambda name, t: t) -> dict[str, list]:
    """Each of ``calls`` timed in turn, one call each per round (a load change on the machine hits all alike),
    ``steps`` rounds after ``warmup``: per name, ``after(name, seconds)`` of each timed call (by default the
    seconds). ``before(name, k)`` runs untimed before the call of round k, ``after`` untimed after it (a
    barrier, a scheduler's step, the slowest rank's time)."""
    out: dict[str, list] = {name: [] for name in calls}
    for k in range(warmup + steps):
        for name, call in calls.items():
            before(name, k)
            sync()
            t0 = time.perf_counter()
            call()
            sync()
            t = after(name, time.perf_counter() - t0)
            if k >= warmup:
                out[name].append(t)
    return out


# ------------------------------------------------------------------------------------------ memory: resident
def rss_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024  # kB
    return out


def settle() -> None:
    """Drop what Python and glibc still hold of freed memory, so the RSS is what is live."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_hwm() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so that the next read is the peak since."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ------------------------------------------------------------------------------------------ memory: live tensors
def categories(snapshot) -> dict[str, int]:
    """A MemTracker snapshot's bytes per category on the CPU (``Total`` included)."""
    import torch

    return {getattr(k, "value", str(k)): int(v) for k, v in snapshot.get(torch.device("cpu"), {}).items()}


class Marks:
    """The peak inside a window (the optimizer's step, the framework's) minus the live bytes as it opens,
    the largest over the window's calls (ZeRO-3 steps its optimizer once per sub-group), by category at
    that peak (MemTracker's or FSDPMemTracker's, on the CPU); the tracker's whole-step peak is kept."""

    NAMES = {"step": ("live_before_step", "step_peak", "step_peak_categories", "transient"),
             "framework": ("framework_live_before", "framework_peak", "framework_peak_categories",
                           "framework_transient")}

    def __init__(self, tracker) -> None:
        self.tracker, self.out = tracker, {}

    def wrap(self, obj, attr: str, key: str) -> None:
        inner = getattr(obj, attr)

        def call(*a, **k):
            with self.window(key):
                return inner(*a, **k)

        setattr(obj, attr, call)

    @contextlib.contextmanager
    def window(self, key: str):
        import torch

        t, dev = self.tracker, torch.device("cpu")
        before = dict(t.get_tracker_snapshot("current").get(dev, {}))
        total = next((int(v) for k, v in before.items() if getattr(k, "value", k) == "Total"), 0)
        self.out.setdefault("peak_before_" + key, max(t._peak_mem.values(), default=0))
        saved, saved_snap = t._peak_mem, t._peak_mem_snap
        t._peak_mem, t._peak_mem_snap = {dev: total}, {dev: before}
        try:
            yield
        finally:
            peak = max(t._peak_mem.values(), default=0)
            live, top, cats, transient = self.NAMES[key]
            if peak - total >= self.out.get(transient, -1):
                self.out.update({live: total, top: peak, cats: categories(t.get_tracker_snapshot("peak")),
                                 transient: peak - total})
            if max(saved.values(), default=0) >= peak:  # keep the whole step's peak
                t._peak_mem, t._peak_mem_snap = saved, saved_snap


def tracked_step(fwd_bwd, step, tracker) -> dict[str, int]:
    """One step under ``tracker`` (a MemTracker already entered): ``fwd_bwd()`` then ``step()`` in a
    :class:`Marks` window; the tracker's peak is left at the whole step's."""
    fwd_bwd()
    marks = Marks(tracker)
    with marks.window("step"):
        step()
    return marks.out


def traced(world: int, rank: int = 0):
    """``with traced(W, r):`` this process is rank ``r`` of ``W`` on torch's fake process group (every
    collective returns at once, nothing moves), for a step traced under ``FakeTensorMode``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    @contextlib.contextmanager
    def group():
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            yield
        finally:
            dist.destroy_process_group()

    return group()
