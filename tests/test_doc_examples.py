"""Every integration page's complete example runs as written: the page's ```python block is saved under
the name the page gives it and started with the page's own launch command (`.venv/bin/` there is this
interpreter's folder). Where the example prints ``step loss`` lines (or the Trainer's ``{'loss': ...}``
logs), the loss must fall. Examples that need CUDA (megatron-core's) run only where CUDA is available."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "integrations"
_NAMED = re.compile(r"`(\w+\.py)`(?:(?!```).){0,300}?```python\n(.*?)```", re.S)


def examples() -> list[tuple[str, str, str, str]]:
    """(page, file name, code, launch command) for every complete example on the integration pages."""
    out = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for name, code in dict(_NAMED.findall(text)).items():
            launch = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()
                      if re.search(rf"\b{re.escape(name)}\b", line)]
            assert launch, f"{page.name}: no launch command for {name}"
            out.append((page.name, name, code, launch[0].split("#")[0].strip()))
    return out


# pages whose example is a launch command another test runs as written (not a saved file)
RUN_ELSEWHERE = {"torchtitan.md": "tests/test_torchtitan.py::test_documented_cpu_command_runs"}


def test_every_integration_page_has_a_runnable_example():
    pages = {p for p, *_ in examples()}
    for page, test in RUN_ELSEWHERE.items():
        path, name = test.split("::")
        assert f"def {name}(" in (DOCS.parent.parent / path).read_text(), f"{page}: {test} is gone"
        assert f"{page.removesuffix('.md')}-command -->" in (DOCS / page).read_text(), page
    assert pages | set(RUN_ELSEWHERE) == {p.name for p in DOCS.glob("*.md")}, pages


@pytest.mark.parametrize("page,name,code,command", examples(), ids=lambda v: v if str(v).endswith(".py") else "")
def test_page_example_runs_as_written(tmp_path, page, name, code, command):
    if re.search(r'init_process_group\(\s*"nccl"', code) or "CUDA_" in command:
        if not torch.cuda.is_available():
            pytest.skip(f"{page}: {name} needs CUDA (its calls run on CPU in tests/test_megatron_core.py)")
    (tmp_path / name).write_text(code)
    bin_dir = Path(sys.executable).parent
    words, env = shlex.split(command), dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    while "=" in words[0]:  # VAR=value before the command
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    argv = [str(bin_dir / a[len(".venv/bin/"):]) if a.startswith(".venv/bin/") else a for a in words]
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=800)
    losses = [float(m) for m in re.findall(r"^(?:step )?\d+:? (?:loss )?([0-9.]+)\s*$", out.stdout, re.M)]
    losses += [float(m) for m in re.findall(r"^\{'loss': '?([0-9.]+)'?,", out.stdout, re.M)]  # Trainer's logs
    # a rank aborting in native teardown after the script finished (DeepSpeed/gloo threads freed during
    # interpreter exit, docs/troubleshooting.md) is torch's, not the example's: accepted only then
    teardown = "terminate called without an active exception" in out.stderr and len(losses) >= 2
    assert out.returncode == 0 or teardown, \
        f"{page}: `{command}` exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    if len(losses) >= 2:
        assert losses[-1] < losses[0], f"{page}: the loss did not fall: {losses}"


# ---- the lr convention in every example (no process launched)
_BLOCK = re.compile(r"```[\w-]*\n(.*?)```", re.S)
_START = re.compile(r"\bSWAN\(|\bswap\(|SWANFactory\s*,\s*\{|[\"']type[\"']\s*:\s*[\"']SWAN[\"']|\bget_swan_optimizer\(|"
                    r"SwanOptimizersContainer\.Config\(|\bswan_config\(|--optimizer[ =]swan\b")
_FOLLOWS = re.compile(r"adamw_lr|from_adamw|--swan-from-adamw|\bswap\(")


def _balanced(code: str, i: int) -> str:
    """``code`` from the bracket at ``i`` to the one closing it."""
    depth = 0
    for j in range(i, len(code)):
        depth += code[j] in "({["
        depth -= code[j] in ")}]"
        if depth == 0:
            return code[i:j + 1]
    return code[i:]


def constructions(text: str) -> list[str]:
    """Every SWAN construction in the fenced code blocks of a page: a ``SWAN(...)`` / ``swap(...)`` call, a
    ``SWANFactory`` kwargs dict, a ``"type": "SWAN"`` config, megatron-core's ``get_swan_optimizer(...)``,
    torchtitan's ``SwanOptimizersContainer.Config(...)`` / ``swan_config(...)``, a ``--optimizer swan`` command."""
    out = []
    for block in _BLOCK.findall(text):
        code = block.replace("\\\n", " ")  # a shell command's continued lines as one
        for m in _START.finditer(code):
            if m.group().startswith("--optimizer"):
                end = code.find("\n", m.end())
                out.append(code[code.rfind("\n", 0, m.start()) + 1:end if end >= 0 else None])
            elif "type" in m.group():
                out.append(_balanced(code, code.rfind("{", 0, m.start())))
            else:
                out.append(m.group()[:-1] + _balanced(code, m.end() - 1) if m.group().endswith("(")
                           else _balanced(code, m.end() - 1))
    return out


def test_every_swan_construction_in_readme_and_integration_pages_follows_the_lr_convention():
    """README.md's and the integration pages' examples build SWAN from an AdamW lr (``adamw_lr``, ``from_adamw``,
    ``swap``, ``--swan-from-adamw``), never at a preset's or SWAN's own lr (docs/convergence.md, "The lr
    convention"); the presets' lr is documented with the presets (docs/optimizer.md)."""
    bad = ('```python\nopt = swan_dist.SWAN(model, preset="swan_ddagger")\n```\n```json\n{"optimizer": {"type": "SWAN", '
           '"params": {"lr": 0.02}}}\n```\n```bash\ntorchrun x.py --optimizer swan \\\n  --lr 0.02\n```\n')
    assert [bool(_FOLLOWS.search(c)) for c in constructions(bad)] == [False, False, False]  # the check can fail
    pages = [DOCS.parent.parent / "README.md", *sorted(DOCS.glob("*.md"))]
    found = {page.name: constructions(page.read_text()) for page in pages}
    assert all(found.values()), found  # every page builds SWAN somewhere
    wrong = [f"{page}: {' '.join(c.split())[:160]}" for page, cs in found.items() for c in cs if not _FOLLOWS.search(c)]
    assert not wrong, "SWAN built without the lr convention (adamw_lr=, from_adamw, swap, --swan-from-adamw):\n" + \
        "\n".join(wrong)
