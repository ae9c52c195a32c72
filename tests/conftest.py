"""Test-wide settings: one intra-op thread per process, so that multi-process tests (and tests that
run beside other work) do not oversubscribe the cores: on 2 cores an oversubscribed OpenMP pool
makes small matmuls ~100x slower. Spawned children inherit the environment variables.

Whitening precision: ``whiten_dtype="auto"`` picks bf16 NSDS on CPUs with native bf16 (see
``swan_dist.functional.resolve_dtype``). The suite compares distributed SWAN with single-process SWAN
and with fp32/fp64 transcriptions of the paper at fp32 tolerances, so it pins 'auto' to fp32 on the
CPU; tests/test_functional.py checks the rule itself and bf16's tolerance against fp32 with the
override removed."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SWAN_DIST_CPU_BF16", "0")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Torch's JIT extensions (DeepSpeed's shm communication op on the CPU) are built in a directory of this
# run's own. A build killed part-way (a timed-out test, a stopped job) leaves its `lock` file behind,
# and every later load in that directory waits on it forever (torch's FileBaton has no owner to check),
# so a shared ~/.cache/torch_extensions would turn one killed build into a hang of every DeepSpeed test.
# The first DeepSpeed test pays the build (25-55 s on 2 cores); the directory goes at exit.
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="swan_dist_torch_ext_")
    atexit.register(shutil.rmtree, os.environ["TORCH_EXTENSIONS_DIR"], True)
