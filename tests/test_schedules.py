"""An lr schedule costs nothing per step: under torch.distributed (owner mode, W=2 and W=4) with torch's
LambdaLR, a warm-up + cosine schedule and OneCycleLR (which also cycles Adam's beta1), every step after
the first makes exactly the agreement's all_reduce and the status all_reduce and builds no plan, and the weights equal the
single-process run under the same schedule. A rank whose lr differs raises on every rank naming
``'lr'``; a structure change made on every rank (``split_fused``) rebuilds the plan exactly once."""

import pytest
import torch
import transformers
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, OneCycleLR, SequentialLR

from swan_dist import SWAN

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(300)

STEPS = 6
KINDS = ("lambda", "warmup_cosine", "onecycle")
OPTS = dict(preset="swan_ddagger", lr=0.01, whiten_dtype="float32", fallback="adamw", verbose=False)
AGREEMENT = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list")


def _model():
    torch.manual_seed(0)  # GPT-2: fused c_attn (Q, K, V whitened apart), Conv1D weights stored (in, out)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    return transformers.GPT2LMHeadModel(cfg)


def _schedule(kind, opt):
    if kind == "lambda":
        return LambdaLR(opt, lambda t: 1.0 / (1 + t))
    if kind == "warmup_cosine":
        return SequentialLR(opt, [LinearLR(opt, 0.1, total_iters=2), CosineAnnealingLR(opt, T_max=STEPS)],
                            milestones=[2])
    return OneCycleLR(opt, max_lr=[g["lr"] for g in opt.param_groups], total_steps=STEPS + 4)


def _grads(model, t):
    g = torch.Generator().manual_seed(100 + t)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _count():
    import torch.distributed as dist

    calls = dict.fromkeys(AGREEMENT, 0)
    for fn in AGREEMENT:
        orig = getattr(dist, fn)

        def counted(*a, _fn=fn, _orig=orig, **k):
            calls[_fn] += 1
            return _orig(*a, **k)

        setattr(dist, fn, counted)
    return calls


def _run(kind, calls=None):
    model = _model()
    opt = SWAN(model, **OPTS)
    sched = _schedule(kind, opt)
    per_step, lrs = [], []
    for t in range(STEPS):
        _grads(model, t)
        before, built = dict(calls or {}), opt.plans.built
        opt.step()
        sched.step()
        lrs.append([(g["lr"], g["betas"][0]) for g in opt.param_groups])
        per_step.append(({k: calls[k] - before[k] for k in calls} if calls else {}, opt.plans.built - built))
    return model, opt, per_step, lrs


def _worker(rank, world):
    calls = _count()
    out = {}
    for kind in KINDS:
        model, opt, per_step, lrs = _run(kind, calls)
        out[kind] = (per_step, lrs, {n: p.detach().clone() for n, p in model.named_parameters()})
    # a structure option changed on every rank alike: one rebuild, then steady again
    for g in opt.param_groups:
        g["split_fused"] = False
    rebuilt = []
    for t in range(3):
        _grads(model, t)
        before, built = dict(calls), opt.plans.built
        opt.step()
        rebuilt.append(({k: calls[k] - before[k] for k in calls}, opt.plans.built - built))
    # one rank's lr differs (its scheduler diverged): every rank raises, naming the key
    if rank == world - 1:
        opt.param_groups[0]["lr"] *= 2
    _grads(model, 0)
    try:
        opt.step()
        diverged = None
    except ValueError as e:
        diverged = str(e)
    return out, rebuilt, diverged


@pytest.mark.parametrize("world", [2, 4])
def test_scheduled_lr_builds_no_plan_and_adds_no_collective(world):
    results = run_distributed(_worker, world, timeout=280)
    reference = {kind: _run(kind) for kind in KINDS}  # one process, no torch.distributed
    for rank, (out, rebuilt, diverged) in enumerate(results):
        for kind in KINDS:
            per_step, lrs, weights = out[kind]
            ref_model, _, _, ref_lrs = reference[kind]
            assert lrs == ref_lrs and len({lr for step in lrs for lr, _ in step}) > 2, (kind, lrs)
            first, steady = per_step[0], per_step[1:]
            assert first[1] == 1, (kind, first)  # the first step builds the plan
            for counts, built in steady:
                assert built == 0 and counts == {**dict.fromkeys(AGREEMENT, 0), "all_reduce": 2}, (kind, per_step)
            for n, p in ref_model.named_parameters():
                assert torch.allclose(weights[n], p.detach(), atol=1e-6, rtol=1e-5), (rank, kind, n)
        assert [built for _, built in rebuilt] == [1, 0, 0], rebuilt
        assert rebuilt[2][0] == {**dict.fromkeys(AGREEMENT, 0), "all_reduce": 2}, rebuilt
        assert diverged is not None and "'lr'" in diverged and f"rank {world - 1}" in diverged, diverged
