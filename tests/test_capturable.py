"""SWAN(..., capturable=True): each group's lr, alpha, weight decay, eps and betas 0-d tensors on its parameters' device,
lr filled in place by an lr scheduler, the others by the caller; the step equal to the ordinary one, reading nothing on the host and sending nothing from it
(no tensor built from host values in a steady step: what a CUDA graph cannot hold); checkpoints between
the two kinds; torch.compile(opt.step) without a recompile per lr change; and, where CUDA is present, a
captured step replayed equal to eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from swan_dist import SWAN
from swan_dist.host_reads import HostReads
from swan_dist.reference.model import Llama, model_config


def _model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    cfg = model_config("tiny", dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16)
    return Llama(cfg).to(device=device, dtype=dtype)


def _batch(t, device="cpu"):
    torch.manual_seed(100 + t)
    return torch.randint(0, 64, (2, 16), device=device)


def _train(model, opt, steps, hook=None):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    for t in range(steps):
        opt.zero_grad()
        model(_batch(t)).float().logsumexp(-1).mean().backward()
        if hook is not None and t >= 2:
            with hook():
                opt.step()
                sched.step()
        else:
            opt.step()
            sched.step()


class _HostValues:
    """Counts tensors made from host values (torch.tensor / as_tensor, a pinned copy): each is a copy
    from the host a CUDA graph cannot replay with new values."""

    def __enter__(self):
        self.n, self._saved = 0, (torch.tensor, torch.as_tensor, torch.Tensor.pin_memory)

        def counted(f):
            def wrapped(*a, **k):
                self.n += 1
                return f(*a, **k)
            return wrapped
        torch.tensor, torch.as_tensor = counted(torch.tensor), counted(torch.as_tensor)
        torch.Tensor.pin_memory = counted(torch.Tensor.pin_memory)
        return self

    def __exit__(self, *exc):
        torch.tensor, torch.as_tensor, torch.Tensor.pin_memory = self._saved


OPTIONS = [dict(weight_decay=0.1), dict(fallback="sign", weight_decay=0.1), dict(fallback="sgd"),
           dict(fallback_lr=0.003, nonfinite="skip_step"), dict(step_in_backward=True, weight_decay=0.1)]


@pytest.mark.parametrize("options", OPTIONS, ids=["adamw", "sign", "sgd", "fallback_lr", "in_backward"])
def test_capturable_equals_the_ordinary_step(options):
    ref, cap = _model(), _model()
    o_ref = SWAN(ref, lr=0.01, verbose=False, **options)
    o_cap = SWAN(cap, lr=0.01, verbose=False, capturable=True, **options)
    lrs = [g["lr"] for g in o_cap.param_groups]
    for key in ("lr", "alpha", "weight_decay", "eps", "betas"):
        held = [x for g in o_cap.param_groups for x in (g[key] if key == "betas" else (g[key],))]
        assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in held), key
    reads, made = [], []

    def counted():
        class Both:
            def __enter__(self):
                self.r, self.m = HostReads().__enter__(), _HostValues().__enter__()

            def __exit__(self, *exc):
                self.m.__exit__(*exc)
                self.r.__exit__(*exc)
                reads.append(self.r.n_ours)
                made.append(self.m.n)
        return Both()

    _train(ref, o_ref, 6)
    _train(cap, o_cap, 6, hook=counted)
    assert reads == [0] * 4 and made == [0] * 4  # steady steps: nothing read, nothing sent from the host
    assert [g["lr"] for g in o_cap.param_groups] == lrs  # the scheduler filled the same tensors
    for g, r in zip(o_cap.param_groups, o_ref.param_groups):
        assert g["lr"].item() == pytest.approx(r["lr"], rel=1e-6)
    for (n, a), b in zip(ref.named_parameters(), cap.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")
    assert o_cap.last_step.update_rms == pytest.approx(o_ref.last_step.update_rms, rel=1e-6)


def _schedule(g: dict, t: int) -> None:
    """Step ``t``'s weight decay, alpha, betas and eps: filled in place where a group holds tensors
    (``capturable=True``), written as numbers otherwise (the fp32 values the tensors hold: a beta of 0.9
    and its fp32 0.89999998 part by 2e-7 in ``1 - beta``, which five steps of this model amplify)."""
    fp32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    values = {"weight_decay": fp32(0.1 * (t + 1)), "alpha": fp32(0.05 + 0.01 * t), "eps": fp32(10.0 ** -(6 + t))}
    betas = (fp32(0.9 - 0.02 * t), fp32(0.999 - 0.01 * t))
    if isinstance(g["weight_decay"], torch.Tensor):
        for key, value in values.items():
            g[key].fill_(value)
        for b, value in zip(g["betas"], betas):
            b.fill_(value)
    else:
        g.update(values, betas=betas)


@pytest.mark.parametrize("fallback", ["adamw", "sign"])
def test_options_filled_in_place_equal_numbers_written(fallback):
    """A weight-decay, alpha, betas and eps schedule: written as numbers into the ordinary optimizer's
    groups, filled in place into the capturable one's tensors; the weights agree, the steady steps read
    nothing on the host and send nothing from it. A fallback parameter whose gradient is NaN
    (``nonfinite="skip"``) keeps its value bit for bit, and its moments, masked on the device."""
    ref, cap = _model(), _model()
    # (whitening in fp32: the capturable AdamW's rounding, once in bf16, would part the two runs more)
    kw = dict(lr=0.01, verbose=False, weight_decay=0.1, fallback=fallback, whiten_dtype="float32")
    o_ref, o_cap = SWAN(ref, **kw), SWAN(cap, capturable=True, **kw)
    held = [(g["alpha"], g["weight_decay"], g["eps"], *g["betas"]) for g in o_cap.param_groups]
    norm = dict(cap.named_parameters())["norm.weight"]
    reads = []
    for t in range(5):
        for m, o in ((ref, o_ref), (cap, o_cap)):
            o.zero_grad()
            m(_batch(t)).logsumexp(-1).mean().backward()
            for g in o.param_groups:
                _schedule(g, t)
        if t == 4:
            dict(ref.named_parameters())["norm.weight"].grad[0] = float("nan")
            norm.grad[0] = float("nan")
            before = norm.detach().clone()
            moments = [x.clone() for x in o_cap.state[norm].values()]
        with HostReads() as r, _HostValues() as made:
            o_cap.step()
        reads.append((r.n_ours, made.n, dict(r.ours)))
        o_ref.step()
    assert [x[:2] for x in reads[2:4]] == [(0, 0)] * 2, reads  # steady steps; then the NaN step, whose
    assert reads[4][1] == 0 and all(k.startswith("swan_dist/engine.py") for k in reads[4][2]), reads  # names read
    assert [(g["alpha"], g["weight_decay"], g["eps"], *g["betas"]) for g in o_cap.param_groups] == held  # the same tensors
    assert torch.equal(norm.detach(), before)
    assert all(torch.equal(a, b) for a, b in zip(o_cap.state[norm].values(), moments))
    for (n, a), b in zip(ref.named_parameters(), cap.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")


def test_checkpoints_between_capturable_and_not():
    model = _model()
    opt = SWAN(model, lr=0.01, verbose=False, capturable=True)
    _train(model, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    plain = SWAN(copy.deepcopy(model), lr=0.5, verbose=False)
    plain.load_state_dict(saved)
    again = SWAN(copy.deepcopy(model), lr=0.5, verbose=False, capturable=True)
    again.load_state_dict(SWAN(model, lr=0.01, verbose=False).state_dict() | {"state": {}})
    for g, s in zip(plain.param_groups, opt.param_groups):  # numbers again in an ordinary optimizer
        assert isinstance(g["lr"], float) and g["lr"] == pytest.approx(s["lr"].item())
        assert all(isinstance(x, float) for x in (g["alpha"], g["weight_decay"], g["eps"], *g["betas"]))
    lr = again.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dim() == 0 and lr.item() == pytest.approx(0.01)
    assert all(isinstance(g[k], torch.Tensor) for g in again.param_groups for k in ("lr", "alpha", "weight_decay", "eps"))
    assert all(isinstance(b, torch.Tensor) for g in again.param_groups for b in g["betas"])
    again.load_state_dict(saved)
    assert all(isinstance(g["lr"], torch.Tensor) for g in again.param_groups)


def test_capturable_is_a_bool():
    with pytest.raises(TypeError, match="capturable"):
        SWAN(nn.Linear(4, 4), lr=0.01, verbose=False, capturable="yes")


@pytest.mark.parametrize("capturable, backend", [(True, "eager"), (False, "aot_eager")])
def test_compiled_step_equals_eager(capturable, backend):
    """torch.compile(opt.step): with ``capturable=True`` under an lr schedule (the lr a tensor changing every
    step), and the ordinary optimizer at a constant lr (a number: each new value would be compiled anew, as
    for torch's own optimizers) through AOT autograd's functionalization (what inductor runs first; the fused
    AdamW kernel with a per-piece ``found_inf`` failed there, so a traced step takes the foreach AdamW):
    compiled in the first steps, nothing compiled after, the host bookkeeping of collecting the entries not
    compiled (no per-parameter frames), weights equal to the ordinary eager step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref, cap = _model(), _model()
    kw = dict(lr=0.01, verbose=False, whiten_dtype="float32")
    o_ref = SWAN(ref, **kw)
    o_cap = SWAN(cap, **kw, capturable=capturable)
    step = torch.compile(o_cap.step, backend=backend)
    compiled = []
    rule = (lambda t: 1.0 / (1 + t)) if capturable else (lambda t: 1.0)
    sched_ref = torch.optim.lr_scheduler.LambdaLR(o_ref, rule)
    sched_cap = torch.optim.lr_scheduler.LambdaLR(o_cap, rule)
    for t in range(4):
        for m, o, s, f in ((ref, o_ref, sched_ref, o_ref.step), (cap, o_cap, sched_cap, step)):
            o.zero_grad()
            m(_batch(t)).logsumexp(-1).mean().backward()
            f()
            with warnings.catch_warnings():  # a compiled step is not seen by the scheduler's step check
                warnings.simplefilter("ignore", UserWarning)
                s.step()
        compiled.append(counters["stats"]["unique_graphs"])
    assert compiled[1] > 0 and compiled[-1] == compiled[1], compiled  # nothing compiled after step 2
    assert compiled[-1] <= 4, compiled  # (traced, the per-parameter helpers made 26 and more)
    for a, b in zip(ref.parameters(), cap.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
@pytest.mark.parametrize("options", [{}, {"step_in_backward": True}, {"capturable": True}],
                         ids=["ordinary", "in_backward", "capturable"])
def test_steady_steps_never_wait_for_the_gpu(options):
    """torch.cuda.set_sync_debug_mode("error") around the steady steps (optimizer and scheduler): any
    synchronising call (a host read, a pageable copy) raises."""
    model = _model(device="cuda")
    opt = SWAN(model, lr=0.01, verbose=False, weight_decay=0.1, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    for t in range(6):
        opt.zero_grad()
        loss = model(_batch(t, "cuda")).float().logsumexp(-1).mean()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if t >= 2 else 0)
        try:
            loss.backward()  # (with step_in_backward the updates are made here)
            opt.step()
            sched.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(p.isfinite().all() for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
def test_a_captured_step_replays_equal_to_eager():
    """The documented recipe: warm-up steps on a side stream, gradients kept in place
    (zero_grad(set_to_none=False)), the step captured once, replayed with the lr scheduled."""
    ref, cap = _model(device="cuda"), _model(device="cuda")
    o_ref = SWAN(ref, lr=0.01, verbose=False, capturable=True, weight_decay=0.1)
    o_cap = SWAN(cap, lr=0.01, verbose=False, capturable=True, weight_decay=0.1)
    s_ref = torch.optim.lr_scheduler.LambdaLR(o_ref, lambda t: 1.0 / (1 + t))
    s_cap = torch.optim.lr_scheduler.LambdaLR(o_cap, lambda t: 1.0 / (1 + t))

    def grads(m, t):
        m(_batch(t, "cuda")).float().logsumexp(-1).mean().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in range(3):
            for m, o, s in ((ref, o_ref, s_ref), (cap, o_cap, s_cap)):
                o.zero_grad(set_to_none=False)
                grads(m, t)
                o.step()
                s.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    o_cap.zero_grad(set_to_none=False)
    grads(cap, 3)
    with torch.cuda.graph(graph):
        o_cap.step()
    for t in range(3, 8):
        o_ref.zero_grad(set_to_none=False)
        grads(ref, t)
        o_ref.step()
        s_ref.step()
        if t > 3:
            o_cap.zero_grad(set_to_none=False)
            grads(cap, t)
        graph.replay()
        s_cap.step()
    torch.cuda.synchronize()
    for a, b in zip(ref.parameters(), cap.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
