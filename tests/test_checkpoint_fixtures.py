"""Checkpoints saved by earlier versions load with this one: every folder of ``tests/fixtures/checkpoints/``
(written by ``tests/fixtures/make_checkpoints.py``, one per version, never rewritten), as a plain ``torch.save``
state dict through ``torch.load(weights_only=True)`` and as a ``torch.distributed.checkpoint`` through
``set_state_dict``. What was saved comes back exactly: the weights, each fallback tensor's moments and step, the
groups' options; SWAN's matrices keep no state; and training continues from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import swan_dist

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from make_checkpoints import Fixture, train  # noqa: E402

VERSIONS = sorted(p.name for p in (FIXTURES / "checkpoints").iterdir() if p.is_dir())
FALLBACK = {"embed.weight", "up.bias", "norm.weight", "norm.bias", "head.weight"}


def test_this_version_has_its_fixtures():
    assert swan_dist.__version__ in VERSIONS, "run tests/fixtures/make_checkpoints.py for this version"


def _fresh(meta: dict):
    torch.manual_seed(1)  # other weights than the checkpoint's: loading must bring them
    model = Fixture()
    return model, swan_dist.SWAN(model, verbose=False, **{**meta["options"], "lr": 0.5, "weight_decay": 0.0})


def _check_loaded(model, opt, saved_model: dict, saved_opt: dict, meta: dict) -> None:
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved_model[name]), name
    names = {p: n for n, p in model.named_parameters()}
    by_name = {}
    for g in saved_opt["param_groups"]:
        for i, n in zip(g["params"], g["param_names"]):
            by_name[n] = saved_opt["state"].get(i, {})
    for p, n in names.items():
        st = opt.state.get(p, {})
        if n in FALLBACK:
            assert set(st) == {"exp_avg", "exp_avg_sq", "step"}, n
            for key in st:
                assert torch.equal(torch.as_tensor(st[key]), torch.as_tensor(by_name[n][key])), (n, key)
            assert float(st["step"]) == meta["steps"]
        else:
            assert not st, n  # the matrices SWAN whitens keep none
    for g in opt.param_groups:
        assert float(g["lr"]) == meta["options"]["lr"] and float(g["weight_decay"]) == meta["options"]["weight_decay"]


def _continues(model, opt) -> None:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, opt, range(2, 3))
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[n]), n


@pytest.mark.parametrize("version", VERSIONS)
def test_torch_save_checkpoint_of_every_version_loads(version):
    folder = FIXTURES / "checkpoints" / version
    meta = json.loads((folder / "meta.json").read_text())
    saved = torch.load(folder / "swan.pt", weights_only=True)
    model, opt = _fresh(meta)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    _check_loaded(model, opt, saved["model"], saved["optimizer"], meta)
    _continues(model, opt)


@pytest.mark.parametrize("version", VERSIONS)
def test_distributed_checkpoint_of_every_version_loads(version):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = FIXTURES / "checkpoints" / version
    meta = json.loads((folder / "meta.json").read_text())
    saved = torch.load(folder / "swan.pt", weights_only=True)  # the same training state, to compare with
    model, opt = _fresh(meta)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=str(folder / "dcp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    _check_loaded(model, opt, saved["model"], saved["optimizer"], meta)
    _continues(model, opt)
