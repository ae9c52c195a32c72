"""SWAN under FSDP1 (``FullyShardedDataParallel``, auto-wrapped per ``nn.Linear``) on real multi-process
gloo, with ``use_orig_params`` True and False: updates equal single-process SWAN on the same gradients;
with FlatParameters only, each original is classified, whitened or skipped on its own and the fallback
keeps state for its own elements only; ``torch.distributed.checkpoint`` round trips across world sizes.

Gradients are placed from FSDP's own shard metadata (not from what swan_dist records), and results are
read back through ``summon_full_params``, so a wrong mapping in the adapter shows as a wrong update."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dist_utils import check_exchange_dtypes, exchange_bytes, exchange_dtype_runs, run_distributed
from swan_dist import SWAN
from swan_dist.selection import clean_name
from test_distributed_optimizer import Net, _global_grads, _reference

pytestmark = pytest.mark.timeout(300)

SWAN_MATRICES = {"up.weight", "down.weight", "narrow.weight", "mid.weight"}
OPTS = [
    dict(preset="swan_ddagger", lr=0.05),
    dict(preset="swan_dagger", lr=0.05, weight_decay=0.1, ns_steps=4, fallback="sgd"),
    dict(preset="swan_ddagger", lr=0.05, fallback="sign"),
]
ADAMW = OPTS[0]


def _wrap(orig: bool, mesh: bool = False, per_linear: bool = True) -> nn.Module:
    """One FSDP unit per ``nn.Linear`` plus the root (holding the embedding), or with ``per_linear=False``
    one unit, one FlatParameter for the whole model. ``mesh``: built on a DeviceMesh, so that sharded
    state dicts hold DTensors, not ShardedTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    kw = dict(device_mesh=init_device_mesh("cpu", (dist.get_world_size(),))) if mesh else {}
    policy = ModuleWrapPolicy({nn.Linear}) if per_linear else None
    return FSDP(Net(), auto_wrap_policy=policy, use_orig_params=orig, device_id=torch.device("cpu"), **kw)


def _units(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name prefix, FlatParameter) per FSDP unit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [(clean_name(n), m._handle.flat_param) for n, m in model.named_modules()
            if isinstance(m, FSDP) and m._handle]


def _held(model: nn.Module) -> dict[str, int]:
    """Elements of each original this rank holds (FSDP's ``_shard_param_infos``)."""
    return {f"{pre}.{fqn}" if pre else fqn: info.numel_in_shard if info.in_shard else 0
            for pre, flat in _units(model) for fqn, info in zip(flat._fqns, flat._shard_param_infos)}


