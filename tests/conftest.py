"""Test-wide settings: one intra-op thread per process, so that multi-process tests (and tests that
run beside other work) do not oversubscribe the cores: on 2 cores an oversubscribed OpenMP pool
makes small matmuls ~100x slower. Spawned children inherit the environment variable."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
