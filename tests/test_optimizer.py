"""swan_dist.SWAN as a torch optimizer: parameter selection, update rule, fallback rules, state,
torch optimizer conventions, bad input, presets, and short runs in which the loss falls."""

import copy
import logging
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import swan_dist
from swan_dist import SWAN, swan_update

pytestmark = pytest.mark.timeout(120)


class Toy(nn.Module):
    """Embedding, two blocks of (norm, linear with bias, linear), untied head."""

    def __init__(self, vocab=50, dim=16, tie=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleDict(dict(norm=nn.LayerNorm(dim), up=nn.Linear(dim, 2 * dim), down=nn.Linear(2 * dim, dim, bias=False)))
            for _ in range(2)
        )
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x):
        h = self.tok_embeddings(x)
        for blk in self.layers:
            h = h + blk["down"](torch.relu(blk["up"](blk["norm"](h))))
        return self.output(h)


def _loss(model, x):
    return nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _rules(opt):
    return {name: rule_name for name, _, rule_name, _ in opt._rows}


def test_default_selection_by_module_type_and_summary(caplog):
    model = Toy(tie=True)
    with caplog.at_level(logging.INFO, logger="swan_dist"):
        opt = SWAN(model, lr=0.01)
    rules = _rules(opt)
    assert rules["layers.0.up.weight"] == "SWAN" and rules["layers.1.down.weight"] == "SWAN"
    for name in ["tok_embeddings.weight", "layers.0.up.bias", "layers.0.norm.weight"]:
        assert rules[name] == "fallback:adamw", name
    (record,) = [r for r in caplog.records if r.name == "swan_dist"]  # the summary: one INFO record
    assert record.levelno == logging.INFO and record.getMessage() == opt.summary()
    out = record.getMessage()
    assert "4 matrices whitened by SWAN" in out and "layers.*.up.weight" in out
    # the tied weight appears once, on the fallback rule, and the summary says what it is tied to
    row = [line for line in out.splitlines() if "tok_embeddings.weight" in line]
    assert len(row) == 1 and row[0].split()[:2] == ["fallback:adamw", "tok_embeddings.weight"], row
    assert row[0].endswith("nn.Embedding weight (tied with output.weight)"), row
    assert "output.weight" not in rules and "4 matrices whitened by SWAN, 7 tensors on the fallback rule" in out
    untied = SWAN(Toy(tie=False), lr=0.01, verbose=False)
    assert _rules(untied)["output.weight"] == "fallback:adamw" and "tied" not in untied.summary()
    assert [g["use_swan"] for g in opt.param_groups] == [True, False]


SUMMARY_PROBE = """
import logging, sys
from torch import nn
import swan_dist
case = sys.argv[1]
if case == "basic":
    logging.basicConfig()  # the root at WARNING, a handler on stderr
elif case == "quiet":
    logging.getLogger("swan_dist").setLevel(logging.WARNING)
swan_dist.SWAN(nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4)), lr=0.01, verbose=case != "off")
"""


@pytest.mark.timeout(120)
def test_summary_goes_to_logging_and_to_stdout_where_logging_is_not_configured():
    """Logging never configured: printed to stdout (as before it used logging); ``logging.basicConfig()``
    at its default WARNING: on the root's handler (stderr) at INFO; the ``swan_dist`` logger set to WARNING,
    or ``verbose=False``: nothing."""
    head = "swan_dist.SWAN (preset=swan_ddagger): 1 matrices whitened by SWAN"
    out = {case: subprocess.run([sys.executable, "-c", SUMMARY_PROBE, case], capture_output=True, text=True,
                                timeout=100, check=True) for case in ("plain", "basic", "quiet", "off")}
    assert out["plain"].stdout.startswith(head) and head not in out["plain"].stderr
    assert out["basic"].stderr.startswith(f"INFO:swan_dist:{head}") and head not in out["basic"].stdout
    for case in ("quiet", "off"):
        assert head not in out[case].stdout + out[case].stderr, case


