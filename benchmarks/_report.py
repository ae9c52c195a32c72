"""Write a benchmark's results into its own section of docs/benchmarks.md (other sections kept)."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "Every figure here is written by a script under `benchmarks/`, measured side by side in one run; "
    "each section says when and on what device. Re-run the script to refresh its section.\n"
)


def write_section(key: str, title: str, body: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    stamp = datetime.date.today().isoformat()
    block = f"<!-- begin:{key} -->\n## {title}\n\n_Measured {stamp} by `benchmarks/`._\n\n{body}\n<!-- end:{key} -->"
    pattern = re.compile(rf"<!-- begin:{re.escape(key)} -->.*?<!-- end:{re.escape(key)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
