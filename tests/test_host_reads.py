"""Host reads per steady step (torch.Tensor's value-reading methods counted, swan_dist/host_reads.py): none
in one process, exactly one (the step's closing status) per step at W = 2, with an lr schedule running;
updates made during backward included. Steps 1-2 agree and build plans (they may read more); steps 3-5
are counted."""

from __future__ import annotations

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
    """swan_dist's host reads (and where) of each counted step, an lr scheduler stepping every step."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    per_step, where = [], {}
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
    return per_step, where


@pytest.mark.parametrize("options", [{}, {"step_in_backward": True}, {"nonfinite": "skip_step"},
                                     {"fallback": "sign"}, {"nonfinite": "raise"}],
                         ids=["ordinary", "in_backward", "skip_step", "sign", "raise"])
def test_one_process_reads_nothing(options):
    model = _model()
    opt = SWAN(model, preset="swan_ddagger", lr=0.01, verbose=False, **options)
    per_step, where = _reads(model, opt, in_backward=options.get("step_in_backward", False))
    # nonfinite="raise" pays one read per step to raise at once
    assert per_step == [1 if options.get("nonfinite") == "raise" else 0] * (STEPS - WARM), where


def _dist_worker(rank, world, layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _model()
    in_backward = layout == "fsdp2_in_backward"
    if layout == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        opt = SWAN(model, preset="swan_ddagger", lr=0.01, verbose=False)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        opt = SWAN(model, preset="swan_ddagger", lr=0.01, verbose=False, step_in_backward=in_backward)
    return _reads(wrapped, opt, rank, in_backward)


@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "fsdp2_in_backward"])
def test_two_ranks_read_the_status_once(layout):
    for per_step, where in run_distributed(_dist_worker, 2, layout, timeout=240):
        assert per_step == [1] * (STEPS - WARM), where
        assert all("engine.py" in w and "tolist" in w for w in where), where


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
    for per_step, where, _ in run_distributed(_zero_worker, 2, stage, timeout=380):
        # DeepSpeed calls SWAN.step() once per param group (ZeRO-1/2) or sub-group (ZeRO-3), the others
        # taken out of param_groups: each part keeps its own agreement, one read per call
        assert all(n == calls == 2 for n, calls in per_step), (per_step, where)
        assert all("engine.py" in w for w in where), where