def test_selection_by_name_include_exclude_groups_and_bare_tensors():
    model = Toy()
    opt = SWAN(model.named_parameters(), lr=0.01, verbose=False)
    rules = _rules(opt)
    assert rules["output.weight"].startswith("fallback") and rules["layers.0.down.weight"] == "SWAN"
    opt = SWAN(model.named_parameters(), lr=0.01, include=[r"^output\."], exclude=[r"\.down\."], verbose=False)
    rules = _rules(opt)
    assert rules["output.weight"] == "SWAN" and rules["layers.0.down.weight"].startswith("fallback")
    opt = SWAN([{"params": [model.output.weight], "use_swan": True}, {"params": [model.layers[0].up.weight], "use_swan": False}], lr=0.1, verbose=False)
    assert [g["use_swan"] for g in opt.param_groups] == [True, False]
    with pytest.raises(ValueError, match="use_swan=True"):
        SWAN([{"params": [model.layers[0].up.bias], "use_swan": True}], lr=0.1, verbose=False)
    fresh = nn.Linear(4, 3)  # bare, untagged: decided by shape, and the summary says the name is unknown
    with pytest.warns(UserWarning, match="without names"):
        opt = SWAN(fresh.parameters(), lr=0.1, verbose=False)
    assert "name unknown" in opt.summary()
    swan_dist.tag_model(model)  # tagged bare parameters (what DeepSpeed hands over) keep their rules
    opt = SWAN(model.parameters(), lr=0.1, verbose=False)
    rules = _rules(opt)
    assert rules["tok_embeddings.weight"].startswith("fallback") and rules["layers.0.up.weight"] == "SWAN"


def test_stacked_3d_parameter_whitened_per_matrix_when_included():
    experts = nn.Parameter(torch.randn(3, 6, 4))
    opt = SWAN([("experts", experts)], lr=0.1, preset=None, verbose=False)
    assert _rules(opt)["experts"].startswith("fallback")
    opt = SWAN([("experts", experts)], lr=0.1, alpha=1.0, preset=None, include=["experts"], verbose=False)
    experts.grad = torch.randn(3, 6, 4)
    before = experts.detach().clone()
    opt.step()
    expected = torch.stack([swan_update(experts.grad[i])[0] for i in range(3)])
    assert torch.allclose(before - experts.detach(), 0.1 * expected, atol=1e-6)


def test_step_equals_functional_and_fallback_equals_torch_adamw():
    torch.manual_seed(0)
    model = Toy()
    ref = copy.deepcopy(model)
    opt = SWAN(model, lr=0.01, alpha=0.5, weight_decay=0.1, verbose=False)
    swan_names = {n for n, _, r, _ in opt._rows if r == "SWAN"}
    adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in swan_names], lr=0.01, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    x = torch.randint(0, 50, (4, 9))
    for _ in range(3):
        for m in (model, ref):
            m.zero_grad()
            _loss(m, x).backward()
        expected = {}
        for n, p in ref.named_parameters():
            if n in swan_names:
                upd, _ = swan_update(p.grad)
                expected[n] = p.detach() * (1 - 0.005 * 0.1) - 0.005 * upd
        opt.step()
        adamw.step()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n in swan_names:
                    p.copy_(expected[n])
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=1e-6), n


