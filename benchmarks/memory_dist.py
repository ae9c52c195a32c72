"""Peak memory per rank of a whole training step under DDP, FSDP2, DeepSpeed ZeRO-1/2/3 and Megatron-core's
distributed optimizer (spawned processes, gloo on the CPU), AdamW against SWAN‡ in owner and replicated mode
and FSDP2 with ``step_in_backward=True``, on the same model and data, and the transient a SWAN step adds
against the stated bound (docs/engine.md, "Memory a step adds") for several ``bucket_mb``.

Model: the reference LLaMA at a ``MODEL_SIZES`` shape with the papers' 32k vocabulary, bf16 weights (no
fp32 master, no autocast), batch 1 x ``--seq`` tokens per rank, built on ``meta`` and materialised in place
(FSDP2: sharded before it is materialised, so no rank ever holds the whole model). Each (layout, optimizer,
W) runs in fresh processes, one configuration after another, and each rank measures:

1. **resident memory**: after ``--warmup`` steps, ``malloc_trim(0)`` and the high-water mark reset (``5``
   to ``/proc/self/clear_refs``), one step, ``VmHWM`` minus the RSS before the model was built;
2. **live tensor bytes by category**: one more step under torch's ``MemTracker`` (``FSDPMemTracker``
   under FSDP2: sharded/unsharded parameters and gradients, all-gather and reduce-scatter buffers apart),
   its peak per category; and the *step transient*: the peak inside ``optimizer.step()`` minus the live
   bytes just before it (SWAN's assembled fp32 matrices, whitening workspace, exchange buffers and the
   fallback rule's temporaries), against the rank's bound computed from its own exchange schedule.

Frameworks (``--layouts zero1,zero2,zero3,megatron``):

- ``zero1``/``zero2``/``zero3``: ``deepspeed.initialize`` with ``bf16`` enabled (fp32 master partitions, DeepSpeed's
  usual) and DeepSpeed's other settings at their defaults; the optimizer from the JSON: torch's AdamW
  (``"torch_adam": true``: DeepSpeed's own Adam ops need a JIT build) or ``"type": "SWAN"``. The optimizer step
  measured is the inner ``torch.optim.Optimizer``'s (what SWAN's bound is about; ZeRO-3 calls it once per
  sub-group: the largest), and apart from it DeepSpeed's whole ``engine.step()`` (the *framework step*).
- ``megatron``: megatron-core ``GPTModel`` (``build_gpt`` of tests/megatron_harness.py with its CPU shims: local
  layer spec, LayerNorm and linear biases, SwiGLU, RoPE, untied embeddings) at the LLaMA shape of ``--size``,
  bf16 (``Float16Module``), in Megatron DDP with ``use_distributed_optimizer=True``; Megatron's Adam
  (``get_megatron_optimizer``) or SWAN‡ (``get_swan_optimizer``) with the same ``OptimizerConfig``. The framework
  step is Megatron's ``optimizer.step()``.

Under both, what the framework allocates is named: its fp32 master copies (``framework masters``), its gradient
buffers and partitions (``grads``), its communication buckets (``comm. buffers``) and ZeRO-3's gathered
parameters (``params``): tensors it holds before the tracked step by where they sit in its objects, tensors
allocated during the step by the framework code that allocates them.

Writes the ``memory-dist`` section of docs/benchmarks.md and docs/results/memory-dist.json.

    python benchmarks/memory_dist.py --size small --no-write           # quick check
    python benchmarks/memory_dist.py --size 130m --worlds 2,4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import Marks, categories, free_port, reset_hwm, rss_status, settle, write_section  # noqa: E402
from memory import MiB  # noqa: E402

VARIANTS = {
    "adamw": "AdamW (torch, foreach)",
    "owner": "SWAN‡ owner mode",
    "replicated": "SWAN‡ replicated mode",
    "backward": "SWAN‡ owner, step_in_backward",
}
LAYOUT_VARIANTS = {"fsdp2": ("adamw", "owner", "replicated", "backward"), "ddp": ("adamw", "owner", "replicated"),
                   **{f"zero{s}": ("adamw", "owner", "replicated") for s in (1, 2, 3)},
                   "megatron": ("adamw", "owner", "replicated")}
LAYOUT_NAMES = {"fsdp2": "FSDP2", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                "megatron": "Megatron DistOpt"}
FRAMEWORKS = ("zero1", "zero2", "zero3", "megatron")
_HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------- ranks
def _build(size: str, layout: str, world: int):
    from swan_dist.reference.model import Llama, model_config, rope_tables

    cfg = model_config(size, vocab_size=32000)
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    if layout == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        from swan_dist.reference.parallel import shard_fsdp2

        shard_fsdp2(model, init_device_mesh("cpu", (world,)))
    model.to_empty(device="cpu")
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
    model.rope_cos, model.rope_sin = cos, sin
    torch.manual_seed(0)
    model.reset_parameters()
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    return model, cfg


def _optimizer(variant: str, model, bucket_mb: float):
    import swan_dist

    if variant == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    mode = "replicated" if variant == "replicated" else "owner"
    return swan_dist.SWAN(model, preset="swan_ddagger", verbose=False, mode=mode, bucket_mb=bucket_mb,
                          step_in_backward=variant == "backward")


def _swan_options(variant: str, bucket_mb: float) -> dict:
    return {"preset": "swan_ddagger", "verbose": False, "mode": variant, "bucket_mb": bucket_mb}


class _Run:
    """One layout's model and optimizer on this rank: ``iteration()`` runs forward, backward and the step;
    ``inners`` are the ``torch.optim.Optimizer``s whose ``step()`` is the optimizer step measured;
    ``framework_step`` (object, attribute) is the framework's whole step where there is one; ``held()`` the
    tensors the framework keeps outside the module and the optimizers' state, with their categories."""

    def __init__(self, module, inners, params: int, iteration, framework_step=None, held=lambda: []):
        self.module, self.inners, self.params, self.iteration = module, inners, params, iteration
        self.framework_step, self.held = framework_step, held


