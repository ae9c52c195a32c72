"""Reference trainer: a LLaMA-style model on real text with SWAN, or the AdamW / Muon baselines.

    python -m swan_dist.reference.train --config configs/train/main.yaml [--set key=value ...]
    torchrun --nproc_per_node 2 -m swan_dist.reference.train --config configs/train/main.yaml

The pieces (:func:`build_model`, :func:`build_optimizer`, :func:`build_scheduler`,
:func:`wrap_model`) are separate so that other parallel strategies can reuse them;
a new strategy is one more entry in :data:`PARALLEL`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from swan_dist.adapter import PLAIN
from swan_dist.memory import client_optimizer, state_bytes
from swan_dist.selection import clean_name

from . import checkpoint
from .data import TextData, WindowSampler, build_data, eval_batches
from .model import Llama, model_config

# --------------------------------------------------------------------------- configuration


@dataclass
class TrainConfig:
    model: dict[str, Any] = field(default_factory=lambda: {"size": "tiny"})  # size + LlamaConfig overrides
    data: str | list[str] = "wiki"  # built-in corpus name, or text files / globs / directories
    vocab_size: int = 8192
    val_fraction: float = 0.02
    seq_len: int = 128
    batch_size: int = 16  # sequences per rank and micro-step
    grad_accum: int = 1
    steps: int = 250
    optimizer: str = "swan"  # swan | adamw | muon (baseline: torch's Muon on SWAN's matrices, AdamW on the rest)
    preset: str = "swan_ddagger"  # SWAN preset (swan_0, swan_dagger, swan_ddagger)
    lr: float | None = None  # None: the preset's lr (swan) or 1e-3 (adamw, muon)
    weight_decay: float = 0.0
    fallback: str = "adamw"  # optimizer for parameters SWAN does not handle
    warmup_ratio: float | None = None  # None: the preset's schedule (swan) or 0.1 (adamw, muon)
    min_lr_ratio: float | None = None  # cosine decays to min_lr_ratio * lr; None as above
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_every: int = 50
    eval_batches: int = 8  # the validation set is eval_batches * batch_size fixed windows
    log_every: int = 10
    out_dir: str = "runs/default"
    save_model: bool = True  # rank 0 writes out_dir/model.pt (state dict of the unwrapped model)
    seed: int = 0
    parallel: str = "none"  # none | ddp | fsdp2 | fsdp1 | deepspeed
    deepspeed_config: str | None = None  # parallel: deepspeed: a DeepSpeed JSON (configs/deepspeed/)
    fsdp1_use_orig_params: bool = True  # parallel: fsdp1: False hands the optimizer FlatParameters
    swan_mode: str = "auto"  # SWAN engine: auto (owner when world > 1) | owner | replicated | local
    bucket_mb: float = 256.0  # SWAN engine: full fp32 matrices one owner assembles per bucket
    swan_options: dict[str, Any] = field(default_factory=dict)  # more swan_dist.SWAN keyword arguments
    backend: str = "auto"  # auto | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 (autocast)
    checkpoint_every: int = 0  # save out_dir/checkpoints/step_N every this many steps; 0: never
    keep_checkpoints: int = 2  # complete checkpoints kept (older ones are deleted); 0: keep all
    resume: str = "auto"  # auto: the latest complete checkpoint in out_dir, if any | never | a path
    dist_timeout_s: float = 300.0  # process-group timeout: a rank whose peers died fails within it
    time_optimizer: bool = False  # summary's optimizer_s exact on CUDA (synchronises around each step)

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            self.model = {"size": self.model}
        if "vocab_size" in self.model:
            raise ValueError("model.vocab_size comes from the tokenizer; set the top-level vocab_size instead")
        overrides = {k: v for k, v in self.model.items() if k != "size"}
        model_config(self.model.get("size", "tiny"), **overrides)  # validates size and option names
        for name in ("val_fraction", "lr", "weight_decay", "warmup_ratio", "min_lr_ratio", "grad_clip",
                     "dist_timeout_s"):
            value = getattr(self, name)
            if value is not None:  # YAML reads "1e-3" (no dot) as a string
                setattr(self, name, float(value))
        choices = {
            "optimizer": ("swan", "adamw", "muon"), "parallel": tuple(PARALLEL), "backend": ("auto", "gloo", "nccl"),
            "swan_mode": ("auto", "owner", "replicated", "local"),
            "device": ("auto", "cpu", "cuda"), "dtype": ("float32", "bfloat16"),
        }  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"config {name}={getattr(self, name)!r}; choose from {list(allowed)}")
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "eval_batches", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"config {name} must be >= 1")
        for name in ("checkpoint_every", "keep_checkpoints"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"config {name} must be an integer >= 0")
        if self.dist_timeout_s <= 0:
            raise ValueError("config dist_timeout_s must be > 0")
        self.resume = str(self.resume)
        if not self.resume:
            raise ValueError("config resume: auto, never, or a checkpoint path")
        if self.optimizer == "muon" and self.parallel not in MUON_PARALLEL:
            raise ValueError(f"config optimizer=muon (the torch.optim.Muon baseline) needs whole matrices on every "
                             f"rank: parallel={self.parallel!r} hands the optimizer shards (FSDP) or builds its own "
                             f"(DeepSpeed); use parallel in {list(MUON_PARALLEL)}, or optimizer=swan")
        if (self.parallel == "deepspeed") != (self.deepspeed_config is not None):
            raise ValueError("config deepspeed_config is required with parallel: deepspeed, and only then")
        if self.deepspeed_config is not None:
            deepspeed_json(self)  # the file exists, parses, and agrees with the trainer's keys


def _set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = tree.setdefault(key, {})
        if isinstance(node, str) and key == "model":  # `model: tiny` shorthand
            node = tree[key] = {"size": node}
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {dotted!r}: {key!r} is not a section")
        tree = node
    tree[leaf] = value


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML config and apply ``key=value`` overrides (values parsed as YAML, keys may be dotted)."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not of the form key=value")
        _set_key(raw, key.strip(), yaml.safe_load(value))
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}{f' in {path}' if path else ''}; valid keys: {sorted(known)}")
    if isinstance(raw.get("deepspeed_config"), str) and path is not None:
        raw["deepspeed_config"] = _find_relative(raw["deepspeed_config"], Path(path))
    return TrainConfig(**raw)


def _find_relative(name: str, yaml_path: Path) -> str:
    """A relative path as written (from the working directory), else from the YAML's folder or one of
    its parents (``configs/deepspeed/zero2.json`` written in ``configs/train/x.yaml`` finds the repo's)."""
    if Path(name).is_absolute() or Path(name).exists():
        return name
    for folder in yaml_path.resolve().parents:
        if (folder / name).exists():
            return str(folder / name)
    return name


# Keys of the DeepSpeed JSON that the trainer's own config decides.
_DS_FROM_TRAINER = {
    "train_micro_batch_size_per_gpu": "batch_size", "gradient_accumulation_steps": "grad_accum",
    "gradient_clipping": "grad_clip",
}


def deepspeed_json(cfg: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed config for ``cfg``: the JSON file, with batch size, accumulation, clipping and bf16
    from the trainer's keys, and the optimizer block filled from the trainer's where the JSON leaves
    keys out. A JSON value that contradicts the trainer's is an error naming both keys."""
    path = Path(cfg.deepspeed_config)
    if not path.exists():
        raise ValueError(f"config deepspeed_config: {path} does not exist")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config deepspeed_config: {path} is not valid JSON: {e}") from None
    for key, trainer_key in _DS_FROM_TRAINER.items():
        if key in ds and ds[key] != getattr(cfg, trainer_key):
            raise ValueError(f"{path}: {key}={ds[key]!r} contradicts the trainer's {trainer_key}={getattr(cfg, trainer_key)!r}")
        ds[key] = getattr(cfg, trainer_key)
    bf16 = ds.setdefault("bf16", {})
    if bf16.setdefault("enabled", cfg.dtype == "bfloat16") != (cfg.dtype == "bfloat16"):
        raise ValueError(f"{path}: bf16.enabled={bf16['enabled']!r} contradicts the trainer's dtype={cfg.dtype!r}")
    opt = ds.setdefault("optimizer", {"type": "SWAN" if cfg.optimizer == "swan" else "AdamW"})
    if str(opt.get("type", "")).lower() != cfg.optimizer:
        raise ValueError(f"{path}: optimizer.type={opt.get('type')!r} but the trainer's optimizer={cfg.optimizer!r}")
    params = opt.setdefault("params", {})
    if cfg.optimizer == "swan":
        filled = {"preset": cfg.preset, "lr": cfg.lr, "weight_decay": cfg.weight_decay, "fallback": cfg.fallback,
                  "mode": cfg.swan_mode, "bucket_mb": cfg.bucket_mb, **cfg.swan_options}
    else:
        filled = {"lr": cfg.lr if cfg.lr is not None else 1e-3, "betas": [0.9, 0.95], "weight_decay": cfg.weight_decay}
    for key, value in filled.items():
        if value is not None:
            params.setdefault(key, value)
    ds.setdefault("steps_per_print", 10**9)
    return ds


# --------------------------------------------------------------------------- distributed setup


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


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def _all_reduce_max(value: float, env: DistEnv) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=env.device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# --------------------------------------------------------------------------- building blocks


def build_model(cfg: TrainConfig, vocab_size: int) -> Llama:
    overrides = {k: v for k, v in cfg.model.items() if k != "size"}
    overrides.setdefault("max_seq_len", cfg.seq_len)
    return Llama(model_config(cfg.model.get("size", "tiny"), vocab_size=vocab_size, **overrides))


# Strategies under which every rank's optimizer sees whole matrices (Muon orthogonalises a whole matrix;
# FSDP1/FSDP2/ZeRO hand it shards, and torch's Muon has no engine that gathers them as SWAN's does).
MUON_PARALLEL = ("none", "ddp")


def _decays(name: str, p: torch.Tensor) -> bool:
    """AdamW's weight-decay rule: matrices other than the token embedding decay; vectors never."""
    return p.ndim >= 2 and not name.startswith("tok_embeddings")


def _adamw_groups(named: Sequence[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups (named, empty ones dropped): weight decay where :func:`_decays`, none elsewhere."""
    decay = [(n, p) for n, p in named if _decays(n, p)]
    rest = [(n, p) for n, p in named if not _decays(n, p)]
    return [{"params": [p for _, p in pairs], "param_names": [n for n, _ in pairs], "weight_decay": wd}
            for pairs, wd in ((decay, weight_decay), (rest, 0.0)) if pairs]


Named = list[tuple[str, nn.Parameter]]


def muon_split(model: nn.Module, cfg: TrainConfig) -> tuple[Named, Named]:
    """``(muon, rest)``: the ``(name, parameter)`` pairs SWAN would whiten for ``cfg`` (swan_dist's own
    selection: :func:`swan_dist.param_groups` tags the model, :func:`swan_dist.classify` decides with the
    ``include``/``exclude`` patterns of ``swan_options``, as SWAN does), and everything else (embeddings,
    output head, norms, biases). A fused projection SWAN whitens per part (Q/K/V) is one matrix to Muon;
    a whitened 3-D stack (MoE experts) is refused: torch's Muon takes 2-D parameters only."""
    import swan_dist

    include, exclude = cfg.swan_options.get("include"), cfg.swan_options.get("exclude")
    (group,) = swan_dist.param_groups(model, include, exclude)
    muon, rest = [], []
    for name, p in zip(group["param_names"], group["params"]):
        rule = swan_dist.classify(name, p, include, exclude)
        if rule.use_swan and p.ndim != 2:
            raise ValueError(f"config optimizer=muon: SWAN would whiten {name} ({rule.reason}) but it is "
                             f"{p.ndim}-D and torch.optim.Muon takes 2-D matrices only; exclude it "
                             "(swan_options.exclude) or use optimizer=swan")  # fmt: skip
        (muon if rule.use_swan else rest).append((name, p))
    return muon, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """A **baseline** for comparisons, not swan_dist's product: torch's ``torch.optim.Muon`` on the 2-D
    matrices SWAN would whiten (:func:`muon_split`), torch's AdamW on the rest (embeddings, output head,
    norms), as Muon is meant to be used.

    Muon's lr is scaled with ``adjust_lr_fn="match_rms_adamw"`` (``0.2 * sqrt(max(A, B))`` per matrix,
    Moonshot's rule as torch documents it), so that its updates have AdamW's RMS and both take the same
    ``lr``: one global lr and one schedule, like SWAN's. Weight decay is decoupled on both.

    One ``torch.optim.Optimizer`` over both: its param groups (each tagged ``"optimizer": "muon"`` or
    ``"adamw"``, with that optimizer's hyper-parameters) and its ``state`` are the ones the inner
    ``Muon`` and ``AdamW`` step on, so an lr scheduler, ``zero_grad``, ``state_dict`` /
    ``load_state_dict``, the trainer's DCP checkpoints and :func:`swan_dist.memory.state_bytes` see a
    plain optimizer. Muon keeps one momentum buffer per matrix, AdamW two moments per tensor."""

    def __init__(
        self,
        muon: Sequence[tuple[str, nn.Parameter]],
        adamw_groups: Sequence[dict[str, Any]],
        *,
        lr: float,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.95,
        ns_steps: int = 5,
        adjust_lr_fn: str = "match_rms_adamw",
    ) -> None:
        if not muon:
            raise ValueError("optimizer=muon: the model has no matrix SWAN would whiten, so nothing for Muon")
        self._muon = torch.optim.Muon(
            [{"params": [p for _, p in muon], "param_names": [n for n, _ in muon], "optimizer": "muon"}],
            lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._adamw = None
        if adamw_groups:
            self._adamw = torch.optim.AdamW([{**g, "optimizer": "adamw"} for g in adamw_groups], lr=lr, betas=betas,
                                            weight_decay=weight_decay)  # fmt: skip
        inner = [self._muon, *([self._adamw] if self._adamw is not None else [])]
        super().__init__([g for opt in inner for g in opt.param_groups], defaults={})  # the same group dicts

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # load_state_dict replaces this optimizer's groups and state: hand the inner ones the current objects
        for kind, opt in (("muon", self._muon), ("adamw", self._adamw)):
            if opt is not None:
                opt.param_groups = [g for g in self.param_groups if g["optimizer"] == kind]
                opt.state = self.state
                opt.step()
        return loss


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """SWAN (parameter groups classified by swan_dist), AdamW, or the Muon baseline (:class:`MuonWithAdamW`)
    for ``model`` (not a DDP wrapper)."""
    if cfg.optimizer == "swan":
        import swan_dist

        groups = swan_dist.param_groups(model, fallback=cfg.fallback)
        try:
            return swan_dist.SWAN(groups, preset=cfg.preset, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  mode=cfg.swan_mode, bucket_mb=cfg.bucket_mb, **cfg.swan_options)
        except TypeError as e:
            raise ValueError(f"config swan_options {sorted(cfg.swan_options)}: {e}") from None
    lr = cfg.lr if cfg.lr is not None else 1e-3
    if cfg.optimizer == "muon":
        muon, rest = muon_split(model, cfg)
        return MuonWithAdamW(muon, _adamw_groups(rest, cfg.weight_decay), lr=lr, weight_decay=cfg.weight_decay)
    params = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if _decays(n, p)]
    no_decay = [p for n, p in params if not _decays(n, p)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **adamw_kernel([p for _, p in params]))


def adamw_kernel(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """torch's fastest AdamW implementation for these tensors, as an AdamW keyword: fused for plain
    tensors, foreach for tensor subclasses such as FSDP2's DTensors (torch's own default on the CPU is
    a loop over tensors, well behind both)."""
    plain = all(type(p) in PLAIN for p in params)
    return {"fused": True} if plain else {"foreach": True}


def schedule_ratios(cfg: TrainConfig) -> tuple[float, float]:
    """(warmup_ratio, min_lr_ratio): the config's, else the SWAN preset's schedule, else (0.1, 0.1)."""
    defaults = {"warmup_ratio": 0.1, "min_lr_ratio": 0.1}
    if cfg.optimizer == "swan":
        import swan_dist

        defaults.update(swan_dist.load_preset(cfg.preset).get("schedule", {}))
    warmup = cfg.warmup_ratio if cfg.warmup_ratio is not None else defaults["warmup_ratio"]
    min_ratio = cfg.min_lr_ratio if cfg.min_lr_ratio is not None else defaults["min_lr_ratio"]
    return float(warmup), float(min_ratio)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over warmup_ratio * steps, then cosine decay to min_lr_ratio; scales every group."""
    warmup_ratio, min_ratio = schedule_ratios(cfg)
    warmup = int(warmup_ratio * cfg.steps)

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _ddp(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)  # buffers are constants


def _fsdp2(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """FSDP2: each transformer block one shard group, the root (embeddings, norm, head) another."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


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


def wrap_model(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    return PARALLEL[cfg.parallel](model, cfg, env)


def _autocast(cfg: TrainConfig, env: DistEnv):
    """bf16 autocast; DeepSpeed keeps bf16 weights itself (its JSON's ``bf16``)."""
    enabled = cfg.dtype == "bfloat16" and cfg.parallel != "deepspeed"
    return torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate(model: nn.Module, data: TextData, cfg: TrainConfig, env: DistEnv) -> float:
    """Mean token loss over the fixed validation windows, shared between ranks and summed with all_reduce."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=env.device)
    for x, y in eval_batches(data.val, cfg.seq_len, cfg.batch_size, cfg.eval_batches, env.rank, env.world_size):
        with _autocast(cfg, env):
            _, loss = model(x.to(env.device), y.to(env.device))
        total[0] += loss.double() * y.numel()
        total[1] += y.numel()
    model.train()
    _all_reduce_sum(total)
    return (total[0] / total[1]).item()


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha1 over the exact bytes of every tensor of a state dict (replicas must agree bit for bit)."""
    h = hashlib.sha1()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def plot_losses(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # object API + Agg canvas: no pyplot, no global backend

    fig = Figure(figsize=(7, 4.5), dpi=120)
    ax = fig.subplots()
    train = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


# --------------------------------------------------------------------------- training


def train_step(
    wrapped: nn.Module,
    sampler: WindowSampler,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: TrainConfig,
    env: DistEnv,
    clock: dict[str, float] | None = None,
) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns this rank's mean loss (detached).
    ``clock["optimizer_seconds"]`` (if given) accumulates the time spent in the optimizer step (under
    DeepSpeed: ``engine.step()`` at the accumulation boundary)."""
    from torch.distributed.fsdp import FSDPModule

    def timed(fn: Callable[[], Any]) -> None:
        if clock is None:
            fn()
            return
        sync = cfg.time_optimizer and env.device.type == "cuda"
        if sync:
            torch.cuda.synchronize(env.device)
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize(env.device)
        clock["optimizer_seconds"] = clock.get("optimizer_seconds", 0.0) + time.perf_counter() - t

    if cfg.parallel == "deepspeed":  # the engine scales by grad_accum, clips, steps at the boundary
        mean_loss = torch.zeros((), device=env.device)
        for _ in range(cfg.grad_accum):
            x, y = next(sampler)
            _, loss = wrapped(x.to(env.device), y.to(env.device))
            wrapped.backward(loss)
            timed(wrapped.step)
            mean_loss += loss.detach().float() / cfg.grad_accum
        return mean_loss
    ddp = isinstance(wrapped, DistributedDataParallel)
    mean_loss = torch.zeros((), device=env.device)
    for micro in range(cfg.grad_accum):
        x, y = next(sampler)
        last = micro == cfg.grad_accum - 1
        if isinstance(wrapped, FSDPModule):
            wrapped.set_requires_gradient_sync(last)
        sync = wrapped.no_sync() if ddp and not last else nullcontext()
        with sync:  # gradients are reduced on the last micro-batch only
            with _autocast(cfg, env):
                _, loss = wrapped(x.to(env.device), y.to(env.device))
            (loss / cfg.grad_accum).backward()
        mean_loss += loss.detach() / cfg.grad_accum
    if cfg.grad_clip > 0:
        nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.grad_clip)
    timed(optimizer.step)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return mean_loss


class MetricsLog:
    """Metric rows, kept on every rank; rank 0 also appends them to ``metrics.jsonl`` as they come.
    A resumed run starts from the checkpoint's rows: the file is rewritten with those (dropping rows
    logged after the checkpoint, which the resumed run logs again) and continues from there."""

    def __init__(self, path: Path | None, rows: Sequence[dict[str, Any]] = ()) -> None:
        self.rows: list[dict[str, Any]] = []
        self._file = open(path, "w") if path is not None else None
        for row in rows:
            self.add(row)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _whitened(optimizer: torch.optim.Optimizer, env: DistEnv) -> int | None:
    count = getattr(client_optimizer(optimizer), "whitened_matrices", None)
    if count is None:
        return None
    return int(_all_reduce_sum(torch.tensor(float(count), device=env.device)).item())


def _fault_injection(step: int, env: DistEnv) -> None:
    """Tests only: ``SWAN_DIST_FAULT_KILL=RANK:STEP`` makes that rank SIGKILL itself after that step's
    optimizer step, on a job's first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT 0 or unset)."""
    spec = os.environ.get("SWAN_DIST_FAULT_KILL")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, _, at = spec.partition(":")
    if int(rank) == env.rank and int(at) == step:
        print(f"rank {env.rank}: SWAN_DIST_FAULT_KILL, SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Run:
    """What every rank trains with: the data, the model (``owner``: the module the optimizer sees, inside
    ``wrapped``), optimizer, scheduler and sampler, and the clock that keeps evaluation out of throughput."""

    cfg: TrainConfig
    env: DistEnv
    data: TextData
    wrapped: nn.Module
    owner: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: WindowSampler
    n_params: int  # counted before wrapping: ZeRO-3 leaves empty partitions behind
    tokens_per_step: int
    clock: dict[str, float] = field(default_factory=lambda: {"eval_seconds": 0.0})

    def timed_eval(self) -> float:
        """:func:`evaluate`, its time added to ``clock["eval_seconds"]``."""
        t = time.perf_counter()
        loss = evaluate(self.wrapped, self.data, self.cfg, self.env)
        self.clock["eval_seconds"] += time.perf_counter() - t
        return loss

    def lrs(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


@dataclass
class Progress:
    """The training loop's state: where it starts (step 0, or a checkpoint's step), the metrics log, and
    this rank's train-loss accumulators since the last logged row (saved in checkpoints)."""

    log: MetricsLog
    start: float  # perf_counter at the run's start; a resumed run's is earlier by the checkpoint's elapsed
    initial_val: float
    loss_sum: torch.Tensor
    start_step: int = 0
    start_tokens: int = 0
    whitened_offset: int = 0  # whitened matrices counted before the checkpoint but not by the loaded optimizer
    resumed_train_s: float = 0.0  # training time (evaluation excluded) before the checkpoint
    loss_steps: int = 0
    last_tokens: int = 0
    last_time: float = 0.0

    def tokens_at(self, step: int, tokens_per_step: int) -> int:
        return self.start_tokens + (step - self.start_step) * tokens_per_step


def _resume_point(cfg: TrainConfig, env: DistEnv) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from and its meta (both None for a fresh start, which with ``resume:
    never`` first deletes the out_dir's checkpoints, so that a later ``resume: auto`` finds none of them)."""
    resume_from = checkpoint.find(cfg.resume, cfg.out_dir)
    meta = checkpoint.read_meta(resume_from, cfg.parallel, env.world_size) if resume_from else None
    if meta is not None and meta["step"] > cfg.steps:
        raise ValueError(f"{resume_from} is at step {meta['step']}, past this run's steps={cfg.steps}")
    if cfg.resume == "never" and env.is_main:
        checkpoint.clear(cfg.out_dir)
    return resume_from, meta


def build_run(cfg: TrainConfig, env: DistEnv) -> Run:
    """Build the data, model, parallel wrapper, optimizer, scheduler and sampler; rank 0 also writes the
    out_dir's config.yaml and prints the run's size."""
    if not env.is_main:  # rank 0 builds the data cache, the others then read it
        _barrier()
    data = build_data(cfg.data, vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction)
    if env.is_main:
        _barrier()

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data.vocab_size).to(env.device)
    n_params = model.num_params()
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * env.world_size
    if env.is_main:
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
        print(
            f"model {cfg.model}: {n_params / 1e6:.2f}M params | data {data.path} "
            f"({len(data.train):,} train / {len(data.val):,} val tokens) | "
            f"world {env.world_size} on {env.device} | {tokens_per_step:,} tokens/step",
            flush=True,
        )
    if cfg.parallel == "deepspeed":
        wrapped, optimizer, scheduler = deepspeed_engine(model, cfg)
        owner = wrapped.module
    else:
        wrapped = wrap_model(model, cfg, env)
        # the optimizer sees the module that owns every parameter: DDP's inner module (names without
        # "module."), FSDP1's root wrapper (its FlatParameter views), FSDP2's sharded model itself
        owner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
        optimizer = build_optimizer(cfg, owner)
        scheduler = build_scheduler(cfg, optimizer)
    sampler = WindowSampler(data.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed, rank=env.rank)
    return Run(cfg, env, data, wrapped, owner, optimizer, scheduler, sampler, n_params, tokens_per_step)


def _fresh_start(run: Run) -> Progress:
    """Start at step 0: a new metrics log whose first row is the initial validation loss."""
    loss_sum = torch.zeros((), device=run.env.device)
    log = MetricsLog(Path(run.cfg.out_dir) / "metrics.jsonl" if run.env.is_main else None)
    start = time.perf_counter()
    initial_val = run.timed_eval()
    log.add({"step": 0, "tokens": 0, "val_loss": initial_val, "lr": run.lrs()})
    return Progress(log, start, initial_val, loss_sum)


def _resume(run: Run, resume_from: Path, meta: dict[str, Any]) -> Progress:
    """Load the checkpoint into the model, optimizer, scheduler and sampler, and continue from its step,
    clocks and metrics rows (and this rank's loss accumulators, if saved at the same world size)."""
    cfg, env = run.cfg, run.env
    loss_sum = torch.zeros((), device=env.device)
    mine = checkpoint.load(resume_from, rank=env.rank, world_size=env.world_size, seed=cfg.seed,
                           wrapped=run.wrapped, optimizer=run.optimizer, scheduler=run.scheduler,
                           sampler=run.sampler, deepspeed=cfg.parallel == "deepspeed")  # fmt: skip
    resumed_train_s = meta["elapsed"] - meta["eval_seconds"]
    if mine is not None:  # same world size: the log's accumulators continue too
        loss_sum += mine["loss_sum"].to(env.device)
        loss_steps, last_tokens, last_time = mine["loss_steps"], meta["last_tokens"], meta["last_time"]
    else:
        loss_steps, last_tokens, last_time = 0, meta["tokens"], resumed_train_s
    whitened_offset = 0
    if meta.get("whitened_matrices") is not None:  # loading may take a zero step (DCP's state init)
        whitened_offset = meta["whitened_matrices"] - (_whitened(run.optimizer, env) or 0)
    run.clock["eval_seconds"] = meta["eval_seconds"]
    log = MetricsLog(Path(cfg.out_dir) / "metrics.jsonl" if env.is_main else None, meta["rows"])
    start = time.perf_counter() - meta["elapsed"]
    if env.is_main:
        print(f"resumed from {resume_from} (step {meta['step']}, saved at world size {meta['world_size']})",
              flush=True)  # fmt: skip
    return Progress(log, start, log.rows[0]["val_loss"], loss_sum, start_step=meta["step"],
                    start_tokens=meta["tokens"], whitened_offset=whitened_offset, resumed_train_s=resumed_train_s,
                    loss_steps=loss_steps, last_tokens=last_tokens, last_time=last_time)  # fmt: skip


def _save_checkpoint(run: Run, p: Progress, step: int, tokens: int) -> None:
    """Checkpoint ``step`` on every rank, with what a resume needs: clocks, metrics rows, loss accumulators."""
    cfg, env = run.cfg, run.env
    whitened = _whitened(run.optimizer, env)
    checkpoint.save(
        cfg.out_dir, step, cfg.keep_checkpoints, rank=env.rank, wrapped=run.wrapped, optimizer=run.optimizer,
        scheduler=run.scheduler, sampler=run.sampler, deepspeed=cfg.parallel == "deepspeed",
        rank_state={"loss_sum": p.loss_sum.detach().cpu(), "loss_steps": p.loss_steps},
        meta={"world_size": env.world_size, "parallel": cfg.parallel, "tokens": tokens,
              "elapsed": time.perf_counter() - p.start, "eval_seconds": run.clock["eval_seconds"],
              "last_tokens": p.last_tokens, "last_time": p.last_time, "rows": p.log.rows,
              "whitened_matrices": None if whitened is None else whitened + p.whitened_offset},
    )  # fmt: skip


def _train_loop(run: Run, p: Progress) -> None:
    """Steps ``p.start_step + 1`` to ``cfg.steps``: a metrics row every ``log_every`` / ``eval_every`` steps
    and at the last, a checkpoint every ``checkpoint_every``; closes the log at the end."""
    cfg, env = run.cfg, run.env
    bar = tqdm(range(p.start_step + 1, cfg.steps + 1), initial=p.start_step, total=cfg.steps,
               disable=not env.is_main, desc="train", dynamic_ncols=True)  # fmt: skip
    for step in bar:
        lrs = run.lrs()
        p.loss_sum += train_step(run.wrapped, run.sampler, run.optimizer, run.scheduler, cfg, env, run.clock)
        p.loss_steps += 1
        _fault_injection(step, env)
        tokens, last = p.tokens_at(step, run.tokens_per_step), step == cfg.steps
        row: dict[str, Any] = {}
        if step % cfg.log_every == 0 or last:  # mean train loss since the last log, over all ranks
            train_time = time.perf_counter() - p.start - run.clock["eval_seconds"]
            row["train_loss"] = _all_reduce_sum(p.loss_sum / p.loss_steps).item() / env.world_size
            row["tok_per_s"] = (tokens - p.last_tokens) / max(train_time - p.last_time, 1e-9)
            p.loss_sum.zero_()
            p.loss_steps, p.last_tokens, p.last_time = 0, tokens, train_time
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", tok_s=f"{row['tok_per_s']:,.0f}")
        if step % cfg.eval_every == 0 or last:
            row["val_loss"] = run.timed_eval()
        if row:
            p.log.add({"step": step, "tokens": tokens, **row, "lr": lrs, "elapsed": time.perf_counter() - p.start})
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            _save_checkpoint(run, p, step, tokens)
    bar.close()
    p.log.close()


def _summary(run: Run, p: Progress, elapsed: float) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The run's summary and the model's full state dict; collective, so every rank calls it."""
    cfg, env = run.cfg, run.env
    eval_seconds = run.clock["eval_seconds"]
    full = full_state_dict(run.owner)
    digests = [weights_digest(full)] * env.world_size
    if dist.is_initialized():
        dist.all_gather_object(digests, digests[0])
    tokens = p.tokens_at(cfg.steps, run.tokens_per_step)
    summary = {
        "optimizer": cfg.optimizer,
        "preset": cfg.preset if cfg.optimizer == "swan" else None,
        "model": cfg.model,
        "n_params": run.n_params,
        "parallel": cfg.parallel,
        "world_size": env.world_size,
        "device": str(env.device),
        "steps": cfg.steps,
        "tokens": tokens,
        "time_s": elapsed,
        "tok_per_s": tokens / max(elapsed - eval_seconds, 1e-9),
        # this run's seconds in the optimizer step (slowest rank; steps before a resume not counted), and
        # their share of the training time (evaluation excluded)
        "optimizer_s": (opt_s := _all_reduce_max(run.clock.get("optimizer_seconds", 0.0), env)),
        "optimizer_share": opt_s / max(elapsed - eval_seconds - p.resumed_train_s, 1e-9),
        "initial_val_loss": p.initial_val,
        "final_val_loss": p.log.rows[-1]["val_loss"],
        "final_train_loss": p.log.rows[-1]["train_loss"],
        "weights_sha1": digests,  # one per rank; data parallelism must keep them equal
        # SWAN: matrices whitened, summed over ranks (a resumed run counts those before the checkpoint)
        "whitened_matrices": None if (w := _whitened(run.optimizer, env)) is None else w + p.whitened_offset,
        # bytes summed over ranks: the optimizer's state, and a wrapper's fp32 masters (DeepSpeed's)
        **{k: int(_all_reduce_sum(torch.tensor(float(v), device=env.device)).item())
           for k, v in state_bytes(run.optimizer).items()},
    }
    return summary, full


def _write_outputs(cfg: TrainConfig, summary: dict[str, Any], full: dict[str, torch.Tensor],
                   rows: list[dict[str, Any]]) -> None:  # fmt: skip
    """Rank 0's outputs: model.pt (with save_model), loss_curve.png, summary.json, and the final losses."""
    out_dir = Path(cfg.out_dir)
    if cfg.save_model:
        torch.save(full, out_dir / "model.pt")
    label = summary["preset"] or cfg.optimizer
    title = f"{cfg.model.get('size', 'tiny')} / {label} / world {summary['world_size']}"
    plot_losses(rows, out_dir / "loss_curve.png", title)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("initial_val_loss", "final_val_loss", "final_train_loss", "time_s")}))


def train(cfg: TrainConfig, env: DistEnv) -> dict[str, Any]:
    """Train (from the checkpoint ``cfg.resume`` finds, if any), write the outputs, and return the summary."""
    resume_from, meta = _resume_point(cfg, env)
    run = build_run(cfg, env)
    progress = _fresh_start(run) if resume_from is None else _resume(run, resume_from, meta)
    _train_loop(run, progress)
    elapsed = time.perf_counter() - progress.start
    summary, full = _summary(run, progress, elapsed)
    if env.is_main:
        _write_outputs(cfg, summary, full, progress.log.rows)
    return summary


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m swan_dist.reference.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config (see configs/train/)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set steps=50 model.n_layers=2 lr=3e-3")  # fmt: skip
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's; LOCAL_RANK is read
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set)
    env = setup_distributed(cfg)
    try:
        summary = train(cfg, env)
        gc.collect()  # the model's and optimizer's tensors go while the interpreter is whole, not at its exit
        if env.owns_process_group:  # every rank done before any tears down (rank 0 may host the store)
            dist.barrier()
        return summary
    finally:
        if env.owns_process_group:
            dist.destroy_process_group()


def cli() -> None:
    """Console-script entry point (``main`` returns the summary, which ``sys.exit`` would print as an error).

    After a finished run (results written, process group destroyed) the process leaves with ``os._exit``:
    native libraries' threads torn down by the interpreter's exit have aborted a finished rank ("terminate
    called without an active exception", about once in tens of gloo runs), which torchrun reports as a
    failed job and restarts under ``--max-restarts``. An error still raises as usual."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    cli()
