"""Trainer checkpoints: periodic, atomic, pruned, and resumed from the latest complete one.

Layout (``out_dir/checkpoints/``)::

    step_N/            a complete checkpoint (only complete ones carry this name)
      dcp/             none/DDP/FSDP2/FSDP1: torch.distributed.checkpoint of {"model", "optim"}
      engine/          parallel: deepspeed: the engine's own save_checkpoint (tag "engine")
      rank_R.pt        per rank: LR scheduler, data position (the sampler's generator), torch CPU/CUDA
                       RNG states, the train-loss accumulator since the last log row: tensors and plain
                       Python values only, read back with ``torch.load(weights_only=True)``
      meta.json        step, world size, strategy, optimizer, tokens, clocks, metric rows so far
    step_N.tmp/        being written (or left by a crash): ignored by resume, removed by the next save

Every rank writes into ``step_N.tmp``; after a barrier (every rank finished) rank 0 writes
``meta.json`` and renames the folder to ``step_N`` (one ``rename``: atomic on a POSIX file system),
then prunes to ``keep_checkpoints``.

:func:`init_from` starts a new run from another run's checkpoint (``init_from:``): its model weights and,
for SWAN, the AdamW moments of the fallback parameters (:func:`swan_dist.load_adamw_checkpoint`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT = 1
_STEP = re.compile(r"^step_(\d+)$")


def root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def complete(folder: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``folder`` (``step_N`` with ``meta.json``), oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _STEP.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _resolve(resume: str, out_dir: str) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        found = complete(root(out_dir))
        return found[-1][1] if found else None
    p = Path(resume)
    if _STEP.match(p.name) and (p / "meta.json").is_file():
        return p
    for folder in (p, p / "checkpoints"):  # a checkpoints folder, or an out_dir: its latest
        found = complete(folder)
        if found:
            return found[-1][1]
    raise FileNotFoundError(
        f"config resume={resume!r}: no complete checkpoint there (a step_N folder with meta.json, "
        "a checkpoints/ folder, or an out_dir holding one)"
    )


def find(resume: str, out_dir: str) -> Path | None:
    """The checkpoint to resume from, decided by rank 0 and broadcast (every rank gets the same)."""
    choice: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            path = _resolve(resume, out_dir)
            choice[0] = None if path is None else str(path)
        except FileNotFoundError as e:
            choice[0] = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], Exception):
        raise choice[0]
    return None if choice[0] is None else Path(choice[0])


def _meta(path: Path) -> dict[str, Any]:
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {meta.get('format')!r}, this trainer reads {FORMAT}")
    return meta


def read_meta(path: Path, parallel: str, world_size: int, optimizer: str | None = None) -> dict[str, Any]:
    """``meta.json`` of ``path``, checked against this run: the same strategy, the same optimizer (where
    the checkpoint names it), and for DeepSpeed the same world size (its ZeRO checkpoints load only at the
    world size that wrote them)."""
    meta = _meta(path)
    written = meta.get("optimizer")  # absent in checkpoints written before it was recorded
    if optimizer is not None and written is not None and written != optimizer:
        raise ValueError(
            f"{path} was written with optimizer: {written}; this run has optimizer: {optimizer}. Resuming continues "
            f"a run with its own optimizer; to go on from it with {optimizer}, start a new run from it: "
            f"init_from={path} in another out_dir (docs/launch.md, \"From AdamW to SWAN\")")
    if meta["parallel"] != parallel:
        raise ValueError(f"{path} was written with parallel: {meta['parallel']}; this run has parallel: {parallel}")
    if parallel == "deepspeed" and meta["world_size"] != world_size:
        raise ValueError(
            f"{path} was written by DeepSpeed at world size {meta['world_size']}; this run has {world_size}. "
            "DeepSpeed's ZeRO checkpoints load only at the world size that wrote them: resume at world size "
            f"{meta['world_size']}, or convert {path / 'engine'} to a universal checkpoint "
            "(python -m swan_dist.integrations.ds_universal, docs/integrations/deepspeed.md) and load that "
            "with DeepSpeed's load_universal; the reference trainer does not load universal checkpoints"
        )
    return meta


def clear(out_dir: str) -> None:
    """Remove ``out_dir/checkpoints`` (a fresh start, ``resume: never``, must not leave checkpoints of
    another run behind for a later ``resume: auto``)."""
    shutil.rmtree(root(out_dir), ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    out_dir: str,
    step: int,
    keep: int,
    *,
    rank: int,
    wrapped: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: Any,
    rank_state: dict[str, Any],
    meta: dict[str, Any],
    deepspeed: bool,
) -> Path:
    """Collective: every rank calls it at the same step. Returns the final ``step_N`` path."""
    folder = root(out_dir)
    final, tmp = folder / f"step_{step}", folder / f"step_{step}.tmp"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("step_*.tmp"):  # left by a crash while saving
            shutil.rmtree(stale)
        tmp.mkdir()
    _barrier()
    if deepspeed:  # the engine: module, ZeRO partitions with fp32 masters, optimizer, lr scheduler
        wrapped.save_checkpoint(str(tmp), tag="engine", save_latest=False)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(wrapped, optimizer)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"), no_dist=not dist.is_initialized())
    mine = {
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.rng.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        **rank_state,
    }
    torch.save(mine, tmp / f"rank_{rank}.pt")
    _barrier()  # every rank finished writing
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step, **meta}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for _, old in complete(folder)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(
    path: Path,
    *,
    rank: int,
    world_size: int,
    seed: int,
    wrapped: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sampler: Any,
    deepspeed: bool,
) -> dict[str, Any] | None:
    """Collective. Loads model, optimizer and (same world size) every rank's scheduler, data position
    and RNG states; returns this rank's extra state (``rank_state`` given to :func:`save`), or None
    when the world size changed (then the scheduler comes from rank 0's file and each rank's data
    stream restarts from a generator seeded with (seed, rank, step): a new stream, as the ranks differ)."""
    meta = _meta(path)
    if deepspeed:
        load_path, _ = wrapped.load_checkpoint(str(path), tag="engine", load_optimizer_states=True,
                                               load_lr_scheduler_states=True)  # fmt: skip
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {path / 'engine'}")
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(wrapped, optimizer)
        state = {"model": msd, "optim": osd}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not dist.is_initialized())
        set_state_dict(wrapped, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same_world = meta["world_size"] == world_size
    mine = read_rank_file(path / f"rank_{rank if same_world else 0}.pt")
    scheduler.load_state_dict(mine["scheduler"])
    if not same_world:
        sampler.rng = np.random.default_rng([seed, rank, meta["step"]])
        return None
    sampler.rng.bit_generator.state = mine["sampler"]
    torch.set_rng_state(mine["torch_rng"])
    if mine["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(mine["cuda_rng"])
    return {k: v for k, v in mine.items() if k not in ("scheduler", "sampler", "torch_rng", "cuda_rng")}


def read_rank_file(path: Path) -> dict[str, Any]:
    """A ``rank_R.pt``, read with ``torch.load(weights_only=True)``: tensors and plain Python values only (all
    the trainer writes there, in every version), so a file that would run code when unpickled is refused."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{path}: refused: it holds more than tensors and plain Python values, which is not what the reference "
            f"trainer writes, and loading it would run code (torch.load weights_only=True says: "
            f"{str(e).splitlines()[0]})") from e


