"""The frameworks of memory_dist.py: DeepSpeed ZeRO and Megatron's distributed optimizer set up on the bf16 model,
the tensors they hold sorted by kind, and a MemTracker that files their allocations under masters, comm. buffers,
gradients and temporaries by the code making them."""

import os
import sys
import sysconfig
import warnings
from types import SimpleNamespace

import torch

from memory_estimate import build

_HERE = os.path.dirname(os.path.abspath(__file__))


def setup(layout: str, variant: str, world: int, args, cfg, swan: dict, x, y) -> SimpleNamespace:
    """ZeRO stage ``layout[-1]`` or Megatron's distributed optimizer over the bf16 model ``cfg``, as
    memory_dist._setup returns it (``held()``: the framework's tensors, by kind)."""
    if layout == "megatron":  # megatron-core's GPTModel at the same shape, Megatron DDP, the distributed optimizer
        import megatron_harness as harness
        from megatron.core import parallel_state as ps
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from swan_dist.integrations.megatron_factory import get_swan_optimizer

        ps.initialize_model_parallel()
        chunks, _ = harness.build_gpt(1, hidden=cfg.dim, ffn=cfg.ffn_dim, layers=cfg.n_layers, heads=cfg.n_heads,
                                      query_groups=cfg.n_kv_heads or cfg.n_heads, vocab=cfg.vocab_size, seq=args.seq,
                                      tied=cfg.tie_embeddings, bf16=True, use_distributed_optimizer=True)
        ocfg = OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, bf16=True, use_distributed_optimizer=True)
        opt = (get_megatron_optimizer(ocfg, chunks) if variant == "adamw" else
               get_swan_optimizer(ocfg, chunks, swan=swan))
        wrappers = getattr(opt, "chained_optimizers", [opt])
        batch = harness.dp_share(harness.global_batch(0, world, args.seq, cfg.vocab_size),
                                 ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        masters = lambda: [t for w in wrappers for n in ("shard_fp32_from_float16_groups",  # noqa: E731
                                                         "fp32_from_float16_groups") for t in flat(getattr(w, n, []))]
        return SimpleNamespace(module=chunks[0], inners=[w.optimizer for w in wrappers], framework=(opt, "step"),
                               held=lambda: framework_tensors([opt, *chunks], masters()),
                               params=sum(p.numel() for c in chunks for p in c.parameters()),
                               iteration=lambda: harness.train_step(chunks, opt, batch))
    import deepspeed  # ZeRO stage layout[-1], bf16 (fp32 master partitions), DeepSpeed's defaults otherwise

    import swan_dist  # noqa: F401 - registers "SWAN" with DeepSpeed
    from swan_dist.integrations.deepspeed import master_weights
    from swan_dist.memory import client_optimizer

    model = build(cfg)
    opt = ({"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}} if variant == "adamw" else
           {"type": "SWAN", "params": swan})
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": opt, "bf16": {"enabled": True}, "zero_optimization": {"stage": int(layout[-1])}}
    engine, wrapper, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def iteration() -> None:
        engine.backward(engine(x, y)[1])
        engine.step()  # DeepSpeed's step clears the gradients

    def held() -> list:
        partitions = [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]  # ZeRO-3
        return framework_tensors([wrapper], flat(master_weights(wrapper))) + [(t, "param") for t in partitions]

    params = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
    return SimpleNamespace(module=engine, inners=[client_optimizer(wrapper)], params=params, iteration=iteration,
                           framework=(engine, "step"), held=held)


def flat(value) -> list:
    if torch.is_tensor(value):
        return [value]
    return [t for v in value for t in flat(v)] if isinstance(value, (list, tuple)) else []


def framework_tensors(roots: list, masters: list) -> list:
    """(tensor, kind) for the tensors a framework's objects hold: ``masters`` as masters, else by the attribute
    names on the way (``ipg``: DeepSpeed's reduce buckets, comm; ``grad``; ``param``/``bit16``/``fp16``)."""
    found, seen = [], set()

    def visit(obj, path: str, depth: int) -> None:
        if depth > 6 or id(obj) in seen:
            return
        seen.add(id(obj))
        module = isinstance(obj, torch.nn.Module)
        if torch.is_tensor(obj):
            found.extend([(path, obj)] + ([(path + ".grad", obj.grad)] if obj.grad is not None else []))
        elif isinstance(obj, (list, tuple, dict)):
            for k, v in list(obj.items() if isinstance(obj, dict) else enumerate(obj)):
                visit(v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", depth + 1)
        elif module or hasattr(obj, "__dict__") and any(c.__module__.split(".")[0] in ("deepspeed", "megatron")
                                                        for c in type(obj).__mro__):  # SWAN's subclasses too
            for k, v in vars(obj).items():
                if not (module and (k.startswith("_") or k in ("module", "config"))):
                    visit(v, f"{path}.{k}", depth + 1)

    with warnings.catch_warnings():  # .grad of a non-leaf tensor
        warnings.simplefilter("ignore")
        for root in roots:
            visit(root, type(root).__name__, 0)
    master_ptrs = {t.untyped_storage().data_ptr() for t in masters if t.numel()}
    order, best = ("master", "param", "grad", "comm", "other"), {}
    for path, t in found + [("masters", t) for t in masters]:
        if t.device.type == "cpu" and t.numel():
            ptr, low = t.untyped_storage().data_ptr(), path.lower()
            kind = ("master" if ptr in master_ptrs else "comm" if "ipg" in low else "grad" if "grad" in low
                    else "param" if any(w in low for w in ("param", "bit16", "fp16")) else "other")
            if ptr not in best or order.index(kind) < order.index(best[ptr][0]):
                best[ptr] = (kind, t)
    return [(t, kind) for kind, t in best.values()]


def framework_tracker():
    """torch's MemTracker with categories ``Framework masters`` and ``Framework comm``, a tensor an activation or
    temporary to it put by the DeepSpeed or Megatron code making it (parameter gathers, comm, grads)."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType

    kinds = _RefType("_FrameworkRefType", {**{m.name: m.value for m in _MemRefType},
                                           "MASTER": "Framework masters", "COMM": "Framework comm"})
    sep, paths = os.sep, sysconfig.get_paths()
    site, stdlib = paths["purelib"] + sep, paths["stdlib"] + sep
    harness = os.path.join(os.path.dirname(_HERE), "tests", "megatron_harness.py")
    # frames that pass a call on: decorators, generic helpers, the CPU shims, ZeRO-3's linear autograd function
    neutral = (f"deepspeed{sep}utils{sep}nvtx.py", f"megatron{sep}core{sep}utils.py",
               f"deepspeed{sep}runtime{sep}zero{sep}linear.py")

    def allocated_by():
        """The innermost calling frame that is DeepSpeed's, Megatron's or the caller's decides."""
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


def prepare(layout: str) -> None:
    """A framework imported before the baseline RSS is read (its libraries are not the step's memory); for
    Megatron this folder leaves sys.path (benchmarks/megatron.py would shadow ``megatron``), tests/ joins it."""
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
