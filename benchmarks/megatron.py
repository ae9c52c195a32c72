"""SWAN vs Megatron's own Adam on a tiny megatron-core GPTModel, measured side by side in one run.

Two layouts at world size W (default 2; gloo on CPU, NCCL on GPU): TP=W (tensor parallel, no data
parallelism) and DP=W with Megatron's distributed optimizer (each rank holds a contiguous shard of the
fp32 main parameters). In each, the same model (Megatron DDP around a GPTModel: local layer spec,
SwiGLU, GQA, RoPE, tied embeddings, fp32) trains a few iterations with

- Megatron's Adam: ``megatron.core.optimizer.get_megatron_optimizer(OptimizerConfig(optimizer="adam",
  use_distributed_optimizer=...))`` (Transformer Engine's or apex's FusedAdam when installed, otherwise
  torch's AdamW: the table names the class);
- SWAN‡: ``swan_dist.integrations.megatron_factory.get_swan_optimizer`` with the same ``OptimizerConfig``
  (SWAN for the linear weights, each whitened once per step by one owner rank of the TP x DP group;
  the AdamW fallback for embeddings and norms).

Reported per layout and optimizer:

- ``optimizer.step()`` time: Megatron's whole wrapper step (gradient norm and clipping, the inner
  optimizer, and under the distributed optimizer the all-gather of updated parameters), median over
  ``--steps`` iterations after warm-up, of the slowest rank; and the whole iteration's time;
- optimizer state bytes per rank: the tensors in the inner optimizer's ``state``
  (:func:`swan_dist.memory.state_bytes`): Adam's ``exp_avg``/``exp_avg_sq`` of this rank's shard under
  the distributed optimizer; SWAN's fallback moments only (its matrices keep none);
- for SWAN: the bytes its owner engine sent per step (all ranks, both directions; the exchange's
  ``bytes_sent`` counter) vs the minimum for the plan's owners: each matrix's owner receives the pieces
  it does not hold, and sends each other holder its piece of the update; and the matrices whitened per
  step (each once).

On CPU megatron-core needs CUDA shims: this script borrows the test harness ``tests/megatron_harness.py``
by putting ``tests/`` on ``sys.path``: ``install_cpu_shims`` and ``build_gpt`` on CPU only (the shims are
test-only code, never part of swan_dist), and its device-agnostic ``global_batch``, ``dp_share`` and
``train_step`` everywhere. With CUDA there are no shims: ``torch.cuda.set_device(local rank)``, NCCL
(with gloo beside it for ``train_step``'s CPU loss scalar), and the model is built here with
``build_gpt``'s config and weights, moved to the GPU before Megatron DDP allocates its buffers.

Writes a section of docs/benchmarks.md (``megatron`` on CPU, ``megatron-cuda`` on GPU).

    python benchmarks/megatron.py --world 2 --steps 10                  # spawns W processes
    torchrun --nproc-per-node 1 benchmarks/megatron.py                  # or under torchrun (W = its world)
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

# This file is named megatron.py and megatron-core's ``megatron`` is a namespace package, which any
# megatron.py on sys.path would shadow: this script's folder leaves sys.path (``measure`` is loaded by
# its path), and tests/ (the CPU harness) joins it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent / "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# megatron-core's "Apex / Transformer Engine not installed, falling back" notes (the table names the
# optimizer class instead) and torch.distributed's deprecation notes for the collectives Megatron calls
warnings.filterwarnings("ignore", module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")


def _load_measure():
    spec = importlib.util.spec_from_file_location("measure", _HERE / "measure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_measure = _load_measure()
write_section, free_port = _measure.write_section, _measure.free_port

SEED = 1234


EXPERTS = 4  # the MoE layout's experts per layer (top 2, SequentialMLP, harness.MOE_CPU's settings)
OPTIMIZERS = ("megatron-adam", "megatron-muon", "megatron-dist-muon", "swan")


def _layouts(world: int, moe: bool) -> list[tuple[str, int, int, bool]]:
    """(name, tensor-parallel size, expert-parallel size, distributed optimizer); data-parallel size =
    world / TP. EP > 1: every layer's MLP is a MoE of ``EXPERTS`` experts, EP of them per rank group."""
    out = [(f"TP={world}", world, 1, False), (f"DP={world}, distributed optimizer", 1, 1, True)]
    if moe:
        out.append((f"MoE, EP=2 x DP={world // 2}, distributed optimizer", 1, 2, True))
    return out


