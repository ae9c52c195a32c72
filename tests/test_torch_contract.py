"""SWAN against the behaviours torch's own optimizers are tested for (torch's test/test_optim.py and
common_optimizers.py): state-dict round trips (repeated groups, named parameters, a non-tensor ``step``), the
state-dict and step hooks, ``deepcopy``, zero and absent gradients, non-contiguous parameters, a tensor lr of any
1-element shape, schedulers, ``torch.save``/``torch.load(weights_only=True)``, bad ``params``, and
``maximize`` (left out: the update is odd in the gradient). Each for every fallback rule and preset, in one
process, on a model small enough that the whole module runs in seconds."""

from __future__ import annotations

import copy
import io
import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from swan_dist import SWAN

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from make_checkpoints import Fixture as Tiny  # noqa: E402  an embedding, a norm and a head (fallback), two matrices

RULES = ("adamw", "sign", "sgd")
PRESETS = ("swan_0", "swan_dagger", "swan_ddagger")
CASES = list(itertools.product(PRESETS, RULES))


def _model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _opt(model, preset, rule, params=None, **kw):
    kw.setdefault("lr", 0.01)
    return SWAN(model if params is None else params, preset=preset, fallback=rule, verbose=False,
                weight_decay=kw.pop("weight_decay", 0.1), **kw)


def _backward(model, step: int) -> torch.Tensor:
    x = torch.randint(0, 9, (3, 5), generator=torch.Generator().manual_seed(step))
    out = model(x)
    loss = nn.functional.cross_entropy(out.reshape(-1, 9), x.roll(1, 1).reshape(-1))
    loss.backward()
    return loss.detach()


def _train(model, opt, steps, start: int = 0) -> None:
    for t in range(start, start + steps):
        opt.zero_grad()
        _backward(model, t)
        opt.step()


def _same(a: nn.Module, b: nn.Module, tol: float = 0.0) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=tol, rtol=tol, msg=name)


def _state_equal(sa: dict, sb: dict) -> None:
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys(), k
        for key in sa[k]:
            torch.testing.assert_close(torch.as_tensor(sa[k][key]), torch.as_tensor(sb[k][key]), atol=0, rtol=0)


# ---------------------------------------------------------------- state dicts


@pytest.mark.parametrize("preset,rule", CASES)
def test_state_dict_round_trip_continues_identically(preset, rule):
    a = _model()
    opt_a = _opt(a, preset, rule)
    _train(a, opt_a, 2)
    sd = opt_a.state_dict()
    b = copy.deepcopy(a)
    opt_b = _opt(b, preset, rule, lr=0.5)  # its own options are replaced by the checkpoint's
    opt_b.load_state_dict(copy.deepcopy(sd))
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    _state_equal(opt_b.state_dict()["state"], sd["state"])  # deterministic: what was loaded saves the same
    _train(a, opt_a, 2, start=2)
    _train(b, opt_b, 2, start=2)
    _same(a, b)
    stateful = rule == "adamw"
    assert any(opt_a.state_dict()["state"].values()) == stateful  # the matrices and stateless rules keep none


@pytest.mark.parametrize("preset,rule", CASES)
def test_repeated_param_group_saves_loads_and_steps_each_tensor_once(preset, rule):
    plain, repeated = _model(), _model()
    opt_p, opt_r = _opt(plain, preset, rule), _opt(repeated, preset, rule)
    opt_r.param_groups.append(opt_r.param_groups[0])  # as torch's AdamW allows
    _train(plain, opt_p, 1)
    _train(repeated, opt_r, 1)
    _same(plain, repeated)
    sd = opt_r.state_dict()
    assert len(sd["param_groups"]) == len(opt_r.param_groups)
    assert sd["param_groups"][-1]["params"] == sd["param_groups"][0]["params"]
    again = copy.deepcopy(repeated)
    opt_again = _opt(again, preset, rule)
    opt_again.param_groups.append(opt_again.param_groups[0])
    opt_again.load_state_dict(torch.load(_saved(sd), weights_only=True))
    _train(repeated, opt_r, 1, start=1)
    _train(again, opt_again, 1, start=1)
    _train(plain, opt_p, 1, start=1)
    _same(repeated, again)
    _same(plain, repeated)


