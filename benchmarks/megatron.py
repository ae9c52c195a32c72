"""SWAN vs Megatron's own Adam (and Muon) on a tiny megatron-core GPTModel (tests/megatron_harness.py's on the
CPU) at TP=W, DP=W (distributed optimizer) and, with ``--moe``, EP=2: step time, state, SWAN's bytes sent
(section ``megatron``; ``megatron-cuda`` on a GPU). ``--sweep N``: the loss after N iterations (``megatron-loss``).

    python benchmarks/megatron.py --world 4 --moe       # spawns W processes (or under torchrun: W = its world)
"""

import importlib.util
import math
import os
import statistics
import sys
import warnings
from pathlib import Path
from unittest import mock

# this file would shadow megatron-core's namespace package: its folder leaves sys.path, tests/ (the harness) joins
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent / "tests")]
_spec = importlib.util.spec_from_file_location("measure", _HERE / "measure.py")
measure = sys.modules["measure"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(measure)

# "Apex / Transformer Engine not installed" (the table names the optimizer class), deprecated collectives
warnings.filterwarnings("ignore", module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")

import megatron.core.distributed as mcd  # noqa: E402
import megatron_harness as harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import __version__ as MCORE, parallel_state as ps  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402

from swan_dist.integrations.megatron_factory import get_swan_optimizer  # noqa: E402
from swan_dist.memory import state_bytes  # noqa: E402
from swan_dist.reference.data import WindowSampler, build_data, eval_batches  # noqa: E402

try:  # Megatron's Muon needs emerging-optimizers v0.1.0 (bash launch/install_muon.sh)
    from megatron.core.optimizer.muon import HAVE_EMERGING_OPTIMIZERS as MUON, get_megatron_muon_optimizer
except ImportError:
    MUON = False

SEED, EXPERTS = 1234, 4  # EXPERTS: per layer of the MoE layout (top 2, SequentialMLP: harness.MOE_CPU)
# dist-muon on GPUs only: it all-gathers a size per rank, which gloo refuses
LABELS = {"megatron-adam": "Megatron Adam", "megatron-muon": "Megatron Muon, every DP rank all matrices",
          "megatron-dist-muon": "Megatron Muon, layer-wise distributed", "swan": "SWAN‡"}
LRS = {"megatron-adam": (5e-4, 1e-3, 2e-3), "megatron-muon": (5e-4, 1e-3, 3e-3), "swan": (2.5e-3, 5e-3, 1e-2)}


def _layouts(world: int, moe: bool) -> list[tuple[str, int, int, bool]]:
    """(name, TP size, EP size, distributed optimizer); DP = W / TP."""
    out = [(f"TP={world}", world, 1, False), (f"DP={world}, distributed optimizer", 1, 1, True)]
    return out + ([(f"MoE, EP=2 x DP={world // 2}, distributed optimizer", 1, 2, True)] if moe else [])


def _build(tp: int, distopt: bool, a, experts: int = 0) -> list:
    """``harness.build_gpt``'s model; on a GPU without the CPU shims, moved there before Megatron DDP's buffers."""
    kw = dict(hidden=a.hidden, ffn=a.ffn, layers=a.layers, heads=a.heads, query_groups=a.query_groups,
              vocab=a.vocab, seq=a.seq, seed=SEED, use_distributed_optimizer=distopt, experts=experts)
    if not torch.cuda.is_available():
        return harness.build_gpt(tp, **kw)[0]
    if experts:
        raise SystemExit("benchmarks/megatron.py: the MoE layout (--moe) runs on the CPU only")
    ddp = mcd.DistributedDataParallel
    with mock.patch.object(harness, "install_cpu_shims"), mock.patch.object(
            mcd, "DistributedDataParallel", lambda config, ddp_config, model: ddp(config, ddp_config, model.cuda())):
        return harness.build_gpt(tp, **kw)[0]


def _optimizer(name: str, chunks: list, lr: float, distopt: bool):
    cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.1, use_distributed_optimizer=distopt)
    if name == "swan":
        return get_swan_optimizer(cfg, chunks, swan={"preset": "swan_ddagger", "verbose": False})
    if name == "megatron-adam":
        return get_megatron_optimizer(cfg, chunks)
    return get_megatron_muon_optimizer(cfg, chunks, layer_wise_distributed_optimizer=name == "megatron-dist-muon")


def _inner(opt) -> list:
    return [w.optimizer for w in getattr(opt, "chained_optimizers", [opt]) if getattr(w, "optimizer", None) is not None]


def _counters(opt) -> list[int]:
    """Bytes SWAN's exchanges sent and matrices it whitened so far, on this rank."""
    inner = _inner(opt)
    return [sum(ex.bytes_sent for o in inner for ex in getattr(getattr(o, "plans", None), "cache", {}).values()),
            sum(getattr(o, "whitened_matrices", 0) for o in inner)]


def _minimum_bytes(opt) -> tuple[int, int]:
    """Bytes that must move per step for the plans' owners and for the best owner of each matrix (the rank
    holding most of it), counted on the first rank of each SWAN group (the expert groups are disjoint)."""
    given = best = 0
    for o in _inner(opt):
        ex = o.exchange
        if ex is None or dist.get_rank() != min(dist.get_process_group_ranks(o.process_group or dist.group.WORLD)):
            continue
        table, elem = ex.plan.ranges.table(), ex.dtypes[0].itemsize
        held = table[..., 1] - table[..., 0]  # (rank, matrix)
        need = torch.tensor([s.numel for s in ex.plan.specs]) + held.sum(0) - 2 * held.max(0).values
        given += ex.plan.bytes_moved(elem)
        best += elem * int(need[[m for b in ex.plan.buckets for m in b.matrices]].sum())
    return given, best


def _run(rank: int, a) -> list[dict]:
    """Every layout and optimizer: times of the slowest rank, state of the fullest, SWAN's bytes of all."""
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for layout, tp, ep, distopt in _layouts(dist.get_world_size(), a.moe):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        for name in (n for n in LABELS if (MUON or "muon" not in n) and (dev.type == "cuda" or "dist-" not in n)):
            sharded = distopt and "muon" not in name  # Muon refuses the distributed optimizer
            chunks = _build(tp, sharded, a, EXPERTS if ep > 1 else 0)
            opt = _optimizer(name, chunks, 1e-3, sharded)
            schedule = harness.lr_schedule(opt, 1e-3, a.warmup + a.steps, 0.1)  # a new lr every iteration
            step_t, start, batch, losses = [], [], {}, []

            def timed_step(inner=opt.step, times=step_t):
                dist.all_reduce(torch.zeros(1, device=dev))  # every rank enters the step together
                out = []
                times.append(measure.median_time(lambda: out.append(inner()), 1, sync=sync)[0])
                return out[0]

            def before(i: int) -> None:
                if i == a.warmup:
                    step_t.clear()
                    start[:] = _counters(opt)
                share = harness.dp_share(harness.global_batch(i, a.batch, a.seq, a.vocab), dp_rank, dp)
                batch.update({k: None if v is None else v.to(dev) for k, v in share.items()})

            def iteration() -> None:
                losses.append(harness.train_step(chunks, opt, batch))
                schedule.step(1)

            opt.step = timed_step
            t_iter = measure.median_time(iteration, a.steps, a.warmup, sync, before)[0]
            sent, whitened = ((now - then) / a.steps for now, then in zip(_counters(opt), start))
            minimum, best = _minimum_bytes(opt) if name == "swan" else (0, 0)
            state = sum(state_bytes(o)["optimizer_state"] for o in _inner(opt))
            top = torch.tensor([statistics.median(step_t), t_iter, state], dtype=torch.float64, device=dev)
            total = torch.tensor([sent, whitened, minimum, best], dtype=torch.float64, device=dev)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            dist.all_reduce(total)
            inner = type(_inner(opt)[0]).__name__
            wrapper = "+".join(dict.fromkeys(type(w).__name__ for w in getattr(opt, "chained_optimizers", [opt])))
            label = f"{LABELS[name]} (`{inner}` in `{wrapper}`" + (
                ", no distributed optimizer: Muon refuses it)" if "muon" in name and distopt else ")")
            rows.append(dict(zip(("step", "iter", "state", "sent", "whitened", "minimum", "best"),
                                 top.tolist() + total.tolist()), layout=layout, name=name, label=label))
            if rank == 0:
                print(f"[megatron] {layout} {name}: step {rows[-1]['step'] * 1e3:.1f} ms, loss {losses[-1]:.3f}")
            del opt, chunks
        ps.destroy_model_parallel()
    return rows


def _sweep(rank: int, a) -> list[dict]:
    """Per optimizer and lr, the same ``wiki`` batches at DP=W: train loss of the last 10 iterations, validation
    loss of 4 held-out batches."""

    def text(x: torch.Tensor, y: torch.Tensor) -> dict:
        return dict(tokens=x, labels=y, position_ids=torch.arange(x.shape[1]).expand(*x.shape).contiguous(),
                    attention_mask=None)

    data, rows = build_data("wiki", vocab_size=a.vocab), []  # (built by the parent: loaded here)
    ps.initialize_model_parallel()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    for name, lr in ((n, lr) for n, lrs in LRS.items() if "muon" not in n or MUON for lr in lrs):
        chunks = _build(1, False, a)
        opt = _optimizer(name, chunks, lr, False)
        sampler = WindowSampler(data.train, a.seq, a.batch, seed=SEED)  # the global batch, the same on every rank
        losses = [harness.train_step(chunks, opt, harness.dp_share(text(*next(sampler)), dp_rank, dp))
                  for _ in range(a.sweep)]
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for x, y in eval_batches(data.val, a.seq, a.batch, 4, rank=dp_rank, world_size=dp):
                per_token = chunks[0](x, text(x, y)["position_ids"], None, labels=y)
                total += torch.tensor([float(per_token.float().sum()), per_token.numel()], dtype=torch.float64)
        dist.all_reduce(total)
        rows.append(dict(name=name, lr=lr, train=statistics.mean(losses[-10:]), val=float(total[0] / total[1]),
                         finite=all(map(math.isfinite, losses))))
        if rank == 0:
            print(f"[megatron sweep] {name} lr {lr:g}: validation {rows[-1]['val']:.3f}")
        del opt, chunks
    ps.destroy_model_parallel()
    return rows


def _worker(rank: int, world: int, a) -> list[dict] | None:
    """One rank (torchrun's environment): its process group, the layouts or the sweep; rank 0's rows."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)  # gloo: the CPU loss scalar
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        harness.install_cpu_shims()
    rows = (_sweep if a.sweep else _run)(rank, a)
    dist.barrier()
    dist.destroy_process_group()
    return rows if rank == 0 else None


def _sweep_table(rows: list[dict], a, world: int) -> str:
    labels = {n: LABELS[n].split(",")[0] for n in LRS}
    best = {n: min((r for r in rows if r["name"] == n and r["finite"]), key=lambda r: r["val"], default=None)
            for n in labels}
    lines = [f"The dense model (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, seq {a.seq}) at DP = {world}, "
             f"{a.sweep} iterations of {a.batch}x{a.seq} tokens of `wiki` text per run at a constant lr; validation "
             "loss on 4 held-out batches.", "",
             "| optimizer | lr | train loss (last 10) | validation loss |", "|---|---:|---:|---:|"]
    for r in rows:
        mark = "**" if best[r["name"]] is r else ""
        val = f"{mark}{r['val']:.3f}{mark}" if r["finite"] else "diverged"
        lines.append(f"| {labels[r['name']]} | {r['lr']:g} | {r['train']:.3f} | {val} |")
    found = "; ".join(f"{labels[n]} {b['val']:.3f} at lr {b['lr']:g}" for n, b in best.items() if b is not None)
    return "\n".join(lines + ["", f"Best of each sweep (bold): {found}."])


def _table(rows: list[dict], a, world: int) -> str:
    threads, mib = max(1, (os.cpu_count() or 2) // world), lambda n: f"{n / 2**20:.2f}"
    device = (f"{torch.cuda.get_device_name(0)}, NCCL" if torch.cuda.is_available() else
              f"CPU ({os.cpu_count()} cores, {world} ranks x {threads} threads, gloo)")
    lines = [f"megatron-core {MCORE} `GPTModel` (hidden {a.hidden}, ffn {a.ffn}, {a.layers} layers, "
             f"{a.heads} heads / {a.query_groups} query groups, vocab {a.vocab}, seq {a.seq}) at W = {world} on "
             f"{device}, torch {torch.__version__}; global batch {a.batch}x{a.seq}; median of {a.steps} iterations "
             f"after {a.warmup} warm-up.", "",
             "| layout | optimizer | step ms | iteration ms | step vs Adam | state MiB / rank | state vs Adam "
             "| sent / step | minimum | sent / minimum | matrices whitened / step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for layout, *_ in _layouts(world, a.moe):
        adam = next(r for r in rows if r["layout"] == layout and r["name"] == "megatron-adam")
        for r in (x for x in rows if x["layout"] == layout):
            vs = (f"{r['step'] / adam['step']:.2f}x", f"{r['state'] / adam['state']:.2f}" if adam["state"] else "-")
            swan = ["-"] * 4
            if r["name"] == "swan":
                swan = [f"{mib(r['sent'])} MiB", f"{mib(r['minimum'])} MiB",
                        f"{r['sent'] / r['minimum']:.2f}" if r["minimum"] else "-", f"{r['whitened']:.0f}"]
                if r["best"] < r["minimum"]:
                    notes.append(f"{layout}: with the rank holding most of each matrix as its owner, {mib(r['best'])} "
                                 f"MiB would move per step; the planner balances whitening cost first: "
                                 f"{mib(r['sent'])} MiB moved, the minimum for its owners.")
            lines.append(f"| {layout} | {r['label']} | {r['step'] * 1e3:.1f} | {r['iter'] * 1e3:.1f} | "
                         f"{vs[0]} | {mib(r['state'])} | {vs[1]} | " + " | ".join(swan) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> None:
    ap = measure.parser(__doc__, world=2, steps=10, warmup=2, batch=8, hidden=256, ffn=1024, layers=4, heads=8,
                        query_groups=4, vocab=1024, seq=128, sweep=0)  # --sweep N: the loss after N iterations
    ap.add_argument("--moe", action="store_true", help="also a MoE layout, EP=2 x DP=W/2 (W even, >= 4)")
    a = ap.parse_args()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else a.world
    where = "GPU" if torch.cuda.is_available() else "CPU"
    if a.moe and (world < 4 or world % 2):
        ap.error(f"--moe needs an even world size of at least 4 (EP=2 x DP=W/2), not {world}")
    if a.sweep:
        if where == "GPU":
            ap.error("--sweep runs on the CPU (gloo) only")
        build_data("wiki", vocab_size=a.vocab)  # once, before the ranks load it
    rows = _worker(int(os.environ["RANK"]), world, a) if torchrun else measure.spawn(_worker, world, a)[0]
    if rows is None:  # a rank other than 0 under torchrun
        return
    if a.sweep:
        key, title = "megatron-loss", (f"Megatron-core: loss after {a.sweep} iterations, SWAN vs Megatron's Muon and "
                                       f"Adam at their best lr (W={world}, CPU)")
    else:
        key = "megatron" if where == "CPU" else "megatron-cuda"
        title = f"Megatron-core: SWAN vs Megatron's Adam{' and Muon' if MUON else ''} (W={world}, {where})"
    measure.publish(key, title, (_sweep_table if a.sweep else _table)(rows, a, world), write=not a.no_write)


if __name__ == "__main__":
    main()