def test_fallback_lr_sets_the_fallback_groups_lr_apart_and_schedulers_scale_both():
    """``fallback_lr``: the fallback rule's own lr (AdamW's steps equal torch's AdamW at that lr), the
    matrices still at ``lr * alpha``; a scheduler scales each group from its own start; bad values are
    refused naming the key."""
    torch.manual_seed(0)
    model = Toy()
    ref = copy.deepcopy(model)
    opt = SWAN(model, lr=0.02, alpha=0.5, fallback_lr=0.003, verbose=False)
    swan_names = {n for n, _, r, _ in opt._rows if r == "SWAN"}
    assert sorted((g["use_swan"], g["lr"]) for g in opt.param_groups) == [(False, 0.003), (True, 0.02)]
    adamw = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in swan_names], lr=0.003, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda t: 0.5 ** t)
    x = torch.randint(0, 50, (4, 9))
    for t in range(3):
        for m in (model, ref):
            m.zero_grad()
            _loss(m, x).backward()
        expected = {n: p.detach() - 0.02 * 0.5 ** t * 0.5 * swan_update(p.grad)[0]
                    for n, p in ref.named_parameters() if n in swan_names}
        opt.step()
        adamw.step()
        sched.step()
        ref_sched.step()
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if n in swan_names:
                    p.copy_(expected[n])
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=1e-6), (t, n)
    assert sorted((g["use_swan"], g["lr"]) for g in opt.param_groups) == [(False, 0.003 / 8), (True, 0.02 / 8)]
    for bad, err in ((float("nan"), ValueError), (-1.0, ValueError), ("0.1", TypeError)):
        with pytest.raises(err, match="fallback_lr"):
            SWAN(Toy(), lr=0.02, fallback_lr=bad, verbose=False)
    assert SWAN(Toy(), verbose=False).param_groups[1]["lr"] == SWAN(Toy(), verbose=False).param_groups[0]["lr"]


@pytest.mark.parametrize("fallback", ["sign", "sgd"])
def test_stateless_fallbacks_keep_zero_state(fallback):
    model = Toy()
    opt = SWAN(model, lr=0.01, fallback=fallback, verbose=False)
    emb = model.tok_embeddings.weight
    before = emb.detach().clone()
    _loss(model, torch.randint(0, 50, (4, 9))).backward()
    g = emb.grad.clone()
    opt.step()
    step = g.sign() if fallback == "sign" else g
    assert torch.allclose(emb.detach(), before - 0.01 * step)
    assert all(st == {} for st in opt.state_dict()["state"].values())


