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
