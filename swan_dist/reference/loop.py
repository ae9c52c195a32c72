"""The reference trainer's run: build the data, model, parallel wrapper, optimizer and schedule
(:func:`build_run`), start fresh or resume from a checkpoint, train with a metrics row every
``log_every`` / ``eval_every`` steps and a checkpoint every ``checkpoint_every``, and summarise
(:func:`train`)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from swan_dist.memory import client_optimizer, state_bytes

from . import checkpoint
from .config import TrainConfig
from .data import TextData, WindowSampler, build_data
from .model import Llama, model_config
from .optim import build_optimizer, build_scheduler
from .outputs import MetricsLog, weights_digest, write_outputs
from .parallel import DistEnv, all_reduce_max, all_reduce_sum, barrier, deepspeed_engine, full_state_dict, wrap_model
from .step import evaluate, train_step


def build_model(cfg: TrainConfig, vocab_size: int) -> Llama:
    overrides = {k: v for k, v in cfg.model.items() if k != "size"}
    overrides.setdefault("max_seq_len", cfg.seq_len)
    return Llama(model_config(cfg.model.get("size", "tiny"), vocab_size=vocab_size, **overrides))


def _whitened(optimizer: torch.optim.Optimizer, env: DistEnv) -> int | None:
    count = getattr(client_optimizer(optimizer), "whitened_matrices", None)
    if count is None:
        return None
    return int(all_reduce_sum(torch.tensor(float(count), device=env.device)).item())


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
    meta = checkpoint.read_meta(resume_from, cfg.parallel, env.world_size, cfg.optimizer) if resume_from else None
    if meta is not None and meta["step"] > cfg.steps:
        raise ValueError(f"{resume_from} is at step {meta['step']}, past this run's steps={cfg.steps}")
    if cfg.resume == "never" and cfg.init_from is not None:
        inside, source = checkpoint.root(cfg.out_dir).resolve(), Path(cfg.init_from).resolve()
        if source in (inside, inside.parent) or inside in source.parents:
            raise ValueError(f"config init_from={cfg.init_from} lies in this run's out_dir={cfg.out_dir}, whose "
                             "checkpoints resume=never deletes: give this run another out_dir")
    if cfg.resume == "never" and env.is_main:
        checkpoint.clear(cfg.out_dir)
    return resume_from, meta


def build_run(cfg: TrainConfig, env: DistEnv) -> Run:
    """Build the data, model, parallel wrapper, optimizer, scheduler and sampler; rank 0 also writes the
    out_dir's config.yaml and prints the run's size."""
    if not env.is_main:  # rank 0 builds the data cache, the others then read it
        barrier()
    data = build_data(cfg.data, vocab_size=cfg.vocab_size, val_fraction=cfg.val_fraction)
    if env.is_main:
        barrier()

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


def _init_from(run: Run) -> None:
    """``init_from``: the model's weights (and, for SWAN, the fallback parameters' AdamW moments) from
    another run's checkpoint, before step 0."""
    cfg, env = run.cfg, run.env
    try:
        path = checkpoint.find(cfg.init_from, cfg.out_dir)
    except FileNotFoundError as e:
        raise FileNotFoundError(str(e).replace("config resume=", "config init_from=", 1)) from None
    meta = checkpoint.init_from(path, wrapped=run.wrapped, optimizer=run.optimizer, swan=cfg.optimizer == "swan")
    if env.is_main:
        kept = ("weights and the fallback parameters' AdamW moments (SWAN's matrices start without state)"
                if cfg.optimizer == "swan" else "weights (the optimizer starts without state)")
        print(f"init_from {path} (step {meta['step']}, optimizer {meta.get('optimizer', 'not recorded')}): {kept}; "
              f"this run starts at step 0 with its own lr schedule", flush=True)


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
        meta={"world_size": env.world_size, "parallel": cfg.parallel, "optimizer": cfg.optimizer, "tokens": tokens,
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
            row["train_loss"] = all_reduce_sum(p.loss_sum / p.loss_steps).item() / env.world_size
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
        "optimizer_s": (opt_s := all_reduce_max(run.clock.get("optimizer_seconds", 0.0), env)),
        "optimizer_share": opt_s / max(elapsed - eval_seconds - p.resumed_train_s, 1e-9),
        "initial_val_loss": p.initial_val,
        "final_val_loss": p.log.rows[-1]["val_loss"],
        "final_train_loss": p.log.rows[-1]["train_loss"],
        "weights_sha1": digests,  # one per rank; data parallelism must keep them equal
        # SWAN: matrices whitened, summed over ranks (a resumed run counts those before the checkpoint)
        "whitened_matrices": None if (w := _whitened(run.optimizer, env)) is None else w + p.whitened_offset,
        # bytes summed over ranks: the optimizer's state, and a wrapper's fp32 masters (DeepSpeed's)
        **{k: int(all_reduce_sum(torch.tensor(float(v), device=env.device)).item())
           for k, v in state_bytes(run.optimizer).items()},
    }
    return summary, full


def train(cfg: TrainConfig, env: DistEnv) -> dict[str, Any]:
    """Train (from the checkpoint ``cfg.resume`` finds, if any), write the outputs, and return the summary."""
    resume_from, meta = _resume_point(cfg, env)
    run = build_run(cfg, env)
    if resume_from is None and cfg.init_from is not None:  # a resumed run continues from its own checkpoint
        _init_from(run)
    progress = _fresh_start(run) if resume_from is None else _resume(run, resume_from, meta)
    _train_loop(run, progress)
    elapsed = time.perf_counter() - progress.start
    summary, full = _summary(run, progress, elapsed)
    if env.is_main:
        write_outputs(cfg, summary, full, progress.log.rows)
    return summary
