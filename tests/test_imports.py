"""``import swan_dist`` loads no framework it adapts to.

A user of one framework should not pay for (or break on) the others: the adapters reach their framework
only through ``sys.modules`` or imports inside functions, and DTensor's private helpers are imported on
first use, so a torch upgrade that moves them fails at that use with a message naming the version.
"""

import re
import subprocess
import sys

import pytest
import torch

# Importing the public torch.distributed.tensor loads its private modules too, so none of it may load.
FRAMEWORKS = ("deepspeed", "megatron", "transformers", "accelerate", "lightning", "pytorch_lightning",
              "lightning_fabric", "torch.distributed.fsdp", "torch.distributed.tensor")

PROBE = f"""
import sys
import torch
import swan_dist

frameworks = {FRAMEWORKS!r}
print(sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in frameworks)))
print(swan_dist.SWANFactory.__name__, torch.optim.SWAN is swan_dist.SWAN)
"""


def test_import_loads_no_framework():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    loaded, resolved = done.stdout.strip().splitlines()
    assert loaded == "[]", f"import swan_dist imported {loaded}"
    assert resolved == "SWANFactory True"  # the Trainer factory and DeepSpeed's "type": "SWAN" still resolve


def test_missing_private_dtensor_api_names_the_version():
    from swan_dist.integrations import dtensor

    with pytest.raises(ImportError, match=re.escape(f"torch {torch.__version__} has no torch.distributed.tensor._utils.x")):
        dtensor._private("torch.distributed.tensor._utils", "x")


def _reference_imports() -> dict[str, set[str]]:
    """Each module of swan_dist.reference -> the modules of swan_dist.reference it imports (at run time or
    for type checking: ``from .x import``, ``from . import x``, ``swan_dist.reference.x``)."""
    import ast
    from pathlib import Path

    import swan_dist.reference as ref

    folder = Path(ref.__file__).parent
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 1:
                    found |= {mod.split(".")[0]} if mod else {a.name for a in node.names}
                elif mod.startswith("swan_dist.reference."):
                    found.add(mod.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("swan_dist.reference.")}
        graph[name] = found & names
    return graph


@pytest.mark.timeout(300)
def test_reference_modules_import_alone_and_form_no_cycle():
    """Every module of the reference trainer imports in a fresh interpreter, first of all; and their imports
    (type-checking ones included) form no cycle: config imports none of the modules that import it."""
    graph = _reference_imports()
    assert graph["config"] <= {"model"}, graph["config"]
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        if name not in done:
            for dep in sorted(graph[name]):
                visit(dep, path + (name,))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())
    for name in sorted(graph):
        run = subprocess.run([sys.executable, "-c", f"import swan_dist.reference.{name}"], capture_output=True,
                             text=True, timeout=120, check=False)
        assert run.returncode == 0, (name, run.stderr[-2000:])