def test_state_dict_holds_no_swan_state_and_round_trips():
    torch.manual_seed(0)
    model = Toy()
    opt = SWAN(model, verbose=False)
    x = torch.randint(0, 50, (4, 9))

    def train(m, o, n):
        for _ in range(n):
            o.zero_grad()
            _loss(m, x).backward()
            o.step()

    train(model, opt, 2)
    sd = opt.state_dict()
    swan_ids = {i for g in sd["param_groups"] if g["use_swan"] for i in g["params"]}
    assert swan_ids and all(sd["state"][i] == {} for i in swan_ids)  # an entry, holding nothing
    assert {i for i, st in sd["state"].items() if st} == {i for g in sd["param_groups"] if not g["use_swan"] for i in g["params"]}
    model2 = copy.deepcopy(model)
    opt2 = SWAN(model2, verbose=False)
    opt2.load_state_dict(copy.deepcopy(sd))
    train(model, opt, 2)
    train(model2, opt2, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_torch_optimizer_conventions():
    model = Toy()
    opt = SWAN(model, lr=0.01, verbose=False)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    x = torch.randint(0, 50, (4, 9))

    def closure():
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and calls == ["pre", "post"]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    twin_model = copy.deepcopy(model)
    clone = copy.deepcopy({"m": model, "o": opt})  # params and optimizer copied together
    assert clone["o"].state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert clone["o"].summary() == opt.summary() and clone["o"].mode == opt.mode
    for m, o in ((model, opt), (clone["m"], clone["o"])):
        o.zero_grad()
        _loss(m, x).backward()
        o.step()
    for a, b in zip(model.parameters(), clone["m"].parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(twin_model.layers[0].up.weight, model.layers[0].up.weight)
    group = object()  # stands for a data-parallel ProcessGroup (not touched without torch.distributed)
    opt.process_group = group
    opt.load_state_dict(opt.state_dict())  # torch calls __setstate__ here: the group must survive
    assert opt.process_group is group and copy.deepcopy(opt).process_group is None
    opt.process_group = None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.005, 0.005]
    w = model.layers[0].up.weight
    before = w.detach().clone()
    opt.step(closure)
    sched.step()
    delta = (w.detach() - before).norm()  # SWAN update norm is sqrt(mn): step = lr * alpha * sqrt(mn)
    assert math.isclose(delta.item(), 0.005 * 0.05 * math.sqrt(w.numel()), rel_tol=1e-4)


def test_dcp_init_with_zero_grads_and_lr_zero_writes_no_nan():
    """torch.distributed.checkpoint's get_state_dict steps once with zero grads and lr 0."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = Toy()
    opt = SWAN(model, verbose=False)
    before = [p.detach().clone() for p in model.parameters()]
    _, osd = get_state_dict(model, opt)
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b)
    assert "state" in osd and all(g["lr"] == 0.02 for g in opt.param_groups)


def test_nonfinite_skip_and_raise():
    model = Toy()
    x = torch.randint(0, 50, (4, 9))
    opt = SWAN(model, lr=0.01, verbose=False)
    _loss(model, x).backward()
    opt.step()  # creates AdamW state
    emb_state = copy.deepcopy(opt.state[model.tok_embeddings.weight])
    opt.zero_grad()
    _loss(model, x).backward()
    model.layers[0].up.weight.grad[0, 0] = float("nan")
    model.tok_embeddings.weight.grad[1, 1] = float("inf")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.warns(RuntimeWarning, match="layers.0.up.weight"):
        opt.step()
    assert torch.equal(model.layers[0].up.weight, frozen["layers.0.up.weight"])
    assert torch.equal(model.tok_embeddings.weight, frozen["tok_embeddings.weight"])
    assert torch.equal(opt.state[model.tok_embeddings.weight]["exp_avg"], emb_state["exp_avg"])
    assert not torch.equal(model.layers[1].up.weight, frozen["layers.1.up.weight"])
    assert opt.nonfinite_skips["layers.0.up.weight"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())

    opt = SWAN(model, lr=0.01, nonfinite="raise", verbose=False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(FloatingPointError, match="tok_embeddings.weight"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, frozen[n]), n


def test_zero_and_empty_and_bf16_parameters():
    w = nn.Parameter(torch.randn(8, 4))
    e = nn.Parameter(torch.empty(0, 4))
    b = nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = SWAN([("w", w), ("e", e), ("b", b)], lr=0.1, verbose=False)
    w.grad, e.grad, b.grad = torch.zeros(8, 4), torch.empty(0, 4), torch.randn(8, 4, dtype=torch.bfloat16)
    before = w.detach().clone(), b.detach().clone()
    opt.step()
    assert torch.equal(w, before[0]) and e.shape == (0, 4)
    assert b.dtype == torch.bfloat16 and not torch.equal(b, before[1]) and torch.isfinite(b).all()


def test_presets_load_and_configure():
    assert set(swan_dist.list_presets()) >= {"swan_0", "swan_dagger", "swan_ddagger"}
    p = swan_dist.load_preset("SWAN‡")
    assert p["name"] == "swan_ddagger" and p["optimizer"]["whitening"] == "nsds"
    model = Toy()
    cases = {"swan_0": ("ns", 10, 0.8, 1.0, 0.001), "swan_dagger": ("ns", 10, 0.8, 0.05, 0.02), "swan_ddagger": ("nsds", 2, 0.4, 0.05, 0.02)}
    for name, (method, steps, beta, alpha, lr) in cases.items():
        g = SWAN(model, preset=name, verbose=False).param_groups[0]
        assert (g["whitening"], g["ns_steps"], g["beta"], g["alpha"], g["lr"]) == (method, steps, beta, alpha, lr)
    g = SWAN(model, preset="swan_0", lr=0.5, ns_steps=3, verbose=False).param_groups[0]
    assert (g["lr"], g["ns_steps"], g["whitening"]) == (0.5, 3, "ns")
    with pytest.raises(ValueError, match="unknown SWAN preset 'swan_3'.*swan_ddagger"):
        SWAN(model, preset="swan_3")
    with pytest.raises(TypeError):
        SWAN(model, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="fallback"):
        SWAN(model, fallback="lion")
    with pytest.raises(ValueError, match="lr is required"):
        SWAN(model, preset=None)


def test_preset_file_with_unknown_key_is_named(tmp_path):
    bad = tmp_path / "mine.yaml"
    bad.write_text("optimizer:\n  lr: 0.1\n  ns_stepz: 3\n")
    with pytest.raises(ValueError, match="ns_stepz"):
        swan_dist.load_preset(str(bad))


def _permutation_task(seed=0):
    """Sequences that follow a fixed random permutation of the vocabulary: x[t+1] = perm[x[t]]."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(50, generator=g)
    seqs = [torch.randint(0, 50, (256,), generator=g)]
    for _ in range(11):
        seqs.append(perm[seqs[-1]])
    return torch.stack(seqs, dim=1)


@pytest.mark.parametrize("preset", ["swan_0", "swan_dagger", "swan_ddagger"])
def test_short_run_loss_falls_with_each_preset(preset):
    """The loss falls with each preset, and the whitened matrices carry it: the same run with alpha=0
    (SWAN's matrices never move, only the fallback's embedding and head train) ends clearly higher."""

    def run(**kw):
        torch.manual_seed(0)
        model = Toy(dim=32)
        opt = SWAN(model, preset=preset, lr=0.01 if preset == "swan_0" else None, verbose=False, **kw)
        data = _permutation_task()
        losses = []
        for step in range(60):
            batch = data[(step * 32) % 256 :][:32]
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    losses, frozen = run(), run(alpha=0.0)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses[::10]
    assert sum(losses[-5:]) < 0.1 * sum(frozen[-5:]), (losses[-5:], frozen[-5:])


def test_state_bytes_count_the_fallback_moments_only():
    """swan_dist.memory.state_bytes: AdamW holds 2 fp32 moments (+ a 4-byte step) per tensor; SWAN‡
    holds them for the fallback tensors only, none with a stateless fallback; no wrapper, no masters."""
    from swan_dist.memory import state_bytes

    x = torch.randint(0, 50, (4, 9))
    sizes = {}
    for name, make in {
        "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        "swan": lambda m: SWAN(m, verbose=False),
        "swan_sign": lambda m: SWAN(m, fallback="sign", verbose=False),
    }.items():
        model = Toy()
        opt = make(model)
        _loss(model, x).backward()
        opt.step()
        sizes[name] = state_bytes(opt)
        fallback = [p for n, p in model.named_parameters() if _rules(opt).get(n, "fallback") != "SWAN"] \
            if isinstance(opt, SWAN) else list(model.parameters())
        if name != "swan_sign":
            assert sizes[name]["optimizer_state"] == sum(8 * p.numel() + 4 for p in fallback), name
    assert sizes["swan_sign"] == {"optimizer_state": 0, "master_weights": 0}
    assert sizes["adamw"]["master_weights"] == 0
    assert sizes["swan"]["optimizer_state"] < sizes["adamw"]["optimizer_state"]


@pytest.mark.parametrize("per", [1, 2, 5])
def test_local_stacks_cut_at_the_cpu_batch_bound_give_the_same_step(monkeypatch, per):
    """The CPU whitens same-shape matrices in stacks of at most _CPU_BATCH_BYTES: a stack cut into
    chunks (with a remainder) gives each matrix exactly its own single-matrix update."""
    import swan_dist.whitening as so

    monkeypatch.setattr(so, "_CPU_BATCH_BYTES", per * 4 * 12 * 10)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(10, 12, bias=False) for _ in range(5)))
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = SWAN(model, lr=0.1, alpha=1.0, verbose=False)
    assert {r for _, _, r, _ in opt._rows} == {"SWAN"}
    opt.step()
    assert opt.whitened_matrices == 5
    for p, p0 in zip(model.parameters(), before):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * swan_update(p.grad)[0], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- the lr convention (swan_dist.from_adamw)