@pytest.mark.parametrize("preset,rule", CASES)
def test_named_parameters_round_trip(preset, rule):
    a = _model()
    opt_a = _opt(a, preset, rule, params=a.named_parameters())
    _train(a, opt_a, 1)
    sd = opt_a.state_dict()
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in a.named_parameters())
    b = copy.deepcopy(a)
    opt_b = _opt(b, preset, rule, params=b.named_parameters())
    opt_b.load_state_dict(copy.deepcopy(sd))  # a copy: loading keeps the saved tensors, as torch's does
    _train(a, opt_a, 1, start=1)
    _train(b, opt_b, 1, start=1)
    _same(a, b)


@pytest.mark.parametrize("preset", PRESETS)
def test_non_tensor_step_loads(preset):
    """A checkpoint whose AdamW-fallback ``step`` is a Python number (as older torch saved it) continues as
    one with tensor steps does."""
    a = _model()
    opt_a = _opt(a, preset, "adamw")
    _train(a, opt_a, 2)
    sd = copy.deepcopy(opt_a.state_dict())
    steps = [st for st in sd["state"].values() if "step" in st]
    assert steps
    for st in steps:
        st["step"] = float(st["step"])
    b = copy.deepcopy(a)
    opt_b = _opt(b, preset, "adamw")
    opt_b.load_state_dict(sd)
    assert all(torch.is_tensor(st["step"]) for st in opt_b.state.values() if "step" in st)
    _train(a, opt_a, 1, start=2)
    _train(b, opt_b, 1, start=2)
    _same(a, b)


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("preset,rule", CASES)
def test_save_and_load_with_weights_only(preset, rule):
    a = _model()
    opt_a = _opt(a, preset, rule, capturable=rule == "sgd")  # tensor options (capturable) load too
    _train(a, opt_a, 2)
    loaded = torch.load(_saved(opt_a.state_dict()), weights_only=True)
    b = copy.deepcopy(a)
    opt_b = _opt(b, preset, rule, capturable=rule == "sgd")
    opt_b.load_state_dict(loaded)
    _train(a, opt_a, 1, start=2)
    _train(b, opt_b, 1, start=2)
    _same(a, b)


# ---------------------------------------------------------------- hooks and copies


def test_step_and_state_dict_hooks_run_as_torchs_do():
    model = _model()
    opt = _opt(model, "swan_ddagger", "adamw")
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o is opt)))
    glob = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global", o is opt)))
    try:
        _train(model, opt, 1)
    finally:
        glob.remove()
    assert calls == [("global", True), ("pre", True), ("post", True)]

    def pre_sd(o):
        calls.append("sd-pre")

    def post_sd(o, sd):
        sd["extra"] = 7
        return sd

    opt.register_state_dict_pre_hook(pre_sd)
    opt.register_state_dict_post_hook(post_sd)
    sd = opt.state_dict()
    assert calls[-1] == "sd-pre" and sd["extra"] == 7

    def pre_load(o, sd):
        sd = dict(sd)
        sd.pop("extra")
        calls.append("load-pre")
        return sd

    opt.register_load_state_dict_pre_hook(pre_load)
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    opt.load_state_dict(sd)
    assert calls[-2:] == ["load-pre", "load-post"]
    _train(model, opt, 1, start=1)


