"""Hugging Face: Accelerate's FSDP2 preparation swapping SWAN's parameters, and Transformers' Trainer under
DDP, FSDP2 and DeepSpeed ZeRO-2/3 (real transformers and accelerate, CPU, gloo, a tiny Llama from a config).

- Accelerate FSDP2, SWAN built before ``prepare`` (Accelerate swaps the sharded DTensors into
  ``param_groups``) and after: both equal single-process SWAN on the same batches, and no reference to the
  replaced full-size parameters remains (weak references, after ``gc.collect``), right after ``prepare``.
- Trainer (tests/hf_trainer_job.py under torchrun, one launch per configuration): the entry point
  ``swan_dist.SWANFactory`` and the bare ``optimizer_cls_and_kwargs=(swan_dist.SWAN, ...)`` under DDP and
  FSDP2, and ``"optimizer": {"type": "SWAN"}`` under ZeRO-2 and ZeRO-3: the loss falls, the summary puts
  the embeddings and ``lm_head`` on the fallback, FSDP2 trains exactly as DDP does.
- Single process: a one-to-one swap moves fallback state and rule tags to the new tensors and frees the
  old; DeepSpeed's adapter claims only its own flat partitions.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

from dist_utils import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(400)

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128))


def _qwen3_moe():
    """A tiny Qwen3-MoE: 4 experts (top 2) in layer 0, a dense MLP in layer 1 (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=128, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]))


MODELS = {"llama": _llama, "qwen3_moe": _qwen3_moe}


def _batch(t: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(t))


def _accelerate_worker(rank, world, steps, kind="llama", orders=("before", "after")):
    """Both orders with one Accelerator whose real FSDP2 path runs (``Accelerator.prepare`` ->
    ``_prepare_fsdp2`` -> ``fsdp2_prepare_model`` and ``fsdp2_switch_optimizer_parameters``). Every rank
    trains on the same batches, so the averaged gradient is the single-process one."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    import swan_dist

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    acc = Accelerator(fsdp_plugin=plugin)
    # On the CPU Accelerate picks MULTI_CPU (DDP) whatever the plugin; on GPUs this plugin gives FSDP.
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2
    out = {}
    for order in orders:
        model = MODELS[kind]()
        if order == "before":  # the order Accelerate's docs teach, and Trainer's under FSDP2
            opt = swan_dist.SWAN(model, verbose=False)
            originals = [weakref.ref(p) for p in model.parameters()]
        else:  # the model already sharded by Accelerate's own function, SWAN built on it, then prepare
            model = fsdp2_prepare_model(acc, model)
            opt = swan_dist.SWAN(model, verbose=False)
            originals = []
        model, opt = acc.prepare(model, opt)
        swan = opt.optimizer
        gc.collect()
        alive_after_prepare = sum(r() is not None for r in originals)
        for t in range(steps):
            x = _batch(t)
            acc.backward(model(input_ids=x, labels=x).loss)
            opt.step()
            opt.zero_grad()
        gc.collect()
        out[order] = {
            "alive": (alive_after_prepare, sum(r() is not None for r in originals), len(originals)),
            "weights": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "types": sorted({type(p).__name__ for g in swan.param_groups for p in g["params"]}),
            "origin_types": sorted({type(q).__name__ for g in swan._origin for _, q in g}),
            "summary": swan.summary(),
            "state": sorted({type(v).__name__ for st in swan.state.values() for k, v in st.items() if k != "step"}),
        }
    return out


def _single_process(kind: str):
    """The model of ``kind`` trained STEPS steps by single-process SWAN on the workers' batches."""
    import swan_dist

    model = MODELS[kind]()
    opt = swan_dist.SWAN(model, verbose=False)
    for t in range(STEPS):
        x = _batch(t)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_accelerate_fsdp2_swan_before_and_after_prepare():
    results = run_distributed(_accelerate_worker, 2, STEPS, timeout=240)
    model, opt = _single_process("llama")
    want = {n: p.detach() for n, p in model.named_parameters()}
    start = _llama().state_dict()
    for order in ("before", "after"):
        for rank in range(2):
            got = results[rank][order]
            assert got["types"] == ["DTensor"] and got["origin_types"] == ["DTensor"], (order, got["types"])
            assert got["state"] == ["DTensor"]  # AdamW moments of the fallback tensors live on the shards
            assert got["summary"] == opt.summary()
            assert set(got["weights"]) == set(want)
            for n, w in want.items():
                assert not torch.equal(w, start[n]), n  # every parameter moved
                torch.testing.assert_close(got["weights"][n], w, rtol=1e-5, atol=2e-6, msg=f"{order} {n}")
        alive_prepare, alive_end, total = results[0][order]["alive"]
        assert (alive_prepare, alive_end) == (0, 0), f"{order}: SWAN keeps replaced parameters alive"
    assert results[0]["before"]["alive"][2] == len(want)


