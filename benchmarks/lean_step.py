"""What does SWAN's bookkeeping cost per tensor? Its step with ``whitening="none"`` on 435 tensors too small for
the math to matter, against torch AdamW (foreach) under an lr schedule: step time, host syncs, at W=2 collectives.

    python benchmarks/lean_step.py --steps 50
    python benchmarks/lean_step.py --world 0 --no-write   # one process only
"""

import contextlib
import statistics
import warnings
from collections import Counter
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from swan_dist.host_reads import HostReads

from measure import parser, publish, spawn, turns  # noqa: E402 (the script's folder)
from optimizer_step import device_name, sync_of  # noqa: E402

LAYERS, DIM = 48, 64
TARGET = 2.0  # SWAN (whitening none) within 2x of AdamW (foreach) per tensor
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "barrier",
               "send", "recv", "isend", "irecv", "gather", "scatter")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(d)
        self.w1, self.w2, self.w3 = (nn.Linear(d, d, bias=False) for _ in range(3))


def build(layers: int, d: int, device: torch.device, vocab: int = 256) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(embed=nn.Embedding(vocab, d), layers=nn.ModuleList(Block(d) for _ in range(layers)),
                               norm=nn.RMSNorm(d), head=nn.Linear(d, vocab, bias=False))).to(device)
    return model, [torch.randn_like(p) * 1e-3 for p in model.parameters()]


def make(name: str, model: nn.Module, grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    import swan_dist

    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    if name.startswith("adamw"):  # adamw-foreach, adamw-fused
        return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **{name.split("-")[1]: True})
    base, _, mode = name.partition("@")
    return swan_dist.SWAN(model, preset="swan_ddagger", lr=1e-4, whitening="none", weight_decay=0.1,
                          fallback="sign" if base.endswith("+sign") else "adamw", mode=mode or "auto", verbose=False)


def count_syncs(fn, device: torch.device) -> int:
    """Host syncs in one call of ``fn``: CUDA's sync debug mode on CUDA, Python-level host reads (anyone's:
    :class:`swan_dist.host_reads.HostReads`) on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
    with HostReads() as reads:
        fn()
    return reads.n_all


def count_collectives(fn) -> Counter:
    """``torch.distributed``'s collectives called in one call of ``fn``, by name."""
    with contextlib.ExitStack() as stack:
        calls = {n: stack.enter_context(mock.patch.object(dist, n, wraps=getattr(dist, n)))
                 for n in COLLECTIVES if hasattr(dist, n)}
        fn()
    return Counter({n: c.call_count for n, c in calls.items() if c.call_count})


def measure(names, model, grads, steps, device, barrier=lambda: None, collectives=False) -> list[dict]:
    """Every optimizer on the same parameters, stepped in turn under the reference trainer's lr schedule (warm-up,
    cosine): per optimizer the median step, its host syncs and collectives (one scheduled step)."""
    from swan_dist.reference.config import TrainConfig
    from swan_dist.reference.optim import build_scheduler

    opts = {name: make(name, model, grads) for name in names}
    scheds = {name: build_scheduler(TrainConfig(steps=steps + 4, warmup_ratio=0.1, min_lr_ratio=0.1), opt)
              for name, opt in opts.items()}
    # 3 warm-up rounds (state, plan, caches); the next lr set after each step, untimed
    times = turns({name: opt.step for name, opt in opts.items()}, steps, warmup=3, sync=sync_of(device),
                  before=lambda name, k: barrier(), after=lambda name, t: scheds[name].step() or t)
    rows = []
    for name, opt in opts.items():
        row = dict(name=name, t=statistics.median(times[name]), syncs=count_syncs(opt.step, device))
        scheds[name].step()
        if collectives:
            row["coll"] = count_collectives(opt.step)
        rows.append(row)
    return rows


def _rank(rank: int, world: int, layers: int, d: int, steps: int, names, cuda: bool) -> list[dict]:
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model, grads = build(layers, d, device)
    rows = measure(names, model, grads, steps, device, barrier=dist.barrier, collectives=True)
    t = torch.tensor([row["t"] for row in rows], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median
    for row, slowest in zip(rows, t.tolist()):
        row["t"] = slowest
    dist.destroy_process_group()
    return rows


def table(rows: list[dict], n_tensors: int, world: int) -> list[str]:
    ref = next(r["t"] for r in rows if r["name"] == "adamw-foreach")
    coll = any("coll" in r for r in rows)
    lines = ["| W | optimizer | step (ms) | per tensor (µs) | vs AdamW foreach | target ≤ 2x | host syncs / step |"
             + (" collectives / step |" if coll else ""), "|---:|---|---:|---:|---:|---|---:|" + "---|" * coll]
    for r in rows:
        ratio = r["t"] / ref
        verdict = ("met" if ratio <= TARGET else "missed") if r["name"].startswith("swan") else "-"
        line = (f"| {world} | {r['name']} | {r['t'] * 1e3:.2f} | {r['t'] / n_tensors * 1e6:.1f} | {ratio:.2f}x | "
                f"{verdict} | {r['syncs']} |")
        if "coll" in r:
            line += " " + (", ".join(f"{k} {v}" for k, v in sorted(r["coll"].items())) or "none") + " |"
        lines.append(line)
    return lines


def main() -> None:
    # world: also W processes (0: one only)
    args = parser(__doc__, steps=50, world=2).parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # as each of the W ranks
    model, grads = build(LAYERS, DIM, device)
    n_tensors, n_matrices = len(grads), 7 * LAYERS
    names = ["adamw-foreach", "adamw-fused", "swan-none", "swan-none+sign"]
    rows = measure(names, model, grads, args.steps, device)
    lines = table(rows, n_tensors, 1)
    multi = args.world > 1 and (not cuda or torch.cuda.device_count() >= args.world)
    if multi:  # one GPU per rank under NCCL; on the CPU, gloo
        wnames = ["adamw-foreach", "swan-none@owner", "swan-none+sign@owner", "swan-none@local"]
        wrows = spawn(_rank, args.world, LAYERS, DIM, args.steps, wnames, cuda)[0]
        wlines = table(wrows, n_tensors, args.world)  # its header adds the collectives column: W=1 rows get '-'
        lines = wlines[:2] + [line + " - |" for line in lines[2:]] + wlines[2:]

    setup = (f"{LAYERS} layers x 7 `Linear({DIM}, {DIM}, bias=False)` ({n_matrices} matrices) + 2 RMSNorms each, "
             f"embedding, final norm, head: {n_tensors} tensors ({sum(g.numel() for g in grads) / 1e6:.2f}M "
             f"parameters). {device_name(device)}, torch {torch.__version__}; median of {args.steps} steps, the "
             "optimizers in turn under the reference trainer's lr schedule")
    if multi:
        setup += (f" (W={args.world}: {args.world} processes, {'one GPU each, NCCL' if cuda else '1 thread each, gloo'}"
                  ", the whole model on every rank; the slowest rank's median)")
    setup += "." if multi or args.world <= 1 else f". W={args.world} needs {args.world} GPUs."
    publish(f"lean-step-{device.type}", f"Lean step ({device.type.upper()}): per-tensor overhead on many small "
            "matrices under an lr schedule", "\n".join([setup, "", *lines]), write=not args.no_write)


if __name__ == "__main__":
    main()