def _torch_run(layout: str, variant: str, world: int, args, x, y) -> _Run:
    model, _ = _build(args.size, layout, world)
    opt = _optimizer(variant, model, args.bucket_mb)

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        opt.step()

    return _Run(model, [opt], sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()), iteration)


def _deepspeed_run(layout: str, variant: str, world: int, args, x, y) -> _Run:
    """DeepSpeed's engine at ZeRO stage ``layout[-1]`` with bf16 (fp32 master partitions) and DeepSpeed's
    defaults otherwise; the optimizer from the JSON: torch's AdamW (``torch_adam``) or ``"type": "SWAN"``
    (``import swan_dist`` registers it; SWAN finds the engine's model for the parameters' names)."""
    import deepspeed

    import swan_dist  # noqa: F401 - registers "SWAN" with DeepSpeed
    from swan_dist.integrations.deepspeed import master_weights
    from swan_dist.memory import client_optimizer

    model, _ = _build(args.size, "zero", world)
    if variant == "adamw":
        optimizer = {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}}
    else:
        optimizer = {"type": "SWAN", "params": _swan_options(variant, args.bucket_mb)}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": optimizer, "bf16": {"enabled": True}, "zero_optimization": {"stage": int(layout[-1])}}
    engine, wrapper, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def iteration() -> None:
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()  # DeepSpeed's step clears the gradients

    def held() -> list:
        partitions = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]  # ZeRO-3
        return _framework_tensors([wrapper], _flat(master_weights(wrapper))) + [(t, "param") for t in partitions]

    params = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
    return _Run(engine, [client_optimizer(wrapper)], params, iteration, (engine, "step"), held)