def _lrs(opt):
    """(matrices' lr, lr x alpha; the fallback's lr) of a SWAN's first SWAN and first fallback group."""
    swan = next(g for g in opt.param_groups if g["use_swan"])
    rest = next(g for g in opt.param_groups if not g["use_swan"])
    return swan["lr"] * swan["alpha"], rest["lr"]


def test_from_adamw_gives_the_lr_convention():
    """Matrices at lr x alpha = 0.2 eta, the fallback at 4 eta (tied to lr at alpha 0.05), weight decay 5x AdamW's
    (the matrices then decay by AdamW's factor 1 - eta lambda per step), betas and eps as given."""
    eta = 3e-4
    got = swan_dist.from_adamw(eta, betas=[0.9, 0.95], weight_decay=0.1, eps=1e-10)
    assert got.keys() == {"preset", "lr", "betas", "eps", "weight_decay"} and got["preset"] == "swan_ddagger"
    assert got["lr"] == pytest.approx(4 * eta) and got["betas"] == (0.9, 0.95) and got["eps"] == 1e-10
    assert got["lr"] * 0.05 * got["weight_decay"] == pytest.approx(eta * 0.1)
    assert swan_dist.from_adamw(eta, preset="swan_dagger")["lr"] == pytest.approx(4 * eta)
    zero = swan_dist.from_adamw(eta, preset="swan_0")  # alpha 1: the fallback set apart
    assert zero["lr"] == pytest.approx(0.2 * eta) and zero["fallback_lr"] == pytest.approx(4 * eta)
    assert swan_dist.from_adamw(eta) == {"preset": "swan_ddagger", "lr": pytest.approx(4 * eta), "betas": (0.9, 0.999),
                                         "eps": 1e-8, "weight_decay": pytest.approx(0.05)}  # torch's AdamW defaults
    for bad, err in ((0.0, ValueError), (float("inf"), ValueError), ("3e-4", TypeError)):
        with pytest.raises(err, match="adamw_lr"):
            swan_dist.from_adamw(bad)


