"""Host reads per steady step (torch.Tensor's value-reading methods counted, swan_dist/host_reads.py): none
in one process, exactly one (the step's closing status) per step at W = 2, with an lr schedule running;
updates made during backward included. Steps 1-2 agree and build plans (they may read more); steps 3-5
are counted. Layouts at W = 2: DDP, FSDP2 (in backward too), TP (DTensor Shard on a 2-rank mesh) and
megatron-core's distributed optimizer, all in one launch; HSDP on a 2 x 2 (replicate, shard) mesh at
W = 4; DeepSpeed ZeRO-2/3 (one read per SWAN.step() call). Reads made elsewhere (torch, a framework)
are counted apart: torch makes none, Megatron reads its grad norm (MEGATRON_READS)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dist_utils import run_distributed
from swan_dist.host_reads import HostReads
from torch import nn

from swan_dist import SWAN
from swan_dist.reference.model import Llama, model_config

STEPS, WARM = 5, 2


def _model():
    torch.manual_seed(0)
    return Llama(model_config("tiny", dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16))


def _reads(model, opt, rank=0, in_backward=False):
    """swan_dist's host reads of each counted step, where they were made, and the reads made elsewhere (torch,
    a framework) per counted step: an lr scheduler stepping every step. ``rank`` seeds the batch."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    per_step, where, others = [], {}, Counter()
    for t in range(STEPS):
        torch.manual_seed(100 + t + rank)
        x = torch.randint(0, 64, (2, 16))
        with HostReads() as reads:
            opt.zero_grad()
            loss = model(x).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            sched.step()
        if t >= WARM:
            per_step.append(reads.n_ours)
            where.update(reads.ours)
            others.update(reads.others)
    return per_step, where, others


@pytest.mark.parametrize("options", [{}, {"step_in_backward": True}, {"nonfinite": "skip_step"},
                                     {"fallback": "sign"}, {"nonfinite": "raise"}, {"capturable": True},
                                     {"capturable": True, "step_in_backward": True}],
                         ids=["ordinary", "in_backward", "skip_step", "sign", "raise", "capturable",
                              "capturable_in_backward"])
def test_one_process_reads_nothing(options):
    model = _model()
    opt = SWAN(model, preset="swan_ddagger", lr=0.01, verbose=False, **options)
    per_step, where, _ = _reads(model, opt, in_backward=options.get("step_in_backward", False))
    # nonfinite="raise" pays one read per step to raise at once
    assert per_step == [1 if options.get("nonfinite") == "raise" else 0] * (STEPS - WARM), where


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _torch_case(rank, world, layout):
    """One layout of the reference model: DDP, FSDP2 (in backward too, with capturable=True too), HSDP (FSDP2 on a 2 x W/2
    (replicate, shard) mesh), TP (DTensor ``Shard`` on the whole world: ColwiseParallel / RowwiseParallel)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = _model()
    in_backward = layout == "fsdp2_in_backward"
    if layout == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    elif layout == "hsdp":
        wrapped = _fsdp2(model, init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    elif layout == "tp":
        from test_tensor_parallel import _parallelize

        _parallelize(model, world, 1)
        wrapped, rank = model, 0  # the TP ranks see the same batch
    else:
        wrapped = _fsdp2(model, init_device_mesh("cpu", (world,)))
    opt = SWAN(model, preset="swan_ddagger", lr=0.01, verbose=False, step_in_backward=in_backward,
               capturable=layout == "fsdp2_capturable")
    weights = {n: getattr(p, "_local_tensor", p).detach() for n, p in model.named_parameters()}  # this rank's shards
    return (*_reads(wrapped, opt, rank, in_backward), weights)


def _megatron_case(rank, world):
    """megatron-core's distributed optimizer over DP = W (``get_swan_optimizer``, Megatron's default
    clip_grad 1.0), a step of Megatron's pipeline schedule, Megatron's lr scheduler stepping every step. The
    harness's own loss reads (tests/megatron_harness.py) are left out of the framework's."""
    import contextlib
    import io

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig

    import megatron_harness as H
    from swan_dist.integrations.megatron_factory import get_swan_optimizer

    H.install_cpu_shims()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        chunks, _ = H.build_gpt(1, use_distributed_optimizer=True, vocab=64, seq=16, layers=2)
        with contextlib.redirect_stdout(io.StringIO()):
            opt = get_swan_optimizer(OptimizerConfig(lr=1e-2, min_lr=1e-3, weight_decay=0.1, use_distributed_optimizer=True),
                                     chunks, swan={"verbose": False, "bucket_mb": 0.01})
        kinds = [type(w).__name__ for w in opt.chained_optimizers]
        sched = H.lr_schedule(opt, 1e-2, STEPS, 0.1)
        per_step, where, others = [], {}, Counter()
        for t in range(STEPS):
            batch = H.dp_share(H.global_batch(t, 4, 16, 64), rank, world)
            with HostReads() as reads:
                H.train_step(chunks, opt, batch)
                sched.step(1)
            if t >= WARM:
                per_step.append(reads.n_ours)
                where.update(reads.ours)
                others.update({w: n for w, n in reads.others.items() if "megatron_harness.py" not in w})
        return per_step, where, others, kinds
    finally:
        ps.destroy_model_parallel()


W2 = ("ddp", "fsdp2", "fsdp2_in_backward", "fsdp2_capturable", "tp", "megatron_distopt")


def _w2_worker(rank, world, layouts):
    """Every W = 2 layout, one after another in the same two processes (one launch)."""
    out = {}
    for layout in layouts:
        if layout == "megatron_distopt":
            out[layout] = _megatron_case(rank, world) if _has_megatron() else None
        else:
            out[layout] = _torch_case(rank, world, layout)
    return out


def _hsdp_worker(rank, world):
    return {"hsdp": _torch_case(rank, world, "hsdp")}


def _has_megatron() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron.core") is not None


_DONE: dict = {}


def _launch(name):
    """[rank] -> {layout: result} of a launch, run once per test process."""
    if name not in _DONE:
        _DONE[name] = (run_distributed(_w2_worker, 2, W2, timeout=360) if name == "w2"
                       else run_distributed(_hsdp_worker, 4, timeout=240))
    return _DONE[name]


def _per_step_others(others):
    return {w: n / (STEPS - WARM) for w, n in sorted(others.items())}


# the reads Megatron makes itself per step: its grad norm for clip_grad (1.0, its default) read once
# (clip_grads.py's total_norm.item()); on a host without apex / Transformer Engine (this CPU harness) its
# stand-in l2 norm reads once more (utils.py's local_multi_tensor_l2_norm). fp32: no grad scaler, no found_inf
MEGATRON_READS = ("megatron/core/optimizer/clip_grads.py", "megatron/core/utils.py")


@pytest.mark.parametrize("layout", [*W2, "hsdp"])
def test_two_ranks_read_the_status_once(layout):
    """swan_dist reads the step's closing status once per step (at W = 4 for HSDP's 2 x 2 mesh). torch
    (DDP, FSDP2, DTensor) reads nothing in a steady step; Megatron reads its grad norm."""
    if layout == "megatron_distopt" and not _has_megatron():
        pytest.skip("megatron-core not installed")
    results = [r[layout] for r in _launch("hsdp" if layout == "hsdp" else "w2")]
    for res in results:
        per_step, where, others = res[:3]
        assert per_step == [1] * (STEPS - WARM), (where, _per_step_others(others))
        assert all("engine.py" in w and "tolist" in w for w in where), where
        if layout == "megatron_distopt":
            assert res[3] == ["SwanDistributedOptimizer"], res[3]  # Megatron's distributed optimizer, SWAN inside
            assert others and all(any(m in w for m in MEGATRON_READS) for w in others), others
            assert sum(others.values()) <= 2 * (STEPS - WARM), _per_step_others(others)
        else:
            assert not others, _per_step_others(others)


def test_fsdp2_capturable_equals_fsdp2():
    """The capturable step (options on the device; the AdamW fallback in foreach ops, not fused) of the same
    FSDP2 run at W = 2 lands on the ordinary step's weights, shard by shard, under the same lr schedule."""
    for res in _launch("w2"):
        ordinary, capturable = res["fsdp2"][3], res["fsdp2_capturable"][3]
        assert ordinary.keys() == capturable.keys()
        for n, w in ordinary.items():
            torch.testing.assert_close(capturable[n], w, rtol=1e-4, atol=1e-5, msg=lambda s, n=n: f"{n}: {s}")