def test_accelerate_fsdp2_qwen3_moe_equals_single_process():
    """A MoE model under Accelerate's FSDP2: the expert stacks are row-sharded DTensors; each expert (gate and
    up apart) is whitened once, the router as a matrix, and the weights equal single-process SWAN's."""
    results = run_distributed(_accelerate_worker, 2, STEPS, "qwen3_moe", ("before",), timeout=240)
    model, opt = _single_process("qwen3_moe")
    rows = {line.split()[1]: line for line in opt.summary().splitlines()[1:] if line.startswith(("  SWAN", "  fallback"))}
    assert "MoE experts of Qwen3MoeExperts (E=4), stored (E, out, in): whitened per expert, as gate, up" in \
        rows["model.layers.*.mlp.experts.gate_up_proj"]
    assert rows["model.layers.*.mlp.gate.weight"].split()[0] == "SWAN"  # the router: a matrix
    assert opt.whitened_matrices == STEPS * (8 + 3 + 1 + 4 + 4 * 2)  # attention, dense MLP, router, experts
    for rank in range(2):
        got = results[rank]["before"]
        assert got["summary"] == opt.summary()
        for n, p in model.named_parameters():
            torch.testing.assert_close(got["weights"][n], p.detach(), rtol=1e-5, atol=2e-6, msg=n)


# ---------------------------------------------------------------------------------------- Trainer
@functools.lru_cache(maxsize=None)
def _trainer_job(config: str, out_dir: str) -> dict:
    """One torchrun launch of tests/hf_trainer_job.py per configuration, shared by the tests."""
    os.makedirs(out_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SWAN_DIST_CPU_BF16": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "hf_trainer_job.py"), config, out_dir]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360, cwd=out_dir)
    ranks = []
    for r in range(2):
        path = os.path.join(out_dir, f"{r}.json")
        assert os.path.exists(path), f"{config}: rank {r} wrote no result (rc={proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        with open(path) as f:
            ranks.append(json.load(f))
    return {"ranks": ranks, "stdout": proc.stdout}


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("hf_trainer"))
    return lambda config: _trainer_job(config, os.path.join(base, config))


def _check_run(run: dict, label: str) -> None:
    losses = run["losses"]
    assert len(losses) == 6 and all(map(lambda v: v == v, losses)), (label, losses)
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, f"{label}: loss did not fall: {losses}"
    rows = run["summary"].splitlines()
    assert rows[0].startswith("swan_dist.SWAN (preset=swan_ddagger): 14 matrices whitened by SWAN, 7 tensors"), rows[0]
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        row = next(r for r in rows if f" {name} " in r)
        assert row.split()[0] == "fallback:adamw", (label, row)
    assert not any("name unknown" in r for r in rows), label
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        row = next(r for r in rows if f".{proj}.weight " in r)
        assert row.split()[0] == "SWAN", (label, row)


def _check_schedule(run: dict, label: str) -> None:
    """Trainer's linear schedule from lr 0.02 drives every SWAN and fallback group (ends at 0)."""
    logged = run["logged_lr"]
    # (DeepSpeed's engine steps the scheduler before the Trainer logs: its first logged lr is one step on)
    assert 0.015 < logged[0] <= 0.02 and all(x > y for x, y in zip(logged, logged[1:])), (label, logged)
    assert len(run["lr"]) >= 2 and run["lr"] == [0.0] * len(run["lr"]), (label, run["lr"])


def test_trainer_entry_point_ddp_and_fsdp2(trainer_job):
    """``SWANFactory`` and the bare ``(SWAN, kwargs)`` under Trainer's DDP and FSDP2 (transformers 5's
    ``fsdp=`` / ``fsdp_config={"version": 2}``): SWAN is built before ``accelerator.prepare``, which swaps
    in the DTensors under FSDP2; the same data and seed give the same losses in all four runs."""
    runs = {}
    for config in ("ddp", "fsdp2"):
        job = trainer_job(config)
        for variant in ("factory", "bare"):
            r0, r1 = (job["ranks"][r][variant] for r in range(2))
            assert r0["losses"] == r1["losses"] and r0["summary"] == r1["summary"]
            assert r0["whitened"] + r1["whitened"] == 14 * 6  # owner mode: each matrix once per step, on one rank
            _check_run(r0, f"{config}/{variant}")
            assert r0["types"] == (["DTensor"] if config == "fsdp2" else ["Parameter"]), (config, variant, r0["types"])
            _check_schedule(r0, f"{config}/{variant}")
            runs[(config, variant)] = r0["losses"]
    ref = runs[("ddp", "factory")]
    for key, losses in runs.items():
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-5), (key, losses, ref)


