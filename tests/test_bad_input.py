"""Bad hyper-parameters and inputs a user may pass are refused with an error naming the key or the
parameter, at construction and (for options a scheduler or the user may set later) at every step,
before any parameter or optimizer state changes; under torch.distributed every rank raises, also when
only one rank's lr went bad."""

import math

import pytest
import torch
from torch import nn

from swan_dist import SWAN

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(180)


class Net(nn.Module):
    def __init__(self, sparse: bool = False):
        super().__init__()
        self.embed = nn.Embedding(10, 8, sparse=sparse)
        self.a = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 10)


def _step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


@pytest.mark.parametrize("kw, key, exc", [
    (dict(lr=float("nan")), "lr", ValueError),
    (dict(lr=float("inf")), "lr", ValueError),
    (dict(lr=-0.1), "lr", ValueError),
    (dict(lr="0.1"), "lr", TypeError),
    (dict(alpha=float("nan")), "alpha", ValueError),
    (dict(weight_decay=float("-inf")), "weight_decay", ValueError),
    (dict(eps=float("nan")), "eps", ValueError),
    (dict(betas=(0.9, 1.0)), "betas[1]", ValueError),
    (dict(betas=(float("nan"), 0.99)), "betas[0]", ValueError),
    (dict(betas=0.9), "betas", TypeError),
    (dict(ns_steps=2.5), "ns_steps", TypeError),
    (dict(beta=float("nan")), "beta", ValueError),
    (dict(bucket_mb=0), "bucket_mb", ValueError),
    (dict(bucket_mb=-5), "bucket_mb", ValueError),
    (dict(bucket_mb=float("nan")), "bucket_mb", ValueError),
    (dict(nonfinite="ignore"), "nonfinite", ValueError),
    (dict(mode="sharded"), "mode", ValueError),
])
def test_bad_hyper_parameters_are_refused_at_construction(kw, key, exc):
    with pytest.raises(exc, match=key.replace("[", r"\[").replace("]", r"\]")):
        SWAN(Net(), verbose=False, **kw)


@pytest.mark.parametrize("key, value", [("lr", float("nan")), ("lr", float("inf")), ("alpha", float("nan")),
                                        ("lr", "0.1"), ("weight_decay", -1.0)])
def test_bad_value_set_after_construction_is_refused_before_anything_changes(key, value):
    torch.manual_seed(0)
    model = Net()
    opt = SWAN(model, verbose=False, preset="swan_ddagger", lr=0.01)
    _step(model, opt)  # AdamW fallback state exists
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: {s: v.clone() for s, v in st.items()} for k, st in opt.state.items()}
    opt.param_groups[-1][key] = value
    with pytest.raises((ValueError, TypeError), match=key):
        _step(model, opt, seed=1)
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    for k, st in opt.state.items():
        assert all(torch.equal(v, state[k][s]) for s, v in st.items())


def test_sparse_gradient_is_named():
    model = Net(sparse=True)
    opt = SWAN(model, verbose=False, preset="swan_ddagger", lr=0.01)
    model.head(model.a(model.embed(torch.tensor([1, 2, 3])))).sum().backward()
    before = model.a.weight.detach().clone()
    with pytest.raises(ValueError, match=r"'embed.weight'.*sparse"):
        opt.step()
    assert torch.equal(model.a.weight, before)


def test_complex_parameter_is_named():
    w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"'w' is complex"):
        SWAN([("w", w)], verbose=False, preset="swan_ddagger", lr=0.01)


def _nan_lr_worker(rank, world):
    out = []
    for who in ("all", "last"):  # a scheduler gone NaN on every rank; on one rank only
        torch.manual_seed(0)
        model = Net()
        opt = SWAN(model, verbose=False, preset="swan_ddagger", lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: float("nan") if t >= 2 and (who == "all" or rank == world - 1) else 1.0)
        for t in range(2):
            _step(model, opt, t)
            sched.step()
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            _step(model, opt, 2)
            err = None
        except (ValueError, TypeError, RuntimeError) as e:
            err = (type(e).__name__, str(e))
        same = all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
        out.append((who, err, same, math.isnan(opt.param_groups[0]["lr"])))
    return out


def test_nan_lr_from_a_scheduler_raises_on_every_rank_and_changes_nothing():
    world = 2
    for rank, rows in enumerate(run_distributed(_nan_lr_worker, world, timeout=120)):
        for who, err, same, nan_here in rows:
            assert err is not None and err[0] == "ValueError" and "lr" in err[1], (rank, who, err)
            assert same, (rank, who)
            if who == "last" and rank != world - 1:
                assert not nan_here and f"on rank {world - 1}" in err[1], err
