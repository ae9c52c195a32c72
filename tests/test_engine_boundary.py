"""The engine's boundary: the communication device from the group's real backend, the per-step
agreement's cost, and torch idioms SWAN cannot serve refused at once, on every rank, with the fix."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from dist_utils import run_distributed
from swan_dist import SWAN
from swan_dist.adapter import Adapter, tensor_piece
from swan_dist.collectives import comm_device, served_devices
from test_distributed_optimizer import Net, _global_grads

pytestmark = pytest.mark.timeout(300)

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize("backend, pieces, want", [
    ("gloo", [CPU], CPU),
    ("gloo", [CUDA1], CPU),  # gloo's all_to_all is CPU-only: CUDA pieces go through the CPU
    ("nccl", [CUDA1], CUDA1),
    ("nccl", [CPU], torch.device("cuda", 3)),  # CPU-offloaded pieces under NCCL move to the current GPU
    ("nccl", [CPU, CUDA0], CUDA0),
    ("cuda:nccl,cpu:gloo", [CPU], torch.device("cuda", 3)),  # one answer whatever a rank's placement
    ("cpu:gloo,cuda:nccl", [CUDA1], CUDA1),
    ("cuda:nccl,cpu:gloo", [], torch.device("cuda", 3)),  # no pieces here: the GPU its peers use
    ("undefined", [CPU], torch.device("cuda", 3)),  # lazy init: torch's default backend per device
    ("undefined", [CUDA0], CUDA0),
    ("ucc", [CUDA1], CUDA1),
    ("mpi", [CUDA1], CPU),
])
def test_comm_device_follows_the_backend_for_the_pieces_devices(backend, pieces, want):
    assert comm_device(backend, pieces, {"cuda": 3}) == want


def test_comm_device_without_pieces_or_accelerator():
    assert comm_device("cuda:nccl,cpu:gloo", []) == CPU  # no CUDA on this machine
    assert comm_device("gloo", [], {"cuda": 0}) == CPU
    assert comm_device("undefined", [CPU]) == CPU  # no accelerator available here


def test_backend_strings():
    assert served_devices("cuda:nccl,cpu:gloo") == ("cuda", "cpu")
    assert served_devices("NCCL") == ("cuda",)
    assert "cpu" in served_devices("undefined") and "cuda" in served_devices("undefined")
    with pytest.raises(ValueError, match="'fancy'"):
        served_devices("fancy")


def test_unnamed_matrices_warn_and_strict_raises():
    model = Net()
    with pytest.warns(UserWarning, match=r"without names.*SWAN\(model\)"):
        SWAN(model.parameters(), verbose=False)
    with pytest.raises(ValueError, match=r"without names.*strict=True"):
        SWAN(model.parameters(), verbose=False, strict=True)
    heads = [("output.weight", torch.zeros(3, 4)), ("lm_head.weight", torch.zeros(5, 4))]
    with pytest.raises(ValueError, match=r"whitens none of the 2 2-D tensors"):  # every matrix named like a head
        SWAN(heads, verbose=False, strict=True)
    with pytest.warns(UserWarning, match=r"whitens none"):
        SWAN(heads, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named: no warning
        SWAN(model, verbose=False, strict=True)
        SWAN(model.named_parameters(), verbose=False, strict=True)
        SWAN(model, verbose=False, strict=True, exclude=[r"\.weight$"])  # the user's choice
        SWAN([{"params": list(model.parameters()), "use_swan": False}], lr=0.1, verbose=False, strict=True)


def _fsdp1_bare_worker(rank, world, orig):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=orig,
                 device_id=torch.device("cpu"))
    errors = []
    for params in (model.parameters(), model.named_parameters()):
        try:
            SWAN(params, verbose=False)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.parametrize("orig", [True, False])
def test_fsdp1_bare_parameters_refused_at_construction_on_every_rank(orig):
    """Flattened FSDP1 shards carry no shape or name SWAN could use: refused before any collective
    (the workers never reach step()), each error saying what to pass instead."""
    res = run_distributed(_fsdp1_bare_worker, 2, orig)
    for errors in res:
        for e in errors:
            assert e is not None and "FSDP" in e and "SWAN(" in e and "tag_model" in e, e


def _agreement_worker(rank, world):
    import torch.distributed as dist

    calls = {"all_reduce": 0, "all_gather": 0, "all_gather_object": 0}
    for fn in calls:
        orig = getattr(dist, fn)

        def counted(*a, _fn=fn, _orig=orig, **k):
            calls[_fn] += 1
            return _orig(*a, **k)

        setattr(dist, fn, counted)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Net())
    opt = SWAN(model.module, verbose=False, preset="swan_ddagger", lr=0.05)
    per_step = []
    for t in range(4):
        for n, p in model.module.named_parameters():
            p.grad = _global_grads(model.module, t)[n]
        before = dict(calls)
        opt.step()
        per_step.append({k: calls[k] - before[k] for k in calls})
    if rank == 1:  # a rank's configuration changes after the agreement: caught on every rank
        for g in opt.param_groups:
            g["beta"] = 0.5
    try:
        opt.step()
        late = None
    except ValueError as e:
        late = str(e)
    return per_step, late


def test_steady_step_costs_two_all_reduces_and_still_catches_a_late_change():
    """The agreement's all_reduce before the step and the status all_reduce after it (a late failure or a
    non-finite update on any rank); nothing else once the plan exists."""
    res = run_distributed(_agreement_worker, 2)
    for per_step, late in res:
        assert per_step[0]["all_gather"] == 1 and per_step[0]["all_gather_object"] == 1  # agreement, then the plan
        for s in per_step[1:]:
            assert s == {"all_reduce": 2, "all_gather": 0, "all_gather_object": 0}, per_step
        assert late is not None and "'beta'" in late and "rank 1" in late, late


class RowShardAdapter(Adapter):
    """docs/engine.md's worked example: a framework that keeps each parameter's local rows as a plain
    tensor with ``full_shape`` and ``row0``."""

    name = "rowshard"

    def claims(self, tensor):
        return hasattr(tensor, "full_shape")

    def shape(self, tensor):
        return tuple(tensor.full_shape)

    def pieces(self, tensor, name, rules):
        row = math.prod(tensor.full_shape[1:])
        return [tensor_piece(name, tensor, shape=self.shape(tensor), lo=tensor.row0 * row, grad=tensor.grad)]


def _rowshard_worker(rank, world):
    import swan_dist.integrations as integrations

    integrations.ADAPTERS = (RowShardAdapter(), *integrations.ADAPTERS)  # the one registry line
    torch.manual_seed(0)
    full = Net()
    named = []
    for n, p in full.named_parameters():
        rows = -(-p.shape[0] // world)
        local = nn.Parameter(p.detach()[rank * rows: (rank + 1) * rows].clone())
        local.full_shape, local.row0 = tuple(p.shape), min(rank * rows, p.shape[0])
        named.append((n, local))
    opt = SWAN(named, verbose=False, preset="swan_ddagger", lr=0.05, fallback="sgd")
    for t in range(2):
        grads = _global_grads(full, t)
        for n, p in named:
            p.grad = grads[n][p.row0: p.row0 + p.shape[0]].clone()
        opt.step()
    return {n: p.detach() for n, p in named}, opt.summary()


def test_a_new_framework_is_one_adapter_and_one_registry_line():
    from test_distributed_optimizer import _reference

    res = run_distributed(_rowshard_worker, 2)
    ref = _reference(_global_grads, dict(preset="swan_ddagger", lr=0.05, fallback="sgd"), range(2))
    for n, p in ref.named_parameters():
        got = torch.cat([r[0][n] for r in res])
        assert (got - p.detach()).abs().max() < 2e-5, n
    assert "4 matrices whitened by SWAN" in res[0][1]


def _reshard_worker(rank, world):
    """Rows split evenly for two steps, then re-sharded unevenly (rank 0 one row fewer) for three."""
    import torch.distributed as dist

    import swan_dist.integrations as integrations

    integrations.ADAPTERS = (RowShardAdapter(), *integrations.ADAPTERS)
    torch.manual_seed(0)
    full = Net()

    def shard(weights, shift):
        named = []
        for n, w in weights.items():
            rows = -(-w.shape[0] // world)
            cut = [min(max(0, r * rows - (shift if r else 0)), w.shape[0]) for r in range(world)] + [w.shape[0]]
            local = nn.Parameter(w[cut[rank]: cut[rank + 1]].clone())
            local.full_shape, local.row0 = tuple(w.shape), cut[rank]
            named.append((n, local))
        return named

    named = shard({n: p.detach() for n, p in full.named_parameters()}, 0)
    opt = SWAN(named, verbose=False, preset="swan_ddagger", lr=0.05, fallback="sgd")
    built = []
    for t in range(5):
        if t == 2:  # re-shard: gather the current rows, cut them anew, hand the optimizer the new tensors
            parts = [None] * world
            dist.all_gather_object(parts, {n: p.detach() for n, p in named})
            named = shard({n: torch.cat([part[n] for part in parts]) for n, _ in named}, 1)
            for g in opt.param_groups:
                g["params"] = [p for n, p in named if n in set(g.get("param_names", ()))]
        grads = _global_grads(full, t)
        for n, p in named:
            p.grad = grads[n][p.row0: p.row0 + p.shape[0]].clone()
        before = opt.plans.built
        opt.step()
        built.append(opt.plans.built - before)
    return {n: p.detach() for n, p in named}, built


def test_a_layout_change_between_steps_rebuilds_the_plan_once():
    from test_distributed_optimizer import _reference

    res = run_distributed(_reshard_worker, 2)
    ref = _reference(_global_grads, dict(preset="swan_ddagger", lr=0.05, fallback="sgd"), range(5))
    for n, p in ref.named_parameters():
        got = torch.cat([r[0][n] for r in res])
        assert (got - p.detach()).abs().max() < 2e-5, n
    for _, built in res:
        assert built == [1, 0, 1, 0, 0], built


def _one_rank_fails_worker(rank, world):
    import swan_dist.integrations as integrations

    integrations.ADAPTERS = (RowShardAdapter(), *integrations.ADAPTERS)
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    w.full_shape, w.row0 = (6, 4), 3 * rank
    opt = SWAN([("proj.weight", w)], verbose=False, preset="swan_ddagger", lr=0.05)
    w.grad = torch.randn(3, 4)
    opt.step()  # agreed
    w.grad = torch.randn(3, 4)
    if rank == 1:  # only this rank's piece becomes invalid (a sparse gradient: SWAN takes dense ones)
        w.grad = w.grad.to_sparse()
    try:
        opt.step()
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def test_a_check_failing_on_one_rank_raises_on_every_rank_without_a_hang():
    res = run_distributed(_one_rank_fails_worker, 2, timeout=120)
    assert all(r is not None and "'proj.weight'" in r and "dense gradients" in r for r in res), res
    assert "on rank 1" in res[0], res[0]
