"""DeepSpeed with "optimizer": {"type": "SWAN"} under ZeRO 0, 1 and 2 (fp32 and bf16) on real gloo processes:
final weights equal single-process SWAN on the same data, one whitening per matrix per optimizer
step under gradient accumulation, and the JSON errors a user sees."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import check_exchange_dtypes, exchange_bytes, exchange_dtype_runs, run_distributed
from swan_dist import SWAN
from test_distributed_optimizer import Net

pytestmark = pytest.mark.timeout(400)

MICRO = 2  # sequences per rank and micro-step
PARAMS = {"preset": "swan_ddagger", "lr": 0.05}
SWAN_MATRICES = {"up.weight", "down.weight", "narrow.weight", "mid.weight"}


def _batch(step: int, micro: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randint(0, 11, (world * MICRO, 6), generator=g)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _ds_worker(rank, world, stage, gas, steps, params, bf16=False, offload=False, tag=True, zero_init=False,
               masters=False, exchange=False):
    """``tag``: call swan_dist.tag_model first (else SWAN finds the engine's model itself);
    ``zero_init``: build the model under ``deepspeed.zero.Init`` (partitioned before the optimizer);
    ``masters``: also return DeepSpeed's fp32 master weights, whole; ``exchange``: also the weights and
    bytes sent of the same run under each ``exchange_dtype`` (:func:`dist_utils.exchange_dtype_runs`)."""
    import contextlib

    import deepspeed

    import swan_dist

    def train(params):
        config = {
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
            "optimizer": {"type": "SWAN", "params": params}, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
        }
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.float32) if zero_init else contextlib.nullcontext():
            model = Net()
        if tag:
            swan_dist.tag_model(model)  # DeepSpeed hands the optimizer bare parameters: keep module-type rules
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for t in range(steps):
            for m in range(gas):
                x = _batch(t, m, world)[rank * MICRO : (rank + 1) * MICRO]
                engine.backward(_loss(engine, x))
                engine.step()
        return engine, optimizer, optimizer if isinstance(optimizer, SWAN) else optimizer.optimizer

    engine, optimizer, swan = train(params)
    out = (_full_weights(engine), swan.whitened_matrices, type(optimizer).__name__, swan.summary())
    if exchange:
        def run(xd):
            engine, _, swan = train({**params, "exchange_dtype": xd})
            return _full_weights(engine), exchange_bytes(swan)
        out = (*out, exchange_dtype_runs(run))
    return (*out, _fp32_masters(engine, optimizer)) if masters else out


def _fp32_masters(engine, optimizer) -> dict[str, torch.Tensor]:
    """DeepSpeed's fp32 master weights, whole (a collective under ZeRO: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    copies = {id(lp): hp for lo, hi in zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", []))
              for lp, hp in zip(lo, hi)}  # ZeRO-0's unfused bf16 optimizer: one fp32 copy per parameter
    out = {}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[n] = (full if full is not None else copies[id(p)]).detach().float().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape).clone()
    return out


def _full_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole (ZeRO-3 holds partitions: gather them)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_id")):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _reference(world, gas, steps, params=PARAMS):
    torch.manual_seed(0)
    model = Net()
    opt = SWAN(model, verbose=False, **params)
    for t in range(steps):
        opt.zero_grad()
        for m in range(gas):
            (_loss(model, _batch(t, m, world)) / gas).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage,gas", [(0, 1), (0, 4), (1, 1), (1, 4), (2, 1), (2, 4), (3, 1), (3, 4)])
def test_zero_stage_equals_single_process(stage, gas):
    steps = 3
    exchange = (stage, gas) == (3, 1)
    res = run_distributed(_ds_worker, 2, stage, gas, steps, PARAMS, False, False, True, False, False, exchange,
                          timeout=380)
    ref = _reference(2, gas, steps)
    for weights, *_ in res:
        for n, v in ref.items():
            assert torch.allclose(weights[n], v, atol=1e-5), (stage, n, (weights[n] - v).abs().max())
    assert sum(r[1] for r in res) == steps * 4  # each matrix whitened once per optimizer step
    if exchange:  # exchange_dtype: bf16 within its bound of fp32, half the bytes; "param" as fp32
        check_exchange_dtypes([r[4] for r in res], PARAMS["lr"], steps)
    if stage:
        assert res[0][2] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")


