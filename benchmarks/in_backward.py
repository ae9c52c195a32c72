"""Updates made during backward against the ordinary step: the time of a whole training iteration
(``zero_grad``, forward, backward, ``step``) of SWAN‡ with ``step_in_backward=True`` and without, on the
same model and data, measured side by side in one run (rounds alternate the two), at W=1 (one process)
and under FSDP2 at W ranks (spawned processes, gloo on the CPU, each transformer block an FSDP module).
Reported: the median iteration time and its ratio in-backward / ordinary (the slowest rank's median at
W > 1). Memory is measured by ``benchmarks/memory.py``. Writes a section of docs/benchmarks.md.

    python benchmarks/in_backward.py                          # small, W=1 and W=2, 8x128 tokens per rank
    python benchmarks/in_backward.py --size tiny --no-write   # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from measure import free_port, write_section  # noqa: E402 (benchmarks/ is the script's folder)

VARIANTS = ("ordinary", "in_backward")


def _model(size: str, world: int):
    from swan_dist.reference.model import Llama, model_config

    torch.manual_seed(0)
    model = Llama(model_config(size))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from swan_dist.reference.parallel import shard_fsdp2

        shard_fsdp2(model, init_device_mesh("cpu", (world,)))
    return model


def _times(size: str, world: int, rank: int, args) -> dict[str, list[float]]:
    import swan_dist

    runs = {}
    for name in VARIANTS:
        model = _model(size, world)
        opt = swan_dist.SWAN(model, preset="swan_ddagger", verbose=False, step_in_backward=name == "in_backward")
        runs[name] = (model, opt)
    vocab = runs["ordinary"][0].cfg.vocab_size
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g) for _ in range(4)]
    times: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for step in range(args.warmup + args.steps):
        for name, (model, opt) in runs.items():  # alternating: a change in the machine's load hits both
            tokens = batches[step % len(batches)]
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        times = _times(args.size, world, rank, args)
        torch.save(times, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measure(world: int, args) -> dict[str, float]:
    """Median iteration seconds per variant (the slowest rank's, at W > 1)."""
    if world == 1:
        torch.set_num_threads(args.threads)
        per_rank = [_times(args.size, 1, 0, args)]
    else:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_worker, args=(world, free_port(), args, out), nprocs=world, join=True)
            per_rank = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]
    return {n: max(statistics.median(t[n]) for t in per_rank) for n in VARIANTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the one-process run (W>1: one each)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = ["| layout | W | ordinary (ms) | in backward (ms) | in backward / ordinary |", "|---|---|---|---|---|"]
    for world in map(int, args.worlds.split(",")):
        t = measure(world, args)
        layout = "one process" if world == 1 else "FSDP2"
        rows.append(f"| {layout} | {world} | {1e3 * t['ordinary']:.1f} | {1e3 * t['in_backward']:.1f} | "
                    f"{t['in_backward'] / t['ordinary']:.2f} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        f"The `{args.size}` reference model, {args.batch} x {args.seq} tokens per rank, SWAN‡ (`swan_ddagger`), a "
        "whole iteration (`zero_grad`, forward, backward, `step`); median of "
        f"{args.steps} after {args.warmup} warm-up, rounds alternating the two.", "", *rows, "",
        "In backward, parameters (one process) or FSDP modules (FSDP2) are updated once their gradients are "
        "reduced, in batches of up to 16 MiB of gradients per rank (the rest when backward ends), and those "
        "gradients freed; the ordinary step holds every gradient until `step()`."])
    if not args.no_write:
        write_section("in-backward-cpu", "Updates made during backward (CPU): iteration time against the ordinary "
                      "step", body)


if __name__ == "__main__":
    main()
