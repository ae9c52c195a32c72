"""``swan_dist.swap``: a live AdamW (decay / no-decay groups, its own betas and eps) turned into SWAN in one
process: each group's options converted by the lr convention, the fallback's moments handed over, the run
equal to SWAN built by hand with those settings and moments; lr schedulers going on from their step; what
cannot be converted refused with nothing changed. FSDP2 and DDP at W=2: tests/test_from_adamw.py's worker."""

import copy
import logging
import math

import pytest
import torch

import swan_dist
from swan_dist import SWAN
from test_from_adamw import Toy, _loss, _train

pytestmark = pytest.mark.timeout(120)


def _groups(model):
    """An AdamW port's groups: matrices other than the embedding decay, vectors and the embedding do not."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in named if p.ndim < 2 or "embed" in n]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _trained(steps=3, scheduler=None, **adamw):
    torch.manual_seed(0)
    model = Toy()
    opt = torch.optim.AdamW(_groups(model), **{"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-7, **adamw})
    sched = scheduler(opt) if scheduler else None
    gen = torch.Generator().manual_seed(1)
    pair = [torch.randint(0, 50, (4, 9), generator=gen) for _ in range(2)]
    for i in range(steps):
        opt.zero_grad()
        _loss(model, pair[i % 2]).backward()
        opt.step()
        if sched:
            sched.step()
    return model, opt, sched, [pair[i % 2] for i in range(6)]


def test_swap_converts_each_group_hands_over_the_moments_and_equals_swan_by_hand(caplog):
    model, adamw, _, batches = _trained()
    twin = copy.deepcopy(model)
    moments = {p: adamw.state[p] for g in adamw.param_groups for p in g["params"]}
    with caplog.at_level(logging.INFO, logger="swan_dist"):
        swan = swan_dist.swap(adamw, model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("swan_dist.swap")]
    assert len(lines) == 1 and "of 8 fallback tensors carried" in lines[0] and "4 matrices" in lines[0], lines
    # groups: [decay: SWAN, decay: fallback (the head), no decay: fallback]; no-decay stays no-decay
    assert [(g["use_swan"], len(g["params"])) for g in swan.param_groups] == [(True, 4), (False, 1), (False, 7)]
    for g, wd in zip(swan.param_groups, (0.5, 0.5, 0.0)):
        assert math.isclose(g["lr"], 4 * 3e-3) and g["alpha"] == 0.05 and math.isclose(g["weight_decay"], wd)
        assert g["betas"] == (0.8, 0.95) and g["eps"] == 1e-7
    for g in swan.param_groups:
        for p in g["params"]:
            if g["use_swan"]:
                assert p not in swan.state
            else:  # handed over, not copied
                assert swan.state[p]["exp_avg"] is moments[p]["exp_avg"]
                assert torch.equal(swan.state[p]["step"], moments[p]["step"])

    # by hand: the same groups with the converted options, the moments cloned in
    groups = _groups(twin)
    hand = SWAN([{**groups[0], "weight_decay": 0.5}, groups[1]], model=twin, verbose=False, lr=4 * 3e-3,
                betas=(0.8, 0.95), eps=1e-7)
    source = dict(model.named_parameters())
    for n, p in twin.named_parameters():
        if not any(p is q for g in hand.param_groups if g["use_swan"] for q in g["params"]):
            hand.state[p] = {k: v.clone() for k, v in adamw.state[source[n]].items()}
    losses = _train(model, swan, batches)
    assert _train(twin, hand, batches) == losses
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), n
    assert losses[-1] < losses[0], losses


def test_swap_without_model_takes_param_names_and_adam_without_decay():
    torch.manual_seed(0)
    model = Toy()
    adam = torch.optim.Adam(list(model.named_parameters()), lr=1e-3)
    _loss(model, torch.randint(0, 50, (4, 9))).backward()
    adam.step()
    swan = swan_dist.swap(adam, preset="swan_0", verbose=False)
    rules = {n: g["use_swan"] for g in swan.param_groups for n in g["param_names"]}
    assert not rules["tok_embeddings.weight"] and not rules["output.weight"] and rules["layers.0.up.weight"]
    swan_group, fallback = swan.param_groups  # SWAN-0 (alpha 1): lr 0.2 η on the matrices, fallback_lr 4 η
    assert math.isclose(swan_group["lr"], 2e-4) and math.isclose(fallback["lr"], 4e-3)
    assert fallback["weight_decay"] == 0.0 and len(swan.state) == 8


def _continued(make_sched, swap_at=4, total=12):
    """Group lrs of SWAN after a swap at ``swap_at`` against 4x those of the AdamW run on without it."""
    ref_model, ref, ref_sched, _ = _trained(swap_at, make_sched)
    model, adamw, sched, _ = _trained(swap_at, make_sched)
    swan = swan_dist.swap(adamw, model, scheduler=sched, verbose=False)
    assert sched.optimizer is swan
    x = torch.randint(0, 50, (4, 9))
    for _ in range(total - swap_at):
        for m, o, s in ((ref_model, ref, ref_sched), (model, swan, sched)):
            o.zero_grad()
            _loss(m, x).backward()
            o.step()
            s.step()
        want = [4 * ref.param_groups[i]["lr"] for i in (0, 0, 1)]
        got = [g["lr"] for g in swan.param_groups]
        assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(got, want)), (got, want)
        assert sched.get_last_lr() == got
    return [g["lr"] for g in swan.param_groups]


def test_lambda_lr_warmup_cosine_goes_on_after_swap():
    def warm_cos(step, warm=5, total=12):
        return (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))

    with _no_warnings():
        _continued(lambda o: torch.optim.lr_scheduler.LambdaLR(o, [warm_cos, lambda s: 0.9 ** s]))


def test_sequential_linear_warmup_then_cosine_goes_on_after_swap():
    sched = torch.optim.lr_scheduler

    def make(o):
        return sched.SequentialLR(o, [sched.LinearLR(o, start_factor=0.1, total_iters=5),
                                      sched.CosineAnnealingLR(o, T_max=7, eta_min=1e-4)], milestones=[5])
    with _no_warnings():
        final = _continued(make)
    assert all(math.isclose(lr, 4e-4, rel_tol=1e-6) for lr in final)  # cosine's end: eta_min converted


class _no_warnings:
    """No warning (torch's scheduler warns if it cannot see the optimizer step first)."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def _frozen(model, opt, sched):
    return (copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()],
            copy.deepcopy({k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}) if sched else None,
            sched.optimizer if sched else None)


