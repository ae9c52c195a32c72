"""Reference trainer: a LLaMA-style model on real text with SWAN, or the AdamW / Muon baselines.

    python -m swan_dist.reference.train --config configs/train/main.yaml [--set key=value ...]
    torchrun --nproc_per_node 2 -m swan_dist.reference.train --config configs/train/main.yaml

This module is the command line; the trainer's parts are modules of their own so that other parallel
strategies can reuse them: the config (:mod:`.config`), the model (:mod:`.model`) and data (:mod:`.data`),
the process group and parallel wrappers (:mod:`.parallel`; a new strategy is one more entry in
``PARALLEL``), the optimizer and schedule (:mod:`.optim`, the baselines in :mod:`.baselines`), one
training step (:mod:`.step`), the run with its resume and checkpoints (:mod:`.loop`, :mod:`.checkpoint`)
and what it writes (:mod:`.outputs`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .config import load_config
from .loop import train
from .parallel import setup_distributed


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