def muon_available() -> bool:
    """Whether Megatron's Muon (``megatron.core.optimizer.muon``) can run: it needs emerging-optimizers
    v0.1.0 (``bash benchmarks/install_muon.sh``)."""
    try:
        from megatron.core.optimizer import muon
    except ImportError:
        return False
    return bool(muon.HAVE_EMERGING_OPTIMIZERS)


def _build_cuda(tp: int, distopt: bool, a) -> list:
    """``build_gpt``'s model (tests/megatron_harness.py) for a GPU, without its CPU shims: the same config
    and CPU initialisation, moved to the current device before Megatron DDP allocates its buffers there."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    assert ps.get_tensor_model_parallel_world_size() == tp
    model_parallel_cuda_manual_seed(SEED)
    config = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=a.heads,
        num_query_groups=a.query_groups, kv_channels=a.hidden // a.heads, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=True, init_method_std=0.02,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, deallocate_pipeline_outputs=False)
    torch.manual_seed(SEED)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=a.vocab,
                     max_sequence_length=a.seq, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=True, position_embedding_type="rope")
    model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distopt)
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return [model]


def _build(tp: int, distopt: bool, a, cuda: bool, experts: int = 0) -> list:
    if cuda:
        if experts:
            raise SystemExit("benchmarks/megatron.py: the MoE layout (--moe) runs on the CPU only")
        return _build_cuda(tp, distopt, a)
    import megatron_harness as harness

    chunks, _ = harness.build_gpt(tp, hidden=a.hidden, ffn=a.ffn, layers=a.layers, heads=a.heads,
                                  query_groups=a.query_groups, vocab=a.vocab, seq=a.seq, seed=SEED,
                                  use_distributed_optimizer=distopt, experts=experts)
    return chunks


def _optimizer(name: str, chunks: list, lr: float, distopt: bool):
    """Megatron's Adam, its Muon (``--optimizer muon``: every DP rank orthogonalizes every matrix;
    ``dist_muon``: Megatron's layer-wise distributed optimizer splits them over the DP ranks), or SWAN‡.
    Muon refuses the distributed optimizer: its model is built without one."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr / 10, weight_decay=0.1, use_distributed_optimizer=distopt)
    if name == "swan":
        return get_swan_optimizer(cfg, chunks, swan={"preset": "swan_ddagger", "verbose": False})
    if name == "megatron-adam":
        return get_megatron_optimizer(cfg, chunks)
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer

    return get_megatron_muon_optimizer(cfg, chunks, layer_wise_distributed_optimizer=name == "megatron-dist-muon")


def _names(a) -> list[str]:
    """The optimizers run: Muon where installed; ``dist_muon`` on GPUs only (its parameter all-gather has
    a size per rank, which NCCL takes and gloo refuses)."""
    return [n for n in OPTIMIZERS if ("muon" not in n or a.muon) and (n != "megatron-dist-muon"
                                                                     or torch.cuda.is_available())]


def _inner(opt) -> list:
    return [w.optimizer for w in getattr(opt, "chained_optimizers", [opt]) if getattr(w, "optimizer", None) is not None]


def _exchanges(opt) -> list:
    return [ex for o in _inner(opt) for ex in getattr(getattr(o, "plans", None), "cache", {}).values()]


def _minimum_bytes(opt) -> tuple[int, int]:
    """Bytes that must move per step for the plans' owners (and for the best owner of each matrix): the
    owner receives every element of the matrix it does not hold and sends each other holder its piece.
    Counted for the SWAN groups this rank is the first of (summed over ranks, each group counts once:
    under expert parallelism the expert groups are disjoint)."""
    given = best = 0
    for o in _inner(opt):
        ex = o.exchange
        if ex is None or dist.get_rank() != min(dist.get_process_group_ranks(o.process_group or dist.group.WORLD)):
            continue
        plan = ex.plan
        for bucket in plan.buckets:
            for m in bucket.matrices:
                held = [hi - lo for lo, hi in (rg[m] for rg in plan.ranges)]
                elem = torch.empty(0, dtype=ex.dtypes[m]).element_size()
                need = [plan.specs[m].numel - held[r] + sum(held) - held[r] for r in range(plan.world)]
                owner = bucket.owners[m]
                given += elem * (need[owner] if owner >= 0 else sum(need))
                best += elem * min(need)
    return given, best