def test_trainer_deepspeed_zero2_and_zero3(trainer_job):
    """``"optimizer": {"type": "SWAN", "params": {"lr": "auto"}}`` under Trainer's DeepSpeed integration, and at
    ZeRO-2 ``{"adamw_lr": "learning_rate"}`` (the Trainer's ``learning_rate`` as AdamW's, converted by the lr
    convention; Accelerate refuses an ``"auto"`` it does not know).
    (On the CPU Accelerate counts one process under DeepSpeed, so both ranks read the same batches; ZeRO
    still partitions over both.)"""
    losses = {}
    for config in ("zero2", "zero3"):
        job = trainer_job(config)
        r0, r1 = (job["ranks"][r]["json"] for r in range(2))
        assert r0["losses"] == r1["losses"]
        assert r0["whitened"] + r1["whitened"] == 14 * 6
        _check_run(r0, config)
        _check_schedule(r0, config)  # "auto" took TrainingArguments.learning_rate
        losses[config] = r0["losses"]
        if config == "zero2":  # "adamw_lr": "learning_rate" with learning_rate 0.005: SWAN's lr 4x it, the same run
            converted = job["ranks"][0]["json-adamw"]
            _check_run(converted, "zero2, adamw_lr")
            assert converted["losses"] == pytest.approx(r0["losses"], rel=1e-5, abs=1e-5)
            assert converted["logged_lr"] == pytest.approx(r0["logged_lr"], rel=1e-6)
    assert losses["zero3"] == pytest.approx(losses["zero2"], rel=1e-5, abs=1e-5)


def test_trainer_deepspeed_zero3_trains_a_moe_model(trainer_job):
    """Qwen3-MoE under Trainer + DeepSpeed ZeRO-3 with the JSON's SWAN: experts whitened per expert (gate and
    up apart), each once per step on one rank; the router a matrix; the loss falls."""
    job = trainer_job("zero3-moe")
    r0, r1 = (job["ranks"][r]["json"] for r in range(2))
    assert r0["losses"] == r1["losses"] and r0["summary"] == r1["summary"]
    assert r0["whitened"] + r1["whitened"] == (8 + 3 + 1 + 4 + 4 * 2) * 6
    losses = r0["losses"]
    assert len(losses) == 6 and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.3, losses
    rows = r0["summary"].splitlines()
    expert = next(r for r in rows if " model.layers.*.mlp.experts.gate_up_proj " in r)
    assert expert.split()[0] == "SWAN" and "whitened per expert, as gate, up" in expert, expert
    assert next(r for r in rows if " model.layers.*.mlp.gate.weight " in r).split()[0] == "SWAN"
    _check_schedule(r0, "zero3-moe")


# ---------------------------------------------------------------------------------------- single process
def test_one_to_one_swap_moves_state_and_tags_and_frees_originals():
    """A framework replacing every tensor of the groups by a same-shape copy (as DeepSpeed's fp32 copies,
    or Accelerate with plain tensors) after a step: the copies take the fallback state and rule tags, and
    the run continues exactly as without the swap; the replaced tensors are freed."""
    import copy
    import pickle

    import swan_dist
    from swan_dist.selection import tagged_name

    # reference: no swap; each step's gradients remembered by position in the groups
    model = _llama()
    opt = swan_dist.SWAN(model, verbose=False)
    order = [p for g in opt.param_groups for p in g["params"]]
    grads = {}
    for t in range(3):
        x = _batch(t)
        model(input_ids=x, labels=x).loss.backward()
        grads[t] = [p.grad.clone() for p in order]
        opt.step()
        opt.zero_grad()
    stateful = {i for i, p in enumerate(order) if opt.state.get(p)}

    model2 = _llama()
    opt2 = swan_dist.SWAN(model2, verbose=False)
    x = _batch(0)
    model2(input_ids=x, labels=x).loss.backward()
    opt2.step()
    opt2.zero_grad()
    olds = []
    for g in opt2.param_groups:  # the framework's copies replace the model's tensors in the groups
        olds += [weakref.ref(p) for p in g["params"]]
        g["params"] = [torch.nn.Parameter(p.detach().clone()) for p in g["params"]]
    del model2
    new = [p for g in opt2.param_groups for p in g["params"]]
    assert all(tagged_name(p) is None for p in new)
    for t in (1, 2):
        for i, p in enumerate(new):
            p.grad = grads[t][i].clone()
        opt2.step()
        opt2.zero_grad()
    gc.collect()
    assert all(r() is None for r in olds), "SWAN keeps replaced tensors alive"
    for i, (p, w) in enumerate(zip(new, order)):
        torch.testing.assert_close(p.detach(), w.detach(), rtol=0, atol=0, msg=f"tensor {i}")
    assert {i for i, p in enumerate(new) if opt2.state.get(p)} == stateful and stateful
    names = [n for g in opt2._origin for n, _ in g]
    assert [tagged_name(p) for p in new] == names and "lm_head.weight" in names
    # torch's deep copy and pickling keep working with the weakly held originals
    for clone in (copy.deepcopy(opt2), pickle.loads(pickle.dumps(opt2))):
        assert [n for g in clone._origin for n, _ in g] == names
        assert all(q is not None for g in clone._origin for _, q in g)  # held by the copy's own param_groups