def test_the_counter_sees_a_read():
    """The counter is live: a read made from swan_dist's code is counted, one made elsewhere is not."""
    from swan_dist.agreement import nonfinite_grads

    with HostReads() as reads:
        torch.ones(3).tolist()
        nonfinite_grads([("w", "skip")], torch.tensor([1]).tolist())
    assert reads.n_ours == 0 and sum(reads.others.values()) == 2
    from swan_dist.rules.apply import Missed

    m = Missed()
    m.add(["w"], torch.tensor([True]))
    with HostReads() as reads:
        assert m.names() == ["w"]
    assert reads.n_ours == 1


def _zero_worker(rank, world, stage):
    """DeepSpeed ZeRO with "type": "SWAN": swan_dist's reads and SWAN.step() calls per engine step (ZeRO-3
    calls it once per sub-group), and the reads made elsewhere (DeepSpeed's own), by place."""
    import deepspeed
    from test_deepspeed import MICRO, _batch, _loss
    from test_distributed_optimizer import Net

    import swan_dist

    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9,
              "optimizer": {"type": "SWAN", "params": {"preset": "swan_ddagger", "lr": 0.05}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
              "zero_optimization": {"stage": stage}}
    torch.manual_seed(0)
    model = Net()
    swan_dist.tag_model(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    calls = [0]
    step = SWAN.step

    def counted(self, *a, **k):
        calls[0] += 1
        return step(self, *a, **k)

    SWAN.step = counted
    per_step, where, others = [], {}, {}
    for t in range(STEPS):
        x = _batch(t, 0, world)[rank * MICRO: (rank + 1) * MICRO]
        engine.backward(_loss(engine, x))
        calls[0] = 0
        with HostReads() as reads:
            engine.step()
        if t >= WARM:
            per_step.append((reads.n_ours, calls[0]))
            where.update(reads.ours)
            others.update(reads.others)
    SWAN.step = step
    return per_step, where, others


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_reads_the_status_once_per_optimizer_step(stage):
    for per_step, where, others in run_distributed(_zero_worker, 2, stage, timeout=380):
        # DeepSpeed calls SWAN.step() once per param group (ZeRO-1/2) or sub-group (ZeRO-3), the others
        # taken out of param_groups: each part keeps its own agreement, one read per call
        assert all(n == calls == 2 for n, calls in per_step), (per_step, where)
        assert all("engine.py" in w for w in where), where
        # DeepSpeed's own: its grad-norm check (runtime/utils.py, is_invalid_grad_norm), at most one per step
        assert all("deepspeed/runtime/utils.py" in w for w in others) and sum(others.values()) <= 3, others