def _run(rank: int, world: int, local_rank: int, a) -> list | None:
    """Every layout and optimizer on this rank (process group initialised); rank 0 returns the rows."""
    from megatron.core import parallel_state as ps

    from swan_dist.memory import state_bytes

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    import megatron_harness as harness  # global_batch, dp_share, train_step, lr_schedule (device-agnostic but the batch)
    if not cuda:
        harness.install_cpu_shims()

    def reduce(values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=op)
        return t.tolist()

    rows = []
    for layout, tp, ep, distopt in _layouts(world, a.moe):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        try:
            dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
            for name in _names(a):
                sharded = distopt and "muon" not in name
                chunks = _build(tp, sharded, a, cuda, EXPERTS if ep > 1 else 0)
                opt = _optimizer(name, chunks, 1e-3, sharded)
                schedule = harness.lr_schedule(opt, 1e-3, a.warmup + a.steps, 0.1)  # a new lr every iteration
                step_t: list[float] = []
                wrapped = opt.step

                def timed_step(wrapped=wrapped, step_t=step_t):
                    dist.all_reduce(torch.zeros(1, device=dev))  # every rank enters the step together
                    sync()
                    t0 = time.perf_counter()
                    out = wrapped()
                    sync()
                    step_t.append(time.perf_counter() - t0)
                    return out

                opt.step = timed_step
                iter_t, sent0, white0 = [], 0, 0
                for i in range(a.warmup + a.steps):
                    if i == a.warmup:
                        step_t.clear()
                        sent0 = sum(ex.bytes_sent for ex in _exchanges(opt))
                        white0 = sum(getattr(o, "whitened_matrices", 0) for o in _inner(opt))
                    batch = harness.dp_share(harness.global_batch(i, a.batch, a.seq, a.vocab), dp_rank, dp)
                    batch = {k: None if v is None else v.to(dev) for k, v in batch.items()}
                    sync()
                    t0 = time.perf_counter()
                    loss = harness.train_step(chunks, opt, batch)
                    schedule.step(1)
                    sync()
                    iter_t.append(time.perf_counter() - t0)
                sent = (sum(ex.bytes_sent for ex in _exchanges(opt)) - sent0) / a.steps
                whitened = (sum(getattr(o, "whitened_matrices", 0) for o in _inner(opt)) - white0) / a.steps
                state = sum(state_bytes(o)["optimizer_state"] for o in _inner(opt))
                minimum, best = _minimum_bytes(opt) if name == "swan" else (0, 0)
                t_step, t_iter, state_max = reduce([statistics.median(step_t), statistics.median(iter_t[a.warmup:]),
                                                    state], dist.ReduceOp.MAX)
                sent_all, whitened_all, minimum, best = reduce([sent, whitened, minimum, best], dist.ReduceOp.SUM)
                kind = type(_inner(opt)[0]).__name__
                n_params = sum(p.numel() for c in chunks for p in c.parameters())  # this rank's (TP slice)
                rows.append(dict(layout=layout, name=name, kind=kind, sharded=sharded, step=t_step, iter=t_iter, state=state_max,
                                 sent=sent_all, minimum=minimum, best=best, whitened=whitened_all, loss=loss,
                                 params_rank=n_params, wrapper=[type(w).__name__ for w in
                                                                getattr(opt, "chained_optimizers", [opt])]))
                if rank == 0:
                    r = rows[-1]
                    print(f"[megatron] {layout} {name} ({kind}): step {r['step'] * 1e3:.1f} ms, "
                          f"iteration {r['iter'] * 1e3:.1f} ms, state {r['state'] / 2**20:.2f} MiB, loss {loss:.3f}",
                          flush=True)
                del opt, chunks
        finally:
            ps.destroy_model_parallel()
    return rows if rank == 0 else None


def _text_batch(x: torch.Tensor, y: torch.Tensor) -> dict:
    b, seq = x.shape
    return dict(tokens=x, labels=y, position_ids=torch.arange(seq).expand(b, seq).contiguous(), attention_mask=None)


