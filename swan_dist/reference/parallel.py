"""The reference trainer's distributed setup: the process group and device (:func:`setup_distributed`),
collectives that fall back to one process, and the parallel strategies that wrap the model
(:func:`wrap_model`; DeepSpeed's engine is built with its optimizer, :func:`deepspeed_engine`).
A new strategy is one more entry in :data:`PARALLEL` (and its name in :data:`.config.STRATEGIES`).
The DeepSpeed JSON built from the trainer's keys is :func:`.config.deepspeed_json` (imported here too)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import STRATEGIES, TrainConfig, deepspeed_json
from .optim import build_scheduler


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool  # we initialised it, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: TrainConfig) -> DistEnv:
    """Read the torchrun environment, pick the device and threads, and start the process group."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world > 1 and cfg.parallel == "none":
        raise ValueError(f"WORLD_SIZE={world} needs a parallel strategy; set parallel: ddp")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores between local ranks (torchrun sets 1)
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    owns = False
    if cfg.parallel != "none" and not dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
        timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        shared_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if "MASTER_ADDR" in os.environ and attempt is not None and shared_store:
            # torchrun (c10d rendezvous) shares its TCPStore with the workers, and the keys of an earlier
            # attempt (a rank's old gloo/NCCL address) are still there after a restart: this attempt's
            # keys go under their own prefix (pytorch/pytorch#135712). The count is each agent's own: if
            # agents restart for different reasons (several nodes) they disagree; there, start torchrun
            # with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store each attempt, no prefix needed).
            store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
            dist.init_process_group(backend, store=dist.PrefixStore(f"swan_dist/attempt_{attempt}", store),
                                    rank=rank, world_size=world, timeout=timeout)  # fmt: skip
        elif "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        else:  # plain `python -m ...` with parallel: ddp: a one-process group
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        owns = True
    return DistEnv(rank, world, local_rank, device, owns)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def all_reduce_max(value: float, env: DistEnv) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=env.device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _ddp(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)  # buffers are constants


def shard_fsdp2(model: nn.Module, mesh) -> nn.Module:
    """``fully_shard`` the reference LLaMA as FSDP2 users do: the embeddings one shard group, each
    transformer block one, the head one, the root (the final norm) the last. The embeddings and the head
    apart keep their unsharded gradients and reduce-scatter buffers (the model's largest) from living
    through all of backward in the root's group; tied embeddings stay in the root."""
    from torch.distributed.fsdp import fully_shard

    tied = model.output.weight is model.tok_embeddings.weight
    if not tied:
        fully_shard(model.tok_embeddings, mesh=mesh)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    if not tied:
        fully_shard(model.output, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    return shard_fsdp2(model, init_device_mesh(env.device.type, (env.world_size,)))


def _fsdp1(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """FSDP1, one FlatParameter per transformer block plus the root's; the optimizer gets the original
    parameters' flat views (``fsdp1_use_orig_params: true``) or the FlatParameters themselves."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from .model import TransformerBlock

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                use_orig_params=cfg.fsdp1_use_orig_params, device_id=env.device)


# parallel strategy -> wrapper(model, cfg, env); DeepSpeed builds its engine with the optimizer (below).
PARALLEL: dict[str, Callable[[nn.Module, TrainConfig, DistEnv], nn.Module]] = {
    "none": lambda m, c, e: m, "ddp": _ddp, "fsdp2": _fsdp2, "fsdp1": _fsdp1, "deepspeed": lambda m, c, e: m,
}


assert tuple(PARALLEL) == STRATEGIES, "a strategy is one entry here and one name in config.STRATEGIES"


def wrap_model(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    return PARALLEL[cfg.parallel](model, cfg, env)


def deepspeed_engine(model: nn.Module, cfg: TrainConfig):
    """``deepspeed.initialize`` with :func:`deepspeed_json`: the engine builds the optimizer from the
    JSON's ``"type"`` (``SWAN`` resolves through ``import swan_dist``) and steps our lr schedule."""
    import deepspeed

    import swan_dist  # noqa: F401 - registers "SWAN"; SWAN tags the engine's model (names, module types)

    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_json(cfg), lr_scheduler=lambda opt: build_scheduler(cfg, opt),
    )
    return engine, optimizer, scheduler


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict; a collective under FSDP1/FSDP2, so every rank calls it
    (FSDP1's root wrapper gathers full tensors by default; FSDP2 returns DTensors, gathered here)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # DeepSpeed ZeRO-3 partitions: gather them
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.clone() for k, v in model.state_dict().items()}
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
