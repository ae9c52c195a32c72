"""Do updates made during backward cost iteration time? A whole iteration (``zero_grad``, forward, backward, ``step``)
of SWAN‡ with ``step_in_backward=True`` and without, on the same model and data in turn, at W=1 and under FSDP2 at
W ranks (gloo, each block an FSDP module): the median and its ratio (the slowest rank's at W > 1).

    python benchmarks/in_backward.py --steps 20
    python benchmarks/in_backward.py --size tiny --no-write   # a quick look
"""

import functools
import statistics

import torch
import torch.distributed as dist

from measure import parser, publish, spawn, turns

BATCH, SEQ, WARMUP, THREADS = 8, 128, 2, 2  # per rank; THREADS: the one-process run's (W > 1: one each)


def _times(rank: int, world: int, size: str, steps: int) -> dict[str, list[float]]:
    """Per variant, every timed iteration's seconds on this rank (``world`` > 1: its process group started here)."""
    import swan_dist
    from swan_dist.reference.model import Llama, model_config

    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from swan_dist.reference.parallel import shard_fsdp2

        dist.init_process_group("gloo")
    runs, batch = {}, [None]
    for name in ("ordinary", "in_backward"):
        torch.manual_seed(0)
        model = Llama(model_config(size))
        if world > 1:
            shard_fsdp2(model, init_device_mesh("cpu", (world,)))
        runs[name] = (model, swan_dist.SWAN(model, preset="swan_ddagger", verbose=False,
                                            step_in_backward=name == "in_backward"))
    g = torch.Generator().manual_seed(rank)
    vocab = runs["ordinary"][0].cfg.vocab_size
    batches = [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(4)]

    def iteration(model, opt):
        tokens = batch[0]
        opt.zero_grad()
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()

    def before(name: str, k: int) -> None:
        batch[0] = batches[k % len(batches)]
        if world > 1:
            dist.barrier()

    times = turns({n: functools.partial(iteration, *run) for n, run in runs.items()}, steps,
                  warmup=WARMUP, before=before)
    if world > 1:
        dist.destroy_process_group()
    return times


def main() -> None:
    args = parser(__doc__, size="small", worlds="1,2", steps=10).parse_args()
    rows = ["| layout | W | ordinary (ms) | in backward (ms) | in backward / ordinary |", "|---|---|---|---|---|"]
    for world in map(int, args.worlds.split(",")):
        torch.set_num_threads(THREADS)
        per_rank = [_times(0, 1, args.size, args.steps)] if world == 1 else spawn(_times, world, args.size, args.steps)
        t = {n: max(statistics.median(r[n]) for r in per_rank) for n in ("ordinary", "in_backward")}
        rows.append(f"| {'one process' if world == 1 else 'FSDP2'} | {world} | {1e3 * t['ordinary']:.1f} | "
                    f"{1e3 * t['in_backward']:.1f} | {t['in_backward'] / t['ordinary']:.2f} |")
        print(rows[-1], flush=True)
    publish("in-backward-cpu", "Updates made during backward (CPU): iteration time against the ordinary step",
            "\n".join([f"The `{args.size}` reference model, {BATCH} x {SEQ} tokens per rank, SWAN‡ (`swan_ddagger`), "
                       "a whole iteration (`zero_grad`, forward, backward, `step`); median of "
                       f"{args.steps} after {WARMUP} warm-up, rounds alternating the two.", "", *rows]),
            write=not args.no_write)


if __name__ == "__main__":
    main()
