"""Write a benchmark's results into its own section of docs/benchmarks.md (other sections kept), and the
same results as JSON in docs/results/<section>.json: provenance (date, script, command, commit, host CPU,
GPU) and every Markdown table of the section as rows of cells, for tools and later comparisons."""

from __future__ import annotations

import datetime
import json
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
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
    prov = provenance()
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


_STAMP = re.compile(r"_Measured (?P<date>\S+) by `(?P<script>[^`]+)` \((?:`(?P<command>[^`]*)`|command not recorded)\), "
                    r"commit (?P<commit>[^,]+), (?:host CPU (?P<cpu>[^,]+), )?(?P<device>[^.]*)\.?_")


def export(doc: Path) -> list[Path]:
    """The JSON record of every section of ``doc`` from its Markdown (for sections measured before scripts
    wrote JSON themselves): provenance parsed from the section's stamp, its tables. Returns the files written."""
    out = []
    for m in re.finditer(r"<!-- begin:(?P<key>[\w-]+) -->\n## (?P<title>.*?)\n\n(?P<body>.*?)<!-- end:(?P=key) -->",
                         doc.read_text(), re.S):
        stamp = _STAMP.search(m["body"])
        prov = {k: (stamp[k] if stamp else None) for k in ("date", "script", "command", "commit", "cpu")}
        gpu = stamp["device"] if stamp else None
        prov["gpu"] = gpu[len("GPU "):] if gpu and gpu.startswith("GPU ") else None
        record = {"section": m["key"], "title": m["title"], **prov, "exported_from": doc.name,
                  "tables": tables(m["body"]), "markdown": m["body"].strip()}
        path = doc.parent / "results" / f"{m['key']}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        out.append(path)
    return out


if __name__ == "__main__":  # python benchmarks/_report.py: docs/results/*.json from the Markdown sections
    for page in (DOC, DOC.parent / "convergence.md"):
        if page.exists():
            for path in export(page):
                print(path.relative_to(DOC.parent.parent))


def against(commit: str, script: str, argv: list[str], rounds: int = 2) -> tuple[list[list[dict]], list[list[dict]]]:
    """``script`` (this checkout's benchmark) run ``rounds`` times on this checkout's swan_dist and as many on
    ``commit``'s (its ``swan_dist/``, ``integrations/`` and ``configs/`` put first on PYTHONPATH; a module the benchmark
    needs that the commit lacks, such as ``swan_dist/host_reads.py``, taken from this checkout), in turn
    (new, old, new, old: a load change on the machine hits both alike). Each run gets ``argv`` plus
    ``--no-write --json FILE`` and writes its rows there; returns (this checkout's runs, the commit's)."""
    import os
    import shutil
    import tempfile

    root = DOC.parent.parent
    runs: tuple[list, list] = ([], [])
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        old.mkdir()
        archive = subprocess.run(["git", "archive", commit, "swan_dist", "integrations", "configs"], cwd=root,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        for path in ("swan_dist/host_reads.py",):
            if not (old / path).exists():
                shutil.copy(root / path, old / path)
        for r in range(rounds):
            for k, path in enumerate((root, old)):
                out = Path(tmp) / f"rows{r}{k}.json"
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path), str(Path(script).resolve().parent)])}
                print(f"{'this checkout' if k == 0 else commit}, round {r + 1}:", flush=True)
                subprocess.run([sys.executable, script, *argv, "--no-write", "--json", str(out)], env=env, check=True)
                runs[k].append(json.loads(out.read_text()))
    return runs


def against_table(commit: str, new: list[list[dict]], old: list[list[dict]], group: tuple[str, str, str],
                  ref: tuple[str, str], extra: tuple[str, Callable[[dict, dict], str]] | None = None,
                  ) -> tuple[list[str], dict[tuple, tuple[float, float]]]:
    """The Markdown table of :func:`against`'s runs (rows with ``name`` and median step seconds ``t``): per
    row, keyed by its ``group`` field and ``name``, the best of the rounds' medians (a round slowed by the
    machine counts least) on this checkout and on ``commit``, their ratio, and the ratio with each run's
    time taken relative to its own ``ref`` row of the same group.

    ``group``: (row field, column header, column alignment such as ``---:``); ``ref``: (optimizer name, as
    the header calls it); ``extra``: a last column's header and its cell from the two best rows (this
    checkout's, ``commit``'s). Returns the table's lines and, per key, (ratio, ratio relative to ``ref``)."""
    def best(runs: list[list[dict]]) -> dict[tuple, dict]:
        out: dict[tuple, dict] = {}
        for run in runs:
            for r in run:
                key = (r[group[0]], r["name"])
                if key not in out or r["t"] < out[key]["t"]:
                    out[key] = r
        return out

    a, b = best(new), best(old)
    head = f"| {group[1]} | optimizer | this commit (ms) | {commit} (ms) | ratio | ratio, each vs its {ref[1]} |"
    sep = f"|{group[2]}|---|---:|---:|---:|---:|"
    if extra:
        head, sep = f"{head} {extra[0]} |", f"{sep}---|"
    lines, ratios = [head, sep], {}
    for (g, name), r in a.items():
        r0 = b[(g, name)]
        t, t0 = r["t"], r0["t"]
        ratios[(g, name)] = (t / t0, (t / a[(g, ref[0])]["t"]) / (t0 / b[(g, ref[0])]["t"]))
        line = f"| {g} | {name} | {t * 1e3:.2f} | {t0 * 1e3:.2f} | {t / t0:.2f}x | {ratios[(g, name)][1]:.2f}x |"
        lines.append(f"{line} {extra[1](r, r0)} |" if extra else line)
    return lines, ratios