def test_adamw_lr_resolves_like_from_adamw_and_conflicts_name_both_keys():
    eta, wd = 3e-4, 0.1
    for preset in ("swan_ddagger", "swan_0"):
        a = SWAN(Toy(), adamw_lr=eta, weight_decay=wd, preset=preset, verbose=False)
        b = SWAN(Toy(), verbose=False, **swan_dist.from_adamw(eta, weight_decay=wd, preset=preset))
        assert _lrs(a) == pytest.approx((0.2 * eta, 4 * eta)) and _lrs(b) == pytest.approx(_lrs(a)), preset
        assert all(g["weight_decay"] == pytest.approx(5 * wd) for g in a.param_groups + b.param_groups)
    for key in ("lr", "fallback_lr"):
        with pytest.raises(ValueError, match=f"adamw_lr=0.0003 and {key}=0.01"):
            SWAN(Toy(), adamw_lr=eta, verbose=False, **{key: 0.01})
    with pytest.raises(ValueError, match="adamw_lr='auto'.*Trainer.*learning_rate"):
        SWAN(Toy(), adamw_lr="auto", verbose=False)


def test_adamw_lr_alone_takes_torchs_adamw_defaults_and_groups_keep_their_decay():
    """``SWAN(model, adamw_lr=eta)`` with no betas, eps or weight decay takes torch's AdamW's ((0.9, 0.999), 1e-8,
    0.01 converted to 0.05), not the preset's (weight decay 0); a no-decay group stays at 0."""
    adamw = torch.optim.AdamW([nn.Parameter(torch.zeros(1))])
    torch_defaults = {k: adamw.defaults[k] for k in ("betas", "eps", "weight_decay")}
    for preset in ("swan_ddagger", "swan_0"):
        opt = SWAN(Toy(), adamw_lr=3e-4, preset=preset, verbose=False)
        for g in opt.param_groups:
            assert g["betas"] == torch_defaults["betas"] and g["eps"] == torch_defaults["eps"], preset
            assert g["weight_decay"] == pytest.approx(5 * torch_defaults["weight_decay"]), preset
    model = Toy()
    named = list(model.named_parameters())
    opt = SWAN([{"params": [p for _, p in named if p.ndim == 2]}, {"params": [p for _, p in named if p.ndim < 2],
                "weight_decay": 0.0}], adamw_lr=3e-4, betas=(0.9, 0.95), model=model, verbose=False)
    assert sorted(round(g["weight_decay"], 9) for g in opt.param_groups) == [0.0, 0.05, 0.05]
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)