def _megatron_run(variant: str, world: int, args) -> _Run:
    """megatron-core's GPTModel at the LLaMA shape of ``args.size`` (tests/megatron_harness.py ``build_gpt``),
    bf16, in Megatron DDP with the distributed optimizer: Megatron's Adam or SWAN‡ from the same config."""
    import megatron_harness as harness
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from swan_dist.integrations.megatron_factory import get_swan_optimizer
    from swan_dist.reference.model import model_config

    cfg = model_config(args.size, vocab_size=32000)
    ps.initialize_model_parallel()
    chunks, _ = harness.build_gpt(1, hidden=cfg.dim, ffn=cfg.ffn_dim, layers=cfg.n_layers, heads=cfg.n_heads,
                                  query_groups=cfg.n_kv_heads or cfg.n_heads, vocab=cfg.vocab_size, seq=args.seq,
                                  tied=cfg.tie_embeddings, bf16=True, use_distributed_optimizer=True)
    ocfg = OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, bf16=True, use_distributed_optimizer=True)
    if variant == "adamw":
        opt = get_megatron_optimizer(ocfg, chunks)
    else:
        opt = get_swan_optimizer(ocfg, chunks, swan=_swan_options(variant, args.bucket_mb))
    wrappers = getattr(opt, "chained_optimizers", [opt])
    batch = harness.dp_share(harness.global_batch(0, world, args.seq, cfg.vocab_size),
                             ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())

    def iteration() -> None:
        harness.train_step(chunks, opt, batch)

    def held() -> list:
        masters = [t for w in wrappers for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups")
                   for t in _flat(getattr(w, name, []))]
        return _framework_tensors([opt, *chunks], masters)

    return _Run(chunks[0], [w.optimizer for w in wrappers], sum(p.numel() for c in chunks for p in c.parameters()),
                iteration, (opt, "step"), held)