def _reference_bf16(world, steps, params):
    """Single-process SWAN as DeepSpeed runs it in bf16: the model in bf16 (forward, backward, bf16
    gradients), fp32 master weights starting from the bf16-rounded initial weights, updated by SWAN
    from the bf16 gradients and copied back into the model after every step."""
    torch.manual_seed(0)
    master = Net()
    with torch.no_grad():
        for p in master.parameters():
            p.copy_(p.bfloat16().float())
    opt = SWAN(master, verbose=False, **params)
    low = Net().bfloat16()
    for t in range(steps):
        with torch.no_grad():
            for q, p in zip(low.parameters(), master.parameters()):
                q.copy_(p)
        low.zero_grad()
        _loss(low, _batch(t, 0, world)).backward()
        for q, p in zip(low.parameters(), master.parameters()):
            p.grad = q.grad.float()
        opt.step()
    return {n: p.detach().clone() for n, p in master.named_parameters()}


def test_bf16_stages_equal_single_process_bf16_within_a_fraction_of_a_step():
    """bf16 weights and gradients, fp32 master weights: DeepSpeed's fp32 masters after 3 steps equal a
    single-process bf16 run of SWAN (same data; the two ranks' bf16 partial gradients round differently
    from one process's, which is all that separates them) to well below one step's change, and a run
    one step short is far outside that tolerance. The fallback is SGD here: AdamW normalises the tiny,
    bf16-rounded gradients of embeddings to ±lr steps and so amplifies rounding, which is Adam's
    behaviour, not SWAN's."""
    params = {**PARAMS, "fallback": "sgd"}
    steps = 3
    ref, short = _reference_bf16(2, steps, params), _reference_bf16(2, steps - 1, params)
    step_size = params["lr"] * 0.05  # lr·α = 2.5e-3: SWAN's update entries are O(1) (norm sqrt(mn))
    # measured: SWAN matrices within 2.3e-4 (9 % of one step), a step short 3.7e-3 or more away;
    # SGD-managed tensors within 2e-5, a step short 4.7e-4 or more away
    tol = {n: 0.15 * step_size if n in SWAN_MATRICES else 5e-5 for n in ref}
    masters = {}
    for stage in (0, 1, 2, 3):
        res = run_distributed(_ds_worker, 2, stage, 1, steps, params, True, False, True, False, True, timeout=380)
        masters[stage] = got = res[0][4]
        for n in ref:
            err = (got[n] - ref[n]).abs().max().item()
            assert err < tol[n], (stage, n, err, tol[n])
            assert (got[n] - short[n]).abs().max().item() > 5 * tol[n], (stage, n)  # a dropped step shows
        # ZeRO-0 bf16 (FP16_UnfusedOptimizer) steps once on zero gradients at start-up: 4 more whitenings
        assert sum(r[1] for r in res) == steps * 4 + (4 if stage == 0 else 0)
    for n in ref:
        assert torch.equal(masters[1][n], masters[2][n]), n  # the same partitioned math


def test_json_errors_name_the_bad_key():
    bad = run_distributed(_ds_worker, 1, 1, 1, 1, {"preset": "swan_ddager"}, raw=True, timeout=200)
    assert bad[0][0] == "error" and "swan_ddager" in bad[0][3] and "swan_ddagger" in bad[0][3]
    bad = run_distributed(_ds_worker, 1, 1, 1, 1, {"momentum": 0.9}, raw=True, timeout=200)
    assert bad[0][0] == "error" and "momentum" in bad[0][3]


