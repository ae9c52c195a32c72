"""torchtitan job configs (a ``config_registry`` module for ``--module torchtitan_configs``) for the tests.

Each is torchtitan's debug config with SWAN swapped in by one entry (``config.optimizer``); the rest sizes it
for a CPU: short sequences, float32, no activation checkpointing, the harness's tokenizer and data.
"""

from __future__ import annotations

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.validate import Validator
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from swan_dist.integrations.torchtitan import SwanOptimizersContainer

SEQ = 16


def _cpu(config):
    assets = os.environ["SWAN_TT_ASSETS"]
    config.hf_assets_path = assets
    config.dataloader.dataset_path = os.path.join(assets, "data")
    config.training.seq_len = SEQ
    config.training.local_batch_size = 2
    config.training.global_batch_size = 4
    config.training.steps = 3
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.activation_checkpoint = None
    config.validator = Validator.Config()
    config.lr_scheduler.warmup_steps = 1
    config.metrics.log_freq = 1
    config.checkpoint = CheckpointManager.Config(enable=True, interval=1000, last_save_model_only=False)
    config.debug.seed = 0
    # torchtitan 0.3.0's default "spmd_types" backend fails in torch 2.13's fully_shard ("When dp_mesh_dims is
    # provided, all parameters must be DTensors on the full SPMD mesh"); DTensor on the model-parallel axes runs
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def swan(lr: float = 2e-3, **kw) -> SwanOptimizersContainer.Config:
    return SwanOptimizersContainer.Config(lr=lr, fallback_lr=kw.pop("fallback_lr", 1e-3), whiten_dtype="float32", **kw)


def _llama3():
    config = _cpu(llama3_debugmodel())
    return config


def llama3_swan():
    config = _llama3()
    config.optimizer = swan()
    return config


def llama3_adamw():
    return _llama3()


def dsv3_swan():
    config = _cpu(deepseek_v3_debugmodel())
    config.optimizer = swan()
    return config


def __getattr__(name: str):
    """``llama3_adamw_lr<lr>`` / ``llama3_swan_lr<lr>``: the benchmark's lr sweep (no checkpoint), by name."""
    import re
    m = re.fullmatch(r"llama3_(adamw|swan)_lr([0-9.e-]+)", name)
    if m is None:
        raise AttributeError(name)
    lr = float(m.group(2))

    def config():
        c = _llama3()
        if m.group(1) == "swan":
            c.optimizer = swan(lr, fallback_lr=lr / 2)
        else:
            c.optimizer.param_groups[0].optimizer_kwargs["lr"] = lr
        c.checkpoint.enable = False
        return c
    return config


def _gpu(optimizer=None):
    """benchmarks/torchtitan.py --cuda's jobs: the debug llama3 at W=1 on a GPU, seq 512, no checkpoint."""
    c = llama3_debugmodel()
    c.hf_assets_path = os.environ["SWAN_TT_ASSETS"]
    c.dataloader.dataset_path = os.path.join(c.hf_assets_path, "data")
    c.validator, c.activation_checkpoint, c.training.seq_len = None, None, 512
    c.checkpoint.enable = False
    if optimizer is not None:
        c.optimizer = optimizer
    return c


def cuda_adamw():
    return _gpu()


def cuda_distmuon():
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    return _gpu(OptimizersContainer.Config(param_groups=[
        ParamGroupConfig(pattern=r"layers\..*\.weight$", optimizer_name="DistMuon", optimizer_kwargs={"lr": 0.02}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 8e-4})]))


def cuda_swan():
    return _gpu(SwanOptimizersContainer.Config(lr=2e-3))
