"""A step's memory, for memory.py, memory_dist.py and real_setup.py: one rank's whole FSDP2 training step measured
live (``FSDPMemTracker``) or traced without allocating (rank r of W on torch's fake process group, ``FakeTensorMode``;
a fake step assumes every gradient finite), two steps with the real optimizer, the second counted; one process's
step under MemTracker and the bound on its transient; the LLaMA shapes, the bf16 model built in place."""

import contextlib

import torch

from measure import categories, traced, tracked_step

LLAMA = {  # the LLaMA paper's 7B and 13B, LLaMA-2 70B (grouped-query attention, 8 key/value heads)
    "7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    "13b": dict(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}
VARIANTS = {"adamw": "AdamW (torch, foreach)", "owner": "SWAN‡ owner mode", "replicated": "SWAN‡ replicated mode",
            "backward": "SWAN‡ owner, step_in_backward"}


def model_config(size: str, **overrides):
    """The reference LLaMA of ``size`` (a reference size, or a name of :data:`LLAMA`), the papers' 32k vocabulary."""
    from swan_dist.reference.model import LlamaConfig, model_config

    if size in LLAMA:
        return LlamaConfig(**{"vocab_size": 32000, "max_seq_len": 4096, **LLAMA[size], **overrides})
    return model_config(size, **{"vocab_size": 32000, **overrides})


def build(cfg, device: str = "cpu", shard=None, fake: bool = False):
    """The reference LLaMA ``cfg`` in bf16, made on ``meta`` (``shard(model)`` there) and materialised on ``device``
    in place (no fp32 copy); ``fake``: made under the caller's ``FakeTensorMode``. For memory.py, memory_dist.py."""
    from swan_dist.reference.model import Llama, rope_tables

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with contextlib.nullcontext() if fake else torch.device("meta"):
            model = Llama(cfg)
    finally:
        torch.set_default_dtype(default)
    if shard is not None:
        shard(model)
    if not fake:
        model.to_empty(device=device)
        torch.manual_seed(0)
        model.reset_parameters()
    cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # the constant tables, fp32 as the model keeps
    return model


def optimizer(variant: str, model, bucket_mb: float = 256.0):
    """torch's AdamW or SWAN‡ in the benchmarks' variants (see :data:`VARIANTS`)."""
    if variant == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    import swan_dist

    return swan_dist.SWAN(model, preset="swan_ddagger", verbose=False, bucket_mb=bucket_mb,
                          mode="replicated" if variant == "replicated" else "owner",
                          step_in_backward=variant == "backward")


def step_bound(opts: list, variant: str) -> dict | None:
    """The largest bound (``Exchange.transient_bound``, docs/engine.md, "Memory a step adds") of the schedules
    SWAN's ``step()`` ran on this rank (ZeRO-3: one per sub-group); None for AdamW and for updates made during
    backward, whose steps are not ``step()``'s."""
    from swan_dist import whitening

    if variant not in ("owner", "replicated"):
        return None
    bounds = [ex.transient_bound(whitening._CPU_PASS_BYTES) for o in opts
              for memo in getattr(o, "_memos", {}).values() for ex in memo.plans.cache.values()]
    return max(bounds, key=lambda b: b["total"], default=None)


def tracked(model, opts, step) -> dict:
    """One step under MemTracker: its peak and current snapshots by category, the model's forward and backward peaks."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *opts)
    with tracker:
        step()
    snaps = getattr(tracker.memory_tracking.get(model), "snapshots", {})
    return dict(peak=categories(tracker.get_tracker_snapshot("peak")),
                after=categories(tracker.get_tracker_snapshot("current")),
                module_peaks={k.value: max(map(categories, v), key=lambda c: c.get("Total", 0))
                              for k, v in snaps.items() if v and k.value in ("Peak-Forward", "Peak-Backward")})


def phase(r: dict) -> str:
    """Where MemTracker's peak fell: forward or backward (the model's module-wise peak reaches it), else the step."""
    mods = r.get("module_peaks", {})
    return next((n.lower() for n in ("Backward", "Forward")
                 if mods.get(f"Peak-{n}", {}).get("Total", -1) >= r["peak"].get("Total", 0)), "step")


def transient(r: dict) -> int:
    """The step's scratch at MemTracker's peak: its optimizer category less the state kept after it."""
    return max(0, r["peak"].get("Optstate", 0) - r["after"].get("Optstate", 0))


def transient_bound(cfg, fallback: str) -> int:
    """docs/engine.md's bound ("Memory a step adds", one process) on SWAN‡'s step transient for the model ``cfg``
    (bf16) with ``fallback``, on the CPU, in bytes."""
    from swan_dist.functional import WhitenConfig, resolve_dtype
    from swan_dist.rules.fallback import _SIGN_CPU_BYTES
    from swan_dist.whitening import _CPU_BATCH_BYTES

    w = torch.empty((), dtype=resolve_dtype(WhitenConfig(method="nsds"), torch.device("cpu"))).element_size()
    g = p = 2  # bf16 gradients and weights
    shapes = {(cfg.dim, cfg.dim): 4 * cfg.n_layers, (cfg.ffn_dim, cfg.dim): 2 * cfg.n_layers,
              (cfg.dim, cfg.ffn_dim): cfg.n_layers}  # wq wk wv wo; w1 w3; w2 (out, in)
    worst = 0
    for (m, n), count in shapes.items():
        k = min(count, max(1, _CPU_BATCH_BYTES // (4 * m * n)))
        worst = max(worst, k * m * n * ((g if k > 1 else 0) + 2 * w + 4 + p) + 2 * k * min(m, n) ** 2 * max(w, 4))
    return max(worst, 0 if fallback == "adamw" else min(_SIGN_CPU_BYTES, 2 * cfg.vocab_size * cfg.dim * g))


def state_bytes(opts: list) -> int:
    """The optimizers' state tensors on this rank (DTensors: their local shards; step counters left out)."""
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for o in opts for s in o.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def largest_unit_bytes(model) -> int:
    """The largest FSDP unit's unsharded parameter bytes: the size of its gradients' reduce-scatter input
    (what a trace on the fake process group does not hold at the peak where a real run does)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    owner = {id(p): k for k, m in enumerate(units) for p in m.parameters()}  # pre-order: nested units' own last
    per = [0] * len(units)
    for p in model.parameters():
        per[owner[id(p)]] += p.numel() * p.element_size()
    return max(per)


def fsdp2_step(cfg, mesh, variant, seq: int, bucket_mb: float = 256.0, dtype=torch.bfloat16, *, batch: int = 1,
               mp=None, ac: bool = False) -> dict:
    """The reference LLaMA ``cfg`` in ``dtype`` (blocks checkpointed where ``ac``) sharded over ``mesh`` (policy
    ``mp``), optimizer ``variant`` (a name of :data:`VARIANTS` or a function of the model): two steps of ``batch`` x
    ``seq`` tokens under ``FSDPMemTracker``, the second measured; on real or fake tensors (:func:`trace_step`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    from swan_dist.reference.model import Llama
    from swan_dist.reference.parallel import shard_fsdp2

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in dtype (Module.to cannot swap fake tensors)
    try:
        model = Llama(cfg)
    finally:
        torch.set_default_dtype(default)
    if ac:  # each block's activations recomputed in backward, as torchtitan's "full" mode
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if mp is None:
        shard_fsdp2(model, mesh)
    else:  # the same units as shard_fsdp2, each with the policy
        for unit in (model.tok_embeddings, *model.layers, model.output, model):
            fully_shard(unit, mesh=mesh, mp_policy=mp)
    opt = variant(model) if callable(variant) else optimizer(variant, model, bucket_mb)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()

    tracker = FSDPMemTracker(model, opt)
    tracker.track_external(model, opt)
    with tracker:
        fwd_bwd()
        opt.step()  # the first step creates the fallback's state: not counted
        tracker.reset_mod_stats()
        tracker._peak_mem = {torch.device("cpu"): 0}
        marks = tracked_step(fwd_bwd, opt.step, tracker)
        peak = categories(tracker.get_tracker_snapshot("peak"))
    return {"peak": peak, "peak_total": max(peak.get("Total", 0), marks["peak_before_step"], marks["step_peak"]),
            "state_bytes": state_bytes([opt]), "bound": None if callable(variant) else step_bound([opt], variant),
            "largest_unit_bytes": largest_unit_bytes(model), **marks}


def trace_step(size, world: int, variant, seq: int, *, rank: int = 0, **options) -> dict:
    """Rank ``rank`` of ``world`` on the fake process group: :func:`fsdp2_step` (``options``) on fake tensors.
    ``size``: a name of :func:`model_config` or a ``LlamaConfig``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    with traced(world, rank):
        cfg = model_config(size) if isinstance(size, str) else size
        mesh = init_device_mesh("cpu", (world,))  # made on real tensors
        with FakeTensorMode():
            return {"world": world, "rank": rank, "seq": seq, **fsdp2_step(cfg, mesh, variant, seq, **options)}
