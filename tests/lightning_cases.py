"""Lightning 2.6 on CPU for tests/test_lightning.py: a tiny LightningModule whose ``configure_optimizers``
returns ``swan_dist.SWAN(self)``, Lightning's real strategies, and the runs each rank makes.

Lightning refuses FSDP and DeepSpeed on a CPU accelerator. The strategies below are Lightning's own, each
in the smallest subclass that skips only its device checks: FSDP1 is wrapped with ``device_id=cpu``
(Lightning passes ``root_device.index``, ``None`` on a CPU, and FSDP1 then asks for an accelerator);
DeepSpeed's "CUDA only" check is skipped and it is given CPU devices numbered by rank (its device-index
check and ``deepspeed.initialize`` want an index). The process group is gloo. FSDP checkpoints use
Lightning's ``state_dict_type="sharded"``: its default, "full", sets ``offload_to_cpu=True``, with which
torch 2.13's FSDP1 full *model* state dict segfaults on a CPU model, whatever the optimizer.

Each rank trains on its own slice of a fixed global batch per step, chosen by ``trainer.global_step``
(so a resumed run sees the batch an uninterrupted one sees, whatever Lightning does with the data
loader on resume); the single-process reference trains the same module on the whole batch.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader

import swan_dist
from swan_dist.selection import clean_name

VOCAB, WIDTH, SEQ, MICRO = 64, 32, 9, 4  # MICRO: sequences per rank and step
OPTS = dict(preset="swan_ddagger", lr=0.05)


def global_batch(step: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (world * MICRO, SEQ), generator=g)


class Lit(pl.LightningModule):
    """``how``: what ``configure_optimizers`` returns: ``module`` SWAN(self), ``params`` SWAN(self.parameters()),
    ``strict`` the same with strict=True, ``config`` nothing (DeepSpeed builds SWAN from its config).
    ``fsdp2``: ``configure_model`` applies ``fully_shard`` per Linear and to the whole (ModelParallelStrategy)."""

    def __init__(self, how: str = "module", fsdp2: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.how, self.fsdp2 = how, fsdp2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + torch.tanh(self.fc1(h))
        h = h + torch.tanh(self.fc2(h))
        return self.head(h)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        logits = self(x[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        rank, world = self.trainer.global_rank, self.trainer.world_size
        x = global_batch(self.trainer.global_step, world)[rank * MICRO: (rank + 1) * MICRO]
        return self.loss(x)

    def train_dataloader(self):
        return DataLoader(range(64), batch_size=None)

    def configure_model(self) -> None:
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for m in (self.fc1, self.fc2, self.head):
            fully_shard(m, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self):
        if self.how == "module":
            return swan_dist.SWAN(self, **OPTS)
        if self.how in ("params", "strict"):
            return swan_dist.SWAN(self.parameters(), strict=self.how == "strict", **OPTS)
        return None


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy; the model is wrapped as Lightning wraps it, with ``device_id=cpu``."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        if not any(isinstance(m, FSDP) for m in model.modules()):
            model = FSDP(model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                         sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs)
            self.kwargs.pop("auto_wrap_policy", None)  # applied (Lightning drops it for a wrapped model)
        return super()._setup_model(model)


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy without its "CUDA only" check. It is given CPU devices numbered by
    local rank (``cpu:0``, ``cpu:1``: the same CPU to torch), as DeepSpeed wants a device index per rank."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips only DeepSpeedStrategy's CUDA accelerator check


def strategy(kind: str, **kw):
    if kind == "ddp":
        return DDPStrategy(process_group_backend="gloo")
    if kind == "fsdp":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({nn.Linear}) if kw.get("wrap") else None
        return CPUFSDPStrategy(process_group_backend="gloo", use_orig_params=kw["orig"], auto_wrap_policy=policy,
                               state_dict_type=kw.get("state_dict_type", "sharded"))
    if kind == "deepspeed":
        config = {"zero_optimization": {"stage": kw["stage"]}, "train_micro_batch_size_per_gpu": MICRO}
        if kw.get("config"):
            config["optimizer"] = {"type": "SWAN", "params": OPTS}
        return CPUDeepSpeedStrategy(config=config, process_group_backend="gloo",
                                    parallel_devices=[torch.device("cpu", i) for i in range(2)])
    if kind == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    raise ValueError(kind)


def trainer(kind: str, steps: int, **kw) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(kind, **kw), max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)


def swan_of(optimizer) -> swan_dist.SWAN:
    """The SWAN inside a strategy's optimizer wrapper (DeepSpeed's ZeRO optimizers hold it as ``optimizer``)."""
    while not isinstance(optimizer, swan_dist.SWAN):
        optimizer = optimizer.optimizer
    return optimizer


def full_weights(tr: pl.Trainer, kind: str) -> dict[str, torch.Tensor]:
    """Every parameter of the LightningModule, whole (a collective for FSDP1 and ZeRO-3: every rank calls it)."""
    module = tr.lightning_module
    if kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(tr.strategy.model, writeback=False):
            return {clean_name(n): p.detach().clone() for n, p in module.named_parameters()}
    if kind == "deepspeed":
        import deepspeed

        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
            return {n: p.detach().clone() for n, p in module.named_parameters()}
    if kind == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def run(kind: str, ckpt: str | None = None, **kw) -> dict:
    """One strategy: 1 step (whole weights, summary, matrices this rank whitened), and with ``ckpt`` (a
    path) ``Trainer.save_checkpoint`` after it, a run resumed from it with ``fit(ckpt_path=...)`` to step 2
    and an uninterrupted 2-step run (whole weights of both)."""
    torch.manual_seed(0)
    how = "config" if kw.get("config") else "module"
    model = Lit(how=how, fsdp2=kind == "fsdp2")
    tr = trainer(kind, 1, **kw)
    tr.fit(model)
    swan = swan_of(tr.optimizers[0])
    out = dict(step1=full_weights(tr, kind), summary=swan.summary(), whitened=swan.whitened_matrices,
               wrapper=type(tr.optimizers[0]).__name__)
    if ckpt is None:
        return out
    tr.save_checkpoint(ckpt)
    torch.manual_seed(1)  # other initial weights: the resumed run's must come from the checkpoint
    tr2 = trainer(kind, 2, **kw)
    tr2.fit(Lit(how=how, fsdp2=model.fsdp2), ckpt_path=ckpt)
    out["resumed"] = full_weights(tr2, kind)
    torch.manual_seed(0)
    tr3 = trainer(kind, 2, **kw)
    tr3.fit(Lit(how=how, fsdp2=model.fsdp2))
    out["straight"] = full_weights(tr3, kind)
    return out


def unnamed(kind: str, **kw) -> dict:
    """``configure_optimizers`` returning ``SWAN(self.parameters())``: the warnings it gives, and the error
    (type, message) of the same with ``strict=True``, or of either where SWAN refuses the bare tensors."""
    import warnings

    out = {}
    for how in ("params", "strict"):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                trainer(kind, 1, **kw).fit(Lit(how=how))
                out[how] = None
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[how] = (type(e).__name__, str(e))
        out[how + "_warnings"] = [str(w.message) for w in caught if "swan_dist" in str(w.message)]
    return out


def reference(steps: int, world: int = 2) -> dict[str, torch.Tensor]:
    """Single-process SWAN on the same module and global batches."""
    torch.manual_seed(0)
    model = Lit()
    opt = swan_dist.SWAN(model, verbose=False, **OPTS)
    for t in range(steps):
        opt.zero_grad()
        model.loss(global_batch(t, world)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
