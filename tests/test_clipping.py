"""What global-norm gradient clipping does with SWAN (docs/optimizer.md, "Gradient clipping"): the whitened
matrices' update does not depend on the gradient's scale, so ``clip_grad_norm_`` leaves it unchanged (to
rounding); the AdamW fallback feels a clip only through its moments, as AdamW does; a non-finite norm turns
every gradient non-finite (or zero), so clipping cannot rescue a non-finite step."""

import torch
from torch import nn

import swan_dist
from test_from_adamw import Toy, _loss


def _run(clip_at_step_1: bool):
    torch.manual_seed(0)
    model = Toy()
    opt = swan_dist.SWAN(model, adamw_lr=3e-3, weight_decay=0.0, verbose=False)
    x = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        _loss(model, x).backward()
        if clip_at_step_1 and step == 1:
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # far below the norm: a strong clip
            assert norm > 0.1  # clipped by 1e-2 or more
        opt.step()
    rules = {n: g["use_swan"] for g in opt.param_groups for n in g["param_names"]}
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, rules  # the clipped step's update


def test_clipping_leaves_the_whitened_update_and_reaches_the_fallback_only():
    clipped, rules = _run(True)
    plain, _ = _run(False)
    for name, delta in clipped.items():
        diff = (delta - plain[name]).abs().max() / plain[name].abs().max()
        if rules[name]:  # whitened: scale-free
            assert diff < 1e-5, (name, diff)
        elif name in ("tok_embeddings.weight", "output.weight"):  # AdamW fallback: its moments saw the clip
            assert diff > 1e-3, (name, diff)


def test_a_non_finite_gradient_makes_clipping_spread_it():
    """One NaN gradient entry: clip_grad_norm_'s norm is NaN and every gradient becomes NaN, so SWAN
    (nonfinite="skip") leaves every parameter where it was: clipping is no remedy for non-finite steps."""
    import pytest

    torch.manual_seed(0)
    model = Toy()
    opt = swan_dist.SWAN(model, adamw_lr=3e-3, verbose=False)
    _loss(model, torch.randint(0, 50, (4, 9))).backward()
    model.output.weight.grad[0, 0] = float("nan")
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(norm)
    assert all(torch.isnan(p.grad).all() for p in model.parameters())  # every gradient NaN now
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