def _lr_worker(rank, world, configs, eta, cases):
    """One launch (DeepSpeed's first initialize in a process is the slow one) for the two tests below: the
    (use_swan, lr, alpha, weight_decay, betas, eps) of each param group of SWAN as DeepSpeed builds it from each of
    ``configs`` (the ``"params"``); and for each of ``cases`` (SWAN params beside ``"adamw_lr": eta``, a DeepSpeed
    ``"scheduler"``) the group lrs (lr x alpha on SWAN groups, the fallback's lr) as the scheduler starts and at the
    end of its 2-step warm-up, with the scheduler's ratio there, or the error DeepSpeed's initialize raised."""
    import deepspeed

    import swan_dist  # noqa: F401 - registers "SWAN"

    def build(params, scheduler=None):
        config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "SWAN", "params": params}, **({"scheduler": scheduler} if scheduler else {})}
        torch.manual_seed(0)
        model = Net()
        _, optimizer, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return optimizer, sched

    groups = []
    for params in configs:
        optimizer, _ = build(params)
        swan = optimizer if isinstance(optimizer, SWAN) else optimizer.optimizer
        groups.append([(g["use_swan"], g["lr"], g["alpha"], g["weight_decay"], g["betas"], g["eps"])
                       for g in swan.param_groups])
    warmups = []
    for params, scheduler in cases:
        try:
            optimizer, sched = build({"adamw_lr": eta, **params}, scheduler)
        except ValueError as e:
            warmups.append(str(e))
            continue

        def lrs():
            return [g["lr"] * (g["alpha"] if g["use_swan"] else 1.0) for g in optimizer.param_groups]
        start = lrs()
        for _ in range(3):  # built at iteration -1 (the min lrs): iteration 2 ends the 2-step warm-up
            sched.step()
        # WarmupCosineLR's ratio at that iteration is already cosine's first step (below 1); the others' 1
        warmups.append((start, lrs(), sched.get_lr_ratio() if hasattr(sched, "get_lr_ratio") else 1.0))
    return groups, warmups


ETA, WD = 3e-4, 0.1


@pytest.fixture(scope="module")
def json_lr_runs():
    warm = {"warmup_num_steps": 2, "warmup_type": "linear"}
    cases = [({}, {"type": "WarmupDecayLR", "params": {**warm, "total_num_steps": 10}}),
             ({"preset": "swan_0"}, {"type": "WarmupDecayLR", "params": {**warm, "total_num_steps": 10}}),
             ({}, {"type": "WarmupLR", "params": {**warm, "warmup_max_lr": ETA, "warmup_min_lr": ETA / 10}}),
             ({}, {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "total_num_steps": 10}}),
             ({}, {"type": "WarmupDecayLR", "params": {**warm, "total_num_steps": 10, "warmup_max_lr": 0.02}})]
    configs = [{"preset": "swan_ddagger", "adamw_lr": ETA, "weight_decay": WD}, {"adamw_lr": ETA}]
    return run_distributed(_lr_worker, 1, configs, ETA, cases, timeout=300)[0]


def test_deepspeed_warmup_schedulers_end_at_the_lrs_converted_from_adamw_lr(json_lr_runs):
    """With ``"adamw_lr"``, WarmupDecayLR (whose warmup_max_lr defaults to 0.001), WarmupLR given AdamW's
    warmup_max_lr and warmup_min_lr, and WarmupCosineLR end their warm-up at SWAN's converted lrs (0.2 eta on the
    matrices, 4 eta on the fallback; SWAN-0's groups apart); a warmup_max_lr other than adamw_lr is refused,
    naming the fix."""
    decay, zero, warmup, cosine, refused = json_lr_runs[1]
    for start, end, ratio in (decay, zero, warmup, cosine):
        # groups [SWAN, fallback]: the matrices at 0.2 eta, the fallback at 4 eta
        assert ratio > 0.9 and end == pytest.approx([0.2 * ETA * ratio, 4 * ETA * ratio], rel=1e-6), (start, end)
    assert warmup[0] == pytest.approx([0.02 * ETA, 0.4 * ETA], rel=1e-6)  # warmup_min_lr eta / 10, converted
    assert "warmup_max_lr=0.02" in refused and "adamw_lr" in refused and "Leave warmup_max_lr out" in refused


def test_adamw_lr_in_the_json_resolves_as_swan_does(json_lr_runs):
    """``"adamw_lr": eta`` in the JSON (with AdamW's weight decay) gives SWAN(adamw_lr=eta)'s matrix and fallback lr
    (0.2 eta, 4 eta) and weight decay (5x); ``"lr"`` stays SWAN's own lr. With ``adamw_lr`` alone, betas, eps and
    weight decay are DeepSpeed's AdamW defaults (not torch's)."""
    eta, wd = ETA, WD
    groups, defaults = json_lr_runs[0]
    # nothing but adamw_lr: DeepSpeed's AdamW defaults (FusedAdam's: (0.9, 0.999), 1e-8, no weight decay)
    assert [(b, e, w) for *_, w, b, e in defaults] == [((0.9, 0.999), 1e-8, 0.0)] * 2, defaults
    plain = SWAN(Net(), adamw_lr=eta, weight_decay=wd, verbose=False)
    resolved = sorted((u, lr * a, lr, w) for u, lr, a, w, _, _ in groups)  # fallback first: (matrix lr, lr, decay)
    expected = sorted((g["use_swan"], g["lr"] * g["alpha"], g["lr"], g["weight_decay"]) for g in plain.param_groups)
    assert len(resolved) == len(expected) and all(
        r[0] == e[0] and r[1:] == pytest.approx(e[1:]) for r, e in zip(resolved, expected)), (resolved, expected)
    assert len(resolved) == 2 and resolved[1][1] == pytest.approx(0.2 * eta) and resolved[0][2] == pytest.approx(4 * eta)
    assert all(w == pytest.approx(5 * wd) for *_, w in resolved)