def _set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """This rank's shard of the global gradients: into each original's ``grad`` (use_orig_params=True)
    or into the FlatParameter's ``grad``, at ``offset_in_shard`` (use_orig_params=False)."""
    for pre, flat in _units(model):
        shard = torch.zeros(flat.numel())
        for i, (fqn, info) in enumerate(zip(flat._fqns, flat._shard_param_infos)):
            g = grads[f"{pre}.{fqn}" if pre else fqn].reshape(-1)
            part = g[info.intra_param_start_idx: info.intra_param_end_idx + 1] if info.in_shard else None
            if flat._params is not None:
                p = flat._params[i]  # a 1-D view of its part of the shard (full-shaped under NO_SHARD)
                p.grad = None if part is None else part.reshape(p.shape).clone()
            elif part is not None:
                shard[info.offset_in_shard: info.offset_in_shard + part.numel()] = part
        if flat._params is None:
            flat.grad = shard


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model):
        return {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _err(got: dict[str, torch.Tensor], ref: nn.Module) -> float:
    return max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


def _state_numel(opt: SWAN) -> int:
    return sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")


# ---------------------------------------------------------------------------------------- updates
def _equal_worker(rank, world):
    out = {}
    for orig in (True, False):
        for c, opts in enumerate(OPTS):
            model = _wrap(orig)
            opt = SWAN(model, verbose=False, bucket_mb=0.0001, **opts)
            for t in range(3):
                _set_grads(model, _global_grads(Net(), t))
                opt.step()
            out[orig, c] = dict(
                err=_err(_full(model), _reference(_global_grads, opts, range(3))),
                whitened=opt.whitened_matrices,
                owners=[b.owners for b in opt.exchange.plan.buckets],
                state=_state_numel(opt),
                rows={n: (list(s), r) for n, s, r, _ in opt._rows},
                summary=opt.summary(),
                held=_held(model),  # (padding differs between the two settings, so does the sharding)
            )
    try:  # bare FlatParameters, never mapped to their originals: refused, not all put on the fallback
        SWAN(_wrap(False).parameters(), verbose=False)
    except ValueError as e:
        out["unmapped"] = str(e)
    if world == 2:
        out["exchange"] = exchange_dtype_runs(_exchange_run)
    return out


def _exchange_run(exchange_dtype):
    """This rank's FlatParameter shards after 3 steps with the owner exchange sending ``exchange_dtype``."""
    model = _wrap(False)
    opt = SWAN(model, verbose=False, bucket_mb=0.0001, exchange_dtype=exchange_dtype, **ADAMW)
    for t in range(3):
        _set_grads(model, _global_grads(Net(), t))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, exchange_bytes(opt)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp1_equals_single_process(world):
    """Both use_orig_params settings, the AdamW, SGD and sign fallbacks; uneven shards cutting through
    rows and originals, originals held by one rank only and ranks holding none of some."""
    res = run_distributed(_equal_worker, world)
    for orig in (True, False):
        held = [r[orig, 0]["held"] for r in res]
        assert any(sum(h[n] > 0 for h in held) == 1 for n in held[0])  # an original on one rank only
        assert any(h[n] == 0 for h in held for n in h)  # a rank holding none of an original
        fallback_held = [sum(v for n, v in h.items() if n not in SWAN_MATRICES) for h in held]
        for c in range(len(OPTS)):
            per_rank = [r[orig, c] for r in res]
            assert max(r["err"] for r in per_rank) < 2e-5, (orig, c, per_rank)
            assert sum(r["whitened"] for r in per_rank) == 3 * len(SWAN_MATRICES)
            assert all(r["owners"] == per_rank[0]["owners"] for r in per_rank)
            # AdamW moments for this rank's fallback elements only (SWAN matrices keep none); sign/sgd none
            expect = [2 * n if OPTS[c].get("fallback", "adamw") == "adamw" else 0 for n in fallback_held]
            assert [r["state"] for r in per_rank] == expect, (orig, c)
    rows = res[0][False, 0]["rows"]  # use_orig_params=False: original names and shapes, not FlatParameters
    assert rows == {n: (list(p.shape), "SWAN" if n in SWAN_MATRICES else "fallback:adamw")
                    for n, p in Net().named_parameters()}
    summary = res[0][False, 0]["summary"]
    assert "4 matrices whitened by SWAN, 4 tensors on the fallback" in summary and "SWAN group: nsds" in summary
    assert "_flat_param" not in summary and "up.weight" in summary
    assert all("tag_model" in r["unmapped"] for r in res)
    if world == 2:  # exchange_dtype: bf16 within its bound of fp32, half the bytes; "param" as fp32
        check_exchange_dtypes([r["exchange"] for r in res], ADAMW["lr"], 3)


# ---------------------------------------------------------------------------------------- nonfinite
def _nan_grads(model, t):
    g = _global_grads(model, t)
    if t == 0:
        g["up.bias"][9] = float("nan")  # a fallback original
    if t == 1:
        g["narrow.weight"][1, 2] = float("inf")  # a SWAN matrix
    return g


def _nan_worker(rank, world):
    return {capturable: _nan_case(capturable) for capturable in (False, True)}


def _nan_case(capturable):
    model = _wrap(False, per_linear=False)
    opt = SWAN(model, verbose=False, capturable=capturable, **ADAMW)
    before = _full(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(3):
            _set_grads(model, _nan_grads(Net(), t))
            opt.step()
            if t == 0:
                after0 = _full(model)
    res = dict(
        # later steps too: the skipped original's AdamW step count lags, as in single-process SWAN
        err=_err(_full(model), _reference(_nan_grads, ADAMW, range(3))),
        bias_kept=torch.equal(after0["up.bias"], before["up.bias"]),
        others_moved=all(not torch.equal(after0[n], before[n]) for n in before if n != "up.bias"),
        skips=dict(opt.nonfinite_skips),
        warned=[str(w.message) for w in caught if "non-finite" in str(w.message)],
    )
    model = _wrap(False, per_linear=False)
    opt = SWAN(model, verbose=False, nonfinite="raise", capturable=capturable, **ADAMW)
    before = _full(model)
    _set_grads(model, _nan_grads(Net(), 0))
    try:
        opt.step()
    except FloatingPointError as e:
        res["raised"] = str(e)
    res["raise_kept"] = all(torch.equal(v, before[n]) for n, v in _full(model).items())
    return res


def test_fsdp1_flat_params_nonfinite_skips_one_original():
    """use_orig_params=False, one FlatParameter holding every original: a NaN in one original skips that
    original only (on every rank), the others are updated, and its own AdamW step count stays behind
    as in single-process SWAN; nonfinite='raise' raises everywhere, nothing updated. The same with
    ``capturable=True`` (options on the device: the AdamW fallback masks the skipped original's span of the
    packed state by zero rates)."""
    for r in (r for per_rank in run_distributed(_nan_worker, 3) for r in per_rank.values()):
        assert r["err"] < 2e-5 and r["bias_kept"] and r["others_moved"], r
        assert r["skips"] == {"up.bias": 1, "narrow.weight": 1}, r
        assert len(r["warned"]) == 2 and "up.bias" in r["warned"][0] and "narrow.weight" in r["warned"][1]
        assert "up.bias" in r["raised"] and r["raise_kept"], r


# ---------------------------------------------------------------------------------------- checkpoints
LAYOUTS = [(True, True), (False, True), (False, False)]  # (use_orig_params, one unit per nn.Linear)


def _train(model, opt, steps) -> None:
    for t in steps:  # the same global gradients, NaN in some originals at some steps
        _set_grads(model, _nan_grads(Net(), t))
        opt.step()


def _dcp_worker(rank, world, root, phase):
    """phase 'save': steps 0-1 (an update skipped in each), save, steps 2-3. phase 'load': load, steps 2-3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    out = {}
    for orig, per_linear in LAYOUTS:
        model = _wrap(orig, mesh=True, per_linear=per_linear)
        opt = SWAN(model, verbose=False, **ADAMW)
        ckpt = f"{root}/{orig}_{per_linear}"
        saved = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if phase == "save":
                _train(model, opt, range(2))
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
                local = {n: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in st.items()}
                         for n, st in osd["state"].items()}
                saved = dict(
                    names=sorted(local),
                    # SWAN matrices reach the checkpoint as zeros (FSDP1 needs their entries), if at all
                    swan_zero=all(not v.any() for n in SWAN_MATRICES for k, v in local[n].items()
                                  if k in ("exp_avg", "exp_avg_sq")),
                    steps=local["up.bias"].get("step_per_original"),
                )
            else:
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                dcp.load(state, checkpoint_id=ckpt)
                set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            fallback = sum(v for n, v in _held(model).items() if n not in SWAN_MATRICES)
            compact = _state_numel(opt) == 2 * fallback  # in memory, also after loading
            _train(model, opt, range(2, 4))
        out[orig, per_linear] = _full(model), saved, compact
    return out


@pytest.mark.filterwarnings("ignore:SWAN. non-finite gradient:RuntimeWarning")  # the reference's skips
def test_dcp_checkpoint_saved_at_2_resumes_identically_at_1_and_4(tmp_path):
    """get_state_dict / dcp.save at W=2, dcp.load / set_state_dict at W=1 and W=4 (FlatParameters
    sharded differently), use_orig_params True and False, the latter also with one FlatParameter for the
    whole model: the resumed runs equal the uninterrupted one, which equals single-process SWAN, per-original
    AdamW step counts included. FSDP1 is built on a DeviceMesh: without one its sharded state dicts hold
    ShardedTensors, and torch 2.13 cannot load a parameter with fewer rows than ranks (``narrow.weight``
    at W=4; with torch.optim.AdamW alike): DCP reports missing keys."""
    saved = run_distributed(_dcp_worker, 2, str(tmp_path), "save")
    ref = _reference(_nan_grads, ADAMW, range(4))
    for layout in LAYOUTS:
        final, info, _ = saved[0][layout]
        assert _err(final, ref) < 2e-5 and all(r[layout][2] for r in saved), layout
        assert info["names"] == sorted(n for n, _ in Net().named_parameters()) and info["swan_zero"], layout
    # one FlatParameter: the counts of tok_embeddings, up.bias (skipped once), narrow.bias, output
    assert saved[0][False, False][1]["steps"] == (2.0, 1.0, 2.0, 2.0)
    for world in (1, 4):
        for r in run_distributed(_dcp_worker, world, str(tmp_path), "load"):
            for layout in LAYOUTS:
                got, _, compact = r[layout]
                assert compact, (world, layout)
                for n, v in saved[0][layout][0].items():
                    assert torch.allclose(got[n], v, atol=2e-6), (world, layout, n)


def _full_sd_worker(rank, world, root, phase):
    """As :func:`_dcp_worker`, through FSDP1's FULL_STATE_DICT type: rank 0 writes one torch.save file
    with whole tensors (``full_state_dict=True``), every rank of another world size loads it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    out = {}
    # (cpu_offload=True segfaults in torch 2.13 on a CPU-device FSDP1 model, in the *model* state dict,
    # with no optimizer involved; tensors are on the CPU anyway)
    full = StateDictOptions(full_state_dict=True)
    for orig, per_linear in LAYOUTS[:2]:
        model = _wrap(orig, per_linear=per_linear)
        opt = SWAN(model, verbose=False, **ADAMW)
        path = f"{root}/full_{orig}.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if phase == "save":
                _train(model, opt, range(2))
                msd, osd = get_state_dict(model, opt, options=full)
                if rank == 0:
                    torch.save({"model": msd, "optim": osd}, path)
            else:
                state = torch.load(path, weights_only=False)
                set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                               options=StateDictOptions(full_state_dict=True))
            _train(model, opt, range(2, 4))
        out[orig] = _full(model)
    return out


@pytest.mark.filterwarnings("ignore:SWAN. non-finite gradient:RuntimeWarning")
def test_full_state_dict_saved_at_2_resumes_identically_at_3(tmp_path):
    saved = run_distributed(_full_sd_worker, 2, str(tmp_path), "save")
    resumed = run_distributed(_full_sd_worker, 3, str(tmp_path), "load")
    for orig in (True, False):
        for n, v in saved[0][orig].items():
            assert torch.allclose(resumed[0][orig][n], v, atol=2e-6), (orig, n)