def test_an_adamw_sized_lr_warns_once_naming_the_fix():
    """lr x alpha below 2e-5 (an AdamW lr given as SWAN's) warns once, at construction, naming adamw_lr=; the
    preset's lr, adamw_lr=, lr 0 and SWAN-0's lr (alpha 1) do not."""
    import warnings

    with pytest.warns(UserWarning, match=r"adamw_lr=0\.0003.*from_adamw\(0\.0003\).*lr 0\.0012") as caught:
        opt = SWAN(Toy(), lr=3e-4, verbose=False)
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
        opt.step()
    assert len([w for w in caught if "lr convention" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SWAN(Toy(), verbose=False)
        SWAN(Toy(), lr=4e-4, verbose=False)
        SWAN(Toy(), adamw_lr=5e-5, verbose=False)
        SWAN(Toy(), lr=0.0, verbose=False)
        SWAN(Toy(), lr=3e-4, preset="swan_0", verbose=False)


def test_last_step_records_the_step_for_a_logger(monkeypatch):
    """``opt.last_step``: the step count, the matrices whitened, the names skipped for NaN/Inf and the
    matrices' update RMS (lr x alpha as the step used it, a scheduler's change included) and the fallback
    lr, from host values: step() reads nothing for it; where the step's counts have not landed (an
    accelerator's copy in flight, simulated) reading the record waits for them, and only then reads."""
    from swan_dist.host_reads import HostReads

    import swan_dist.engine

    torch.manual_seed(0)
    model = Toy()
    opt = SWAN(model, lr=0.1, weight_decay=0.0, verbose=False)  # swan_ddagger: alpha 0.05
    assert opt.last_step is None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    x = torch.randint(0, 50, (4, 9))
    up = model.layers[0].up.weight
    for t in range(3):
        opt.zero_grad()
        _loss(model, x).backward()
        before = up.detach().clone()
        with HostReads() as reads:
            opt.step()
        assert reads.n_ours == 0, (t, reads.ours)
        sched.step()  # after the step: the record keeps the lr the step used
        with HostReads() as reads:
            rec = opt.last_step
        assert reads.n_ours == 0, reads.ours  # one process on the CPU: the counts landed with the step
        lr = 0.1 * 0.5 ** t
        assert isinstance(rec, swan_dist.StepRecord) and rec.step == t + 1 and rec.whitened == 4
        assert rec.skipped == rec.nonfinite == () and rec.fallback_lr == (pytest.approx(lr),)
        assert rec.update_rms == pytest.approx(lr * 0.05, rel=1e-12)
        rms = (up.detach() - before).pow(2).mean().sqrt().item()
        assert rms == pytest.approx(rec.update_rms, rel=1e-2), (t, rms, rec.update_rms)
        assert opt.last_step is rec and set(rec._asdict()) == {
            "step", "whitened", "skipped", "nonfinite", "update_rms", "fallback_lr"}

    # a NaN gradient, its counts still on their way when step() returns: step() reads nothing, the record does
    monkeypatch.setattr(swan_dist.engine.Report, "ready", lambda self: False)
    opt.zero_grad()
    _loss(model, x).backward()
    up.grad[0, 0] = float("nan")
    with HostReads() as reads:
        opt.step()
    assert reads.n_ours == 0, reads.ours
    assert opt.nonfinite_skips["layers.0.up.weight"] == 0  # not known yet
    with pytest.warns(RuntimeWarning, match="layers.0.up.weight"), HostReads() as reads:
        rec = opt.last_step
    assert reads.n_ours >= 1  # the names, read when asked
    # decided on the device: the skipped matrix was whitened (work done, counted) and not applied
    assert rec.step == 4 and rec.skipped == ("layers.0.up.weight",) and rec.whitened == 4
    assert opt.nonfinite_skips["layers.0.up.weight"] == 1
    assert copy.deepcopy(opt)._book.steps == 4  # the count survives a copy (the record is not state)

    # several SWAN groups: their lr x alpha weighted by their matrices
    two = SWAN([{"params": [("a", nn.Parameter(torch.randn(4, 4)))], "lr": 0.2},
                {"params": [("b", nn.Parameter(torch.randn(4, 4))), ("c", nn.Parameter(torch.randn(4, 4)))]},
                {"params": [("v", nn.Parameter(torch.randn(4)))], "lr": 0.3}],
               lr=0.1, alpha=0.5, preset=None, verbose=False)
    for g in two.param_groups:
        for p in g["params"]:
            p.grad = torch.randn_like(p)
    two.step()
    rec = two.last_step
    assert rec.whitened == 3 and rec.update_rms == pytest.approx((0.2 * 0.5 + 2 * 0.1 * 0.5) / 3)
    assert rec.fallback_lr == (0.3,)


def _port_groups(model):
    """The usual AdamW port: decay / no-decay groups of bare parameters."""
    decay = [p for _, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def test_adamw_port_groups_named_by_model_or_the_warning_names_model():
    """Decay / no-decay groups of bare tensors with ``model=``: named by identity against the model, the
    embedding and the head on the fallback rule, each group's options kept, no warning. Without it the
    warning (strict=True: the error) names ``model=``; tensors outside the model given are named as such."""
    import warnings

    model = Toy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = SWAN(_port_groups(model), lr=0.02, model=model, verbose=False)
    rules = _rules(opt)
    assert rules["tok_embeddings.weight"] == rules["output.weight"] == "fallback:adamw"
    assert rules["layers.0.up.weight"] == rules["layers.1.down.weight"] == "SWAN"
    assert rules["layers.0.norm.weight"] == "fallback:adamw"
    assert "4 matrices whitened by SWAN" in opt.summary() and "name unknown" not in opt.summary()
    swan = [g for g in opt.param_groups if g["use_swan"] and g["params"]]
    assert len(swan) == 1 and swan[0]["weight_decay"] == 0.1
    assert sorted(g["weight_decay"] for g in opt.param_groups if not g["use_swan"]) == [0.0, 0.1]
    head = opt.param_groups[1]  # the decay group's fallback part: embedding and head
    assert {id(p) for p in head["params"]} == {id(model.tok_embeddings.weight), id(model.output.weight)}

    fresh = Toy()
    with pytest.warns(UserWarning, match=r"without names.*model=.*strict=True makes this an error"):
        unnamed = SWAN(_port_groups(fresh), lr=0.02, verbose=False)
    assert _rules(unnamed)["<unnamed 0>"] == "SWAN"  # the embedding, whitened: what the warning is about
    with pytest.raises(ValueError, match=r"without names.*model=.*\(strict=True\)"):
        SWAN(_port_groups(Toy()), lr=0.02, verbose=False, strict=True)
    with pytest.warns(UserWarning, match=r"not parameters of the model given as model="):
        SWAN(_port_groups(Toy()), lr=0.02, model=Toy(), verbose=False)
    with pytest.raises(ValueError, match="two models"):
        SWAN(model, lr=0.02, model=Toy(), verbose=False)
    with pytest.raises(TypeError, match="model= is the nn.Module"):
        SWAN(_port_groups(model), lr=0.02, model="model", verbose=False)
    SWAN(model, lr=0.02, model=model, verbose=False)  # the same module twice: fine
