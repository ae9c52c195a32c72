"""A step-time model of SWAN on GPU clusters: owner mode, replicated mode and AdamW, from the owner
engine's own plans and bytes (simulated in one process, as ``benchmarks/scale.py`` does) and named public
hardware figures, checked against the paper's measured 8-GPU points.

Every input is a named constant below with its source. One is calibrated, not looked up: the rate at
which a GPU runs the whitening, from the paper's SWAN‡ *w/o MP* point (1.3B LLaMA, 8x A100); the same
rate then reproduces the paper's SWAN† w/o MP point independently (a check of the FLOP model), and the
*w/ MP* points are predicted. Training compute (forward, backward, their communication) is taken as
the same for every optimizer: only the optimizer step differs, and the exchange is not assumed to
overlap the whitening (the engine overlaps its phases; no GPU measured how much yet).

    python benchmarks/gpu_model.py           # W = 8, 64, 256, 1024 (a minute or two)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from swan_dist.functional import WhitenConfig
from swan_dist.plan import MatrixSpec
from swan_dist.whitening import exchange_dtype_of, swan_cost, swan_plan

from measure import write_section  # noqa: E402 (benchmarks/ is the script's folder)
from scale import Layout, MODELS, llama, measure  # noqa: E402

NS10 = WhitenConfig(method="ns", steps=10, beta=0.8)  # SWAN†'s whitening
CUDA = torch.device("cuda")  # where the owners whiten (only its type is read: no GPU is needed)

# ------------------------------------------------------------------ inputs (value, source)
INPUTS = {
    "A100 bf16 peak": (312e12, "NVIDIA A100 datasheet (dense BF16 Tensor Core, SXM)"),
    "A100 HBM": (2.039e12, "NVIDIA A100 80GB SXM datasheet (the paper names no memory size)"),
    "A100 NVLink, one direction": (300e9, "NVIDIA A100 datasheet: 600 GB/s NVLink per GPU, both directions"),
    "H100 bf16 peak": (989e12, "NVIDIA H100 SXM datasheet (dense BF16 Tensor Core)"),
    "H100 HBM": (3.35e12, "NVIDIA H100 SXM datasheet"),
    "H100 NVLink, one direction": (450e9, "NVIDIA H100 SXM datasheet: 900 GB/s NVLink per GPU, both directions"),
    "InfiniBand per GPU, one direction": (50e9, "400 Gb/s NDR, one ConnectX-7 per GPU (NVIDIA DGX H100 datasheet)"),
    "link efficiency": (0.8, "assumed: fraction of a link's rate an all_to_all reaches with large messages"),
    "HBM efficiency": (0.8, "assumed: fraction of HBM bandwidth a fused AdamW reaches"),
    "all_to_all latency per peer": (2e-6, "assumed: NCCL's all_to_all_single issues one send and one receive per "
                                          "rank, empty ones included (docs/benchmarks.md, engine at scale)"),
    "AdamW bytes per parameter": (30, "fused AdamW with fp32 master weights: reads p, g, m, v (16 B), writes p, "
                                      "m, v (12 B) and the bf16 copy (2 B)"),
    "MFU": (0.40, "Llama 3 (Dubey et al. 2024, Table 4): 38-43 % BF16 MFU on H100 clusters"),
    "global batch (tokens)": (4 * 2**20, "Llama 2 (Touvron et al. 2023): 4M-token global batch"),
    "paper batch (tokens)": (131072, "SWAN paper, throughput paragraph: 1.3B LLaMA on 8 A100, batch 130K "
                                     "(512 x 256, the GaLore setting)"),
}
V = {k: v for k, (v, _) in INPUTS.items()}

# the paper's Table (raw tokens/s, 1.3B LLaMA on 8x A100, bf16 gradient processing)
PAPER = {"Adam": 117872, "SWAN† w/o MP": 58600, "SWAN‡ w/o MP": 107808, "SWAN† w/ MP": 114160,
         "SWAN‡ w/ MP": 115872}


def llama_1b3(cfg: WhitenConfig) -> list[MatrixSpec]:
    """The GaLore 1.3B LLaMA: hidden 2048, MLP 5461, 24 layers, vocab 32000."""
    specs = llama(24, 2048, 2048, 5461)
    return [MatrixSpec(s.key, s.shape, cfg) for s in specs]


def adamw_s(params: float, hbm: float) -> float:
    return params * V["AdamW bytes per parameter"] / (hbm * V["HBM efficiency"])


@dataclass
class Paper:
    rate: float  # calibrated whitening FLOP/s (A100)
    rows: list[tuple[str, float, float]]  # (point, predicted tokens/s ratio to Adam, measured)


def paper_check() -> Paper:
    """The w/o MP SWAN‡ point gives the whitening rate; everything else is predicted from it."""
    t_adam = V["paper batch (tokens)"] / PAPER["Adam"]
    hbm, link = V["A100 HBM"], V["A100 NVLink, one direction"] * V["link efficiency"]
    params = 1.34e9  # matrices 1.21e9 + embeddings and head 2 x 32000 x 2048
    embed = 2 * 32000 * 2048
    adam = adamw_s(params, hbm)
    fallback = adamw_s(embed, hbm)  # SWAN's AdamW fallback on embeddings and head (norms: negligible)
    totals, slowest, sent = {}, {}, {}
    for name, cfg in (("‡", WhitenConfig()), ("†", NS10)):
        specs = llama_1b3(cfg)
        plan = swan_plan(specs, [[(0, s.numel) for s in specs]] * 8)  # DDP: every rank holds every gradient
        totals[name], slowest[name] = sum(plan.costs), plan.slowest()
        owned = max(sum(specs[m].numel for b in plan.buckets for m, o in b.owners.items() if o == r) for r in range(8))
        # its matrices' updates to the 7 others, in the dtype the engine sends them in (bf16 parameters here)
        sent[name] = owned * 7 * exchange_dtype_of("auto", cfg, torch.bfloat16, CUDA).itemsize
    t_swan = V["paper batch (tokens)"] / PAPER["SWAN‡ w/o MP"]
    rate = totals["‡"] / (t_swan - t_adam + adam - fallback)
    rows = []
    for name in ("†", "‡"):
        for mp in (False, True):
            step = fallback + (slowest[name] / rate + sent[name] / link + 2 * 8 * V["all_to_all latency per peer"]
                               if mp else totals[name] / rate)
            predicted = t_adam / (t_adam - adam + step)
            point = f"SWAN{name} {'w/' if mp else 'w/o'} MP"
            rows.append((point, predicted, PAPER[point] / PAPER["Adam"]))
    return Paper(rate, rows)


@dataclass
class Cluster:
    model: str
    world: int
    compute: float
    adamw: float
    owner: float
    owner_whiten: float
    owner_comm: float
    owner_comm_fp32: float  # the exchange with fp32 pieces (exchange_dtype="param" on fp32 shards)
    replicated: float


def cluster_step(model: str, specs: list[MatrixSpec], params: float, vocab_dim: int, world: int, rate: float,
                 tokens_per_gpu: float, sent: torch.dtype, recompute: bool = False) -> Cluster:
    """One H100 cluster point: FSDP row shards over all W GPUs (the caller's fake process group of W),
    ``tokens_per_gpu`` a step, ``rate`` the whitening FLOP/s, the exchange sending ``sent`` (the bytes the
    simulated step counts); ``recompute``: activation checkpointing runs each forward twice."""
    hbm = V["H100 HBM"]
    row = measure(model, specs, world, Layout("FSDP", world, world), dist.group.WORLD, 256 << 20, sent, torch.float32)
    nvlink = V["H100 NVLink, one direction"] * V["link efficiency"]
    ib = V["InfiniBand per GPU, one direction"] * V["link efficiency"]
    remote = 0.0 if world <= 8 else 1 - 7 / (world - 1)  # share of peers on other nodes

    def move(nbytes: float) -> float:
        return nbytes * (1 - remote) / nvlink + nbytes * remote / ib

    latency = row.collectives * world * V["all_to_all latency per peer"]
    fallback = adamw_s(2 * vocab_dim / world, hbm)
    owner_whiten = row.slowest / rate
    owner_comm = move(row.sent) + latency
    owner_comm_fp32 = move(row.sent * 4 / sent.itemsize) + latency  # bytes scale with the dtype
    matrix_bytes = sent.itemsize * sum(s.numel for s in specs)  # gathered as the exchange sends
    replicated = (fallback + sum(swan_cost(s) for s in specs) / rate
                  + move(matrix_bytes * (world - 1) / world) + 2 * world * V["all_to_all latency per peer"])
    compute = (8 if recompute else 6) * params * tokens_per_gpu / (V["MFU"] * V["H100 bf16 peak"])
    return Cluster(model, world, compute, adamw_s(params / world, hbm), fallback + owner_whiten + owner_comm,
                   owner_whiten, owner_comm, owner_comm_fp32, replicated)


def cluster_rows(rate_fraction: float, worlds: tuple[int, ...], exchange: str = "auto") -> list[Cluster]:
    """FSDP row shards over all W GPUs (H100), NSDS, bucket_mb=256, a 4M-token global batch; FSDP2 mixed
    precision (fp32 shards and gradients), the exchange sending what ``SWAN(exchange_dtype=exchange)``
    sends there (``auto``: bf16, SWAN‡ whitening in bf16 on GPUs)."""
    rate = rate_fraction * V["H100 bf16 peak"]
    sent = exchange_dtype_of(exchange, WhitenConfig(), torch.float32, CUDA)
    out = []
    for world in worlds:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            for model, params, vocab_dim in (("LLaMA-7B", 6.74e9, 32000 * 4096), ("LLaMA-70B", 69.0e9, 32000 * 8192)):
                out.append(cluster_step(model, MODELS[model](), params, vocab_dim, world, rate,
                                        V["global batch (tokens)"] / world, sent))
        finally:
            dist.destroy_process_group()
    return out


def ms(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x < 10 else f"{x:,.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="8,64,256,1024")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    paper = paper_check()
    fraction = paper.rate / V["A100 bf16 peak"]
    rows = cluster_rows(fraction, tuple(int(w) for w in args.worlds.split(",")))
    lines = ["**Inputs.**", "", "| input | value | source |", "|---|---:|---|"]
    lines += [f"| {k} | {v:,.4g} | {src} |" for k, (v, src) in INPUTS.items()]
    lines += ["", f"**Calibrated**: the whitening runs at {paper.rate / 1e12:.0f} TFLOP/s on an A100 "
              f"({fraction:.0%} of its bf16 peak), from the paper's SWAN‡ w/o MP point: its step minus Adam's "
              "is the whole model's NSDS whitening on one GPU plus the AdamW fallback on embeddings and head, "
              "minus Adam's step. On the H100 the model takes the same fraction of peak "
              f"({fraction * V['H100 bf16 peak'] / 1e12:.0f} TFLOP/s).", "",
              "**Check against the paper** (1.3B LLaMA, 8x A100, DDP, batch 131,072 tokens; raw tokens/s "
              "over Adam's). *w/ MP* is swan_dist's owner mode: the plan's slowest owner whitens, each owner "
              "sends its matrices' updates to the 7 others over NVLink in the dtype the engine sends them in "
              "(`exchange_dtype=\"auto\"`: the paper's bf16 parameters under DDP, 2 bytes an element).", "",
              "| point | predicted | paper | predicted / paper |", "|---|---:|---:|---:|"]
    lines += [f"| {p} | {pred:.3f} | {meas:.3f} | {pred / meas:.3f} |" for p, pred, meas in paper.rows]
    lines += ["", "**Predicted, H100 clusters** (FSDP2 over all W GPUs with `MixedPrecisionPolicy(param_dtype="
              "bf16, reduce_dtype=fp32)`: fp32 shards and gradients; SWAN‡ (NSDS, whitened in bf16), bucket_mb=256, "
              "4M-token global batch: per-GPU compute shrinks as W grows). The exchange's bytes are those the engine "
              "sends there (`exchange_dtype=\"auto\"`: bf16 pieces, 2 bytes an element, counted by the simulated "
              "step); *fp32 exchange*: the same exchange with fp32 pieces (`exchange_dtype=\"param\"`, twice the "
              "bytes, the same latency). *compute*: forward and backward at the MFU above, "
              "the same for every optimizer; *owner*: the fallback AdamW on embeddings and head, the plan's "
              "critical path (*whitening*) and rank 0's exchange bytes and latency from the simulated step "
              "(*exchange*); *replicated*: every GPU whitens every matrix after gathering it. Ratios are "
              "tokens/s against AdamW's.", "",
              "| model | W | compute | AdamW step | owner step (whitening + exchange) | fp32 exchange | "
              "replicated step | owner vs AdamW | replicated vs AdamW |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = r.compute + r.adamw
        lines.append(f"| {r.model} | {r.world} | {ms(r.compute)} | {ms(r.adamw)} | {ms(r.owner)} "
                     f"({ms(r.owner_whiten)} + {ms(r.owner_comm)}) | {ms(r.owner_comm_fp32)} | {ms(r.replicated)} | "
                     f"{base / (r.compute + r.owner):.3f} | {base / (r.compute + r.replicated):.3f} |")
    worst = min(rows, key=lambda r: (r.compute + r.adamw) / (r.compute + r.owner))
    sw = next(p for p in paper.rows if p[0] == "SWAN‡ w/ MP")
    st = next(p for p in paper.rows if p[0] == "SWAN† w/ MP")
    lines += ["", f"**Reading it.** The paper's SWAN‡ w/ MP point is predicted at {sw[1]:.3f} against its "
              f"measured {sw[2]:.3f} ({abs(sw[1] / sw[2] - 1):.1%} apart), and SWAN† w/o MP, not used to "
              "calibrate, within a few per cent: the FLOP model and one whitening rate explain both w/o MP "
              f"points. SWAN† w/ MP is predicted at {st[1]:.3f} against {st[2]:.3f}: the paper's NS w/ MP step "
              "is shorter than an eighth of its w/o MP whitening, which this model (whitening split 8 ways, no "
              "overlap) cannot reproduce; an overlap of the NS work with the backward pass, or fewer NS steps "
              "in its MP runs, would explain it, and the paper does not say. Under FSDP on "
              "H100s with a 4M-token batch, owner mode stays within "
              f"{1 - (worst.compute + worst.adamw) / (worst.compute + worst.owner):.1%} of AdamW's tokens/s "
              f"up to W = {max(r.world for r in rows):,} (worst: {worst.model} at W = {worst.world:,}), while "
              "replicated mode falls to a fraction of it as W grows (every GPU whitens every matrix while its "
              "share of the batch shrinks). **Where owner mode stops paying**: past W ≈ the number of matrices "
              "(224 for 7B, 560 for 70B) the critical path is the largest matrix and no longer shrinks, while "
              "the per-GPU compute does and the all_to_all's per-peer latency grows with W; at a fixed global "
              "batch the optimizer's share then rises (LLaMA-7B at W = 1,024: 2 %). What then: a larger batch "
              "per GPU, or HSDP with the exchange inside the shard group (docs/engine.md), which caps the "
              "exchange's peers at the group and leaves each group whitening every matrix. Every figure here "
              "is predicted, not measured on a GPU cluster: the owner exchange over NCCL at W > 1 has not run."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("gpu-model", "Step-time model for GPU clusters (predicted from CPU-simulated plans)", text)


if __name__ == "__main__":
    main()
