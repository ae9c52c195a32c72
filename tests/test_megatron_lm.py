"""Megatron-LM's unmodified ``pretrain_gpt.py`` with ``--optimizer swan`` through swan_dist's launcher,
on CPU with gloo (CUDA shims in ``tests/megatron_lm_cpu.py`` only). Needs a Megatron-LM checkout at
the tag matching the megatron-core pin (``core_v0.16.1``), given by ``SWAN_MEGATRON_LM=/path``;
skipped otherwise (Megatron-LM is not on PyPI)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dist_utils import _free_port

CHECKOUT = os.environ.get("SWAN_MEGATRON_LM")
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not CHECKOUT or not os.path.isfile(os.path.join(CHECKOUT or "", "pretrain_gpt.py")),
                       reason="set SWAN_MEGATRON_LM to a Megatron-LM checkout at tag core_v0.16.1"),
]
HERE = os.path.dirname(os.path.abspath(__file__))
TINY = """--optimizer swan --distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion
--use-cpu-initialization --no-rope-fusion --no-persist-layer-norm --no-bias-swiglu-fusion --no-bias-dropout-fusion
--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --make-vocab-size-divisible-by 64 --num-layers 2
--hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu
--position-embedding-type rope --normalization RMSNorm --disable-bias-linear --attention-dropout 0 --hidden-dropout 0
--seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4
--lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --log-interval 1 --eval-iters 0 --eval-interval 1000
--seed 1234""".split()


def _run(*extra: str, ok: bool = True, nproc: int = 2) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
           os.path.join(HERE, "megatron_lm_cpu.py"), os.path.join(CHECKOUT, "pretrain_gpt.py"), *TINY, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    assert (p.returncode == 0) == ok, out[-4000:]
    return out


def _losses(out: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in re.findall(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", out)}


def _resumed(out: str) -> dict[int, float]:
    """Per-iteration losses of a run resumed at iteration 2. Megatron-LM's first log after a resume
    (iteration 3) shows that iteration's loss; the next one (iteration 4) the mean of iterations 3 and 4
    (its sums restart at the resume, its count does not), so iteration 4's own loss is 2 * logged - L3."""
    logged = _losses(out)
    assert sorted(logged) == [3, 4], logged
    return {3: logged[3], 4: 2 * logged[4] - logged[3]}


def test_pretrain_gpt_with_optimizer_swan(tmp_path):
    """TP=2, DP=2 with the distributed optimizer and DP=2 DDP train alike (the same loss at every
    iteration: the same initial weights, data and SWAN update whatever the layout); torch_dist
    checkpoints saved at iteration 2 resume to the uninterrupted run's iterations 3 and 4: TP=2
    without the distributed optimizer, and DP=2 with it, resumed at DP=2 and at DP=1."""
    tp = _run("--tensor-model-parallel-size", "2", "--train-iters", "4")
    assert "matrices whitened by SWAN" in tp and "whitened as Q, K, V" in tp and "whitened as gate, up" in tp
    assert "embedding.word_embeddings.weight" in tp or "word_embeddings" in tp
    ref = _losses(tp)
    assert sorted(ref) == [1, 2, 3, 4] and ref[1] != ref[4]
    dp = _losses(_run("--use-distributed-optimizer", "--train-iters", "4"))
    assert all(abs(dp[i] - ref[i]) < 1e-5 for i in (1, 2, 3, 4)), (dp, ref)  # fp32 sums in another order
    ckpt = str(tmp_path / "ckpt")
    first = _losses(_run("--tensor-model-parallel-size", "2", "--train-iters", "4", "--save", ckpt,
                         "--save-interval", "2", "--exit-interval", "2", "--ckpt-format", "torch_dist"))
    assert first == {1: ref[1], 2: ref[2]}
    resumed = _resumed(_run("--tensor-model-parallel-size", "2", "--train-iters", "4", "--load", ckpt,
                            "--ckpt-format", "torch_dist"))
    # iteration 3 checks the weights loaded, iteration 4 the optimizer state too (AdamW fallback moments)
    assert all(abs(resumed[i] - ref[i]) < 3e-6 for i in (3, 4)), (resumed, ref)
    # the distributed optimizer: swan_dist's own torch_dist format, reloaded at DP=2 and at DP=1
    dckpt = str(tmp_path / "dckpt")
    distopt = ("--use-distributed-optimizer", "--train-iters", "4", "--ckpt-format", "torch_dist")
    first = _losses(_run(*distopt, "--save", dckpt, "--save-interval", "2", "--exit-interval", "2"))
    assert all(abs(first[i] - dp[i]) < 1e-6 for i in (1, 2)), (first, dp)
    for nproc in (2, 1):
        resumed = _resumed(_run(*distopt, "--load", dckpt, nproc=nproc))
        assert all(abs(resumed[i] - dp[i]) < 1e-5 for i in (3, 4)), (nproc, resumed, dp)
    refused = _run("--use-distributed-optimizer", "--train-iters", "2", "--save", ckpt, "--save-interval", "2",
                   "--ckpt-format", "torch", ok=False)
    assert "--ckpt-format torch_dist" in refused, refused[-3000:]


MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-dtype", "fp32", "--moe-router-load-balancing-type",
       "aux_loss", "--moe-aux-loss-coeff", "0.01", "--use-distributed-optimizer", "--train-iters", "4",
       "--ckpt-format", "torch_dist", "--micro-batch-size", "1")  # (the later flag wins over TINY's)


def test_pretrain_gpt_moe_with_expert_parallelism(tmp_path):
    """``--num-experts 4 --expert-model-parallel-size 2`` with ``--optimizer swan`` and the distributed
    optimizer at W=2: a dense SWAN over both ranks and an expert SWAN per expert-parallel rank (its local
    experts, gate and up apart); the loss falls; a torch_dist checkpoint saved at iteration 2 resumes to
    the uninterrupted run's iterations 3 and 4. At W=4 (EP=2 x DP=2: each expert on two ranks, whitened by
    one) the run equals the W=2 one, and its checkpoint resumes at W=2 (``--no-load-rng``: Megatron's own
    RNG state is saved per DP rank)."""
    out = _run(*MOE)
    assert out.count("swan_dist.SWAN (preset=swan_ddagger)") == 2, out[-4000:]  # dense, then experts
    assert "local_experts.*.linear_fc1.weight x4" in out and "whitened as gate, up" in out
    ref = _losses(out)
    assert sorted(ref) == [1, 2, 3, 4] and ref[4] < ref[1]
    ckpt = str(tmp_path / "ckpt")
    first = _losses(_run(*MOE, "--save", ckpt, "--save-interval", "2", "--exit-interval", "2"))
    assert first == {1: ref[1], 2: ref[2]}
    resumed = _resumed(_run(*MOE, "--load", ckpt))
    assert all(abs(resumed[i] - ref[i]) < 3e-6 for i in (3, 4)), (resumed, ref)
    ckpt4 = str(tmp_path / "ckpt4")
    four = _losses(_run(*MOE, "--save", ckpt4, "--save-interval", "2", "--exit-interval", "2", nproc=4))
    assert sorted(four) == [1, 2] and all(abs(four[i] - ref[i]) < 1e-5 for i in (1, 2)), (four, ref)
    resumed = _resumed(_run(*MOE, "--load", ckpt4, "--no-load-rng"))
    assert all(abs(resumed[i] - ref[i]) < 1e-5 for i in (3, 4)), (resumed, ref)