def _same(a, b):
    (sa, pa, ka, oa), (sb, pb, kb, ob) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)) and oa is ob
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert all(torch.equal(sa["state"][k][n], sb["state"][k][n]) for n in sa["state"][k])
    assert str(ka) == str(kb)


@pytest.mark.parametrize("case", ["sgd", "adafactor", "amsgrad", "foreign", "no_names", "adam_l2", "lr", "scheduler"])
def test_what_cannot_be_converted_is_refused_with_nothing_changed(case):
    sched = torch.optim.lr_scheduler
    make = (lambda o: sched.OneCycleLR(o, max_lr=1e-2, total_steps=20)) if case == "scheduler" else \
        (lambda o: sched.LambdaLR(o, lambda s: 1.0))
    if case in ("sgd", "adafactor"):
        torch.manual_seed(0)
        model = Toy()
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if case == "sgd" else torch.optim.Adafactor(model.parameters())
        _loss(model, torch.randint(0, 50, (4, 9))).backward()
        opt.step()
        s = make(opt)
    elif case == "adam_l2":
        torch.manual_seed(0)
        model = Toy()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.1)
        s = make(opt)
    else:
        model, opt, s, _ = _trained(2, make, amsgrad=case == "amsgrad")
    before = _frozen(model, opt, s)
    args = {"foreign": (opt, Toy()), "no_names": (opt, None)}.get(case, (opt, model))
    kw = {"lr": {"lr": 0.01}}.get(case, {})
    error, match = {"sgd": (TypeError, "AdamW or Adam"), "adafactor": (TypeError, "AdamW or Adam"),
                    "amsgrad": (ValueError, "amsgrad"), "foreign": (ValueError, "not parameters of the model"),
                    "no_names": (ValueError, "pass the model"), "adam_l2": (ValueError, "L2"),
                    "lr": (ValueError, "lr= is taken from each AdamW"), "scheduler": (ValueError, "OneCycleLR")}[case]
    with pytest.raises(error, match=match):
        swan_dist.swap(*args, scheduler=s, **kw)
    _same(before, _frozen(model, opt, s))
    if case == "adam_l2":  # the fix the error names
        swan = swan_dist.swap(opt, model, weight_decay=0.01, verbose=False)
        assert [g["weight_decay"] for g in swan.param_groups] == pytest.approx([0.05, 0.05])
