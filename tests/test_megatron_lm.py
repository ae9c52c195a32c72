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


def _run(*extra: str, ok: bool = True) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           os.path.join(HERE, "megatron_lm_cpu.py"), os.path.join(CHECKOUT, "pretrain_gpt.py"), *TINY, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    assert (p.returncode == 0) == ok, out[-4000:]
    return out


def _losses(out: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in re.findall(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", out)}


def test_pretrain_gpt_with_optimizer_swan(tmp_path):
    """TP=2, DP=2 with the distributed optimizer and DP=2 DDP train alike (the same loss at every
    iteration: the same initial weights, data and SWAN update whatever the layout); a torch_dist
    checkpoint saved at iteration 2 resumes to the uninterrupted run's iteration 3 and 4."""
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
    resumed = _losses(_run("--tensor-model-parallel-size", "2", "--train-iters", "4", "--load", ckpt,
                           "--ckpt-format", "torch_dist"))
    assert abs(resumed[3] - ref[3]) < 1e-6  # the iteration after a resume logs its own loss (Megatron resets its sums)
    refused = _run("--use-distributed-optimizer", "--train-iters", "2", "--save", ckpt, "--save-interval", "2", ok=False)
    assert "not supported yet" in refused and "--no-save-optim" in refused, refused[-3000:]