@pytest.mark.parametrize("world,stage", [(1, 3), (4, 2), (4, 3), (8, 3)])
def test_other_world_sizes_equal_single_process(world, stage):
    """W=1, and W=4 where ZeRO-2's flat partitions and ZeRO-3's per-parameter partitions (ceil(numel/4),
    padded: a 2x7 matrix is 4+4+4+2) cut every matrix unevenly; ZeRO-3 at W=8, where the 2x7 matrix is
    7 pieces of 2 and an empty one."""
    res = run_distributed(_ds_worker, world, stage, 1, 2, PARAMS, timeout=380)
    ref = _reference(world, 1, 2)
    for weights, *_ in res:
        for n, v in ref.items():
            assert torch.allclose(weights[n], v, atol=1e-5), (world, stage, n, (weights[n] - v).abs().max())
    assert sum(r[1] for r in res) == 2 * 4


@pytest.mark.parametrize("stage,zero_init", [(2, False), (3, True)])
def test_untagged_model_keeps_the_plain_optimizers_rules(stage, zero_init):
    """Without swan_dist.tag_model, SWAN built by the engine from "type": "SWAN" finds the engine's
    model and tags it (also when zero.Init partitioned it first): the same rules and the same result
    as the plain optimizer."""
    res = run_distributed(_ds_worker, 2, stage, 1, 2, PARAMS, False, False, False, zero_init, timeout=380)
    if zero_init:  # zero.Init initialises differently (low-precision copies): compare with explicit tags
        ref = run_distributed(_ds_worker, 2, stage, 1, 2, PARAMS, False, False, True, zero_init, timeout=380)[0][0]
    else:
        ref = _reference(2, 1, 2)
    for weights, *_ in res:
        for n, v in ref.items():
            assert torch.allclose(weights[n], v, atol=1e-5), (stage, n, (weights[n] - v).abs().max())
    summary = res[0][3]
    assert "4 matrices whitened by SWAN, 4 tensors on the fallback rule" in summary and "name unknown" not in summary
    assert "tok_embeddings.weight" in summary and "nn.Embedding weight" in summary


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_offload_equals_single_process(stage):
    """ZeRO-Offload (``offload_optimizer: cpu``): the fp32 partitions SWAN steps live on the host."""
    res = run_distributed(_ds_worker, 2, stage, 2, 2, PARAMS, False, True, timeout=380)
    ref = _reference(2, 2, 2)
    for weights, *_ in res:
        for n, v in ref.items():
            assert torch.allclose(weights[n], v, atol=1e-5), (stage, n, (weights[n] - v).abs().max())
    assert sum(r[1] for r in res) == 2 * 4


