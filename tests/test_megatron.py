"""megatron-core tensor parallelism (gloo, CPU): ``ColumnParallelLinear`` (rows cut over TP) and
``RowParallelLinear`` (columns cut over TP) are whitened as the full logical matrix, once, over the
TP x DP world; the fused QKV and SwiGLU fc1 weights are whitened as their parts (Q, K, V; gate,
up); updates equal single-process SWAN on separate layers with the same global gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from swan_dist import SWAN

pytestmark = pytest.mark.timeout(300)

OPTS = dict(preset="swan_ddagger", lr=0.05, weight_decay=0.1)
# The reference keeps Q, K, V and gate, up as separate layers; the Megatron model fuses them as
# Megatron does: ``linear_qkv`` rows [q k v] per query group (2 groups of 4 query rows, 2 key and 2
# value rows each), ``linear_fc1`` rows [gate_r; up_r] on TP rank r.
SHAPES = {"embed.weight": (11, 6), "q.weight": (8, 6), "q.bias": (8,), "k.weight": (4, 6), "k.bias": (4,),
          "v.weight": (4, 6), "v.bias": (4,), "gate.weight": (10, 6), "up.weight": (10, 6), "down.weight": (8, 10),
          "output.weight": (11, 8)}
GROUPS = 2


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.q, self.k, self.v = nn.Linear(6, 8), nn.Linear(6, 4), nn.Linear(6, 4)
        self.gate, self.up = nn.Linear(6, 10, bias=False), nn.Linear(6, 10, bias=False)
        self.down = nn.Linear(10, 8, bias=False)
        self.output = nn.Linear(8, 11, bias=False)


class Parallel(nn.Module):
    """The same with megatron-core's tensor-parallel layers and Megatron's fused layouts."""

    def __init__(self, tp: int):
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        init = nn.init.zeros_
        self.embed = nn.Embedding(11, 6)
        self.qkv = ColumnParallelLinear(6, 16, config=cfg, init_method=init, bias=True, gather_output=False)
        self.fc1 = ColumnParallelLinear(6, 20, config=cfg, init_method=init, bias=False, gather_output=False, stride=2)
        self.down = RowParallelLinear(10, 8, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                      skip_bias_add=True)
        self.output = nn.Linear(8, 11, bias=False)
        rows = 16 // GROUPS
        self.qkv.weight._swan_split = (rows // 2, rows // 4, rows // 4)  # as mark_fused records on linear_qkv
        self.fc1.weight._swan_split = (10 // tp, 10 // tp)
        self.qkv.weight._swan_parts, self.fc1.weight._swan_parts = "Q, K, V", "gate, up"


def _full_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _qkv(v: dict, kind: str) -> torch.Tensor:
    q, k, vv = (v[f"{x}.{kind}"].chunk(GROUPS) for x in "qkv")
    return torch.cat([torch.cat(t) for t in zip(q, k, vv)])


def _unqkv(fused: torch.Tensor) -> list[torch.Tensor]:
    per = [g.split([4, 2, 2]) for g in fused.chunk(GROUPS)]
    return [torch.cat([p[i] for p in per]) for i in range(3)]


def _local(values: dict, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This TP rank's block of each Megatron parameter, in Megatron's layouts."""
    return {
        "embed.weight": values["embed.weight"].clone(), "output.weight": values["output.weight"].clone(),
        "qkv.weight": _qkv(values, "weight").chunk(tp)[rank].clone(), "qkv.bias": _qkv(values, "bias").chunk(tp)[rank].clone(),
        "fc1.weight": torch.cat([values["gate.weight"].chunk(tp)[rank], values["up.weight"].chunk(tp)[rank]]),
        "down.weight": values["down.weight"].chunk(tp, dim=1)[rank].clone(),
    }


def _worker(rank, world, tp):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        r = ps.get_tensor_model_parallel_rank()
        model = Parallel(tp)
        with torch.no_grad():
            start = _local(_full_values(0), r, tp)
            for n, p in model.named_parameters():
                p.copy_(start[n])
        opt = SWAN(model, verbose=False, bucket_mb=0.0001, **OPTS)
        for t in range(3):
            grads = _local(_full_values(10 + t), r, tp)
            for n, p in model.named_parameters():
                p.grad = grads[n]
            opt.step()
        return r, {n: p.detach().clone() for n, p in model.named_parameters()}, opt.whitened_matrices, opt.summary()
    finally:
        ps.destroy_model_parallel()


def _reference() -> dict[str, torch.Tensor]:
    model = Plain()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_full_values(0)[n])
    opt = SWAN(model, verbose=False, **OPTS)
    for t in range(3):
        grads = _full_values(10 + t)
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _gathered(parts: dict, tp: int) -> dict[str, torch.Tensor]:
    """The reference's parameters from one replica of each TP rank's blocks."""
    out = {"embed.weight": parts[0]["embed.weight"], "output.weight": parts[0]["output.weight"],
           "down.weight": torch.cat([parts[r]["down.weight"] for r in range(tp)], dim=1)}
    for kind in ("weight", "bias"):
        for x, t in zip("qkv", _unqkv(torch.cat([parts[r][f"qkv.{kind}"] for r in range(tp)]))):
            out[f"{x}.{kind}"] = t
    gate_up = [parts[r]["fc1.weight"].chunk(2) for r in range(tp)]
    out["gate.weight"] = torch.cat([g for g, _ in gate_up])
    out["up.weight"] = torch.cat([u for _, u in gate_up])
    return out


@pytest.mark.parametrize("world, tp", [(2, 2), (4, 2)])
def test_megatron_tensor_parallel_layers_equal_single_process(world, tp):
    """Column/row-parallel layers whitened as the full matrix; the fused QKV and gate/up weights as
    their separate matrices, exactly as separate layers are in a single process."""
    res = run_distributed(_worker, world, tp)
    ref = _reference()
    parts = {r: weights for r, weights, _, _ in res}  # one replica of each TP rank's blocks
    got = _gathered(parts, tp)
    for n, v in ref.items():
        assert (got[n] - v).abs().max() < 2e-5, n
        assert (v - _full_values(0)[n]).abs().max() > 1e-3, n  # the step moved it
    for r, weights, _, _ in res:  # every DP replica of a TP rank holds the same block
        assert all(torch.equal(weights[n], parts[r][n]) for n in weights)
    assert sum(w for _, _, w, _ in res) == 3 * 6  # Q, K, V, gate, up, down: each whitened once per step
    summary = res[0][3]
    assert "3 matrices whitened by SWAN" in summary and "[8, 10]" in summary and "[16, 6]" in summary
    assert "whitened as Q, K, V" in summary and "whitened as gate, up" in summary


def test_fused_matrix_whitened_fused_without_split():
    """Without the row pattern the fused matrix is one matrix: the result differs from the split one
    (so the split test above can fail)."""
    from swan_dist.layout import split_rows
    from swan_dist.functional import WhitenConfig, swan_update

    g = _qkv(_full_values(3), "weight")
    cfg = WhitenConfig(method="nsds", steps=2, beta=0.4)
    split = split_rows(g[None], (4, 2, 2), lambda x: swan_update(x, cfg)[0])[0]
    parts = [swan_update(t, cfg)[0] for t in _unqkv(g)]
    assert torch.allclose(torch.cat(_unqkv(split)), torch.cat(parts), atol=1e-6)
    assert (swan_update(g, cfg)[0] - split).abs().max() > 1e-2
