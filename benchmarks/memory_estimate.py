"""Per-rank peak memory of an FSDP2 training step at world sizes no machine here has, estimated without
allocating anything: one process plays rank 0 of W on torch's fake process group (``FakeStore``), the
model built under ``FakeTensorMode`` and each block ``fully_shard``-ed, one step under ``FSDPMemTracker``.

SWAN's step itself is not run under fake tensors here; its estimate is put together from what is:

- the step of SWAN‡ minus its whitening: the same model with torch's AdamW on exactly SWAN‡'s fallback
  parameters (embeddings, head, norms: SWAN‡'s fallback state) and nothing else, traced under the
  tracker: its peak over forward and backward and its live bytes before the step;
- plus the transient SWAN's step adds, bounded by ``Exchange.transient_bound()`` of the plan the planner
  builds for the same matrices and the same FSDP2 row ranges at W (owner or replicated mode), for rank 0
  and for the busiest owner (the rank with the largest bound).

Estimate = max(peak over forward and backward, live before the step + the rank's bound). AdamW is traced
whole (its state and its step's temporaries). ``check()`` compares the estimate with the real measurement
of ``benchmarks/memory_dist.py`` at the shape both run."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

LLAMA = {  # the LLaMA shapes, full multi-head attention (the reference model has no grouped-query heads)
    "7b": dict(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672),
}
FALLBACK = ("tok_embeddings", "output", "norm")  # SWAN‡'s fallback: embeddings, head, every norm


def _config(size: str, n_layers: int | None = None):
    from swan_dist.reference.model import LlamaConfig, model_config

    extra = {} if n_layers is None else {"n_layers": n_layers}
    if size in LLAMA:
        return LlamaConfig(vocab_size=32000, max_seq_len=4096, **{**LLAMA[size], **extra})
    return model_config(size, vocab_size=32000, **extra)


def _cats(snapshot) -> dict[str, int]:
    return {getattr(k, "value", str(k)): int(v) for k, v in snapshot.get(torch.device("cpu"), {}).items()}


LAYERS = (4, 6)  # traced depths (past the blocks in flight at once); figures extrapolated linearly in the blocks


def traced(size: str, world: int, optimizer: str, seq: int) -> dict:
    """:func:`traced_layers` at two depths, extrapolated linearly to the shape's depth: under FSDP2 with
    one unit per block, parameters, gradients, state and saved activations grow by one block's worth per
    block and the unsharded block in flight does not (checked against the real run at the benchmark's
    shape)."""
    n = _config(size).n_layers
    a, b = (traced_layers(size, world, optimizer, seq, k) for k in LAYERS)

    def ext(x, y):
        return int(x + (y - x) * (n - LAYERS[0]) / (LAYERS[1] - LAYERS[0]))

    return {"fwd_bwd_peak": ext(a["fwd_bwd_peak"], b["fwd_bwd_peak"]), "before_step": ext(a["before_step"], b["before_step"]),
            "state": ext(a["state"], b["state"]),
            "peak": {k: ext(a["peak"].get(k, 0), b["peak"].get(k, 0)) for k in b["peak"]}, "traced_layers": LAYERS}


def traced_layers(size: str, world: int, optimizer: str, seq: int, n_layers: int | None = None) -> dict:
    """One step on rank 0 of ``world`` under fake tensors: the tracker's peak by category, the peak over
    forward and backward, the live bytes before ``step()`` and the optimizer state's bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from swan_dist.reference.model import Llama
    from swan_dist.reference.parallel import shard_fsdp2

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world,))
        cfg = _config(size, n_layers)
        with FakeTensorMode():
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = Llama(cfg)
            finally:
                torch.set_default_dtype(default)
            shard_fsdp2(model, mesh)
            if optimizer == "adamw":
                params = list(model.parameters())
            else:  # SWAN‡'s fallback parameters: the state SWAN‡ keeps
                params = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith(FALLBACK)]
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
            tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1))
            tracker = FSDPMemTracker(model, opt)
            tracker.track_external(model, opt)
            out = {}
            with tracker:
                for i in range(2):  # the second step, with the optimizer state there, counts
                    opt.zero_grad(set_to_none=True)
                    model(tokens[:, :-1], tokens[:, 1:])[1].backward()
                    if i == 1:
                        out["fwd_bwd_peak"] = _cats(tracker.get_tracker_snapshot("peak"))["Total"]
                        out["before_step"] = _cats(tracker.get_tracker_snapshot("current"))["Total"]
                    opt.step()
                    if i == 0:
                        tracker.reset_mod_stats()
                        tracker._peak_mem = {torch.device("cpu"): 0}  # the first step's state creation not counted
                peak = _cats(tracker.get_tracker_snapshot("peak"))
            out["peak"] = peak
            out["state"] = sum(getattr(t, "_local_tensor", t).numel() * t.element_size() for s in opt.state.values()
                               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
            return out
    finally:
        dist.destroy_process_group()


def swan_specs(size: str):
    """SWAN‡'s matrices of the shape (out, in), in the model's parameter order, with each rank's FSDP2
    rows as element ranges (dim-0 chunks of ceil(out / W) rows)."""
    from swan_dist.functional import WhitenConfig
    from swan_dist.plan import MatrixSpec

    cfg = _config(size)
    d, f = cfg.dim, cfg.ffn_dim
    shapes = []
    for i in range(cfg.n_layers):
        shapes += [(f"layers.{i}.attention.{n}", (d, d)) for n in ("wq", "wk", "wv", "wo")]
        shapes += [(f"layers.{i}.feed_forward.w1", (f, d)), (f"layers.{i}.feed_forward.w2", (d, f)),
                   (f"layers.{i}.feed_forward.w3", (f, d))]
    return [MatrixSpec(k, s, WhitenConfig()) for k, s in shapes]


def ranges(specs, world: int) -> list[list[tuple[int, int]]]:
    out = []
    for r in range(world):
        row = []
        for s in specs:
            rows, cols = s.shape
            chunk = math.ceil(rows / world)
            lo, hi = min(rows, r * chunk), min(rows, (r + 1) * chunk)
            row.append((lo * cols, hi * cols))
        out.append(row)
    return out


def bounds(size: str, world: int, mode: str, bucket_mb: float, dtype=torch.bfloat16) -> dict[str, dict]:
    """The transient bound of rank 0 and of the busiest owner (largest full fp32 bytes in one bucket),
    from the plan the engine would build."""
    from swan_dist import whitening
    from swan_dist.exchange import Exchange
    from swan_dist.whitening import swan_plan

    specs = swan_specs(size)
    plan = swan_plan(specs, ranges(specs, world), mode, int(bucket_mb * 2**20))
    busiest, most = 0, -1
    if mode == "owner":
        for b in plan.buckets:
            per: dict[int, int] = {}
            for m, o in b.owners.items():
                per[o] = per.get(o, 0) + 4 * specs[m].numel
            for o, n in per.items():
                if n > most:
                    busiest, most = o, n
    out = {}
    for name, rank in (("rank 0", 0), ("busiest owner", busiest)):
        ex = Exchange(plan, rank, None, torch.device("cpu"), [dtype] * len(specs), compute=None,
                      stack_bytes=whitening._CPU_EXCHANGE_STACK_BYTES)
        out[name] = {"rank": rank, **ex.transient_bound(whitening._CPU_PASS_BYTES)}
    out["buckets"] = len(plan.buckets)
    return out


def estimate(size: str, world: int, seq: int, bucket_mb: float, modes=("owner", "replicated")) -> dict:
    """AdamW traced; SWAN‡ = the same trace with AdamW's state on the SWAN matrices taken out (the state is
    live, unchanged, over forward and backward; its bytes follow from the shapes), plus the rank's bound and
    the fallback's own step temporaries (at most two copies of its local parameters: torch's foreach AdamW)."""
    adamw = traced(size, world, "adamw", seq)
    specs = swan_specs(size)
    # AdamW's state on SWAN's matrices (bf16 moments, two per element) on rank 0: its FSDP2 rows
    mine = sum(hi - lo for lo, hi in ranges(specs, world)[0])
    swan_state = 2 * 2 * mine
    fallback_params = adamw["state"] // 2 - mine * 2  # local fallback parameter bytes (bf16): moments = 2x
    out = {"size": size, "world": world, "seq": seq, "adamw": adamw, "adamw_state_on_matrices": swan_state,
           "fallback_params": fallback_params}
    for mode in modes:
        b = bounds(size, world, mode, bucket_mb)
        worst = max(b["rank 0"]["total"], b["busiest owner"]["total"])
        before = adamw["before_step"] - swan_state
        out[mode] = {"bounds": b, "bound": worst,
                     "peak": max(adamw["fwd_bwd_peak"] - swan_state, before + worst + 2 * fallback_params)}
    return out