def _flat(value) -> list:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


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

    site = sysconfig.get_paths()["purelib"] + sep
    stdlib = sysconfig.get_paths()["stdlib"] + sep
    harness = os.path.join(os.path.dirname(_HERE), "tests", "megatron_harness.py")
    # frames that pass a call on: decorators, generic helpers, the CPU shims, ZeRO-3's linear autograd
    # function (the model's matmuls)
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
    _prepare(layout)
    settle()
    baseline = rss_status()["VmRSS"]
    cfg_vocab = 32000
    g = torch.Generator().manual_seed(rank + 1)
    tokens = torch.randint(0, cfg_vocab, (1, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if layout.startswith("zero"):
        run = _deepspeed_run(layout, variant, world, args, x, y)
    elif layout == "megatron":
        run = _megatron_run(variant, world, args)
    else:
        run = _torch_run(layout, variant, world, args, x, y)

    for _ in range(args.warmup):
        run.iteration()
    dist.barrier()
    settle()
    between = rss_status()["VmRSS"]
    reset_hwm()
    run.iteration()
    hwm = rss_status()["VmHWM"]
    out = {"rank": rank, "rss_peak": hwm - baseline, "rss_between": between - baseline, "params": run.params,
           "inner": type(run.inners[0]).__name__}

    from torch.distributed._tools.mem_tracker import MemTracker

    if layout == "fsdp2":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(run.module, run.inners[0])
    elif layout in FRAMEWORKS:
        tracker = _framework_tracker()
    else:
        tracker = MemTracker()
    tracker.track_external(run.module, *run.inners)
    if layout in FRAMEWORKS:
        tracker.register(run.held())
    marks = Marks(tracker)
    saved = [(o, o.__dict__.get("step")) for o in run.inners]
    for o in run.inners:
        marks.wrap(o, "step", "step")
    if run.framework_step is not None:
        obj, attr = run.framework_step
        marks.wrap(obj, attr, "framework")
    dist.barrier()
    try:
        with tracker:
            run.iteration()
            whole = categories(tracker.get_tracker_snapshot("peak"))
    finally:
        for o, step in saved:
            o.__dict__.pop("step", None)
            if step is not None:
                o.step = step
        if run.framework_step is not None:
            run.framework_step[0].__dict__.pop(run.framework_step[1], None)
    out.update(peak=whole, after=categories(tracker.get_tracker_snapshot("current")), **marks.out)
    out["peak_total"] = max(whole.get("Total", 0), marks.out.get("peak_before_step", 0), marks.out.get("step_peak", 0))
    if variant in ("owner", "replicated"):
        from swan_dist import whitening

        bounds = [ex.transient_bound(whitening._CPU_PASS_BYTES) for o in run.inners
                  for memo in getattr(o, "_memos", {}).values() for ex in memo.plans.cache.values()]
        if bounds:  # ZeRO-3: one plan per sub-group, stepped one after another
            out["bound"] = max(bounds, key=lambda b: b["total"])
            out["bucket_mb"] = args.bucket_mb
    state = 0
    for o in run.inners:
        for st in o.state.values():
            local = [getattr(t, "_local_tensor", t) for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
            state += sum(t.numel() * t.element_size() for t in local)
    out["state_bytes"] = state
    return out


def _worker(rank: int, world: int, port: int, layout: str, variant: str, args, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = _rank(rank, world, layout, variant, args)
        with open(os.path.join(path, f"{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        if layout == "megatron" and "megatron.core" in sys.modules:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.destroy_process_group()


def measure(layout: str, variant: str, world: int, args, bucket_mb: float | None = None) -> list[dict]:
    a = argparse.Namespace(**{**vars(args), "bucket_mb": bucket_mb or args.bucket_mb})
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        mp.spawn(_worker, args=(world, free_port(), layout, variant, a, d), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(os.path.join(d, f"{r}.json")) as f:
                ranks.append(json.load(f))
    for r in ranks:
        r.update(layout=layout, variant=variant, world=world, wall_s=time.perf_counter() - t0)
    print(f"{layout} W={world} {variant} bucket_mb={a.bucket_mb:g}: peak live "
          f"{max(r['peak_total'] for r in ranks) / MiB:,.0f} MiB, RSS {max(r['rss_peak'] for r in ranks) / MiB:,.0f} MiB, "
          f"transient {max(r['transient'] for r in ranks) / MiB:,.1f} MiB"
          + (f" (bound {max(r['bound']['total'] for r in ranks if 'bound' in r) / MiB:,.1f})"
             if any("bound" in r for r in ranks) else "") + f" [{time.perf_counter() - t0:.0f} s]", flush=True)
    top = max(ranks, key=lambda r: r["peak_total"])
    print("  at the peak: " + ", ".join(f"{k} {v / MiB:,.0f}" for k, v in top["peak"].items() if v), flush=True)
    return ranks


# --------------------------------------------------------------------------------------------- report
def _m(b) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def _cat(r: dict, *names: str) -> int:
    return sum(v for k, v in r["peak"].items() if k in names)


PARAM = ("Parameter", "Sharded Param", "Unsharded Param")
GRAD = ("Gradient", "Sharded Grad", "Unsharded Grad")
COMM = ("All Gather", "Reduce Scatter", "Framework comm")
OPT = ("Optstate", "OptState")
MASTERS = ("Framework masters",)


def _worst(r: dict) -> dict:
    """The rank of a row whose step transient comes closest to its bound (rows saved before it was kept: the row's)."""
    return r.get("worst_bound") or {"rank": r["rank"], "transient": r["transient"], "bound": r["bound"]["total"]}


def _label(r: dict) -> str:
    if r["variant"] == "adamw" and r["layout"].startswith("zero"):
        return "AdamW (torch, DeepSpeed `torch_adam`)"
    if r["variant"] == "adamw" and r["layout"] == "megatron":
        return f"Megatron Adam (`{r.get('inner', 'AdamW')}`)"
    return VARIANTS[r["variant"]]


def report(rows: list[dict], sweep: list[dict], args) -> tuple[str, list[str]]:
    frameworks = [r for r in rows if r["layout"] in FRAMEWORKS]
    lines = [
        f"Reference LLaMA `{args.size}` (32k vocabulary, {rows[0]['params'] if rows else 0:,} parameters held by "
        f"the largest rank), bf16 weights, batch 1 x {args.seq} tokens per rank, gloo on the CPU, one process per rank; "
        f"`bucket_mb={args.bucket_mb:g}`. Per rank, the largest over ranks: **live** = MemTracker's peak over one whole "
        "step (FSDPMemTracker under FSDP2), by category at that peak; **RSS** = peak resident memory over one step "
        "above the process's RSS before the model was built (allocator trimmed, high-water mark reset before the "
        "step); **transient** = the peak inside `optimizer.step()` minus the live bytes just before it; **bound** = "
        "the rank's bound from its exchange schedule (docs/engine.md, \"Memory a step adds\").",
    ]
    if frameworks:
        megatron = next((r for r in frameworks if r["layout"] == "megatron"), None)
        lines += ["", "Frameworks: **ZeRO-1/2/3** = `deepspeed.initialize` with `bf16` enabled and DeepSpeed's "
                  "other settings at their defaults (`reduce_bucket_size` 5e8 elements), the optimizer from its JSON "
                  "(torch's AdamW as `\"torch_adam\": true`, SWAN‡ as `\"type\": \"SWAN\"`); **Megatron DistOpt** = "
                  "megatron-core `GPTModel` at the same shape (tests/megatron_harness.py `build_gpt` with its CPU "
                  "shims: LayerNorm and linear biases"
                  + (f", {megatron['params']:,} parameters" if megatron else "")
                  + "), bf16, Megatron DDP (fp32 gradient buffer) with `use_distributed_optimizer=True`, Megatron's "
                  "Adam (`get_megatron_optimizer`) or SWAN‡ (`get_swan_optimizer`, the same `OptimizerConfig`). "
                  "There the optimizer step is the inner `torch.optim.Optimizer`'s (ZeRO-3 runs it once per sub-group: "
                  "the largest), and **framework step** = the same for the framework's whole step (`engine.step()`, "
                  "Megatron's `optimizer.step()`: fp32 gradients, clipping, the optimizer, the parameters' copy-back "
                  "and all-gather). **fp32 masters** = the framework's fp32 master copies of the bf16 parameters "
                  "(DeepSpeed's partitions, Megatron's shards); the framework's gradient buffers and partitions count "
                  "as grads, its reduce buckets and collective buffers as comm. buffers, ZeRO-3's gathered parameters "
                  "as params."]
    lines += [
        "",
        "| layout | W | optimizer | live peak MiB | params | grads | opt. state | fp32 masters | activations "
        "| temporaries | comm. buffers | other | RSS peak MiB | step transient MiB | framework step MiB | bound MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["peak"]
        cats = [_cat(r, *PARAM), _cat(r, *GRAD), _cat(r, *OPT), _cat(r, *MASTERS), p.get("Activation", 0),
                p.get("Temp", 0), _cat(r, *COMM)]
        bound = f"{r['bound']['total'] / MiB:,.1f}" if "bound" in r else "-"
        framework = f"{r['framework_transient'] / MiB:,.1f}" if "framework_transient" in r else "-"
        lines.append(f"| {LAYOUT_NAMES[r['layout']]} | {r['world']} | {_label(r)} | {_m(r['peak_total'])} | "
                     + " | ".join(_m(c) for c in cats) + f" | {_m(p.get('Total', 0) - sum(cats))} | {_m(r['rss_peak'])} "
                     f"| {r['transient'] / MiB:,.1f} | {framework} | {bound} |")
    checks: list[str] = []
    if sweep:
        lines += ["", "The transient against the bound, FSDP2 owner mode, per `bucket_mb` (the largest rank; "
                  "parts of that rank's bound: assembled fp32 matrices of a phase, gradient and update buffers of "
                  "the phases in flight, one stack's whitening workspace, update pieces held before they are applied):", "",
                  "| W | bucket_mb | measured MiB | bound MiB | measured / bound | matrices | grad buffers "
                  "| update buffers | workspace | held |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sweep:
            b = r["bound"]
            ratio = r["transient"] / b["total"]
            lines.append(f"| {r['world']} | {r['bucket_mb']:g} | {r['transient'] / MiB:,.1f} | {b['total'] / MiB:,.1f} "
                         f"| {ratio:.2f} | {b['matrices'] / MiB:,.1f} | {b['grad_buffers'] / MiB:,.1f} "
                         f"| {b['update_buffers'] / MiB:,.1f} | {b['workspace'] / MiB:,.1f} | {b['held'] / MiB:,.1f} |")
            checks.append(f"bound W={r['world']} bucket_mb={r['bucket_mb']:g}: measured/bound {ratio:.2f} "
                          f"{'OK' if ratio <= 1.10 else 'VIOLATED'} (<= 1.10)")
    by = {(r["layout"], r["world"], r["variant"]): r for r in rows}
    reading = []
    for layout in LAYOUT_VARIANTS:
        for w in sorted({r["world"] for r in rows}):
            a = by.get((layout, w, "adamw"))
            if not a:
                continue
            parts = [f"{VARIANTS[v]} {by[(layout, w, v)]['peak_total'] / a['peak_total']:.2f}x live, "
                     f"{by[(layout, w, v)]['rss_peak'] / a['rss_peak']:.2f}x resident"
                     for v in LAYOUT_VARIANTS[layout][1:] if (layout, w, v) in by]
            if parts:
                reading.append(f"{LAYOUT_NAMES[layout]} W={w}, against {_label(a)}: " + "; ".join(parts) + ".")
    if reading:
        layouts = {r["layout"] for r in rows}
        notes = []
        if "ddp" in layouts:
            notes.append("under DDP MemTracker does not see the reducer's gradient buckets (allocated by DDP's C++ "
                         "reducer before the tracker starts), which the resident peak counts")
        if layouts & {"zero1", "zero2", "zero3"}:
            notes.append("under ZeRO the live bytes count DeepSpeed's reduce bucket whole (`reduce_bucket_size`, "
                         "5e8 bf16 elements, 954 MiB, by default), the resident peak only the pages written")
        if "megatron" in layouts:
            notes.append("under Megatron gloo's coalesced reduce-scatter copies the whole fp32 gradient buffer "
                         "(comm. buffers; NCCL reduces in place)")
        over = [f"{LAYOUT_NAMES[r['layout']]} W={r['world']} {VARIANTS[r['variant']]}" for r in rows
                if "bound" in r and _worst(r)["transient"] > 1.10 * _worst(r)["bound"]]
        bounds = (f"The transient a SWAN step adds exceeds its bound by more than 10 % in: {', '.join(over)}"
                  if over else "The transient a SWAN step adds stays under its bound (measured / bound in the table)")
        lines += ["", "Reading: " + " ".join(reading) + " " + bounds + "".join(f"; {n}" for n in notes) + "."]
    for w in sorted({r["world"] for r in rows}):
        a, o, bw = by.get(("fsdp2", w, "adamw")), by.get(("fsdp2", w, "owner")), by.get(("fsdp2", w, "backward"))
        if a and o and "bound" in o:
            limit = a["peak_total"] - a["state_bytes"] + o["bound"]["total"]
            checks.append(f"FSDP2 W={w} owner peak {_m(o['peak_total'])} MiB <= AdamW peak {_m(a['peak_total'])} - "
                          f"AdamW state {_m(a['state_bytes'])} + bound {_m(o['bound']['total'])} = {_m(limit)} MiB: "
                          f"{'OK' if o['peak_total'] <= limit else 'NOT MET'}")
            fb = limit + o["state_bytes"]
            checks.append(f"FSDP2 W={w} the same with SWAN‡'s fallback state ({_m(o['state_bytes'])} MiB: AdamW moments "
                          f"of embeddings, head, norms) added to the right side: {_m(fb)} MiB: "
                          f"{'OK' if o['peak_total'] <= fb else 'NOT MET'}")
        if o and bw:
            grads = sum(v for k, v in o["step_peak_categories"].items() if k in GRAD)  # every rank's gradients
            rss = bw["rss_peak"] <= o["rss_peak"] - grads
            checks.append(f"FSDP2 W={w} step_in_backward resident peak {_m(bw['rss_peak'])} MiB <= ordinary "
                          f"{_m(o['rss_peak'])} - the rank's gradients {_m(grads)} = {_m(o['rss_peak'] - grads)} MiB: "
                          f"{'OK' if rss else 'NOT MET'}")
            live = bw["peak_total"] <= o["peak_total"] - grads
            why = ""
            if not live:  # what step_in_backward's peak holds: backward's own working set, gradients not yet reduced
                work = sum(v for k, v in bw["peak"].items() if k in ("Activation", "Temp") + COMM)
                why = (f" (step_in_backward's peak falls in backward, at {_m(work)} MiB of activations, "
                       f"temporaries and collective buffers and {_m(_cat(bw, *GRAD))} MiB of gradients not yet "
                       "reduced: nothing an optimizer can free)")
            checks.append(f"FSDP2 W={w} step_in_backward live peak {_m(bw['peak_total'])} MiB <= ordinary "
                          f"{_m(o['peak_total'])} - the rank's gradients {_m(grads)} = {_m(o['peak_total'] - grads)} "
                          f"MiB: {'OK' if live else 'NOT MET'}{why}")
            saved = o["live_before_step"] - bw["live_before_step"]
            checks.append(f"FSDP2 W={w} live bytes when backward ends: ordinary {_m(o['live_before_step'])} MiB, "
                          f"step_in_backward {_m(bw['live_before_step'])} MiB: {_m(saved)} MiB less, the rank's "
                          f"gradients {_m(grads)} MiB: {'OK' if saved >= 0.98 * grads else 'NOT MET'} (>= 0.98 of them)")
    for r in rows:
        if r["layout"] in FRAMEWORKS and "bound" in r:
            w = _worst(r)
            ratio = w["transient"] / w["bound"]
            checks.append(f"{LAYOUT_NAMES[r['layout']]} W={r['world']} {VARIANTS[r['variant']]}: step transient / "
                          f"bound, {'the largest over ranks (rank' if 'worst_bound' in r else '(rank'} {w['rank']}): "
                          f"{w['transient'] / MiB:,.1f} / "
                          f"{w['bound'] / MiB:,.1f} MiB = {ratio:.2f} {'OK' if ratio <= 1.10 else 'VIOLATED'} "
                          "(<= 1.10)")
    if checks:
        lines += ["", "Checks:", ""] + [f"- {c}" for c in checks]
    return "\n".join(lines), checks


def estimates_report(est: list[dict], rows: list[dict]) -> tuple[str, list[str]]:
    """The traces of benchmarks/memory_estimate.py (fake process group, no allocation) against the real rows."""
    from memory_estimate import TRACED

    real = {(r["world"], r["variant"]): r for r in rows if r["layout"] == "fsdp2"}
    lines = ["", "The same steps traced without allocating (benchmarks/memory_estimate.py: rank 0 of W on torch's fake "
             "process group, `FakeTensorMode`, `FSDPMemTracker`; what benchmarks/memory_dist_scale.py runs at the 7B "
             "and 70B shapes), against the live peaks measured above:", "",
             "| W | optimizer | traced peak MiB | + one RS input MiB | measured live peak MiB | traced / measured "
             "| (+ RS input) / measured | traced transient MiB | measured transient MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    checks = []
    for e in est:
        r = real.get((e["world"], e["variant"]))
        if r is None:
            continue
        ratio = e["peak_total"] / r["peak_total"]
        upper = e["peak_total"] + e["largest_unit_bytes"]
        lines.append(f"| {e['world']} | {TRACED[e['variant']]} | {_m(e['peak_total'])} | {_m(upper)} | "
                     f"{_m(r['peak_total'])} | {ratio:.2f} | {upper / r['peak_total']:.2f} | {e['transient'] / MiB:,.1f} "
                     f"| {r['transient'] / MiB:,.1f} |")
        checks.append(f"traced against measured, W={e['world']} {TRACED[e['variant']]}: {ratio:.2f} "
                      f"(with one reduce-scatter input {upper / r['peak_total']:.2f})")
    return "\n".join(lines), checks


def _largest(ranks: list[dict]) -> dict:
    """The rank with the largest live peak, with the rank whose step transient comes closest to its bound."""
    top = dict(max(ranks, key=lambda r: r["peak_total"]))
    bounded = [r for r in ranks if "bound" in r]
    if bounded:
        worst = max(bounded, key=lambda r: r["transient"] / r["bound"]["total"])
        top["worst_bound"] = {"rank": worst["rank"], "transient": worst["transient"], "bound": worst["bound"]["total"]}
    return top


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="130m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--layouts", default="fsdp2,ddp")
    p.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=256.0)
    p.add_argument("--sweep", default="4,16,64", help="bucket_mb values of the transient sweep (FSDP2 owner mode)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--estimate", type=lambda v: int(v or 0), default=1,
                   help="1: trace the same FSDP2 steps on the fake process group (0 or empty: not)")
    p.add_argument("--from-json", default=None, help="report measurements saved by an earlier run instead of measuring")
    p.add_argument("--variants", default=None, help="only these optimizers (e.g. owner,backward)")
    p.add_argument("--merge", default="", help="more saved runs (JSON, comma-separated) whose rows join --from-json's")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    rows, sweep, est = [], [], []
    saved = json.load(open(args.from_json)) if args.from_json else None
    for layout in args.layouts.split(",") if saved is None else ():
        for w in worlds:
            for v in LAYOUT_VARIANTS[layout]:
                if args.variants and v not in args.variants.split(","):
                    continue
                rows.append(_largest(measure(layout, v, w, args)))
    for w in worlds if saved is None else ():
        for b in [float(x) for x in args.sweep.split(",") if x]:
            ranks = measure("fsdp2", "owner", w, args, bucket_mb=b)
            sweep.append(max(ranks, key=lambda r: r["transient"] / r["bound"]["total"]))
    if saved is not None:
        rows, sweep, est = saved["rows"], saved["sweep"], saved.get("estimates", [])
        for path in filter(None, args.merge.split(",")):
            more = json.load(open(path))
            rows, sweep, est = rows + more["rows"], sweep + more["sweep"], est + more.get("estimates", [])
    with open(os.path.join(tempfile.gettempdir(), "memory_dist_raw.json"), "w") as f:
        json.dump({"rows": rows, "sweep": sweep, "estimates": est}, f)  # before anything can fail
    if args.estimate and not est:
        from memory_estimate import trace_step

        for w in worlds:
            for v in [v for v in VARIANTS if any(r["layout"] == "fsdp2" and r["world"] == w and r["variant"] == v
                                                  for r in rows)]:
                est.append(trace_step(args.size, w, v, args.seq, bucket_mb=args.bucket_mb))
    text, checks = report(rows, sweep, args)
    if est:
        more, more_checks = estimates_report(est, rows)
        text += "\n" + more
    print(text)
    if not args.no_write:
        write_section("memory-dist", "Memory, distributed (CPU): peak per rank under DDP, FSDP2, ZeRO-1/2/3 and "
                      "Megatron's distributed optimizer, and each SWAN step's transient against its bound", text)


if __name__ == "__main__":
    main()
