"""Peak memory per rank of a whole training step under DDP, FSDP2, DeepSpeed ZeRO-1/2/3 and Megatron-core's
distributed optimizer (spawned ranks, gloo on the CPU), AdamW against SWAN‡ (owner, replicated, FSDP2 with
``step_in_backward``): resident and live by category, each SWAN step's transient against its bound, and the
FSDP2 steps traced without allocating (benchmarks/memory_estimate.py). Writes the ``memory-dist`` section.

    python benchmarks/memory_dist.py --seq 128
    python benchmarks/memory_dist.py --size 130m --seq 128 --layouts zero1,zero2,zero3,megatron --sweep "" --estimate ""
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist

from measure import Marks, categories, reset_hwm, rss_status, settle, spawn, write_section
from memory import MiB, build, mib, row
from memory_estimate import VARIANTS, model_config, optimizer, state_bytes, step_bound, trace_step

LAYOUT_VARIANTS = {"fsdp2": ("adamw", "owner", "replicated", "backward"), "ddp": ("adamw", "owner", "replicated"),
                   **{f"zero{s}": ("adamw", "owner", "replicated") for s in (1, 2, 3)},
                   "megatron": ("adamw", "owner", "replicated")}
LAYOUT_NAMES = {"fsdp2": "FSDP2", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                "megatron": "Megatron DistOpt"}
FRAMEWORKS = ("zero1", "zero2", "zero3", "megatron")
PARAM = ("Parameter", "Sharded Param", "Unsharded Param")
GRAD = ("Gradient", "Sharded Grad", "Unsharded Grad")
COMM = ("All Gather", "Reduce Scatter", "Framework comm")
OPT = ("Optstate", "OptState")
MASTERS = ("Framework masters",)
BUCKET_MB = 256.0
_HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------- ranks
def _swan_options(variant: str, bucket_mb: float) -> dict:
    return {"preset": "swan_ddagger", "verbose": False, "mode": variant, "bucket_mb": bucket_mb}


def _torch_run(layout: str, variant: str, world: int, args, x, y) -> SimpleNamespace:
    """The reference LLaMA in bf16 (FSDP2: sharded before it is materialised), its optimizer; ``iteration()``
    runs forward, backward and the step; ``inners`` the optimizers whose ``step()`` is measured."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from swan_dist.reference.parallel import shard_fsdp2

    mesh = init_device_mesh("cpu", (world,)) if layout == "fsdp2" else None
    model = build(model_config(args.size), shard=(lambda m: shard_fsdp2(m, mesh)) if mesh else None)
    model = DistributedDataParallel(model) if layout == "ddp" else model
    opt = optimizer(variant, model, args.bucket_mb)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()

    return SimpleNamespace(module=model, inners=[opt], iteration=iteration, framework_step=None, held=list,
                           params=sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()))


def _deepspeed_run(layout: str, variant: str, world: int, args, x, y) -> SimpleNamespace:
    """DeepSpeed's engine at ZeRO stage ``layout[-1]``, bf16 (fp32 master partitions), defaults otherwise; the
    optimizer from the JSON: torch's AdamW (``torch_adam``) or ``"type": "SWAN"``; ``engine.step()`` the
    framework's step, ``held()`` the tensors it keeps with their categories."""
    import deepspeed

    import swan_dist  # noqa: F401 - registers "SWAN" with DeepSpeed
    from swan_dist.integrations.deepspeed import master_weights
    from swan_dist.memory import client_optimizer

    model = build(model_config(args.size))
    opt = ({"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}} if variant == "adamw" else
           {"type": "SWAN", "params": _swan_options(variant, args.bucket_mb)})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": opt, "bf16": {"enabled": True}, "zero_optimization": {"stage": int(layout[-1])}}
    engine, wrapper, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def iteration() -> None:
        engine.backward(engine(x, y)[1])
        engine.step()  # DeepSpeed's step clears the gradients

    def held() -> list:
        partitions = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]  # ZeRO-3
        return _framework_tensors([wrapper], _flat(master_weights(wrapper))) + [(t, "param") for t in partitions]

    params = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
    return SimpleNamespace(module=engine, inners=[client_optimizer(wrapper)], params=params, iteration=iteration,
                           framework_step=(engine, "step"), held=held)