def _sweep(rank: int, world: int, local_rank: int, a) -> list | None:
    """Loss after ``a.sweep`` iterations of the dense model at DP = W (no distributed optimizer, so that
    Muon runs), on the reference trainer's ``wiki`` text, for each optimizer and lr of ``a.lrs``; the
    same batches for all. Rank 0 returns rows (optimizer, lr, train loss of the last 10, validation loss)."""
    from megatron.core import parallel_state as ps

    import megatron_harness as harness
    from swan_dist.reference.data import WindowSampler, build_data, eval_batches

    harness.install_cpu_shims()
    data = build_data("wiki", vocab_size=a.vocab)  # built by the parent before the spawn: loaded here
    rows = []
    ps.initialize_model_parallel()
    try:
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        for name, lrs in a.lrs.items():
            if "muon" in name and not a.muon:
                continue
            for lr in lrs:
                chunks = _build(1, False, a, False)
                opt = _optimizer(name, chunks, lr, False)
                sampler = WindowSampler(data.train, a.seq, a.batch, seed=SEED)  # the global batch, same on every rank
                losses = [harness.train_step(chunks, opt, harness.dp_share(_text_batch(*next(sampler)), dp_rank, dp))
                          for _ in range(a.sweep)]
                total = torch.zeros(2, dtype=torch.float64)
                with torch.no_grad():
                    for x, y in eval_batches(data.val, a.seq, a.batch, 4, rank=dp_rank, world_size=dp):
                        mb = _text_batch(x, y)
                        per_token = chunks[0](mb["tokens"], mb["position_ids"], None, labels=y)
                        total += torch.tensor([float(per_token.float().sum()), per_token.numel()], dtype=torch.float64)
                dist.all_reduce(total)
                rows.append(dict(name=name, lr=lr, train=statistics.mean(losses[-10:]), val=float(total[0] / total[1]),
                                 finite=all(map(math.isfinite, losses))))
                if rank == 0:
                    print(f"[megatron sweep] {name} lr {lr:g}: train {rows[-1]['train']:.3f}, "
                          f"validation {rows[-1]['val']:.3f}", flush=True)
                del opt, chunks
    finally:
        ps.destroy_model_parallel()
    return rows if rank == 0 else None


