"""The lean step's caches and batched kernels keep the step's behaviour: pieces reused between steps
follow replaced tensors, new gradients, dtype changes and adapter-registry changes; they hold no
gradient after the step; the configuration/layout hashes follow options and pieces; the finite check
neither misses NaN/±Inf nor flags huge finite gradients; same-shape matrices of groups with different
options, and fallback rules over mixed dtypes, update each tensor as the per-tensor rules do."""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from swan_dist import SWAN, swan_update
from swan_dist.adapter import Adapter, tensor_piece

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.c = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(8)


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}


def _step_fresh(model, grads, **kw):
    """The reference: a new optimizer (nothing cached) for one step; stateless rules only."""
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    SWAN(model, verbose=False, **kw).step()


KW = dict(preset="swan_ddagger", lr=0.05, weight_decay=0.1, fallback="sgd")


def test_reused_pieces_follow_new_gradients_replaced_tensors_and_dtypes():
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt = SWAN(model, verbose=False, **KW)
    for t in range(3):  # a new gradient tensor each step, then the same tensors refilled in place
        grads = _grads(model, t)
        for n, p in model.named_parameters():
            if t < 2:
                p.grad = grads[n].clone()
            else:
                p.grad.copy_(grads[n])
        opt.step()
        _step_fresh(ref, grads, **KW)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (t, n)
    assert len(opt._collector.reuse) == len(list(model.parameters()))  # every piece was kept

    # a parameter's storage replaced (p.data = ...), another's dtype changed: pieces made again
    old = model.a.weight.detach()
    new = torch.randn(8, 8)
    model.a.weight.data = new.clone()
    ref.a.weight.data = new.clone()
    model.b.weight.data = model.b.weight.data.double()
    ref.b.weight.data = ref.b.weight.data.double()
    before_old = old.clone()
    grads = _grads(model, 7)
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    _step_fresh(ref, grads, **KW)
    assert torch.equal(old, before_old)  # the old storage is not written
    assert model.b.weight.dtype == torch.float64
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n

    # a group's tensor replaced by another of the same shape: the new one is stepped from then on
    swan_group = next(g for g in opt.param_groups if g["use_swan"])
    i = next(k for k, p in enumerate(swan_group["params"]) if p is model.a.weight)
    replacement = nn.Parameter(model.a.weight.detach().clone())
    swan_group["params"][i] = replacement
    replacement.grad = torch.randn(8, 8)
    before = replacement.detach().clone()
    expected = before * (1 - 0.05 * 0.05 * 0.1) - 0.05 * 0.05 * swan_update(replacement.grad)[0]
    opt.step()
    assert torch.allclose(replacement, expected, atol=1e-6)


def test_options_changed_between_steps_take_effect():
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt = SWAN(model, verbose=False, **KW)
    grads = _grads(model, 0)
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    _step_fresh(ref, grads, **KW)
    for g in opt.param_groups:
        g.update(lr=0.02, weight_decay=0.3, fallback="sign", beta=0.5)
    grads = _grads(model, 1)
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    _step_fresh(ref, grads, **{**KW, "lr": 0.02, "weight_decay": 0.3, "fallback": "sign", "beta": 0.5})
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n


def test_kept_pieces_hold_no_gradient_after_the_step():
    model = Net()
    opt = SWAN(model, verbose=False, **KW)
    refs = []
    for p in model.parameters():
        p.grad = torch.randn_like(p)
        refs.append(weakref.ref(p.grad))
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(r() is None for r in refs)
    assert all(hit.piece.grad is None and hit.piece.target_grad is None for hit in opt._collector.reuse.values())


