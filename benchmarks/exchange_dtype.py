"""What ``SWAN(exchange_dtype=...)`` sends and whether it changes training, at W = 2 (gloo, CPU): rank 0's owner
exchange bytes per step under FSDP2 mixed precision per exchange dtype, and the reference trainer's final validation
loss (FSDP2, wiki, SWAN‡) with ``param`` and ``bf16`` per seed.

    python benchmarks/exchange_dtype.py                       # tiny and small, seeds 0 and 1
    python benchmarks/exchange_dtype.py --sizes tiny --steps 20 --no-write
"""

import statistics
import tempfile

import torch

from measure import parser, publish, spawn  # the script's folder is on sys.path

DTYPES = ("param", "bf16", "fp32")


def _bytes(rank, world, size):
    """Bytes per step rank's exchange sent, per exchange dtype, under FSDP2 mixed precision (3 steps, random tokens)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import swan_dist
    from swan_dist.reference.model import Llama, model_config

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    policy, out = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), {}
    for xd in DTYPES:
        torch.manual_seed(0)
        model = Llama(model_config(size, vocab_size=1024))
        for unit in (*model.layers, model):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        assert next(model.parameters()).dtype == torch.float32  # the shards FSDP2 mixed precision keeps
        opt = swan_dist.SWAN(model, verbose=False, exchange_dtype=xd)
        tokens = torch.randint(0, 1024, (2, 65), generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            opt.zero_grad()
            model(tokens[:, :-1], tokens[:, 1:])[1].backward()
            opt.step()
        out[xd] = opt.exchange.bytes_sent / 3
    dist.destroy_process_group()
    return out


def _train(rank, world, size, steps, seed, xd, out_dir):
    from swan_dist.reference.train import main

    summary = main(["--set", f"model.size={size}", "data=wiki", "seq_len=128", "batch_size=16", f"steps={steps}",
                    "optimizer=swan", "preset=swan_ddagger", "lr=null", "weight_decay=0.0", "parallel=fsdp2",
                    f"seed={seed}", f"eval_every={steps}", "eval_batches=8", f"log_every={steps}",
                    f"out_dir={out_dir}", "save_model=false", "checkpoint_every=0", "resume=never",
                    f"swan_options.exchange_dtype={xd}"])
    return {"final_val_loss": summary["final_val_loss"]}


def main() -> None:
    args = parser(__doc__, sizes="tiny,small", seeds="0,1", steps=250).parse_args()  # steps: of 16 x 128 tokens
    sizes, seeds = args.sizes.split(","), [int(s) for s in args.seeds.split(",")]
    lines = ["**Bytes per step** (rank 0's owner exchange, both directions; FSDP2, "
             "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fp32 shards, W = 2):", "",
             "| model | `param` (fp32 shards) | `bf16` | `fp32` | bf16 / param |", "|---|---:|---:|---:|---:|"]
    for size in sizes:
        p, h, f = (spawn(_bytes, 2, size)[0][x] / 2**10 for x in DTYPES)
        lines.append(f"| {size} | {p:,.1f} KiB | {h:,.1f} KiB | {f:,.1f} KiB | {h / p:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", f"**Loss** (the reference trainer, FSDP2 at W = 2, fp32, wiki, {args.steps} steps of 16 x 128 "
              "tokens, SWAN‡ at its preset lr; final validation loss per seed):", "",
              f"| model | exchange | {' | '.join(f'seed {s}' for s in seeds)} | mean | bf16 - param | seeds' spread "
              "(param) |", "|---|---|" + "---:|" * (len(seeds) + 3)]
    for size in sizes:
        loss = {"param": [], "bf16": []}
        for xd in loss:
            for seed in seeds:
                with tempfile.TemporaryDirectory() as out:
                    loss[xd].append(spawn(_train, 2, size, args.steps, seed, xd, out)[0]["final_val_loss"])
                print(f"{size} {xd} seed {seed}: {loss[xd][-1]:.4f}", flush=True)
        mean = {xd: statistics.mean(v) for xd, v in loss.items()}
        last = f"{mean['bf16'] - mean['param']:+.4f} | {max(loss['param']) - min(loss['param']):.4f} |"
        for xd, v in loss.items():
            cells = " | ".join(f"{x:.4f}" for x in v)
            lines.append(f"| {size} | `{xd}` | {cells} | {mean[xd]:.4f} | {last if xd == 'bf16' else '| |'}")
    publish("exchange-dtype-cpu", "Exchange dtype (CPU, W=2): bytes per step and the loss", "\n".join(lines),
            write=not args.no_write)


if __name__ == "__main__":
    main()
