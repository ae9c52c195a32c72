"""docs/benchmarks.md and docs/convergence.md: every section says which script measured it, at which
commit, on which device, and its results are kept as JSON beside it (docs/results/<section>.json, written
by benchmarks/measure.py)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
_spec = importlib.util.spec_from_file_location("measure_under_test", DOCS.parent / "benchmarks" / "measure.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _sections(page: Path) -> list[tuple[str, str, str]]:
    return re.findall(r"<!-- begin:([\w-]+) -->\n## (.*?)\n\n(.*?)<!-- end:\1 -->", page.read_text(), re.S)


@pytest.mark.parametrize("page", ["benchmarks.md", "convergence.md"])
def test_every_section_is_stamped_and_kept_as_json(page):
    sections = _sections(DOCS / page)
    assert sections or page == "convergence.md"
    for key, title, body in sections:
        stamp = report._STAMP.search(body)
        assert stamp and stamp["script"].startswith("benchmarks/") and stamp["commit"], (key, body[:200])
        assert re.search(r"CPU|GPU|CUDA|no device", title), (key, title)  # every heading says where
        if stamp["device"].startswith("GPU"):
            assert "GPU" in title or "CUDA" in title, (key, title)
        record = json.loads((DOCS / "results" / f"{key}.json").read_text())
        assert record["title"] == title and record["script"] == stamp["script"], key
        assert record["tables"] == report.tables(body), key


def test_tables_are_read_cell_by_cell():
    body = "text\n\n| a | b |\n|---|---:|\n| 1 | x y |\n| 2 | **3** |\n\nmore"
    assert report.tables(body) == [{"header": ["a", "b"], "rows": [["1", "x y"], ["2", "**3**"]]}]


def test_commit_stamp_ignores_only_what_benchmarks_write(tmp_path, monkeypatch):
    """A second benchmark of a session sees the first one's docs/benchmarks.md and docs/results/ changed:
    its commit stays clean; any other change to a tracked file is '+changes'."""
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "docs" / "results").mkdir(parents=True)
    for name in ("docs/benchmarks.md", "docs/results/a.json", "code.py"):
        (tmp_path / name).write_text("0\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(report, "DOC", tmp_path / "docs" / "benchmarks.md")
    (tmp_path / "docs" / "benchmarks.md").write_text("1\n")
    (tmp_path / "docs" / "results" / "a.json").write_text("1\n")
    clean = report._commit()
    assert clean != "unknown" and not clean.endswith("+changes"), clean
    (tmp_path / "code.py").write_text("1\n")
    assert report._commit().endswith(" +changes")


def test_figures_are_written_only_from_a_clean_commit(tmp_path, monkeypatch):
    """A section of the repository's docs measured on uncommitted changes is not written (it is left in
    /tmp/<key>.md) unless asked for, stamped '+changes'; from a clean commit it is written with its command."""
    import subprocess

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n")
    (tmp_path / "code.py").write_text("0\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(report, "_DOCS", docs)
    monkeypatch.setattr(report, "DOC", docs / "benchmarks.md")
    monkeypatch.delenv("SWAN_BENCH_ALLOW_CHANGES", raising=False)
    report.write_section("clean", "Clean (CPU)", "| a |\n|---|\n| 1 |")
    page = (docs / "benchmarks.md").read_text()
    assert "## Clean (CPU)" in page and "+changes" not in page and "command not recorded" not in page
    assert json.loads((docs / "results" / "clean.json").read_text())["command"].startswith("python benchmarks/")
    (tmp_path / "code.py").write_text("1\n")
    with pytest.raises(SystemExit, match="uncommitted changes"):
        report.write_section("dirty", "Dirty (CPU)", "x")
    assert "Dirty" not in (docs / "benchmarks.md").read_text() and "Dirty" in Path("/tmp/dirty.md").read_text()
    monkeypatch.setenv("SWAN_BENCH_ALLOW_CHANGES", "1")
    report.write_section("dirty", "Dirty (CPU)", "x")
    assert "+changes" in (docs / "benchmarks.md").read_text()
