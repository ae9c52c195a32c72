"""swan_dist as a cluster image installs it: an sdist and a wheel built from this checkout, the wheel installed
into a fresh venv with no source tree on ``sys.path``, every entry point run from outside the checkout.

The fresh venv holds swan_dist alone; the suite's own venv serves the dependencies through a ``.pth`` line
(its site-packages appended to ``sys.path``, its ``.pth`` files, the editable install's finder among them,
not run). Three processes: one checks the wheel's contents, a one-process step, the presets, DeepSpeed's
``"type": "SWAN"``, torchtitan's ``SwanOptimizersContainer.Config().build(...)`` and megatron-core's factory;
``python -m swan_dist`` prints the report; ``torchrun`` at W=2 steps FSDP2 against single-process SWAN.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parent.parent
_SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "swan_dist", "integrations")


def _packages_in_checkout() -> set[str]:
    """Every package of the checkout, by its installed name."""
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "swan_dist").rglob("__init__.py")}
    found |= {"swan_dist." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "integrations").rglob("__init__.py")}
    return {p for p in found if "__pycache__" not in p}


def _run(args: list, cwd: Path, env: dict, timeout: int = 300) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args[:4]}... exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the fresh venv's python, a folder outside the checkout, the environment to run in)."""
    tmp = tmp_path_factory.mktemp("installed")
    src, dist = tmp / "src", tmp / "dist"
    src.mkdir()
    for name in _SOURCES:  # a copy: the build writes build/ and *.egg-info where it runs
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if (ROOT / name).is_dir() else {}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SWAN_DIST_CONFIG_DIR")}
    _run([sys.executable, "setup.py", "-q", "sdist", "-d", dist], src, env)
    (sdist,) = dist.glob("swan_dist-*.tar.gz")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, sdist], tmp, env)
    (wheel,) = dist.glob("swan_dist-*.whl")

    # the sdist and the wheel (built from the sdist) hold every package and the presets
    packages = _packages_in_checkout()
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    in_wheel = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages <= in_wheel, f"missing from the wheel: {sorted(packages - in_wheel)}"
    presets = {p.name for p in (ROOT / "swan_dist" / "configs" / "presets").glob("*.yaml")}
    assert presets and {f"swan_dist/configs/presets/{p}" for p in presets} <= set(names)
    with tarfile.open(sdist) as t:
        in_sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"setup.py", "setup.cfg", "integrations/__init__.py", "swan_dist/rules/__init__.py"} <= in_sdist

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], tmp, env)
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env).strip())
    (site / "suite_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run_dir = tmp / "elsewhere"
    run_dir.mkdir()
    return python, run_dir, env, venv


ONE_PROCESS = """
import json, os, sys
from pathlib import Path
import torch
from torch import nn
import swan_dist

venv = Path(sys.argv[1]).resolve()
assert Path(swan_dist.__file__).resolve().is_relative_to(venv), swan_dist.__file__
assert not any(Path(p or ".").resolve() == Path({root!r}) for p in sys.path), sys.path

# the presets, from the package
from swan_dist.presets import config_dir, list_presets
assert Path(str(config_dir())).resolve().is_relative_to(venv), config_dir()
assert list_presets() == ["swan_0", "swan_dagger", "swan_ddagger"], list_presets()
from importlib.metadata import version
assert version("swan_dist") == swan_dist.__version__  # one version, in the package and its metadata
# SWAN_DIST_CONFIG_DIR still overrides: a folder whose presets/ replaces the package's
from swan_dist.presets import load_preset
Path("mine/presets").mkdir(parents=True)
Path("mine/presets/swan_ddagger.yaml").write_text("optimizer:\\n  lr: 0.123\\n")
os.environ["SWAN_DIST_CONFIG_DIR"] = "mine"
assert load_preset("swan_ddagger")["optimizer"] == {{"lr": 0.123}} and list_presets() == ["swan_ddagger"]
os.environ["SWAN_DIST_CONFIG_DIR"] = "nowhere"
try:
    load_preset("swan_ddagger")
    raise AssertionError("a missing SWAN_DIST_CONFIG_DIR was not reported")
except FileNotFoundError as e:
    assert "SWAN_DIST_CONFIG_DIR" in str(e), e
del os.environ["SWAN_DIST_CONFIG_DIR"]

# a one-process step
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 11))
opt = swan_dist.SWAN(model, adamw_lr=3e-4, verbose=False)
before = [p.detach().clone() for p in model.parameters()]
model(torch.randint(0, 11, (4, 5))).logsumexp(-1).mean().backward()
opt.step()
assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
assert opt.whitened_matrices == 2, opt.whitened_matrices  # the two Linears; the embedding and the norm take the fallback

# DeepSpeed: "type": "SWAN" in the JSON resolves to swan_dist.SWAN
import torch.distributed as dist
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("store"), rank=0, world_size=1)
import deepspeed
config = {{"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {{"stage": 1}},
          "optimizer": {{"type": "SWAN", "params": {{"adamw_lr": 3e-4}}}}}}
engine, ds_opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
swan = ds_opt if isinstance(ds_opt, swan_dist.SWAN) else ds_opt.optimizer
assert isinstance(swan, swan_dist.SWAN), type(ds_opt)
engine.backward(engine(torch.randint(0, 11, (2, 5))).logsumexp(-1).mean())
engine.step()

# torchtitan: the container's config builds SWAN
from swan_dist.integrations.torchtitan import SwanOptimizersContainer, TitanSWAN
part = nn.ModuleDict({{"tok_embeddings": nn.Embedding(16, 8), "wq": nn.Linear(8, 8, bias=False), "norm": nn.LayerNorm(8)}})
container = SwanOptimizersContainer.Config().build(model_parts=[part])
assert isinstance(container.swan, TitanSWAN)

# megatron-core: the factory imports
from swan_dist.integrations.megatron_factory import get_swan_optimizer
import megatron.core.optimizer
print("one process: ok")
"""

FSDP2 = """
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import swan_dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 12), nn.Linear(12, 10), nn.GELU(), nn.Linear(10, 12), nn.Linear(12, 11))
model, ref = build(), build()
for layer in list(model)[1:4:2]:
    fully_shard(layer)
fully_shard(model)
opt = swan_dist.SWAN(model, adamw_lr=3e-4, verbose=False)
ref_opt = swan_dist.SWAN(ref, adamw_lr=3e-4, verbose=False)
for step in range(2):
    x = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(step))  # the same batch on each rank
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).logsumexp(-1).mean().backward()
        o.step()
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    full = p.full_tensor()
    assert torch.allclose(full, q, atol=1e-5, rtol=1e-5), (name, (full - q).abs().max())
assert opt.whitened_matrices == ref_opt.whitened_matrices > 0

# every version's checkpoint fixture (saved in one process) loads at W=2 under FSDP2
import sys
from pathlib import Path
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
fixtures = Path(sys.argv[1])
sys.path.insert(0, str(fixtures))
from make_checkpoints import Fixture, OPTIONS
for folder in sorted((fixtures / "checkpoints").iterdir()):
    torch.manual_seed(1)
    m = Fixture()
    for layer in (m.up, m.down):
        fully_shard(layer)
    fully_shard(m)
    o = swan_dist.SWAN(m, verbose=False, **OPTIONS)
    msd, osd = get_state_dict(m, o)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(folder / "dcp"))
    set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    saved = torch.load(folder / "swan.pt", weights_only=True)
    full = StateDictOptions(full_state_dict=True)
    fm, fo = get_state_dict(m, o, options=full)
    for name, value in saved["model"].items():
        assert torch.equal(fm[name], value), (folder.name, name)
    by_name = {n: saved["optimizer"]["state"].get(i, {}) for g in saved["optimizer"]["param_groups"]
               for i, n in zip(g["params"], g["param_names"])}
    for name, st in by_name.items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(fo["state"][name][key]), torch.as_tensor(value)), (folder.name, name, key)
        assert bool(st) == bool(fo["state"].get(name)), (folder.name, name)
dist.barrier()
if rank == 0:
    print("fsdp2 W=2: ok")
dist.destroy_process_group()
"""


def test_wheel_installs_and_runs_from_outside_the_checkout(installed):
    python, run_dir, env, venv = installed
    script = run_dir / "one_process.py"
    script.write_text(ONE_PROCESS.format(root=str(ROOT)))
    assert "one process: ok" in _run([python, script, venv], run_dir, env)


def test_environment_report_of_the_installed_package(installed):
    python, run_dir, env, venv = installed
    out = _run([python, "-m", "swan_dist"], run_dir, env)
    site = str(Path(_run([python, "-c", "import swan_dist, os; print(os.path.dirname(swan_dist.__file__))"],
                         run_dir, env).strip()))
    assert site.startswith(str(venv))
    import swan_dist

    assert f"swan_dist     {swan_dist.__version__} (installed) at {site}" in out, out
    assert "torch         " in out and "NCCL" in out and "gloo yes" in out
    for name in ("deepspeed", "megatron-core", "torchtitan", "transformers", "accelerate", "lightning"):
        assert any(line.split()[:1] == [name] and "integration imports" in line for line in out.splitlines()), out
    assert "\n  cpu " in out and ("float32" in out or "bfloat16" in out)
    assert f"presets       {site}/configs (swan_0, swan_dagger, swan_ddagger)" in out, out


def test_torchrun_fsdp2_step_of_the_installed_package(installed):
    """A step against single-process SWAN, and every version's checkpoint fixture loaded at W=2."""
    python, run_dir, env, venv = installed
    script = run_dir / "fsdp2.py"
    script.write_text(textwrap.dedent(FSDP2))
    fixtures = ROOT / "tests" / "fixtures"
    out = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, fixtures],
               run_dir, env)
    assert "fsdp2 W=2: ok" in out
