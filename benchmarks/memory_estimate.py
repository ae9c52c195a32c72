"""One rank's whole FSDP2 training step, measured live (``FSDPMemTracker``) on real tensors or traced without
allocating: rank r of W on torch's fake process group, the reference LLaMA under ``FakeTensorMode`` sharded as
the reference trainer shards it, two steps with the real optimizer, the second counted (a fake step assumes
every gradient finite). benchmarks/memory_dist.py checks the trace against real runs; benchmarks/real_setup.py
traces LLaMA 1.3B-70B at W up to 1,024."""

from __future__ import annotations

import torch

from measure import categories, traced, tracked_step

LLAMA = {  # LLaMA-2 7B and 70B (70B: grouped-query attention, 8 key/value heads)
    "7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}
VARIANTS = {
    "adamw": "AdamW (torch, foreach)",
    "owner": "SWAN‡ owner mode",
    "replicated": "SWAN‡ replicated mode",
    "backward": "SWAN‡ owner, step_in_backward",
}


def model_config(size: str, **overrides):
    """The reference LLaMA of ``size`` (a reference size, or 7b / 70b) with the papers' 32k vocabulary."""
    from swan_dist.reference.model import LlamaConfig, model_config

    if size in LLAMA:
        return LlamaConfig(**{"vocab_size": 32000, "max_seq_len": 4096, **LLAMA[size], **overrides})
    return model_config(size, vocab_size=32000, **overrides)


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


def state_bytes(opts: list) -> int:
    """The optimizers' state tensors on this rank (DTensors: their local shards; step counters left out)."""
    return sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for o in opts for s in o.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def largest_unit_bytes(model) -> int:
    """The largest FSDP unit's unsharded parameter bytes: the size of its gradients' reduce-scatter input
    (what a trace on the fake process group does not hold at the peak where a real run does)."""
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, int] = {}
    for k, m in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        for p in m.parameters():  # pre-order: a nested unit's parameters end up its own
            owner[id(p)] = k
    per: dict[int, int] = {}
    for p in model.parameters():
        per[owner[id(p)]] = per.get(owner[id(p)], 0) + p.numel() * p.element_size()
    return max(per.values())


def fsdp2_step(cfg, mesh, variant, seq: int, bucket_mb: float = 256.0, dtype=torch.bfloat16, *, batch: int = 1,
               mp=None, ac: bool = False) -> dict:
    """The reference LLaMA ``cfg`` made in ``dtype``, each block in a ``checkpoint_wrapper`` where ``ac``, sharded
    over ``mesh`` (with the ``MixedPrecisionPolicy`` ``mp``), the optimizer ``variant`` (a name of
    :data:`VARIANTS`, or a function of the model): two steps of ``batch`` x ``seq`` tokens under
    ``FSDPMemTracker``, the second measured; on real tensors, or fake ones (:func:`trace_step`)."""
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
