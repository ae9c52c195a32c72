"""Switching a run from AdamW to SWAN: ``SWAN.load_state_dict`` of an AdamW state dict (by position, by
``param_names``, and the FQN-keyed one of ``get_optimizer_state_dict`` through ``set_optimizer_state_dict``)
and ``swan_dist.load_adamw_checkpoint`` from a DCP checkpoint, in one process and under FSDP2 at W=2: the
fallback parameters keep AdamW's moments, the matrices drop theirs, SWAN's hyper-parameters stay; the run
equals SWAN started from those weights with those moments put in by hand, and the loss keeps falling.
The same W=2 launch checks ``swan_dist.swap`` of a live AdamW under FSDP2 and under DDP."""

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

import swan_dist
from dist_utils import run_distributed
from swan_dist import SWAN

pytestmark = pytest.mark.timeout(120)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))


class Toy(nn.Module):
    """Embedding, two blocks of (norm, linear with bias, linear), untied head: 4 matrices SWAN whitens, 8
    tensors on the AdamW fallback."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(2))
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for blk in self.layers:
            h = blk(h)
        return self.output(h)


def _loss(model, x):
    return nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def _train(model, opt, batches):
    losses = []
    for x in batches:
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _by_hand(model, adamw_model, adamw):
    """SWAN over ``model`` (``adamw_model``'s weights) with AdamW's moments put in for its fallback
    parameters, matched through the two models' parameter names."""
    opt = SWAN(model, verbose=False)
    source = dict(adamw_model.named_parameters())
    names = {p: n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        if not g["use_swan"]:
            for p in g["params"]:
                st = adamw.state[source[names[p]]]
                opt.state[p] = {k: st[k].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
    return opt


def _adamw_run(make_opt, steps=3):
    torch.manual_seed(0)
    model = Toy()
    adamw = make_opt(model)
    gen = torch.Generator().manual_seed(1)
    pair = [torch.randint(0, 50, (4, 9), generator=gen) for _ in range(2)]  # learnable: seen again and again
    batches = [pair[i % 2] for i in range(steps + 4)]
    losses = _train(model, adamw, batches[:steps])
    return model, adamw, batches[steps:], losses


def _check_switch(model, adamw, rest, load) -> list[float]:
    """SWAN loaded by ``load(swan)`` equals SWAN with the moments put in by hand, step for step."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    loaded = SWAN(a, verbose=False)
    load(loaded, a)
    hand = _by_hand(b, model, adamw)
    fallback = [p for g in loaded.param_groups if not g["use_swan"] for p in g["params"]]
    matrices = [p for g in loaded.param_groups if g["use_swan"] for p in g["params"]]
    assert len(fallback) == 8 and len(matrices) == 4
    for pa, pb in zip(fallback, [p for g in hand.param_groups if not g["use_swan"] for p in g["params"]]):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded.state[pa][k], hand.state[pb][k]), k
    assert all(not loaded.state.get(p) for p in matrices)  # the matrices' moments dropped
    assert [g["lr"] for g in loaded.param_groups] == [0.02, 0.02] and loaded.param_groups[0]["alpha"] == 0.05
    assert loaded.param_groups[1]["betas"] == (0.9, 0.999) and loaded.param_groups[1]["weight_decay"] == 0.0
    losses = _train(a, loaded, rest)
    _train(b, hand, rest)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    return losses


def test_load_state_dict_of_adamw_by_position_equals_moments_put_in_by_hand(caplog):
    model, adamw, rest, before = _adamw_run(
        lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3, betas=(0.8, 0.95), weight_decay=0.1))
    with caplog.at_level(logging.INFO, logger="swan_dist"):
        after = _check_switch(model, adamw, rest, lambda opt, m: opt.load_state_dict(copy.deepcopy(adamw.state_dict())))
    line = next(r.getMessage() for r in caplog.records if "AdamW state dict" in r.getMessage())
    assert "matched by position" in line and "of 8 fallback tensors taken" in line and "4 matrices" in line
    assert "lr=0.005" in line and "(0.8, 0.95)" in line  # AdamW's hyper-parameters named as not used
    assert after[-1] < before[-1] and after[-1] < after[0], (before, after)  # the loss keeps falling


def test_param_names_match_groups_in_another_order_and_position_mismatch_is_refused():
    def grouped(m, names=True):  # decay / no-decay groups, as trainers build them: not the model's order
        named = list(m.named_parameters())
        groups = [[(n, p) for n, p in named if p.ndim == 2], [(n, p) for n, p in named if p.ndim < 2]]
        return torch.optim.AdamW([{"params": [p for _, p in g], **({"param_names": [n for n, _ in g]} if names else {})}
                                  for g in groups], lr=5e-3)

    model, adamw, rest, _ = _adamw_run(grouped)
    sd = adamw.state_dict()
    assert "param_names" in sd["param_groups"][0]
    _check_switch(model, adamw, rest, lambda opt, m: opt.load_state_dict(copy.deepcopy(sd)))
    model, adamw, rest, _ = _adamw_run(lambda m: grouped(m, names=False))
    with pytest.raises(ValueError, match="not built over the same parameters in the same order"):
        SWAN(copy.deepcopy(model), verbose=False).load_state_dict(adamw.state_dict())


def test_set_optimizer_state_dict_takes_adamws_fqn_keyed_state_dict():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, adamw, rest, _ = _adamw_run(lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3))
    osd = get_optimizer_state_dict(model, adamw)
    assert isinstance(next(iter(osd["state"])), str)
    _check_switch(model, adamw, rest, lambda opt, m: set_optimizer_state_dict(m, opt, copy.deepcopy(osd)))


def test_load_adamw_checkpoint_reads_the_fallback_moments_of_a_dcp_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, adamw, rest, _ = _adamw_run(lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3))
    msd, osd = get_state_dict(model, adamw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
        _check_switch(model, adamw, rest, lambda opt, m: swan_dist.load_adamw_checkpoint(
            m, opt, str(tmp_path), key="optim", no_dist=True))


def _fsdp2_worker(rank, world, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, get_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))

    def sharded():
        torch.manual_seed(0)
        m = Toy()
        for blk in m.layers:
            fully_shard(blk, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
    pair = [torch.randint(0, 50, (4, 9), generator=gen) for _ in range(2)]
    batches = [pair[i % 2] for i in range(6)]
    model = sharded()
    adamw = torch.optim.AdamW(model.parameters(), lr=5e-3, foreach=True)
    before = _train(model, adamw, batches[:3])
    msd, osd = get_state_dict(model, adamw)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)

    def copy_of():
        m = sharded()
        with torch.no_grad():
            for q, p in zip(m.parameters(), model.parameters()):
                q.copy_(p)
        return m

    by_ckpt, in_memory, by_sd, by_hand, swapped = copy_of(), copy_of(), copy_of(), copy_of(), copy_of()
    opts = {}
    live = torch.optim.AdamW(swapped.parameters())  # a live AdamW at this point
    live.load_state_dict(copy.deepcopy(adamw.state_dict()))
    live.param_groups[0]["weight_decay"] = 0.0  # as "hand"'s SWAN(model)
    opts["swap"] = swan_dist.swap(live, swapped, verbose=False)  # DTensor parameters and moments
    opts["ckpt"] = SWAN(by_ckpt, verbose=False)
    swan_dist.load_adamw_checkpoint(by_ckpt, opts["ckpt"], ckpt, key="optim")
    opts["memory"] = SWAN(in_memory, verbose=False)
    # (copies: torch's load_state_dict takes the tensors themselves, which the first run would move on)
    set_optimizer_state_dict(in_memory, opts["memory"], copy.deepcopy(get_optimizer_state_dict(model, adamw)))
    opts["sd"] = SWAN(by_sd, verbose=False)
    opts["sd"].load_state_dict(copy.deepcopy(adamw.state_dict()))  # torch's own, id-keyed: DTensor moments by position
    opts["hand"] = _by_hand(by_hand, model, adamw)
    models = {"ckpt": by_ckpt, "memory": in_memory, "sd": by_sd, "hand": by_hand, "swap": swapped}
    losses = {k: _train(models[k], opts[k], batches[3:]) for k in models}
    full = {k: [p.full_tensor() for p in m.parameters()] for k, m in models.items()}
    states = {k: [len(opts[k].state.get(p) or {}) for g in opts[k].param_groups for p in g["params"]] for k in opts}
    return before, losses, full, states, _ddp_swap(batches)


def _ddp_swap(batches):
    """swan_dist.swap of a live AdamW over a DDP model (in the same launch): equal to SWAN over a DDP replica
    with the converted settings and AdamW's moments put in by hand."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Toy())
    adamw = torch.optim.AdamW(model.parameters(), lr=5e-3, betas=(0.8, 0.95), weight_decay=0.1)
    _train(model, adamw, batches[:3])
    twin = DDP(copy.deepcopy(model.module))
    swan = swan_dist.swap(adamw, model, verbose=False)
    hand = SWAN(twin, verbose=False, lr=0.02, betas=(0.8, 0.95), weight_decay=0.5)
    names = dict(model.named_parameters())
    for g in hand.param_groups:
        if not g["use_swan"]:
            for n, p in zip(g["param_names"], g["params"]):
                hand.state[p] = {k: v.clone() for k, v in adamw.state[names[n]].items()}
    losses = _train(model, swan, batches[3:])
    same = losses == _train(twin, hand, batches[3:]) and all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    return same, len(swan.state), losses


def test_fsdp2_world_two_dcp_state_dicts_and_swap_equal_moments_put_in_by_hand(tmp_path):
    res = run_distributed(_fsdp2_worker, 2, str(tmp_path / "ckpt"), timeout=180)
    for before, losses, full, states, ddp in res:
        assert ddp[0] and ddp[1] == 8 and ddp[2][-1] < ddp[2][0], ddp  # DDP: swap equals SWAN by hand
        for k in ("ckpt", "memory", "sd", "swap"):
            assert states[k] == states["hand"] == [0] * 4 + [3] * 8, (k, states[k])
            assert losses[k] == losses["hand"], k
            for a, b in zip(full[k], full["hand"]):
                assert torch.equal(a, b), k
        assert losses["hand"][-1] < before[-1] and losses["hand"][-1] < losses["hand"][0], (before, losses["hand"])


def test_swans_public_view_of_what_it_was_given():
    """What switching reads of SWAN, through its public methods (no module outside the class reads its private
    fields): each group's labels, the order the parameters were given in, the tensors given, whether a tensor
    packs several parameters."""
    import re
    from pathlib import Path

    model = Toy()
    named = list(model.named_parameters())
    opt = SWAN([{"params": [p for _, p in named[::-1]], "param_names": [n for n, _ in named[::-1]]}], verbose=False)
    assert opt.given_labels() == [n for n, _ in named[::-1]]
    assert [lab for g in opt.group_labels() for lab in g] == [n for g in opt.param_groups for n in g["param_names"]]
    assert [id(p) for p in opt.given_tensors()] == [id(p) for g in opt.param_groups for p in g["params"]]
    assert not opt.packs_parameters
    root = Path(swan_dist.__file__).parent
    private = re.compile(r"(?<!self)\.(_packed|_origin|_rows)\b")
    readers = [str(f.relative_to(root.parent)) for d in (root, root.parent / "integrations") for f in d.rglob("*.py")
               if f.name != "optimizer.py" and private.search(f.read_text())]
    assert not readers, readers
