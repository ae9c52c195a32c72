"""SWAN vs DeepSpeed's own AdamW under ZeRO-1/2/3, side by side in one run: per rank, ``engine.step()`` and
iteration time, optimizer state and fp32 master bytes of the reference LLaMA at W processes (``deepspeed_zero``).

    python benchmarks/deepspeed_zero.py --size small --steps 6
"""

import os
import statistics

import torch
import torch.distributed as dist

from measure import median_time, parser, publish, spawn  # (benchmarks/ is the script's folder)

WARMUP = 2


def _worker(rank: int, world: int, a, stage: int, opt: str) -> dict:
    """``opt`` under ZeRO ``stage``: median step and iteration seconds, state bytes (this rank's)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    import deepspeed

    from swan_dist.memory import client_optimizer, state_bytes
    from swan_dist.reference.model import Llama, model_config

    torch.manual_seed(0)
    model = Llama(model_config(a.size, vocab_size=8192, max_seq_len=a.seq))
    params = {"preset": "swan_ddagger", "lr": 0.02, "verbose": False} if opt == "SWAN" else {"lr": 1e-3}
    config = {"train_micro_batch_size_per_gpu": a.batch, "steps_per_print": 10**9,
              "optimizer": {"type": opt, "params": params}, "zero_optimization": {"stage": stage}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g, sync = torch.Generator().manual_seed(rank), torch.cuda.synchronize if cuda else (lambda: None)
    fwd_bwd_t = []

    def fwd_bwd(k: int) -> None:  # untimed by the step's clock: timed on its own, for the iteration's time
        x = torch.randint(0, 8192, (a.batch, a.seq + 1), generator=g).to(engine.device)
        fwd_bwd_t.append(median_time(lambda: engine.backward(engine(x[:, :-1], x[:, 1:])[1]), 1, sync=sync)[0])

    step, times = median_time(engine.step, a.steps, WARMUP, sync, fwd_bwd)
    row = dict(step=step, iter=statistics.median(f + s for f, s in zip(fwd_bwd_t[WARMUP:], times)),
               **state_bytes(optimizer), kind=type(client_optimizer(optimizer)).__name__,
               n=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
    dist.barrier()
    dist.destroy_process_group()
    return row


def main() -> None:
    a = parser(__doc__, world=2, size="small", steps=6, seq=128, batch=4).parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores, gloo)"
    mb = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    lines = [f"Reference LLaMA `{a.size}`, W = {a.world} on {device}, {a.batch}x{a.seq} tokens per rank and step, "
             f"median of {a.steps} steps after {WARMUP} warm-up.", "",
             "| ZeRO | optimizer | step ms | iteration ms | state MiB | masters MiB | step SWAN/AdamW "
             "| state SWAN/AdamW |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for stage in (1, 2, 3):
        rows = {opt: spawn(_worker, a.world, a, stage, opt)[0] for opt in ("SWAN", "AdamW")}
        s, adam = rows["SWAN"], rows["AdamW"]
        for opt, r in rows.items():
            ratio = (f"{s['step'] / adam['step']:.2f}", f"{s['optimizer_state'] / adam['optimizer_state']:.2f}") \
                if opt == "SWAN" else ("", "")
            lines.append(f"| {stage} | {opt} ({r['kind']}) | {1e3 * r['step']:.1f} | {1e3 * r['iter']:.1f} | "
                         f"{mb(r['optimizer_state'])} | {mb(r['master_weights'])} | {ratio[0]} | {ratio[1]} |")
            print(lines[-1], flush=True)
    lines += ["", f"{rows['SWAN']['n'] / 1e6:.1f}M parameters; AdamW state is 8 bytes per parameter held, split over "
              "the ranks."]
    where = "GPU" if torch.cuda.is_available() else "CPU"
    publish("deepspeed_zero", f"DeepSpeed ZeRO ({where}): SWAN vs DeepSpeed AdamW (W={a.world})", "\n".join(lines),
            write=not a.no_write)


if __name__ == "__main__":
    main()