def init_from(path: Path, *, wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, swan: bool) -> dict[str, Any]:
    """Collective. A new run's start from ``path`` (a ``step_N`` written with parallel none, DDP, FSDP2 or
    FSDP1, any world size, any optimizer): the model's weights, and with ``swan`` the moments of SWAN's
    fallback parameters from the checkpoint's optimizer state (AdamW's, or SWAN's own; SWAN's matrices read
    nothing). Another optimizer (AdamW, Muon) starts without state. Step, scheduler, data position and
    metrics are not read: the run starts at step 0. Returns the checkpoint's meta."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import swan_dist

    meta = _meta(path)
    if meta["parallel"] == "deepspeed":
        raise ValueError(f"config init_from={path}: written by DeepSpeed (its engine's own format); init_from reads "
                         "checkpoints written with parallel none, ddp, fsdp2 or fsdp1 (torch.distributed.checkpoint)")
    no_dist = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        msd = get_model_state_dict(wrapped)
        dcp.load({"model": msd}, checkpoint_id=str(path / "dcp"), no_dist=no_dist)
        set_model_state_dict(wrapped, msd)
        if swan:
            swan_dist.load_adamw_checkpoint(wrapped, optimizer, str(path / "dcp"), key="optim", no_dist=no_dist)
    return meta
