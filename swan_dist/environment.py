"""``python -m swan_dist``: what a bug report needs, in one paste (as ``ds_report`` and
``python -m torch.utils.collect_env`` do for DeepSpeed and torch).

It prints swan_dist's version and where it is installed, torch with its CUDA and NCCL, each framework
swan_dist adapts to with whether its integration imports (and why not), the devices, what
``whiten_dtype="auto"`` resolves to on each, and where the presets were found. Reading it imports the
frameworks; it changes nothing.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import warnings
from importlib import metadata
from pathlib import Path

import torch

__all__ = ["FRAMEWORKS", "report", "main"]

# distribution name -> the modules swan_dist's integration reaches (its adapter and the framework's own modules)
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "deepspeed": ("deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.utils",
                  "swan_dist.integrations.deepspeed", "swan_dist.integrations.ds_universal"),
    "megatron-core": ("megatron.core.optimizer", "megatron.core.optimizer.distrib_optimizer",
                      "megatron.core.dist_checkpointing", "swan_dist.integrations.megatron_factory"),
    "torchtitan": ("torchtitan.components.optimizer", "swan_dist.integrations.torchtitan"),
    "transformers": ("transformers.trainer", "swan_dist.integrations.huggingface", "swan_dist.integrations.hf_layouts"),
    "accelerate": ("accelerate",),
    "lightning": ("lightning",),
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _install_kind() -> str:
    """``editable`` (``pip install -e``), ``installed`` (a wheel, ``pip install .``) or ``source tree`` (not
    installed: found on ``sys.path``)."""
    try:
        direct = metadata.distribution("swan_dist").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return "source tree (not installed)"
    editable = bool(direct and json.loads(direct).get("dir_info", {}).get("editable"))
    return "editable" if editable else "installed"


def _imports(modules: tuple[str, ...]) -> str:
    for name in modules:
        try:
            with warnings.catch_warnings():  # the frameworks' import-time warnings are not the report's
                warnings.simplefilter("ignore")
                importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported, whatever it is
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return f"integration does not import: {name}: {type(e).__name__}: {first}"[:300]
    return "integration imports"


def _nccl() -> str:
    if not torch.cuda.is_available():
        return "n/a (no CUDA device)"
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({type(e).__name__}: {e})"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


def report() -> str:
    """The report, as text."""
    import swan_dist
    from swan_dist.functional import WhitenConfig, _cpuinfo_bf16, resolve_dtype
    from swan_dist.presets import config_dir, list_presets

    lines = [
        f"swan_dist     {swan_dist.__version__} ({_install_kind()}) at {Path(swan_dist.__file__).parent}",
        f"python        {platform.python_version()} ({platform.platform()})",
        f"torch         {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}, NCCL {_nccl()}, "
        f"gloo {'yes' if torch.distributed.is_available() and torch.distributed.is_gloo_available() else 'no'}",
        "frameworks:",
    ]
    for dist_name, modules in FRAMEWORKS.items():
        version = _version(dist_name)
        status = _imports(modules) if version is not None else "not installed"
        lines.append(f"  {dist_name:<14}{version or '-':<10}{status}")
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    lines.append("devices, and what whiten_dtype='auto' gives there (NSDS; NS always fp32):")
    for dev in devices:
        auto = resolve_dtype(WhitenConfig(method="nsds", dtype="auto"), dev)
        if dev.type == "cpu":
            forced = os.environ.get("SWAN_DIST_CPU_BF16")
            why = f"native bf16 (avx512_bf16/amx_bf16) {'yes' if _cpuinfo_bf16() else 'no'}" + (
                f", SWAN_DIST_CPU_BF16={forced}" if forced is not None else "")
            desc = f"{_cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {why}"
        else:
            p = torch.cuda.get_device_properties(dev)
            desc = f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB"
        lines.append(f"  {str(dev):<14}{str(auto).replace('torch.', ''):<10}{desc}")
    try:
        where = f"{config_dir()} ({', '.join(list_presets())})"
    except (FileNotFoundError, OSError) as e:
        where = f"not found: {e}"
    env = os.environ.get("SWAN_DIST_CONFIG_DIR")
    lines.append(f"presets       {where}" + (" (from SWAN_DIST_CONFIG_DIR)" if env else ""))
    return "\n".join(lines)


def main() -> None:
    print(report())
