"""Expert stacks under expert parallelism with FSDP over their rows (torchtitan's layout): a 3-D parameter
``(E, rows, cols)`` as a DTensor on a 2 x 2 ``(ep, dp)`` mesh with placements ``(Shard(0), Shard(1))``: each
rank holds a block of experts and a block of each one's rows. SWAN numbers such a stack as a grid of cells
(``Layout.lead_splits``/``row_splits``), whitens each expert once on its owner, and must equal single-process
SWAN on the same global gradients. Uneven everywhere: 3 experts over 2 EP ranks, 5 rows over 2 DP ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from swan_dist import SWAN
from swan_dist.layout import Layout

pytestmark = pytest.mark.timeout(300)
EXPERTS = ["experts_up", "experts_down"]
OPTS = [dict(preset="swan_ddagger", lr=0.05, weight_decay=0.05), dict(preset="swan_dagger", lr=0.05, ns_steps=4)]


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.router = nn.Linear(4, 3, bias=False)
        self.experts_up = nn.Parameter(torch.randn(3, 5, 4))  # (E, out, in): 3 experts of 5 x 4
        self.experts_down = nn.Parameter(torch.randn(3, 4, 5))


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    torch.manual_seed(0)
    return {n: torch.randn(p.shape, generator=g) for n, p in MoE().named_parameters()}


def _worker(rank: int, world: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    out = []
    for opts in OPTS:
        torch.manual_seed(0)
        model = MoE()
        for name in EXPERTS:  # torchtitan's end state: experts over "ep", each expert's rows over "dp"
            dt = distribute_tensor(getattr(model, name).detach(), mesh, [Shard(0), Shard(1)])
            local = dt.to_local().contiguous()  # (torch 2.6 leaves a Shard(1) slice strided; FSDP2 does not)
            setattr(model, name, nn.Parameter(DTensor.from_local(local, mesh, dt.placements, shape=dt.shape,
                                                                 stride=dt.stride())))
        for module in (model.embed, model.router):  # dense weights replicated (as under DDP)
            module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate(), Replicate()]))
        opt = SWAN(model, include=EXPERTS, verbose=rank == 0, bucket_mb=0.00001, **opts)
        for t in range(3):
            for n, p in model.named_parameters():
                p.grad = distribute_tensor(_grads(t)[n], p.device_mesh, p.placements)
            opt.step()
        torch.manual_seed(0)
        ref = MoE()
        ref_opt = SWAN(ref, include=EXPERTS, verbose=False, **opts)  # whole tensors: each rank the same
        for t in range(3):
            for n, p in ref.named_parameters():
                p.grad = _grads(t)[n]
            ref_opt.step()
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
        out.append(dict(err={n: (full[n] - p).abs().max().item() for n, p in ref.named_parameters()},
                        whitened=opt.whitened_matrices, ref_whitened=ref_opt.whitened_matrices,
                        summary=opt.summary() if rank == 0 else None))
    return out


def test_expert_stacks_split_by_expert_and_row_equal_single_process():
    res = run_distributed(_worker, 4)
    for c in range(len(OPTS)):
        per_rank = [r[c] for r in res]
        for r in per_rank:
            assert max(r["err"].values()) < 2e-5, r["err"]
        # each expert of both stacks (3 + 3) and the router whitened once per step, on one rank
        assert sum(r["whitened"] for r in per_rank) == sum(r["ref_whitened"] for r in per_rank) == 3 * 7
        assert "experts_up" in per_rank[0]["summary"]


def test_grid_layout_round_trip_and_cells():
    lay = Layout(col_splits=(1,), lead_splits=(2,), row_splits=(3,))
    full = torch.arange(3 * 5 * 4, dtype=torch.float32).view(3, 5, 4)
    flat = lay.from_full(full)
    assert torch.equal(lay.to_full(flat, (3, 5, 4)), full)
    for e in ((0, 2), (2, 3)):
        for r in ((0, 3), (3, 5)):
            for c in ((0, 1), (1, 4)):
                lo, hi = lay.box_range((3, 5, 4), [e[0], r[0], c[0]], [e[1] - e[0], r[1] - r[0], c[1] - c[0]])
                assert torch.equal(flat[lo:hi], full[e[0]:e[1], r[0]:r[1], c[0]:c[1]].reshape(-1))
    assert lay.box_range((3, 5, 4), [0, 0, 0], [1, 3, 1]) is None  # not a cell
