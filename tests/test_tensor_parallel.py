"""SWAN on tensor-parallel DTensors (gloo, CPU): ``ColwiseParallel`` / ``RowwiseParallel`` on the
reference LLaMA model, alone (TP=2) and under FSDP2 on a 2x2 (dp, tp) mesh (``_StridedShard(0)`` over
``Shard(0)``, ``Shard(0)`` over ``Shard(1)``). Every matrix is whitened whole, once, over the combined
mesh: updates equal single-process SWAN on the same global gradients; DCP checkpoints of such a model
and optimizer resume exactly, also on another mesh; placements SWAN cannot map are refused when it is
built, on every rank. Gradients are placed with DTensor's own ``distribute_tensor``."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from dist_utils import check_exchange_dtypes, exchange_bytes, exchange_dtype_runs, run_distributed
from swan_dist import SWAN
from swan_dist.reference.model import Llama, LlamaConfig

pytestmark = pytest.mark.timeout(300)

# heads of 6, ffn 22: TP blocks of 11 rows (w1, w3) and 11 columns (w2), cut 6/5 by FSDP2 on dp
CFG = dict(vocab_size=37, dim=12, n_layers=2, n_heads=2, ffn_dim=22, max_seq_len=16)
OPTS = dict(preset="swan_ddagger", lr=0.05, weight_decay=0.1)
STEPS = 3
MATRICES = 2 * 7  # wq wk wv wo w1 w2 w3 per layer


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**CFG))


def _parallelize(model: Llama, world: int, dp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = world // dp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
    plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                 "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()})
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        layer.attention.n_heads //= tp  # each TP rank runs its own heads
    if dp > 1:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return mesh


def _grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    # every rank holds the same full gradients: no broadcast where torch can skip it (src_data_rank, torch >= 2.7)
    local = {"src_data_rank": None} if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}
    for n, p in model.named_parameters():
        p.grad = (distribute_tensor(grads[n], p.device_mesh, p.placements, **local) if isinstance(p, DTensor)
                  else grads[n].clone())


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _reference(steps, tokens: torch.Tensor | None = None):
    """Single-process SWAN on the same gradients; with ``tokens``, then one real forward/backward on them
    and a step: (weights, that loss)."""
    model = _model()
    opt = SWAN(model, verbose=False, **OPTS)
    for t in steps:
        _set_grads(model, _grads(model, t))
        opt.step()
    if tokens is None:
        return _full(model)
    opt.zero_grad()
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    return _full(model), loss.item()


def _placements(model: nn.Module) -> dict[str, str]:
    return {n: str(tuple(p.placements)) for n, p in model.named_parameters() if hasattr(p, "placements")}


def _refused_worker_part(world: int) -> list[str]:
    """Layouts SWAN cannot map, refused at construction (the same error on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    errors = []
    for placement, local in ((Partial(), torch.randn(4, 6)), (_StridedShard(0, split_factor=2), torch.randn(4, 6))):
        w = nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False))
        try:
            SWAN([("proj.weight", w)], verbose=False, **OPTS)
            errors.append("accepted")
        except ValueError as e:
            errors.append(str(e))
    return errors


def _tp_worker(rank, world, dp, ckpt=None):
    model = _model()
    _parallelize(model, world, dp)
    opt = SWAN(model, verbose=False, bucket_mb=0.0005, **OPTS)
    for t in range(STEPS):
        if ckpt is not None and t == 2:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        _set_grads(model, _grads(model, t))
        opt.step()
    ref = _reference(range(STEPS))
    got = _full(model)
    err = max((got[n] - v).abs().max().item() for n, v in ref.items())
    moved = max((got[n] - v).abs().max().item() for n, v in _full(_model()).items())
    # a real forward/backward through the TP layers (the gradients' own placements reach step()): the
    # loss and the updated weights equal the single-process model's on the same tokens
    tokens = torch.randint(0, CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))
    opt.zero_grad()
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    ref_weights, ref_loss = _reference(range(STEPS), tokens)
    got = _full(model)
    real = dict(loss=abs(loss.item() - ref_loss), err=max((got[n] - v).abs().max().item() for n, v in ref_weights.items()),
                moved=max((got[n] - ref[n]).abs().max().item() for n in ref))
    refused = _refused_worker_part(world) if dp == 1 else None
    plan = [b.owners for b in opt.exchange.plan.buckets]
    return dict(err=err, moved=moved, real=real, whitened=opt.whitened_matrices, plan=plan,
                placements=_placements(model), refused=refused, summary=opt.summary(),
                exchange=exchange_dtype_runs(lambda xd: _exchange_run(world, dp, xd)) if dp == 1 else None)