def _ckpt_worker(rank, world, stage, ckpt, phase):
    """2 steps then save (``phase="save"``), or load (``"load"``, ``"universal"``), then 2 more steps;
    the global batch is the same at any world size (gradient accumulation makes up the ranks)."""
    import deepspeed

    import swan_dist

    torch.manual_seed(0)
    model = Net()
    swan_dist.tag_model(model)
    gas = 2 // world
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 10**9,
        "optimizer": {"type": "SWAN", "params": PARAMS}, "zero_optimization": {"stage": stage},
        "checkpoint": {"load_universal": phase == "universal"},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def train(ts):
        for t in ts:
            for m in range(gas):
                r = rank * gas + m
                x = _batch(t, 0, 2)[r * MICRO : (r + 1) * MICRO]
                engine.backward(_loss(engine, x))
                engine.step()

    at_save = None
    if phase == "save":
        train(range(2))
        engine.save_checkpoint(ckpt, tag="t2")
        at_save = _full_weights(engine)
    else:
        engine.load_checkpoint(ckpt, tag="t2_universal" if phase == "universal" else "t2")
    train(range(2, 4))
    return _full_weights(engine), at_save


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_save_and_load_checkpoint_resume_identically(tmp_path, stage):
    """engine.save_checkpoint / load_checkpoint resume bit-identically; the consolidated fp32
    weights from get_fp32_state_dict_from_zero_checkpoint are the weights at save time."""
    ckpt = str(tmp_path / "ckpt")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    saved = run_distributed(_ckpt_worker, 2, stage, ckpt, "save", timeout=380)
    resumed = run_distributed(_ckpt_worker, 2, stage, ckpt, "load", timeout=380)
    final, at_save = saved[0]
    for n, v in final.items():
        assert torch.equal(resumed[0][0][n], v), n
    fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t2")  # DeepSpeed's own consolidation
    for n, v in at_save.items():
        assert torch.equal(fp32[n].float(), v), n
    # the optimizer part: AdamW moments of the fallback partitions (+ a step each), nothing for SWAN;
    # the fp32 master partitions beside them are DeepSpeed's
    import glob

    swan_numel = sum(p.numel() for n, p in Net().named_parameters() if n in SWAN_MATRICES)
    fallback_numel = sum(p.numel() for p in Net().parameters()) - swan_numel
    state_bytes, swan_entries = 0, []
    for path in glob.glob(f"{ckpt}/t2/*_optim_states.pt"):
        osd = torch.load(path, weights_only=False)["optimizer_state_dict"]
        base = osd["base_optimizer_state"] if stage < 3 else osd["optimizer_state_dict"]
        groups = base["param_groups"]
        for g, st in base["state"].items():
            state_bytes += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
            if groups[g]["use_swan"]:
                swan_entries.append(st)
    assert swan_entries and all(st == {} for st in swan_entries)
    padding = 2 * 8 * 2  # at most 2 elements of alignment per rank and moment
    assert 8 * fallback_numel <= state_bytes - 2 * 4 <= 8 * fallback_numel + padding * 8, state_bytes


@pytest.mark.parametrize("stage", [1, 2])
def test_universal_checkpoint_loads_at_another_world_size(tmp_path, stage):
    """Saved by 2 ranks under ZeRO-1/2 (AdamW state on the fallback partition, none for SWAN matrices),
    converted by swan_dist's wrapper of DeepSpeed's ds_to_universal, loaded by 1 rank: the resumed
    run equals the uninterrupted 2-rank run, and no SWAN matrix got optimizer state."""
    from swan_dist.integrations.ds_universal import convert

    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_ckpt_worker, 2, stage, ckpt, "save", timeout=380)
    if stage == 2:  # the plain checkpoint at another world size: DeepSpeed's clear error, nothing loaded
        wrong = run_distributed(_ckpt_worker, 1, stage, ckpt, "load", raw=True, timeout=380)
        assert wrong[0][0] == "error" and "DP world size of 2" in wrong[0][3], wrong[0][:2]
    stateless = convert(f"{ckpt}/t2", f"{ckpt}/t2_universal", ["--num_extract_workers", "1", "--num_merge_workers", "1"])
    assert stateless == ["down.weight", "mid.weight", "narrow.weight", "up.weight"]
    zero = tmp_path / "ckpt" / "t2_universal" / "zero"
    assert sorted(f.name for f in (zero / "up.weight").iterdir()) == ["fp32.pt"]
    assert {"exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"} <= {f.name for f in (zero / "output.weight").iterdir()}
    resumed = run_distributed(_ckpt_worker, 1, stage, ckpt, "universal", timeout=380)
    for n, v in saved[0][0].items():
        assert torch.allclose(resumed[0][0][n], v, atol=1e-6), (n, (resumed[0][0][n] - v).abs().max())


def test_universal_conversion_of_zero3_is_refused_with_the_reason(tmp_path):
    from swan_dist.integrations.ds_universal import convert

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_ckpt_worker, 2, 3, ckpt, "save", timeout=380)
    with pytest.raises(ValueError, match="ZeRO-3 checkpoint.*same world size"):
        convert(f"{ckpt}/t2", f"{ckpt}/t2_universal")