def _megatron_run(variant: str, world: int, args) -> SimpleNamespace:
    """megatron-core's GPTModel at the LLaMA shape of ``args.size`` (tests/megatron_harness.py ``build_gpt``),
    bf16, Megatron DDP with the distributed optimizer: Megatron's Adam or SWAN‡ from the same config."""
    import megatron_harness as harness
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    cfg = model_config(args.size)
    ps.initialize_model_parallel()
    chunks, _ = harness.build_gpt(1, hidden=cfg.dim, ffn=cfg.ffn_dim, layers=cfg.n_layers, heads=cfg.n_heads,
                                  query_groups=cfg.n_kv_heads or cfg.n_heads, vocab=cfg.vocab_size, seq=args.seq,
                                  tied=cfg.tie_embeddings, bf16=True, use_distributed_optimizer=True)
    ocfg = OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, bf16=True, use_distributed_optimizer=True)
    opt = (get_megatron_optimizer(ocfg, chunks) if variant == "adamw" else
           get_swan_optimizer(ocfg, chunks, swan=_swan_options(variant, args.bucket_mb)))
    wrappers = getattr(opt, "chained_optimizers", [opt])
    batch = harness.dp_share(harness.global_batch(0, world, args.seq, cfg.vocab_size),
                             ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())

    def held() -> list:
        masters = [t for w in wrappers for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups")
                   for t in _flat(getattr(w, name, []))]
        return _framework_tensors([opt, *chunks], masters)

    return SimpleNamespace(module=chunks[0], inners=[w.optimizer for w in wrappers], held=held,
                           params=sum(p.numel() for c in chunks for p in c.parameters()),
                           iteration=lambda: harness.train_step(chunks, opt, batch), framework_step=(opt, "step"))


def _flat(value) -> list:
    if torch.is_tensor(value):
        return [value]
    return [t for v in value for t in _flat(v)] if isinstance(value, (list, tuple)) else []