def test_deepspeed_adapter_claims_only_its_partitions():
    """A group whose originals carry DeepSpeed's ``_hp_mapping`` (a DeepSpeed-prepared model) replaced by
    something that is not a flat fp32 partition (2-D tensors, one per original) is not DeepSpeed's: the
    generic one-to-one adoption takes it."""
    from swan_dist.adapter import adopt
    from swan_dist.integrations.deepspeed import replaced_pieces

    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, 3))
    a._hp_mapping = b._hp_mapping = None
    originals = [("a", a), ("b", b)]
    copies = [torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())]
    assert replaced_pieces(originals, copies, True, 0, None) is None
    assert replaced_pieces(originals, [torch.zeros(3, 3)], True, 0, None) is None  # one tensor, but not flat
    pieces, one_to_one = adopt(originals, copies, True, 0, None)
    assert one_to_one and [pc.target for pc in pieces] == copies
    with pytest.raises(ValueError, match=r"param group 0's 2 tensors .*'a', 'b'.* \[\[4, 3\], \[5, 3\]\]"):
        adopt([("a", None), ("b", None)], [torch.zeros(3, 4), torch.zeros(5, 3)], True, 0, None, [(4, 3), (5, 3)])


def test_trainer_learning_rate_as_adamw_lr_resolves_as_swan_does(tmp_path):
    """``adamw_lr="auto"`` takes the Trainer's ``learning_rate`` as AdamW's lr: through ``SWANFactory`` (with the
    Trainer's weight decay, betas and eps) and through SWAN itself (the bare form, and DeepSpeed's ``"adamw_lr":
    "auto"``, which SWAN resolves the same way, finding the Trainer up the stack); ``{"adamw_lr": eta}`` too. Each
    gives SWAN(adamw_lr=eta)'s matrix and fallback lr: 0.2 eta and 4 eta."""
    from transformers import Trainer, TrainingArguments

    import swan_dist

    eta, wd = 3e-4, 0.1

    def lrs(opt):
        swan = next(g for g in opt.param_groups if g["use_swan"])
        rest = next(g for g in opt.param_groups if not g["use_swan"])
        return swan["lr"] * swan["alpha"], rest["lr"]

    def built(cls, kwargs):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, learning_rate=eta, weight_decay=wd,
                                 adam_beta2=0.95, report_to=[])
        return Trainer(model=_llama(), args=args, optimizer_cls_and_kwargs=(cls, {"verbose": False, **kwargs})
                       ).create_optimizer()

    plain = swan_dist.SWAN(_llama(), adamw_lr=eta, weight_decay=wd, verbose=False)
    assert lrs(plain) == pytest.approx((0.2 * eta, 4 * eta))
    factory = built(swan_dist.SWANFactory, {"adamw_lr": "auto"})
    assert lrs(factory) == pytest.approx(lrs(plain))
    assert all(g["weight_decay"] == pytest.approx(5 * wd) and g["betas"] == (0.9, 0.95) for g in factory.param_groups)
    numeric = built(swan_dist.SWANFactory, {"adamw_lr": eta})  # the Trainer's betas, eps, weight decay too
    assert lrs(numeric) == pytest.approx(lrs(plain))
    assert all(g["weight_decay"] == pytest.approx(5 * wd) and g["betas"] == (0.9, 0.95) for g in numeric.param_groups)
    bare = built(swan_dist.SWAN, {"adamw_lr": "auto"})  # the Trainer's decay groups: AdamW's weight decay, converted
    assert lrs(bare) == pytest.approx(lrs(plain))
    assert sorted({round(g["weight_decay"], 9) for g in bare.param_groups}) == [0.0, 5 * wd]
    assert all(g["betas"] == (0.9, 0.95) and g["eps"] == 1e-8 for g in bare.param_groups)
