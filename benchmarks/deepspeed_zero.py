"""SWAN vs DeepSpeed's own AdamW under ZeRO-1/2/3, measured side by side in one run.

For each stage, the reference LLaMA model trains a few steps on W processes (gloo on CPU, NCCL on
GPU) with ``"optimizer": {"type": "SWAN"}`` and with ``"type": "AdamW"`` (DeepSpeed's fused Adam op,
JIT-built on first use; ``--torch-adam`` uses torch's instead). Reported per rank: median
``engine.step()`` time (ZeRO-1 also reduces gradients there), median iteration time (forward,
backward, step), the optimizer's state bytes and DeepSpeed's fp32 master bytes
(:func:`swan_dist.memory.state_bytes`). Writes a section of docs/benchmarks.md.

    python benchmarks/deepspeed_zero.py --size small --steps 6
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from measure import write_section  # noqa: E402 (benchmarks/ is the script's folder)


def _worker(rank, world, port, out, size, stage, opt, steps, torch_adam, seq, batch):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    import deepspeed

    import swan_dist
    from swan_dist.memory import state_bytes
    from swan_dist.reference.model import Llama, model_config

    torch.manual_seed(0)
    model = Llama(model_config(size, vocab_size=8192, max_seq_len=seq))
    params = {"preset": "swan_ddagger", "lr": 0.02, "verbose": False} if opt == "SWAN" else {"lr": 1e-3}
    if opt == "AdamW" and torch_adam:
        params["torch_adam"] = True
    config = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 10**9,
              "optimizer": {"type": opt, "params": params}, "zero_optimization": {"stage": stage}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dev = engine.device
    g = torch.Generator().manual_seed(rank)
    step_t, iter_t = [], []
    for i in range(steps + 2):  # two warm-up steps
        x = torch.randint(0, 8192, (batch, seq + 1), generator=g).to(dev)
        t0 = time.perf_counter()
        _, loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            step_t.append(t2 - t1)
            iter_t.append(t2 - t0)
    mem = state_bytes(optimizer)
    row = dict(step=statistics.median(step_t), iter=statistics.median(iter_t), **mem,
               n=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
               kind=type(swan_dist.memory.client_optimizer(optimizer)).__name__)
    if rank == 0:
        torch.save(row, out)
    dist.barrier()
    dist.destroy_process_group()


def measure(world, size, stage, opt, steps, torch_adam, seq, batch) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.pt")
        mp.start_processes(_worker, args=(world, port, out, size, stage, opt, steps, torch_adam, seq, batch),
                           nprocs=world, start_method="spawn")
        return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--torch-adam", action="store_true", help="DeepSpeed with torch's AdamW instead of its fused op")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores, gloo)"
    mb = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    lines = [
        f"Reference LLaMA `{args.size}`, W = {args.world} on {device}, {args.batch}x{args.seq} tokens per rank and "
        f"step, median of {args.steps} steps after 2 warm-up. Per rank: `engine.step()` time, whole iteration "
        "(forward + backward + step), optimizer state, DeepSpeed's fp32 master partitions. SWAN‡ keeps AdamW "
        "state for embeddings, head and norms only (the fallback rule); every SWAN matrix keeps none.",
        "",
        "| ZeRO | optimizer | step ms | iteration ms | state MiB | masters MiB | step SWAN/AdamW | state SWAN/AdamW |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for stage in map(int, args.stages.split(",")):
        rows = {opt: measure(args.world, args.size, stage, opt, args.steps, args.torch_adam, args.seq, args.batch)
                for opt in ("SWAN", "AdamW")}
        s, a = rows["SWAN"], rows["AdamW"]
        for opt, r in rows.items():
            ratio = (f"{s['step'] / a['step']:.2f}", f"{s['optimizer_state'] / a['optimizer_state']:.2f}") \
                if opt == "SWAN" else ("", "")
            lines.append(
                f"| {stage} | {opt} ({r['kind']}) | {1e3 * r['step']:.1f} | {1e3 * r['iter']:.1f} | "
                f"{mb(r['optimizer_state'])} | {mb(r['master_weights'])} | {ratio[0]} | {ratio[1]} |"
            )
            print(lines[-1], flush=True)
    n = rows["SWAN"]["n"]
    lines += ["", f"{n / 1e6:.1f}M parameters; AdamW state is 8 bytes per parameter held, split over the ranks."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("deepspeed_zero", f"DeepSpeed ZeRO ({'GPU' if torch.cuda.is_available() else 'CPU'}): SWAN vs DeepSpeed AdamW (W={args.world})", body)


if __name__ == "__main__":
    main()