@pytest.mark.parametrize("preset,rule", CASES)
def test_deepcopy_keeps_every_public_attribute(preset, rule):
    model = _model()
    opt = _opt(model, preset, rule)
    _train(model, opt, 1)
    dup = copy.deepcopy(opt)
    public = lambda o: {k for k in vars(o) if not k.startswith("_")}  # noqa: E731
    assert public(dup) == public(opt)
    assert dup.defaults == opt.defaults and dup.preset == opt.preset
    assert [{k: v for k, v in g.items() if k != "params"} for g in dup.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    _state_equal(dup.state_dict()["state"], opt.state_dict()["state"])
    assert dup.summary() == opt.summary()


# ---------------------------------------------------------------- gradients and parameters


@pytest.mark.parametrize("preset,rule", CASES)
def test_absent_gradients_leave_a_tensor_untouched_and_zero_gradients_are_defined(preset, rule):
    model = _model()
    opt = _opt(model, preset, rule, weight_decay=0.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _backward(model, 0)
    model.up.weight.grad = None  # a whitened matrix without a gradient
    model.norm.weight.grad = None  # a fallback tensor without one
    model.down.weight.grad.zero_()  # a whitened matrix with a zero gradient
    model.head.weight.grad.zero_()  # a fallback tensor with one
    opt.step()
    for name in ("up.weight", "norm.weight"):
        assert torch.equal(model.get_parameter(name), before[name]), name
        assert not opt.state.get(model.get_parameter(name)), name  # no state made for it either
    for name in ("down.weight", "head.weight"):  # nothing to follow: no move (no weight decay here)
        assert torch.equal(model.get_parameter(name), before[name]), name
    assert not torch.equal(model.embed.weight, before["embed.weight"])  # the rest stepped


@pytest.mark.parametrize("preset,rule", CASES)
def test_non_contiguous_parameters_step_as_their_contiguous_copies(preset, rule):
    a = _model()
    b = copy.deepcopy(a)
    def gapped(t):  # every other element of a larger buffer, as torch's own optimizer tests make them
        return nn.Parameter(torch.stack([t.detach(), torch.zeros_like(t)], -1)[..., 0])

    b.up.weight = nn.Parameter(b.up.weight.detach().t().contiguous().t())  # the same values, stored transposed
    b.down.weight, b.up.bias, b.head.weight = gapped(b.down.weight), gapped(b.up.bias), gapped(b.head.weight)
    assert not any(t.is_contiguous() for t in (b.up.weight, b.down.weight, b.up.bias, b.head.weight))
    opt_a, opt_b = _opt(a, preset, rule), _opt(b, preset, rule)
    _train(a, opt_a, 2)
    _train(b, opt_b, 2)
    _same(a, b, tol=1e-6)
    assert not b.up.weight.is_contiguous() and not b.down.weight.is_contiguous()  # updated in place


@pytest.mark.parametrize("preset,rule", CASES)
def test_tensor_lr_of_any_one_element_shape(preset, rule):
    """Every 1-element shape steps exactly as the 0-d tensor does, and (one step: an fp32 lr against a Python
    float's double product) within rounding of a number lr."""
    number = _model()
    _train(number, _opt(number, preset, rule, lr=0.01), 1)
    ref = _model()
    opt_ref = _opt(ref, preset, rule, lr=torch.tensor(0.01))
    _train(ref, opt_ref, 1)
    _same(number, ref, tol=1e-6)
    _train(ref, opt_ref, 1, start=1)
    for lr in (torch.tensor([0.01]), torch.tensor([[0.01]])):
        m = _model()
        opt = _opt(m, preset, rule, lr=lr)
        _train(m, opt, 2)
        _same(ref, m)
        assert all(torch.is_tensor(g["lr"]) and g["lr"].dim() == 0 for g in opt.param_groups)
    lr = torch.tensor([0.02])  # a scheduler's in-place fill reaches the step through the view SWAN keeps
    m = _model()
    opt = _opt(m, preset, rule, lr=lr)
    lr.fill_(0.01)
    _train(m, opt, 2)
    _same(ref, m)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        _opt(_model(), preset, rule, lr=torch.tensor([0.01, 0.02]))
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        torch.optim.AdamW(_model().parameters(), lr=torch.tensor([0.01, 0.02]))  # torch's own, for the record


@pytest.mark.parametrize("preset,rule", CASES)
def test_schedulers_scale_every_group_and_training_goes_downhill(preset, rule):
    model = _model()
    opt = _opt(model, preset, rule, lr=torch.tensor(0.01) if rule == "sign" else 0.01, weight_decay=0.0)
    base = [float(g["lr"]) for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    x = torch.randint(0, 9, (8, 6), generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        return nn.functional.cross_entropy(model(x).reshape(-1, 9), x.roll(1, 1).reshape(-1))

    first = loss().item()
    for t in range(6):
        opt.zero_grad()
        loss().backward()
        opt.step()
        sched.step()
        assert sched.get_last_lr() == pytest.approx([b / (t + 2) for b in base])
        assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([b / (t + 2) for b in base])
    assert loss().item() < first
    torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5).step()  # a second scheduler on the same groups


# ---------------------------------------------------------------- bad params, maximize


def test_bad_params_are_refused_as_torch_refuses_them():
    model = _model()
    w, b = model.up.weight, model.up.bias
    cases = [
        (torch.randn(3, 4), TypeError, "iterable of Tensors or dicts"),
        (nn.Parameter(torch.randn(3, 4)), TypeError, "iterable of Tensors or dicts"),
        ([("w", w), b], ValueError, "with/without names"),
        ([b, ("w", w)], ValueError, "with/without names"),
        ([{"params": {w}}], TypeError, "ordered collections"),
        ([w, 1.0], TypeError, "can only optimize Tensors"),
        ([w * 2], ValueError, "non-leaf"),
        ([], ValueError, "empty parameter list"),
        ([{"params": [w]}, {"params": [w]}], ValueError, "more than one parameter group"),
        ([{"params": [("w", w)]}, {"params": [b]}], ValueError, "param groups should be with/without names"),
    ]
    for params, err, match in cases:
        with pytest.raises(err, match=match):
            torch.optim.AdamW(params)  # what torch says ...
        with pytest.raises(err, match=match):
            SWAN(params, lr=0.01, verbose=False)  # ... SWAN says


@pytest.mark.parametrize("preset,rule", CASES)
def test_maximize_is_left_out_and_a_negated_loss_gives_the_exactly_negated_step(preset, rule):
    with pytest.raises(ValueError, match=r"\(-f\)\.backward\(\)"):
        _opt(_model(), preset, rule, maximize=True)
    deltas = []
    for sign in (1.0, -1.0):
        model = _model()
        opt = _opt(model, preset, rule, weight_decay=0.0)
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randint(0, 9, (3, 5), generator=torch.Generator().manual_seed(0))
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 9), x.roll(1, 1).reshape(-1))
        opt.zero_grad()
        (sign * loss).backward()
        opt.step()
        deltas.append([p.detach() - q for p, q in zip(model.parameters(), before)])
    for up, down in zip(*deltas):
        torch.testing.assert_close(up, -down, atol=1e-7, rtol=0)


LEAK_PROBE = """
import gc, weakref
import deepspeed, transformers.trainer  # loaded: SWAN looks up the stack for their engine and Trainer
import torch
from torch import nn
import swan_dist

def build_and_drop(bare):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref = weakref.ref(m[0].weight)
    opt = swan_dist.SWAN(list(m.parameters()) if bare else m, lr=0.01, verbose=False)
    del m, opt
    gc.collect()
    return ref() is None

print(build_and_drop(False), build_and_drop(True))
"""


def test_a_dropped_model_and_optimizer_are_freed_with_deepspeed_and_the_trainer_loaded():
    """SWAN finds DeepSpeed's engine and the Trainer up the call stack by their own frames only: reading every
    caller's locals left a snapshot on the caller's frame, which kept a model it had deleted alive."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", LEAK_PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["True", "True"], done.stdout