def _exchange_run(world, dp, exchange_dtype):
    """This rank's weights after STEPS steps with the owner exchange sending ``exchange_dtype``."""
    model = _model()
    _parallelize(model, world, dp)
    opt = SWAN(model, verbose=False, bucket_mb=0.0005, exchange_dtype=exchange_dtype, **OPTS)
    for t in range(STEPS):
        _set_grads(model, _grads(model, t))
        opt.step()
    return ({n: getattr(p, "_local_tensor", p).detach().clone() for n, p in model.named_parameters()},
            exchange_bytes(opt))


def test_tensor_parallel_w2_equals_single_process():
    res = run_distributed(_tp_worker, 2, 1)
    for r in res:
        assert r["err"] < 2e-5 and r["moved"] > 1e-3, r
        assert r["real"]["loss"] < 1e-5 and r["real"]["err"] < 5e-5 and r["real"]["moved"] > 1e-3, r["real"]
        assert r["plan"] == res[0]["plan"]
    assert res[0]["placements"]["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert res[0]["placements"]["layers.0.feed_forward.w2.weight"] == "(Shard(dim=1),)"
    assert sum(r["whitened"] for r in res) == (STEPS + 1) * MATRICES  # each matrix once per step, owner mode
    assert f"{MATRICES} matrices whitened by SWAN" in res[0]["summary"]
    for r in res:  # refused on every rank, naming the parameter and the placement
        partial, strided = r["refused"]
        assert "'proj.weight'" in partial and "Partial" in partial, partial
        assert "'proj.weight'" in strided and "_StridedShard" in strided, strided
    check_exchange_dtypes([r["exchange"] for r in res], OPTS["lr"], STEPS)  # bf16 within its bound of fp32


def test_fsdp2_plus_tp_2x2_equals_single_process_and_dcp_resumes_on_another_mesh(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    res = run_distributed(_tp_worker, 4, 2, ckpt)
    for r in res:
        assert r["err"] < 2e-5 and r["moved"] > 1e-3, r
        assert r["real"]["loss"] < 1e-5 and r["real"]["err"] < 5e-5 and r["real"]["moved"] > 1e-3, r["real"]
        assert r["plan"] == res[0]["plan"]
    pl = res[0]["placements"]
    assert pl["layers.0.feed_forward.w1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert pl["layers.0.feed_forward.w2.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert sum(r["whitened"] for r in res) == (STEPS + 1) * MATRICES
    # the checkpoint taken before step 2, resumed on the same 2x2 mesh and on TP=2 alone
    for world, dp in ((4, 2), (2, 1)):
        resumed = run_distributed(_dcp_resume_worker, world, dp, ckpt)
        for r in resumed:
            assert r["err"] < 2e-5 and r["swan_state"] == {}, (world, dp, r)


def _dcp_resume_worker(rank, world, dp, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _model()
    _parallelize(model, world, dp)
    opt = SWAN(model, verbose=False, **OPTS)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    swan_state = {k: v for k, v in state["optim"]["state"].items() if k.endswith("wq.weight") and v}
    _set_grads(model, _grads(model, 2))
    opt.step()
    ref = _reference(range(STEPS))
    got = _full(model)
    return dict(err=max((got[n] - v).abs().max().item() for n, v in ref.items()), swan_state=swan_state)
