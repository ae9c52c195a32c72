"""megatron-core tensor parallelism (gloo, CPU): ``ColumnParallelLinear`` (rows cut over TP) and
``RowParallelLinear`` (columns cut over TP) are whitened as the full logical matrix, once, over the
TP x DP world; updates equal single-process SWAN on the same global gradients. (The Megatron-LM flag,
the optimizer factory, the distributed optimizer and pipeline stages are not covered yet.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from swan_dist import SWAN

pytestmark = pytest.mark.timeout(300)

OPTS = dict(preset="swan_ddagger", lr=0.05, weight_decay=0.1)
SHAPES = {"embed.weight": (11, 6), "up.weight": (10, 6), "up.bias": (10,), "down.weight": (8, 10), "output.weight": (11, 8)}


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 8, bias=False)
        self.output = nn.Linear(8, 11, bias=False)


class Parallel(nn.Module):
    """The same shapes with megatron-core's tensor-parallel layers."""

    def __init__(self, tp: int):
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        cfg = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True)
        init = nn.init.zeros_
        self.embed = nn.Embedding(11, 6)
        self.up = ColumnParallelLinear(6, 10, config=cfg, init_method=init, bias=True, gather_output=False)
        self.down = RowParallelLinear(10, 8, config=cfg, init_method=init, bias=False, input_is_parallel=True,
                                      skip_bias_add=True)
        self.output = nn.Linear(8, 11, bias=False)


def _full_values(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _local(name: str, full: torch.Tensor, p: torch.Tensor, rank: int) -> torch.Tensor:
    """This TP rank's block of a full tensor, from Megatron's own attributes on the parameter."""
    if not getattr(p, "tensor_model_parallel", False):
        return full.clone()
    return full.chunk(full.shape[p.partition_dim] // p.shape[p.partition_dim], dim=p.partition_dim)[rank].clone()


def _worker(rank, world, tp):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        r = ps.get_tensor_model_parallel_rank()
        model = Parallel(tp)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(_local(n, _full_values(0)[n], p, r))
        opt = SWAN(model, verbose=False, bucket_mb=0.0001, **OPTS)
        for t in range(3):
            grads = _full_values(10 + t)
            for n, p in model.named_parameters():
                p.grad = _local(n, grads[n], p, r)
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


@pytest.mark.parametrize("world, tp", [(2, 2), (4, 2)])
def test_megatron_tensor_parallel_layers_equal_single_process(world, tp):
    res = run_distributed(_worker, world, tp)
    ref = _reference()
    parts = {r: weights for r, weights, _, _ in res}  # one replica of each TP rank's blocks
    for n, v in ref.items():
        dim = 1 if n == "down.weight" else 0
        got = torch.cat([parts[r][n] for r in range(tp)], dim=dim) if n in ("up.weight", "up.bias", "down.weight") else parts[0][n]
        assert (got - v).abs().max() < 2e-5, n
        assert (v - _full_values(0)[n]).abs().max() > 1e-3, n  # the step moved it
    for r, weights, _, _ in res:  # every DP replica of a TP rank holds the same block
        assert all(torch.equal(weights[n], parts[r][n]) for n in weights)
    assert sum(w for _, _, w, _ in res) == 3 * 2  # up and down, each whitened once per step
    assert "2 matrices whitened by SWAN" in res[0][3] and "[8, 10]" in res[0][3] and "[10, 6]" in res[0][3]