def _framework_tensors(roots: list, masters: list) -> list:
    """(tensor, category) for the tensors a framework's objects hold (DeepSpeed's and Megatron's classes, and
    the attributes of their modules that are not parameters or submodules), by where they sit: ``masters``
    (its fp32 master copies) as masters, else by the attribute names on the way (``ipg``: DeepSpeed's
    reduce buckets, ``grad``: gradient buffers and partitions, ``param``/``bit16``/``fp16``: parameters)."""
    import warnings

    found: list = []
    seen: set[int] = set()

    def visit(obj, path: str, depth: int) -> None:
        if depth > 6 or id(obj) in seen:
            return
        seen.add(id(obj))
        if torch.is_tensor(obj):
            found.append((path, obj))
            if obj.grad is not None:
                found.append((path + ".grad", obj.grad))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            for k, v in list(obj.items()):
                visit(v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", depth + 1)
        elif isinstance(obj, torch.nn.Module):
            for k, v in vars(obj).items():
                if not k.startswith("_") and k not in ("module", "config"):
                    visit(v, f"{path}.{k}", depth + 1)
        elif hasattr(obj, "__dict__") and any(c.__module__.split(".")[0] in ("deepspeed", "megatron")
                                              for c in type(obj).__mro__):  # subclasses too (SWAN's)
            for k, v in vars(obj).items():
                visit(v, f"{path}.{k}", depth + 1)

    with warnings.catch_warnings():  # .grad of a non-leaf tensor
        warnings.simplefilter("ignore")
        for root in roots:
            visit(root, type(root).__name__, 0)
    found += [("masters", t) for t in masters]
    master_ptrs = {t.untyped_storage().data_ptr() for t in masters if t.numel()}
    order = ("master", "param", "grad", "comm", "other")
    best: dict[int, tuple[str, torch.Tensor]] = {}
    for path, t in found:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        ptr, low = t.untyped_storage().data_ptr(), path.lower()
        kind = ("master" if ptr in master_ptrs else "comm" if "ipg" in low else "grad" if "grad" in low
                else "param" if any(w in low for w in ("param", "bit16", "fp16")) else "other")
        if ptr not in best or order.index(kind) < order.index(best[ptr][0]):
            best[ptr] = (kind, t)
    return [(t, kind) for kind, t in best.values()]


def _framework_tracker():
    """torch's MemTracker naming what DeepSpeed and Megatron allocate: two more categories (``Framework
    masters``, ``Framework comm``), and a tensor allocated outside the optimizer's step (where MemTracker
    would say activation or temporary) is put by the framework code allocating it: ZeRO-3's parameter
    gathers as parameters, DeepSpeed's reduce buckets and collectives as comm, the rest of DeepSpeed's and
    Megatron's gradient and optimizer wrappers as gradients."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType

    kinds = _RefType("_FrameworkRefType", {**{m.name: m.value for m in _MemRefType},
                                           "MASTER": "Framework masters", "COMM": "Framework comm"})
    sep = os.sep
    site, stdlib = sysconfig.get_paths()["purelib"] + sep, sysconfig.get_paths()["stdlib"] + sep
    harness = os.path.join(os.path.dirname(_HERE), "tests", "megatron_harness.py")
    # frames that pass a call on: decorators, generic helpers, the CPU shims, ZeRO-3's linear autograd function
    neutral = (f"deepspeed{sep}utils{sep}nvtx.py", f"megatron{sep}core{sep}utils.py",
               f"deepspeed{sep}runtime{sep}zero{sep}linear.py")

    def allocated_by():
        """The category of a tensor being allocated, from the frames calling: the innermost one that is
        DeepSpeed's, Megatron's or the caller's decides; through a torch.distributed collective, comm."""
        collective = False
        f = sys._getframe(2)
        while f is not None:
            path, name = f.f_code.co_filename, f.f_code.co_name
            f = f.f_back
            if f"{sep}torch{sep}distributed{sep}distributed_c10d" in path:
                collective = True
            framework = path.startswith(site) and path[len(site):].split(sep)[0] in ("deepspeed", "megatron")
            if ((path.startswith((site, stdlib)) and not framework) or path.endswith(neutral)
                    or (path == harness and name != "train_step")):
                continue
            if not framework or path.endswith(f"runtime{sep}engine.py"):  # the model's, the engine's fwd/bwd
                return None
            if any(m in path for m in ("partition_parameters", "partitioned_param_coordinator", "parameter_offload")):
                return _MemRefType.PARAM  # ZeRO-3's gathered parameters
            if collective or name == "setup_buckets" or f"{sep}comm{sep}" in path:
                return kinds.COMM
            if f"{sep}megatron{sep}core{sep}optimizer{sep}" in path:
                return _MemRefType.TEMP  # e.g. clipping's scaled copies (without apex)
            return _MemRefType.GRAD  # gradient partitions, flat fp32 gradients, gradient buffers
        return None

    class FrameworkTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self._ref_class = kinds

        def _track(self, reftype, t) -> None:
            if reftype in (_MemRefType.ACT, _MemRefType.TEMP) and any(
                    self._WINFO.get(st, (None, None))[0] is None for st in get_untyped_storages(t)):
                reftype = allocated_by() or reftype
            super()._track(reftype, t)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
            # a framework's masters and buckets keep their category (ZeRO-3's gradients are views of its bucket)
            if reftype not in (kinds.MASTER, kinds.COMM):
                held = [self._WINFO.get(st, (None, None))[0] for st in get_untyped_storages(t)]
                if any(w is not None and w.reftype in (kinds.MASTER, kinds.COMM) for w in held):
                    return {w for w in held if w is not None}
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            shadow = module.__dict__.pop("buffers", None)  # Megatron DDP's list of buffers hides Module.buffers()
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                if shadow is not None:
                    module.__dict__["buffers"] = shadow

        def register(self, held: list) -> None:
            names = {"master": kinds.MASTER, "comm": kinds.COMM, "grad": _MemRefType.GRAD,
                     "param": _MemRefType.PARAM, "other": _MemRefType.OTH}
            for t, kind in held:
                if self._WINFO.get(t.untyped_storage(), (None, None))[0] is None or kind in ("master", "comm"):
                    self._update_and_maybe_create_winfos(t, names[kind])

    return FrameworkTracker()


def _prepare(layout: str) -> None:
    """Import a framework before the baseline RSS is read (its libraries are not the step's memory).
    megatron-core's ``megatron`` is a namespace package that benchmarks/megatron.py would shadow: this
    folder leaves sys.path (what it serves is already imported) and tests/ (the CPU harness) joins it."""
    import warnings

    # torch.distributed's deprecation notes for the collectives DeepSpeed and Megatron call
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")
    if layout.startswith("zero"):
        os.environ["DS_ACCELERATOR"] = "cpu"  # the model and gloo on the CPU, also where a GPU is present
        import deepspeed  # noqa: F401
    elif layout == "megatron":
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
        sys.path.append(os.path.join(os.path.dirname(_HERE), "tests"))
        warnings.filterwarnings("ignore", module=r"megatron\.")
        import megatron_harness

        megatron_harness.install_cpu_shims()


def _rank(rank: int, world: int, layout: str, variant: str, args) -> dict:
    """This rank's peaks: resident over one step after the warm-up (``VmHWM`` above the RSS before the model
    was built, reset after ``malloc_trim``), then live by category over one more step (``FSDPMemTracker``
    under FSDP2), the optimizer's step and the framework's in :class:`measure.Marks` windows."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _prepare(layout)
        settle()
        baseline = rss_status()["VmRSS"]
        tokens = torch.randint(0, 32000, (1, args.seq + 1), generator=torch.Generator().manual_seed(rank + 1))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        run = (_deepspeed_run(layout, variant, world, args, x, y) if layout.startswith("zero") else
               _megatron_run(variant, world, args) if layout == "megatron" else
               _torch_run(layout, variant, world, args, x, y))
        run.iteration()  # the warm-up
        dist.barrier()
        settle()
        reset_hwm()
        run.iteration()
        out = {"rank": rank, "rss_peak": rss_status()["VmHWM"] - baseline, "params": run.params,
               "inner": type(run.inners[0]).__name__}
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # (not in the resident baseline)
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = (FSDPMemTracker(run.module, run.inners[0]) if layout == "fsdp2" else
                   _framework_tracker() if layout in FRAMEWORKS else MemTracker())
        tracker.track_external(run.module, *run.inners)
        if layout in FRAMEWORKS:
            tracker.register(run.held())
        marks = Marks(tracker)
        for o in run.inners:
            marks.wrap(o, "step", "step")
        if run.framework_step:
            marks.wrap(*run.framework_step, "framework")
        dist.barrier()
        with tracker:
            run.iteration()
            whole = categories(tracker.get_tracker_snapshot("peak"))
        out.update(peak=whole, after=categories(tracker.get_tracker_snapshot("current")), **marks.out,
                   state_bytes=state_bytes(run.inners), bucket_mb=args.bucket_mb)
        out["peak_total"] = max(whole.get("Total", 0), out.get("peak_before_step", 0), out.get("step_peak", 0))
        bound = step_bound(run.inners, variant)
        return {**out, "bound": bound} if bound else out
    finally:
        if layout == "megatron" and "megatron.core" in sys.modules:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.destroy_process_group()


def measure(layout: str, variant: str, world: int, args, bucket_mb: float | None = None) -> list[dict]:
    a = argparse.Namespace(**{**vars(args), "bucket_mb": bucket_mb or args.bucket_mb})
    ranks = [{**r, "layout": layout, "variant": variant, "world": world}
             for r in spawn(_rank, world, layout, variant, a)]
    top = max(ranks, key=lambda r: r["peak_total"])
    print(f"{layout} W={world} {variant} bucket_mb={a.bucket_mb:g}: peak live {mib(top['peak_total'])} MiB, RSS "
          f"{mib(max(r['rss_peak'] for r in ranks))} MiB, transient "
          f"{max(r['transient'] for r in ranks) / MiB:,.1f} MiB; at the peak: "
          + ", ".join(f"{k} {mib(v)}" for k, v in top["peak"].items() if v), flush=True)
    return ranks


# --------------------------------------------------------------------------------------------- report
def _cat(r: dict, *names: str) -> int:
    return sum(v for k, v in r["peak"].items() if k in names)


def _worst(r: dict) -> dict:
    """The rank of a row whose step transient comes closest to its bound (rows saved before it was kept: the row's)."""
    return r.get("worst_bound") or {"rank": r["rank"], "transient": r["transient"], "bound": r["bound"]["total"]}


def _label(r: dict) -> str:
    if r["variant"] == "adamw" and r["layout"].startswith("zero"):
        return "AdamW (torch, DeepSpeed `torch_adam`)"
    if r["variant"] == "adamw" and r["layout"] == "megatron":
        return f"Megatron Adam (`{r.get('inner', 'AdamW')}`)"
    return VARIANTS[r["variant"]]


def _ok(good: bool, no: str = "NOT MET") -> str:
    return "OK" if good else no


def report(rows: list[dict], sweep: list[dict], args) -> str:
    megatron = next((r for r in rows if r["layout"] == "megatron"), None)
    lines = [
        f"Reference LLaMA `{args.size}` (32k vocabulary, {rows[0]['params'] if rows else 0:,} parameters held by "
        f"the largest rank), bf16 weights, batch 1 x {args.seq} tokens per rank, gloo on the CPU, one process per "
        f"rank; `bucket_mb={args.bucket_mb:g}`. Per rank, the largest over ranks: **live** = MemTracker's peak over "
        "one whole step (FSDPMemTracker under FSDP2), by category at that peak; **RSS** = peak resident memory over "
        "one step above the process's RSS before the model was built (allocator trimmed, high-water mark reset "
        "before the step); **transient** = the peak inside `optimizer.step()` minus the live bytes just before "
        "it; **bound** = the rank's bound from its exchange schedule (docs/engine.md, \"Memory a step adds\").",
    ]
    if any(r["layout"] in FRAMEWORKS for r in rows):
        lines += ["", "Frameworks: **ZeRO-1/2/3** = `deepspeed.initialize` with `bf16` enabled and DeepSpeed's "
                  "other settings at their defaults (`reduce_bucket_size` 5e8 elements), the optimizer from its JSON "
                  "(torch's AdamW as `\"torch_adam\": true`, SWAN‡ as `\"type\": \"SWAN\"`); **Megatron DistOpt** = "
                  "megatron-core `GPTModel` at the same shape (tests/megatron_harness.py `build_gpt` with its CPU "
                  "shims: LayerNorm and linear biases" + (f", {megatron['params']:,} parameters" if megatron else "")
                  + "), bf16, Megatron DDP (fp32 gradient buffer) with `use_distributed_optimizer=True`, Megatron's "
                  "Adam (`get_megatron_optimizer`) or SWAN‡ (`get_swan_optimizer`, the same `OptimizerConfig`). "
                  "There the optimizer step is the inner `torch.optim.Optimizer`'s (ZeRO-3 runs it once per sub-group: "
                  "the largest), and **framework step** = the same for the framework's whole step (`engine.step()`, "
                  "Megatron's `optimizer.step()`: fp32 gradients, clipping, the optimizer, the parameters' copy-back "
                  "and all-gather). **fp32 masters** = the framework's fp32 master copies of the bf16 parameters "
                  "(DeepSpeed's partitions, Megatron's shards); the framework's gradient buffers and partitions count "
                  "as grads, its reduce buckets and collective buffers as comm. buffers, ZeRO-3's gathered parameters "
                  "as params."]
    lines += ["", "| layout | W | optimizer | live peak MiB | params | grads | opt. state | fp32 masters "
              "| activations | temporaries | comm. buffers | other | RSS peak MiB | step transient MiB "
              "| framework step MiB | bound MiB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["peak"]
        cats = [_cat(r, *PARAM), _cat(r, *GRAD), _cat(r, *OPT), _cat(r, *MASTERS), p.get("Activation", 0),
                p.get("Temp", 0), _cat(r, *COMM)]
        lines.append(row(LAYOUT_NAMES[r["layout"]], r["world"], _label(r), mib(r["peak_total"]), *map(mib, cats),
                         mib(p.get("Total", 0) - sum(cats)), mib(r["rss_peak"]), f"{r['transient'] / MiB:,.1f}",
                         f"{r['framework_transient'] / MiB:,.1f}" if "framework_transient" in r else "-",
                         f"{r['bound']['total'] / MiB:,.1f}" if "bound" in r else "-"))
    checks: list[str] = []
    if sweep:
        lines += ["", "The transient against the bound, FSDP2 owner mode, per `bucket_mb` (the largest rank; "
                  "parts of that rank's bound: assembled fp32 matrices of a phase, gradient and update buffers of "
                  "the phases in flight, one stack's whitening workspace, update pieces held before they are applied):",
                  "", "| W | bucket_mb | measured MiB | bound MiB | measured / bound | matrices | grad buffers "
                  "| update buffers | workspace | held |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            b, ratio = r["bound"], r["transient"] / r["bound"]["total"]
            lines.append(row(r["world"], f"{r['bucket_mb']:g}", f"{r['transient'] / MiB:,.1f}", *(
                f"{b[k] / MiB:,.1f}" if k else f"{ratio:.2f}" for k in
                ("total", None, "matrices", "grad_buffers", "update_buffers", "workspace", "held"))))
            checks.append(f"bound W={r['world']} bucket_mb={r['bucket_mb']:g}: measured/bound {ratio:.2f} "
                          f"{_ok(ratio <= 1.10, 'VIOLATED')} (<= 1.10)")
    by = {(r["layout"], r["world"], r["variant"]): r for r in rows}
    reading = []
    for layout in LAYOUT_VARIANTS:
        for w in sorted({r["world"] for r in rows}):
            a = by.get((layout, w, "adamw"))
            parts = [f"{VARIANTS[v]} {by[(layout, w, v)]['peak_total'] / a['peak_total']:.2f}x live, "
                     f"{by[(layout, w, v)]['rss_peak'] / a['rss_peak']:.2f}x resident"
                     for v in LAYOUT_VARIANTS[layout][1:] if a and (layout, w, v) in by]
            if parts:
                reading.append(f"{LAYOUT_NAMES[layout]} W={w}, against {_label(a)}: " + "; ".join(parts) + ".")
    if reading:
        layouts = {r["layout"] for r in rows}
        notes = [n for k, n in (
            ({"ddp"}, "under DDP MemTracker does not see the reducer's gradient buckets (allocated by DDP's C++ "
                      "reducer before the tracker starts), which the resident peak counts"),
            ({"zero1", "zero2", "zero3"}, "under ZeRO the live bytes count DeepSpeed's reduce bucket whole "
             "(`reduce_bucket_size`, 5e8 bf16 elements, 954 MiB, by default), the resident peak only the pages "
             "written"),
            ({"megatron"}, "under Megatron gloo's coalesced reduce-scatter copies the whole fp32 gradient buffer "
                           "(comm. buffers; NCCL reduces in place)")) if k & layouts]
        over = [f"{LAYOUT_NAMES[r['layout']]} W={r['world']} {VARIANTS[r['variant']]}" for r in rows
                if "bound" in r and _worst(r)["transient"] > 1.10 * _worst(r)["bound"]]
        bounds = (f"The transient a SWAN step adds exceeds its bound by more than 10 % in: {', '.join(over)}"
                  if over else "The transient a SWAN step adds stays under its bound (measured / bound in the table)")
        lines += ["", "Reading: " + " ".join(reading) + " " + bounds + "".join(f"; {n}" for n in notes) + "."]
    for w in sorted({r["world"] for r in rows}):
        a, o, bw = by.get(("fsdp2", w, "adamw")), by.get(("fsdp2", w, "owner")), by.get(("fsdp2", w, "backward"))
        if a and o and "bound" in o:
            limit = a["peak_total"] - a["state_bytes"] + o["bound"]["total"]
            checks.append(f"FSDP2 W={w} owner peak {mib(o['peak_total'])} MiB <= AdamW peak {mib(a['peak_total'])} - "
                          f"AdamW state {mib(a['state_bytes'])} + bound {mib(o['bound']['total'])} = {mib(limit)} MiB: "
                          f"{_ok(o['peak_total'] <= limit)}")
            fb = limit + o["state_bytes"]
            checks.append(f"FSDP2 W={w} the same with SWAN‡'s fallback state ({mib(o['state_bytes'])} MiB: AdamW "
                          f"moments of embeddings, head, norms) added to the right side: {mib(fb)} MiB: "
                          f"{_ok(o['peak_total'] <= fb)}")
        if o and bw:
            grads = sum(v for k, v in o["step_peak_categories"].items() if k in GRAD)  # every rank's gradients
            checks.append(f"FSDP2 W={w} step_in_backward resident peak {mib(bw['rss_peak'])} MiB <= ordinary "
                          f"{mib(o['rss_peak'])} - the rank's gradients {mib(grads)} = {mib(o['rss_peak'] - grads)} "
                          f"MiB: {_ok(bw['rss_peak'] <= o['rss_peak'] - grads)}")
            live = bw["peak_total"] <= o["peak_total"] - grads
            work = sum(v for k, v in bw["peak"].items() if k in ("Activation", "Temp") + COMM)
            why = ("" if live else f" (step_in_backward's peak falls in backward, at {mib(work)} MiB of activations, "
                   f"temporaries and collective buffers and {mib(_cat(bw, *GRAD))} MiB of gradients not yet "
                   "reduced: nothing an optimizer can free)")
            checks.append(f"FSDP2 W={w} step_in_backward live peak {mib(bw['peak_total'])} MiB <= ordinary "
                          f"{mib(o['peak_total'])} - the rank's gradients {mib(grads)} = "
                          f"{mib(o['peak_total'] - grads)} MiB: {_ok(live)}{why}")
            saved = o["live_before_step"] - bw["live_before_step"]
            checks.append(f"FSDP2 W={w} live bytes when backward ends: ordinary {mib(o['live_before_step'])} MiB, "
                          f"step_in_backward {mib(bw['live_before_step'])} MiB: {mib(saved)} MiB less, the rank's "
                          f"gradients {mib(grads)} MiB: {_ok(saved >= 0.98 * grads)} (>= 0.98 of them)")
    for r in rows:
        if r["layout"] in FRAMEWORKS and "bound" in r:
            w = _worst(r)
            ratio = w["transient"] / w["bound"]
            checks.append(f"{LAYOUT_NAMES[r['layout']]} W={r['world']} {VARIANTS[r['variant']]}: step transient / "
                          f"bound, {'the largest over ranks (rank' if 'worst_bound' in r else '(rank'} {w['rank']}): "
                          f"{w['transient'] / MiB:,.1f} / {w['bound'] / MiB:,.1f} MiB = {ratio:.2f} "
                          f"{_ok(ratio <= 1.10, 'VIOLATED')} (<= 1.10)")
    return "\n".join(lines + (["", "Checks:", ""] + [f"- {c}" for c in checks] if checks else []))


def estimates_report(est: list[dict], rows: list[dict]) -> list[str]:
    """The traces of benchmarks/memory_estimate.py (fake process group, no allocation) against the real rows."""
    real = {(r["world"], r["variant"]): r for r in rows if r["layout"] == "fsdp2"}
    lines = ["", "The same steps traced without allocating (benchmarks/memory_estimate.py: rank 0 of W on torch's fake "
             "process group, `FakeTensorMode`, `FSDPMemTracker`), against the live peaks measured above:", "",
             "| W | optimizer | traced peak MiB | + one RS input MiB | measured live peak MiB | traced / measured "
             "| (+ RS input) / measured | traced transient MiB | measured transient MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in est:
        r = real.get((e["world"], e["variant"]))
        if r:
            upper = e["peak_total"] + e["largest_unit_bytes"]
            lines.append(row(e["world"], VARIANTS[e["variant"]], mib(e["peak_total"]), mib(upper), mib(r["peak_total"]),
                             f"{e['peak_total'] / r['peak_total']:.2f}", f"{upper / r['peak_total']:.2f}",
                             f"{e['transient'] / MiB:,.1f}", f"{r['transient'] / MiB:,.1f}"))
    return lines


def _largest(ranks: list[dict]) -> dict:
    """The rank with the largest live peak, with the rank whose step transient comes closest to its bound."""
    top = dict(max(ranks, key=lambda r: r["peak_total"]))
    bounded = [r for r in ranks if "bound" in r]
    if bounded:
        worst = max(bounded, key=lambda r: r["transient"] / r["bound"]["total"])
        top["worst_bound"] = {"rank": worst["rank"], "transient": worst["transient"], "bound": worst["bound"]["total"]}
    return top


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="130m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--layouts", default="fsdp2,ddp", help=f"comma list of {', '.join(LAYOUT_NAMES)}")
    p.add_argument("--sweep", default="4,16,64", help="bucket_mb values of the transient sweep (FSDP2 owner mode)")
    p.add_argument("--estimate", type=lambda v: int(v or 0), default=1,
                   help="1: trace the same FSDP2 steps on the fake process group (0 or empty: not)")
    p.add_argument("--from-json", default=None, help="report measurements saved by an earlier run instead of measuring")
    p.add_argument("--merge", default="", help="more saved runs (JSON, comma-separated) whose rows join --from-json's")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    args.bucket_mb = BUCKET_MB
    worlds = [int(w) for w in args.worlds.split(",")]
    rows, sweep, est = [], [], []
    if args.from_json:
        for path in [args.from_json, *filter(None, args.merge.split(","))]:
            saved = json.load(open(path))
            rows, sweep, est = rows + saved["rows"], sweep + saved["sweep"], est + saved.get("estimates", [])
    else:
        rows = [_largest(measure(layout, v, w, args)) for layout in args.layouts.split(",") for w in worlds
                for v in LAYOUT_VARIANTS[layout]]
        for w in worlds:
            for b in [float(x) for x in args.sweep.split(",") if x]:
                sweep.append(max(measure("fsdp2", "owner", w, args, bucket_mb=b),
                                 key=lambda r: r["transient"] / r["bound"]["total"]))
    with open(os.path.join(tempfile.gettempdir(), "memory_dist_raw.json"), "w") as f:
        json.dump({"rows": rows, "sweep": sweep, "estimates": est}, f)  # before anything can fail
    if args.estimate and not est:
        est = [{**trace_step(args.size, r["world"], r["variant"], args.seq, bucket_mb=args.bucket_mb),
                "variant": r["variant"]} for r in rows if r["layout"] == "fsdp2"]
    text = report(rows, sweep, args) + ("\n" + "\n".join(estimates_report(est, rows)) if est else "")
    print(text)
    if not args.no_write:
        write_section("memory-dist", "Memory, distributed (CPU): peak per rank under DDP, FSDP2, ZeRO-1/2/3 and "
                      "Megatron's distributed optimizer, and each SWAN step's transient against its bound", text)


if __name__ == "__main__":
    main()