class _HalfAdapter(Adapter):
    """Claims every tensor and says this rank holds its first half only (W=1: local mode refuses)."""

    name = "half"

    def claims(self, tensor):
        return True

    def pieces(self, tensor, name, rules):
        half = tensor.detach().reshape(-1)[: tensor.numel() // 2]
        g = None if tensor.grad is None else tensor.grad.reshape(-1)[: tensor.numel() // 2]
        return [tensor_piece(name, tensor, shape=tuple(tensor.shape), local=half, grad=g)]


def test_a_changed_adapter_registry_is_asked_again():
    import swan_dist.integrations as integrations

    model = Net()
    opt = SWAN(model, verbose=False, **KW)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    saved = integrations.ADAPTERS
    integrations.ADAPTERS = (_HalfAdapter(), *saved)
    try:
        with pytest.raises(ValueError, match="sharded"):
            opt.step()
    finally:
        integrations.ADAPTERS = saved
    opt.step()


def test_structure_and_layout_hashes_follow_options_and_pieces_not_scalars():
    """The cached hashes equal fresh ones; a structure option (beta) changes the structure hash, a
    scalar (lr) does not; a new piece object recomputes both (same values, same hashes)."""
    from swan_dist.agreement import Hashes

    model = Net()
    opt = SWAN(model, verbose=False, **KW)
    for p in model.parameters():
        p.grad = torch.randn_like(p)

    kept = Hashes()

    def hashes():
        entries, failure = opt.collect_entries()
        assert failure is None
        records, pieces = [e.record for e in entries], [e.piece for e in entries]
        got = kept.structure(records, ("auto", 1.0)), kept.layout(pieces)
        fresh = Hashes()
        assert got == (fresh.structure(records, ("auto", 1.0)), fresh.layout(pieces))
        for e in entries:
            e.piece.grad = e.piece.target_grad = None
        return got

    first = hashes()
    assert hashes() == first
    swan_group = next(g for g in opt.param_groups if g["use_swan"])
    swan_group["lr"] = 0.5  # a scheduler's change: no new record, no new hash
    assert hashes() == first
    swan_group["beta"] = 0.5
    changed = hashes()
    assert changed[0] != first[0] and changed[1] == first[1]
    model.a.weight.data = torch.randn(8, 8)  # a new piece object: recomputed (same values)
    assert hashes() == changed


def test_finite_check_flags_nan_and_infinities_not_huge_values():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(16, 8))
    v = nn.Parameter(torch.randn(16, 8))
    b = nn.Parameter(torch.randn(16))
    h = nn.Parameter(torch.randn(16, 8, dtype=torch.float16))
    opt = SWAN([("w", w), ("v", v), ("b", b), ("h", h)], preset="swan_ddagger", lr=0.05, fallback="sign",
               verbose=False)
    # finite but beyond what a 2-norm of fp32 (fp16: 65504) holds: stepped, no warning
    w.grad, v.grad, b.grad = torch.full((16, 8), 3e30), torch.randn(16, 8) * 1e30, torch.full((16,), 1e-30)
    h.grad = torch.full((16, 8), 6e4, dtype=torch.float16)
    before = [p.detach().clone() for p in (w, v, b, h)]
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip((w, v, b, h), before))
    assert not opt.nonfinite_skips
    for bad in (float("nan"), float("inf"), -float("inf")):
        for p in (w, b, h):
            p.grad = torch.randn_like(p)
        v.grad = torch.randn(16, 8)
        w.grad[3, 2] = bad
        b.grad[5] = bad
        h.grad[0, 0] = bad
        before = [p.detach().clone() for p in (w, v, b, h)]
        with pytest.warns(RuntimeWarning, match="non-finite"):
            opt.step()
        assert torch.equal(w, before[0]) and torch.equal(b, before[2]) and torch.equal(h, before[3]), bad
        assert not torch.equal(v, before[1])
    assert opt.nonfinite_skips == {"w": 3, "b": 3, "h": 3}


@pytest.mark.parametrize("fallback", ["adamw", "sign", "sgd"])
def test_batched_updates_match_per_tensor_rules_across_groups_and_dtypes(fallback):
    """Same-shape matrices in groups of different options share a stack; fallback tensors of several
    dtypes share a group: each tensor gets exactly what its own rule gives."""
    torch.manual_seed(0)
    mats = [nn.Parameter(torch.randn(8, 8)) for _ in range(4)] + [nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))]
    vecs = [nn.Parameter(torch.randn(5, dtype=dt)) for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float32)]
    groups = [
        dict(params=[(f"m{i}", p) for i, p in enumerate(mats[:3])] + [(f"v{i}", p) for i, p in enumerate(vecs[:2])]),
        dict(params=[("m3", mats[3]), ("m4", mats[4])] + [(f"v{i}", p) for i, p in enumerate(vecs[2:], 2)],
             lr=0.03, weight_decay=0.2, alpha=0.5),
    ]
    opt = SWAN(groups, preset="swan_ddagger", lr=0.05, weight_decay=0.1, fallback=fallback, verbose=False)
    refs = [copy.deepcopy(p.detach()) for p in mats + vecs]
    copies = [nn.Parameter(r.clone()) for r in refs[5:]]
    adam = torch.optim.AdamW([dict(params=copies[:2]), dict(params=copies[2:], lr=0.03, weight_decay=0.2)], lr=0.05,
                             weight_decay=0.1, foreach=False)
    for step in range(3):
        grads = [torch.randn_like(p) for p in mats + vecs]
        for p, g in zip(mats + vecs, grads):
            p.grad = g.clone()
        opt.step()
        for k in range(5):  # matrices: p ← p·(1 − lr·α·wd) − lr·α·ΔW, in the parameter's dtype
            lr, wd = (0.05 * 0.05, 0.1) if k < 3 else (0.03 * 0.5, 0.2)
            refs[k] = refs[k].clone().mul_(1 - lr * wd).add_(swan_update(grads[k])[0].to(refs[k].dtype), alpha=-lr)
            tol = dict(rtol=2**-7, atol=1e-3) if k == 4 else dict(atol=1e-6)  # bf16: one ulp
            assert mats[k].dtype == refs[k].dtype and torch.allclose(mats[k], refs[k], **tol), (step, k)
            refs[k] = mats[k].detach().clone()  # (no drift of the reference over steps)
        if fallback == "adamw":
            for q, g in zip(copies, grads[5:]):
                q.grad = g.clone()
            adam.step()
            expect = [q.detach() for q in copies]
        else:
            expect = []
            for j, (r, g) in enumerate(zip(refs[5:], grads[5:])):
                lr, wd = (0.05, 0.1) if j < 2 else (0.03, 0.2)
                expect.append(r.clone().mul_(1 - lr * wd).add_(g.sign() if fallback == "sign" else g, alpha=-lr))
            refs[5:] = expect
        for j, (v, e) in enumerate(zip(vecs, expect)):
            assert v.dtype == e.dtype
            tol = dict(rtol=2**-7, atol=1e-3) if v.dtype == torch.bfloat16 else dict(atol=1e-6)
            assert torch.allclose(v, e, **tol), (step, j)
            if fallback == "adamw":  # (no drift of the reference over steps)
                copies[j].data.copy_(v.detach())
            else:
                refs[5 + j] = v.detach().clone()
