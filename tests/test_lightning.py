"""Lightning 2.6 users: ``configure_optimizers`` returning ``swan_dist.SWAN(self)`` under Lightning's real
strategies on CPU (2 gloo processes; tests/lightning_cases.py): DDP, FSDP (FSDP1, ``use_orig_params``
True and False, with and without an auto-wrap policy), ModelParallelStrategy (FSDP2 ``fully_shard`` in
``configure_model``) and DeepSpeed (ZeRO 1-3, SWAN from ``configure_optimizers`` and from the config
dict). Each gives the single-process summary, step-1 weights equal to single-process SWAN on the same
global batch (fp32), and, for DDP, FSDP and DeepSpeed, ``Trainer.save_checkpoint`` then
``fit(ckpt_path=...)`` equal to an uninterrupted run. ``SWAN(self.parameters())`` warns (names lost) or
raises with ``strict=True``. Also, without Lightning: SWAN built from a module below the one an FSDP1 unit
wraps (the unit's FlatParameter managed when it holds that module's parameters only, refused otherwise).

One launch per group of strategies; each runs several Trainers in turn."""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.timeout(300)

pytest.importorskip("lightning")

FSDP_DDP = {  # name: (strategy, options, checkpoint round trip)
    "ddp": ("ddp", {}, True),
    "fsdp_orig": ("fsdp", dict(orig=True), True),
    "fsdp_orig_wrap": ("fsdp", dict(orig=True, wrap=True), False),
    "fsdp_flat": ("fsdp", dict(orig=False), True),
    "fsdp_flat_wrap": ("fsdp", dict(orig=False, wrap=True), True),
    "fsdp2": ("fsdp2", {}, False),
}
DEEPSPEED = {
    "zero1": ("deepspeed", dict(stage=1), False),
    "zero2": ("deepspeed", dict(stage=2), True),
    "zero3": ("deepspeed", dict(stage=3), True),
    "zero1_config": ("deepspeed", dict(stage=1, config=True), False),
    "zero2_config": ("deepspeed", dict(stage=2, config=True), False),
    "zero3_config": ("deepspeed", dict(stage=3, config=True), True),
}


def _worker(rank, world, cases, root, extra):
    import warnings

    warnings.filterwarnings("ignore", module="lightning")
    import lightning_cases as lc

    out = {name: lc.run(kind, os.path.join(root, f"{name}.ckpt") if ckpt else None, **kw)
           for name, (kind, kw, ckpt) in cases.items()}
    if extra:
        out["unnamed_ddp"] = lc.unnamed("ddp")
        out["unnamed_fsdp"] = lc.unnamed("fsdp", orig=True)
        out["submodule"] = _submodule(rank, world)
    return out


@pytest.fixture(scope="module")
def fsdp_ddp(tmp_path_factory):
    return run_distributed(_worker, 2, FSDP_DDP, str(tmp_path_factory.mktemp("ckpt")), True, timeout=280)


@pytest.fixture(scope="module")
def deepspeed(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return run_distributed(_worker, 2, DEEPSPEED, str(tmp_path_factory.mktemp("ckpt")), False, timeout=280)


@pytest.fixture(scope="module")
def reference():
    import lightning_cases as lc
    import swan_dist

    torch.manual_seed(0)
    summary = swan_dist.SWAN(lc.Lit(), verbose=False, **lc.OPTS).summary()
    return summary, lc.reference(1), lc.reference(2)


def _rows(summary: str) -> list[str]:
    """The summary without its "SWAN group" lines: ZeRO-3 empties the param groups between its sub-group
    steps, and the summary, read after a step, then cannot name the groups' device."""
    return [line for line in summary.splitlines() if not line.startswith("  SWAN group:")]


def _check(results, name, reference):
    summary, ref1, ref2 = reference
    for rank, res in enumerate(results):
        got = res[name]
        assert _rows(got["summary"]) == _rows(summary), (name, rank, got["summary"])
        assert "  SWAN group: nsds steps=2" in got["summary"], (name, rank, got["summary"])
        assert "2 matrices whitened by SWAN, 5 tensors on the fallback rule" in summary
        assert set(got["step1"]) == set(ref1), (name, sorted(got["step1"]))
        for n, v in ref1.items():
            assert torch.allclose(got["step1"][n], v, rtol=0, atol=1e-6), (name, rank, n, (got["step1"][n] - v).abs().max())
        if "resumed" in got:
            for n, v in ref2.items():
                assert torch.equal(got["resumed"][n], got["straight"][n]), (name, rank, n, "resume differs")
                assert torch.allclose(got["straight"][n], v, rtol=0, atol=1e-6), (name, rank, n)
    assert sum(res[name]["whitened"] for res in results) == 2  # fc1, fc2: each whitened once, by its owner


@pytest.mark.parametrize("name", list(FSDP_DDP))
def test_ddp_fsdp_model_parallel(fsdp_ddp, reference, name):
    _check(fsdp_ddp, name, reference)


@pytest.mark.parametrize("name", list(DEEPSPEED))
def test_deepspeed(deepspeed, reference, name):
    _check(deepspeed, name, reference)
    stage = DEEPSPEED[name][1]["stage"]
    assert deepspeed[0][name]["wrapper"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")


def test_bare_parameters_warn_or_raise(fsdp_ddp):
    for res in fsdp_ddp:
        ddp, fsdp = res["unnamed_ddp"], res["unnamed_fsdp"]
        # DDP: whitened without names (embedding and head included): a warning; strict=True an error
        assert ddp["params"] is None and any("without names" in w for w in ddp["params_warnings"]), ddp
        assert ddp["strict"][0] == "ValueError" and "strict=True" in ddp["strict"][1], ddp
        # FSDP1: flat shards without their module: refused, naming the parameter and the fix
        for how in ("params", "strict"):
            kind, msg = fsdp[how]
            assert kind == "ValueError" and "flattened shard" in msg and "SWAN(self)" in msg, fsdp


def test_submodule_of_an_fsdp1_unit(fsdp_ddp):
    for res in fsdp_ddp:
        sub = res["submodule"]
        for orig in (True, False):
            assert sub[orig]["summary"] == sub["reference_summary"], (orig, sub[orig]["summary"])
            assert sub[orig]["err"] < 1e-6, (orig, sub[orig]["err"])
        kind, msg = sub["mixed"]
        assert kind == "ValueError" and "['0.weight', '0.bias', '2.weight', '2.bias']" in msg and "embed.weight" in msg


# ---------------------------------------------------------------- without Lightning: SWAN(submodule) under FSDP1
def _nets():
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))

        def forward(self, h):
            return h + self.inner(h)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.block, self.head = nn.Embedding(64, 32), Block(), nn.Linear(32, 64)

        def forward(self, x):
            return self.head(self.block(self.embed(x)))

    return Net, Block