def _sweep_table(rows: list[dict], a, world: int) -> str:
    labels = {"megatron-adam": "Megatron Adam", "megatron-muon": "Megatron Muon", "swan": "SWAN‡"}
    best = {n: min((r for r in rows if r["name"] == n and r["finite"]), key=lambda r: r["val"], default=None)
            for n in labels}
    lines = [
        f"The dense model of the section above (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, seq {a.seq}) "
        f"at DP = {world} without the distributed optimizer (Muon refuses it), trained {a.sweep} iterations of "
        f"{a.batch}x{a.seq} tokens of the reference trainer's `wiki` text at a constant lr (no warm-up, weight "
        "decay 0.1), the same batches for every run; validation loss on 4 fixed batches of held-out text. "
        "Megatron's `OptimizerConfig.lr` is the one lr each optimizer gets: Muon's for its matrices and its "
        "Adam's for the rest; SWAN‡'s (its preset scales the matrices' step by alpha 0.05) and its AdamW "
        "fallback's.",
        "",
        "| optimizer | lr | train loss (last 10) | validation loss |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        mark = "**" if best.get(r["name"]) is r else ""
        val = f"{mark}{r['val']:.3f}{mark}" if r["finite"] else "diverged"
        lines.append(f"| {labels[r['name']]} | {r['lr']:g} | {r['train']:.3f} | {val} |")
    found = {n: b for n, b in best.items() if b is not None}
    lines += ["", "Best of each sweep (bold): " + "; ".join(f"{labels[n]} {b['val']:.3f} at lr {b['lr']:g}"
                                                           for n, b in found.items()) + "."]
    return "\n".join(lines)


def _spawned(rank: int, world: int, port: int, out: str, a) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    _init(rank, world, rank)
    rows = (_sweep if a.sweep else _run)(rank, world, rank, a)
    if rank == 0:
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def _init(rank: int, world: int, local_rank: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        # NCCL for the model, the optimizers and SWAN's exchange; gloo for the harness's CPU loss scalar
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        dist.init_process_group("gloo", rank=rank, world_size=world)


def _table(rows: list[dict], a, world: int) -> str:
    if torch.cuda.is_available():
        device = f"{torch.cuda.get_device_name(0)}, NCCL, torch {torch.__version__}"
    else:
        threads = max(1, (os.cpu_count() or 2) // world)
        device = (f"CPU ({os.cpu_count()} cores, {world} process{'es' if world > 1 else ''} of {threads} "
                  f"thread{'s' if threads > 1 else ''}, gloo), torch {torch.__version__}")
    import megatron.core

    mb = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = [
        f"megatron-core {megatron.core.__version__} `GPTModel` (hidden {a.hidden}, ffn {a.ffn} SwiGLU, {a.layers} "
        f"layers, {a.heads} heads / {a.query_groups} query groups, vocab {a.vocab}, seq {a.seq}, tied embeddings, "
        f"fp32) in Megatron DDP, W = {world} on {device}; global batch {a.batch}x{a.seq} tokens; median of {a.steps} "
        f"iterations after {a.warmup} warm-up, slowest rank, under Megatron's `OptimizerParamScheduler` (warm-up, "
        "then cosine: a new lr every iteration). **step**: Megatron's `optimizer.step()` (gradient norm "
        "and clipping, the inner optimizer, and under the distributed optimizer the all-gather of updated "
        "parameters); **iteration**: forward, backward (with DDP's gradient reduction) and step. **state**: the "
        "inner optimizer's state tensors, on the rank holding the most. **sent**: bytes SWAN's owner engine sent "
        "per step, all ranks together, both directions.",
        "",
        "| layout | optimizer | step ms | iteration ms | step vs Adam | state MiB / rank | state vs Adam "
        "| sent / step | minimum | sent / minimum | matrices whitened / step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for layout, *_ in _layouts(world, a.moe):
        adam = next(r for r in rows if r["layout"] == layout and r["name"] == "megatron-adam")
        for r in (x for x in rows if x["layout"] == layout):
            wrapper = "+".join(dict.fromkeys(r["wrapper"]))
            if "muon" in r["name"]:
                how = "layer-wise distributed" if r["name"] == "megatron-dist-muon" else "every DP rank all matrices"
                label = (f"Megatron Muon, {how} (`{r['kind']}` in `{wrapper}`"
                         + (", no distributed optimizer: Muon refuses it)" if "distributed" in layout else ")"))
                swan = ("-", "-", "-", "-")
                vs = (f"{r['step'] / adam['step']:.2f}x", f"{r['state'] / adam['state']:.2f}" if adam["state"] else "-")
            elif r["name"] == "swan":
                label = f"SWAN‡ (`{r['kind']}` in `{wrapper}`)"
                ratio = f"{r['sent'] / r['minimum']:.2f}" if r["minimum"] else "-"
                swan = (f"{mb(r['sent'])} MiB", f"{mb(r['minimum'])} MiB", ratio, f"{r['whitened']:.0f}")
                vs = (f"{r['step'] / adam['step']:.2f}x", f"{r['state'] / adam['state']:.2f}" if adam["state"] else "-")
                if r["best"] < r["minimum"]:
                    notes.append(
                        f"{layout}: most matrices lie wholly in one rank's shard, and with that rank as owner only "
                        f"the matrices a shard boundary cuts would move: {mb(r['best'])} MiB per step. The planner "
                        "balances whitening cost first and moves a matrix to where it lies only among matrices of "
                        f"equal cost, so {mb(r['sent'])} MiB moved, the minimum for the owners it chose.")
            else:
                label = f"Megatron Adam (`{r['kind']}` in `{wrapper}`)"
                swan, vs = ("-", "-", "-", "-"), ("1.00x", "1.00")
            lines.append(f"| {layout} | {label} | {r['step'] * 1e3:.1f} | {r['iter'] * 1e3:.1f} | {vs[0]} | "
                         f"{mb(r['state'])} | {vs[1]} | " + " | ".join(swan) + " |")
    swan_row = next(r for r in rows if r["name"] == "swan")
    adam_kind = next(r["kind"] for r in rows if r["name"] == "megatron-adam")
    lines += [
        "",
        f"SWAN‡ whitens {swan_row['whitened']:.0f} matrices per step, {a.layers} layers x 7 (Q, K and V of "
        "`linear_qkv`, `linear_proj`, the gate and up halves of `linear_fc1`, `linear_fc2`), each once, on one "
        "owner rank; the embedding (tied with the output layer) and the norms keep AdamW moments, so SWAN's state "
        "is the fallback's alone. Adam keeps 8 bytes per parameter a rank holds (its TP slice, or its "
        "distributed-optimizer shard)."
        + (" Megatron's Adam is torch's `AdamW` here: without Transformer Engine or apex, Megatron falls back "
           "to it." if adam_kind == "AdamW" else ""),
        "",
        "Minimum bytes: for each matrix, the elements its owner does not hold (gathered to it) plus every other "
        "rank's piece of the update (sent back). At TP=W each rank holds 1/W of every matrix; under the "
        "distributed optimizer each rank holds a contiguous range of the fp32 parameter buffer, which cuts few "
        "matrices.",
    ]
    if a.moe:
        moe = next(r for r in rows if r["name"] == "swan" and r["layout"].startswith("MoE"))
        lines += ["", f"MoE layout: every layer's MLP is {EXPERTS} experts (top 2, SequentialMLP, the all-to-all "
                  "token dispatcher), two per expert-parallel rank. SWAN‡ whitens per expert (gate, up and fc2 "
                  f"apart) plus the router: {moe['whitened']:.0f} matrices per step, each once, the experts inside "
                  "the ranks holding them (expert data parallel), the dense ones over all DP ranks."]
    if a.muon:
        lines += ["", "Megatron's Muon (megatron-core `get_megatron_muon_optimizer`, emerging-optimizers "
                  f"{_version('emerging-optimizers')}): momentum and 5 Newton-Schulz steps per 2-D non-embedding "
                  "weight (Q, K, V apart), Adam for the rest; at TP > 1 (its default `--muon-tp-mode blockwise`) each rank "
                  "orthogonalizes its own slice of a matrix, where SWAN whitens the whole matrix; it refuses the distributed optimizer, so its rows run "
                  "on a model without one. `dist_muon` is Megatron-LM's `--optimizer dist_muon`: its layer-wise "
                  "distributed optimizer gives each DP rank whole parameters to update and all-gathers them, in one "
                  "all-gather of a size per rank, which gloo refuses: it runs on GPUs only."]
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def _version(dist_name: str) -> str:
    from importlib.metadata import version

    return version(dist_name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=10, help="timed iterations per layout and optimizer")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--query-groups", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--moe", action="store_true", help="also a MoE layout, EP=2 x DP=W/2 (W even, >= 4)")
    ap.add_argument("--no-muon", dest="muon", action="store_false",
                    help="leave out Megatron's Muon (it runs where emerging-optimizers is installed)")
    ap.add_argument("--sweep", type=int, default=0, metavar="N",
                    help="instead: the loss after N iterations on text, per optimizer and lr (--lrs), CPU")
    ap.add_argument("--lrs", default="megatron-adam=5e-4,1e-3,2e-3;megatron-muon=5e-4,1e-3,3e-3;swan=2.5e-3,5e-3,1e-2",
                    help="the sweep's lrs: OPTIMIZER=LR,LR;...")
    ap.add_argument("--no-write", action="store_true", help="print only, do not update docs/benchmarks.md")
    a = ap.parse_args()
    a.lrs = {k: [float(x) for x in v.split(",")] for k, v in (part.split("=") for part in a.lrs.split(";"))}
    if a.sweep:
        if torch.cuda.is_available():
            ap.error("--sweep runs on the CPU (gloo) only")
        from swan_dist.reference.data import build_data

        build_data("wiki", vocab_size=a.vocab)  # once, before the ranks load it
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else a.world
    if a.moe and (world < 4 or world % 2):
        ap.error(f"--moe needs an even world size of at least 4 (EP=2 x DP=W/2), not {world}")
    a.muon = a.muon and muon_available()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(rank, world, int(os.environ.get("LOCAL_RANK", "0")))
        rows = (_sweep if a.sweep else _run)(rank, world, int(os.environ.get("LOCAL_RANK", "0")), a)
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return
    else:
        world = a.world
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows.pt")
            mp.start_processes(_spawned, args=(world, free_port(), out, a), nprocs=world, start_method="spawn")
            rows = torch.load(out)
    body = (_sweep_table if a.sweep else _table)(rows, a, world)
    print(body)
    if a.sweep and not a.no_write:
        write_section("megatron-loss", f"Megatron-core: loss after {a.sweep} iterations, SWAN vs Megatron's Muon "
                      f"and Adam at their best lr (W={world}, CPU)", body)
    elif not a.no_write:
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        key = "megatron" if kind == "cpu" else "megatron-cuda"
        against = "Megatron's Adam and Muon" if a.muon else "Megatron's Adam"
        write_section(key, f"Megatron-core: SWAN vs {against} (W={world}, {'GPU' if kind == 'cuda' else 'CPU'})",
                      body)


if __name__ == "__main__":
    main()
