"""Per-rank peak memory of a whole FSDP2 training step at world sizes no machine here has, traced without
allocating anything: one process plays rank r of W on torch's fake process group (``FakeStore``: every
collective returns at once, with outputs of the right shapes), the model built under ``FakeTensorMode``
(shapes, no data) and sharded as the reference trainer shards it (:func:`swan_dist.reference.parallel.shard_fsdp2`),
and two steps run under ``FSDPMemTracker``; the second counts. The optimizer is the real one: torch's AdamW
(``foreach``), or SWAN‡ itself (owner or replicated mode, or owner mode with ``step_in_backward=True``), whose
owners' plan comes from every rank's DTensor ranges as in a real run; a fake step assumes every gradient
finite (it reads no value on the host).

Reported per traced rank: the tracker's peak by category over the whole step, the peak over forward and
backward, the live bytes just before ``step()``, the step's transient (its peak minus those bytes), the
optimizer's state bytes, and for SWAN the rank's bound (``Exchange.transient_bound``, docs/engine.md,
"Memory a step adds") of the schedule it ran. ``benchmarks/memory_dist.py`` checks the trace against the real
run at the shape both run; ``benchmarks/memory_dist_scale.py`` traces the 7B and 70B shapes at W = 8 … 1,024."""

from __future__ import annotations


import torch
import torch.distributed as dist

from measure import categories, tracked_step

LLAMA = {  # LLaMA-2 7B and 70B (70B: grouped-query attention, 8 key/value heads)
    "7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}
TRACED = {
    "adamw": "AdamW (torch, foreach)",
    "owner": "SWAN‡ owner mode",
    "replicated": "SWAN‡ replicated mode",
    "backward": "SWAN‡ owner, step_in_backward",
}


def model_config(size: str):
    from swan_dist.reference.model import LlamaConfig, model_config

    if size in LLAMA:
        return LlamaConfig(vocab_size=32000, max_seq_len=4096, **LLAMA[size])
    return model_config(size, vocab_size=32000)


def optimizer(variant: str, model, bucket_mb: float):
    """torch's AdamW or SWAN‡ in the benchmark's variants (see :data:`TRACED`)."""
    if variant == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    import swan_dist

    return swan_dist.SWAN(model, preset="swan_ddagger", verbose=False, bucket_mb=bucket_mb,
                          mode="replicated" if variant == "replicated" else "owner",
                          step_in_backward=variant == "backward")


def transient_bound(opt) -> dict | None:
    """The bound of the schedule SWAN's last ``step()`` over every parameter ran on this rank (None: not
    SWAN, no exchange, or updates made during backward, whose steps are not ``step()``'s)."""
    from swan_dist import whitening

    memo = getattr(opt, "_memos", {}).get("all")
    ex = None if memo is None else memo.plans.last
    return None if ex is None else ex.transient_bound(whitening._CPU_PASS_BYTES)


def largest_unit_bytes(model) -> int:
    """The largest FSDP unit's unsharded parameter bytes: the size of its gradients' reduce-scatter input
    (what a trace on the fake process group does not hold at the peak where a real run does; see
    benchmarks/memory_dist.py's check of the traces)."""
    from torch.distributed.fsdp import FSDPModule

    owner: dict[int, int] = {}
    for k, m in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        for p in m.parameters():  # pre-order: a nested unit's parameters end up its own
            owner[id(p)] = k
    per: dict[int, int] = {}
    for p in model.parameters():
        per[owner[id(p)]] = per.get(owner[id(p)], 0) + p.numel() * p.element_size()
    return max(per.values())


def fsdp2_step(cfg, mesh, variant: str, seq: int, bucket_mb: float, dtype=torch.bfloat16) -> dict:
    """The reference LLaMA ``cfg`` in ``dtype``, sharded over ``mesh`` as the reference trainer shards it,
    with :func:`optimizer`'s ``variant``: two steps under ``FSDPMemTracker``, the second measured. On real
    tensors under a real process group, or under ``FakeTensorMode`` on the fake one (:func:`trace_step`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from swan_dist.reference.model import Llama
    from swan_dist.reference.parallel import shard_fsdp2

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in dtype (Module.to cannot swap fake tensors)
    try:
        model = Llama(cfg)
    finally:
        torch.set_default_dtype(default)
    shard_fsdp2(model, mesh)
    opt = optimizer(variant, model, bucket_mb)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()

    tracker = FSDPMemTracker(model, opt)
    tracker.track_external(model, opt)
    with tracker:
        fwd_bwd()
        opt.step()  # the first step creates the fallback's state: not counted
        tracker.reset_mod_stats()
        tracker._peak_mem = {torch.device("cpu"): 0}
        marks = tracked_step(fwd_bwd, opt.step, tracker)
        peak = categories(tracker.get_tracker_snapshot("peak"))
    state = sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for s in opt.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return {"peak": peak, "peak_total": max(peak.get("Total", 0), marks["peak_before_step"], marks["step_peak"]),
            "transient": marks["step_peak"] - marks["live_before_step"], "state_bytes": state,
            "bound": transient_bound(opt), "largest_unit_bytes": largest_unit_bytes(model), **marks}


def trace_step(size, world: int, variant: str, seq: int, *, rank: int = 0, bucket_mb: float = 256.0,
               dtype=torch.bfloat16) -> dict:
    """Rank ``rank`` of ``world`` on the fake process group, :func:`fsdp2_step` on fake tensors (see the
    module). ``size``: a named shape or a ``LlamaConfig``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        cfg = model_config(size) if isinstance(size, str) else size
        mesh = init_device_mesh("cpu", (world,))  # made on real tensors
        with FakeTensorMode():
            out = fsdp2_step(cfg, mesh, variant, seq, bucket_mb, dtype)
        return {"size": size if isinstance(size, str) else "custom", "world": world, "rank": rank,
                "variant": variant, "seq": seq, **out}
    finally:
        dist.destroy_process_group()