def _loss(model, x):
    logits = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1))


def _submodule(rank, world):
    """SWAN(net.block.inner) where an FSDP1 unit wraps ``Block`` (the unit's FlatParameter holds ``inner``'s
    parameters only: managed) for both ``use_orig_params``, against single-process SWAN(inner) on the same
    global batch; and where the root unit packs them with the embedding and head (use_orig_params=False:
    refused)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import swan_dist

    Net, Block = _nets()
    x = torch.randint(0, 64, (4 * world, 9), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    ref = Net()
    opt = swan_dist.SWAN(ref.block.inner, verbose=False, preset="swan_ddagger", lr=0.05)
    _loss(ref, x).backward()
    opt.step()
    out = {"reference_summary": opt.summary()}
    for orig in (True, False):
        torch.manual_seed(0)
        fsdp = FSDP(Net(), use_orig_params=orig, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block}))
        inner = fsdp.module.block.module.inner
        opt = swan_dist.SWAN(inner, verbose=False, preset="swan_ddagger", lr=0.05)
        _loss(fsdp, x[rank * 4: (rank + 1) * 4]).backward()
        opt.step()
        with FSDP.summon_full_params(fsdp, writeback=False):
            err = max((p - q).abs().max().item() for p, q in zip(inner.parameters(), ref.block.inner.parameters()))
        out[orig] = dict(summary=opt.summary(), err=err)
    torch.manual_seed(0)
    fsdp = FSDP(Net(), use_orig_params=False, device_id=torch.device("cpu"))
    try:
        swan_dist.SWAN(fsdp.module.block.inner, verbose=False, preset="swan_ddagger", lr=0.05)
        out["mixed"] = None
    except ValueError as e:
        out["mixed"] = (type(e).__name__, str(e))
    return out


# ---------------------------------------------------------------- one process: the AdamW lr in configure_optimizers
def test_configure_optimizers_with_an_adamw_lr_resolves_as_swan_does():
    """``configure_optimizers`` returning ``SWAN(self, adamw_lr=eta)``: after a Lightning step (one CPU process) the
    matrices step at 0.2 eta and the fallback at 4 eta, as ``SWAN(module, adamw_lr=eta)`` and
    ``swan_dist.from_adamw(eta)`` give (Lightning passes SWAN's lrs through untouched)."""
    import lightning.pytorch as pl

    import lightning_cases as lc
    import swan_dist

    eta = 3e-4

    class Adamw(lc.Lit):
        def configure_optimizers(self):
            return swan_dist.SWAN(self, adamw_lr=eta, verbose=False)

        def training_step(self, batch, batch_idx):
            return self.loss(lc.global_batch(self.trainer.global_step, 1))

    def lrs(opt):
        swan = next(g for g in opt.param_groups if g["use_swan"])
        rest = next(g for g in opt.param_groups if not g["use_swan"])
        return swan["lr"] * swan["alpha"], rest["lr"]

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Adamw())
    got = lrs(lc.swan_of(trainer.optimizers[0]))
    assert got == pytest.approx((0.2 * eta, 4 * eta))
    assert got == pytest.approx(lrs(swan_dist.SWAN(lc.Lit(), verbose=False, **swan_dist.from_adamw(eta))))
