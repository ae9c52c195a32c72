"""Write a benchmark's results into its own section of docs/benchmarks.md (other sections kept)."""

from __future__ import annotations

import datetime
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "Every figure here is written by a script under `benchmarks/`, measured side by side in one run; "
    "each section says when and on what device. Re-run the script to refresh its section.\n"
)


def _commit() -> str:
    """The checkout's commit, with ``+changes`` where the working tree differs from it."""
    root = DOC.parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" +changes" if dirty else "")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def stamp() -> str:
    """When, by which script and command, at which commit, on which CPU the section was measured."""
    script = Path(sys.argv[0]).name
    command = " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, sys.argv[1:])])
    return (f"_Measured {datetime.date.today().isoformat()} by `benchmarks/{script}` (`{command}`), commit "
            f"{_commit()}, host CPU {_cpu()}._")


def write_section(key: str, title: str, body: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    block = f"<!-- begin:{key} -->\n## {title}\n\n{stamp()}\n\n{body}\n<!-- end:{key} -->"
    pattern = re.compile(rf"<!-- begin:{re.escape(key)} -->.*?<!-- end:{re.escape(key)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
