#!/usr/bin/env bash
# The GPU kit: SWAN's benchmarks and numerics checks on a one-GPU machine, in one command.
#
# Run from the repository root on that machine (Python 3.12 at python3 with torch+CUDA; no internet,
# no megatron-core), with the git-ignored folder .whl/ (megatron-core's cp312 manylinux wheel) carried:
#
#     bash benchmarks/gpu_suite.sh
#
# Each step runs under `timeout` within SUITE_BUDGET_S seconds in all (default 540, under the device tool's
# 600 s a command), the optimizer step's first, so that one failure or hang does not stop the rest and a short
# loan measures what matters most; SUITE_STEPS="a b" runs only those. The GPU runs write their sections of
# docs/benchmarks.md; a summary, that page and the logs (logs.tar.gz) go to $OUT (./runs/gpu_suite elsewhere).
# Without CUDA (a dry run, e.g. PYTHON=.venv/bin/python) the benchmarks run small on the CPU and write nothing.

set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/runs/gpu_suite}
mkdir -p "$OUT"
LOGS=$(mktemp -d)  # the per-step logs, packed into $OUT/logs.tar.gz at the end
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SITE=${SWAN_SITE:-/tmp/site}
BUDGET=${SUITE_BUDGET_S:-540}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

# step NAME TIMEOUT_S CMD...: run CMD with at most TIMEOUT_S (less if the budget is nearly spent),
# its output to NAME.log (in logs.tar.gz) and the terminal; record the exit status and time in the summary
step() {
    local name=$1 limit=$2
    shift 2
    if [ -n "${SUITE_STEPS:-}" ] && [[ " $SUITE_STEPS " != *" $name "* ]]; then
        return
    fi
    local left=$((BUDGET - ($(date +%s) - START)))
    if ((left < 15)); then
        echo "== $name: skipped (budget spent)" | tee -a "$SUMMARY"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (timeout ${limit}s): $*"
    local t0 rc verdict=ok
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    ((rc == 124 || rc == 137)) && verdict="TIMED OUT"
    ((rc != 0 && rc != 124 && rc != 137)) && verdict="FAILED"
    echo "== $name: $verdict (exit $rc, $(($(date +%s) - t0)) s)" | tee -a "$SUMMARY"
}

{
    echo "== setup"
    mkdir -p "$SITE"
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
            || echo "wheel install FAILED"
    else
        echo "no .whl/ folder: megatron-core must already be importable (carry .whl)"
    fi
    # swan_dist from this checkout without installing it: setup.py maps swan_dist.integrations to the top-level
    # integrations/, which PYTHONPATH cannot express, so $SITE/swan_dist is a folder of links into the checkout
    rm -rf "$SITE/swan_dist"
    mkdir -p "$SITE/swan_dist"
    for f in "$PWD"/swan_dist/*; do
        [ "$(basename "$f")" = __pycache__ ] || ln -s "$f" "$SITE/swan_dist/"
    done
    ln -s "$PWD/integrations" "$SITE/swan_dist/integrations"
} 2>&1 | tee "$OUT/env.log"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "== environment ($(date -u +%FT%TZ))"
    nvidia-smi || echo "nvidia-smi not found"
    PYTHONSAFEPATH=1 $PY -m swan_dist  # the environment report: versions, what imports, the devices
} 2>&1 | tee -a "$OUT/env.log"

CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
NOWRITE=()
# the GPU run's model: ~150M parameters (the CPU run's default is ~4M, launch-bound on a GPU)
BIG=(--hidden 1024 --ffn 4096 --layers 8 --heads 16 --query-groups 8 --vocab 32768 --seq 1024 --batch 8 --steps 10
     --warmup 3)
if [ "$CUDA" != 1 ]; then  # a dry run of the kit: the default model, nothing written to docs/benchmarks.md
    NOWRITE=(--no-write)
    BIG=()
    echo "no CUDA device: a dry run on the CPU, docs/benchmarks.md left alone" | tee -a "$SUMMARY"
fi

# the optimizer step first (what a short device loan must measure): steady steps under
# torch.cuda.set_sync_debug_mode("error") (ordinary, in backward, capturable), a captured step replayed equal to
# eager, capturable equal to the ordinary step (tests/test_capturable.py)
step gpu_step 120 $PY -m pytest -q -p no:cacheprovider tests/test_capturable.py
# the step's time at 1.3B and 7B in bf16: SWAN‡ eager and captured in a CUDA graph against AdamW foreach / fused and
# torch's Muon (writes `captured-step-cuda`); the whitening against its same-shape GEMMs at `small` and 1.3B's shapes
step captured_step 200 $PY benchmarks/captured_step.py $([ "$CUDA" = 1 ] || echo "--sizes tiny --steps 2 --rounds 1")
step whitening 90 $PY benchmarks/whitening.py "${NOWRITE[@]}" $([ "$CUDA" = 1 ] || echo "--size tiny --dtypes float32 --compile no --no-allocator-run")
[ "$CUDA" = 1 ] && step whitening_1b3 60 $PY benchmarks/whitening.py --size 1b3 --dtypes bfloat16 --no-allocator-run
# memory and iteration time at 1.3B and 7B, the in-backward iteration against the ordinary one
if [ "$CUDA" = 1 ]; then
    step memory_cuda 240 $PY benchmarks/memory.py --device cuda --sizes 1b3,7b --size-timeout 115
else
    step memory_cuda 240 $PY benchmarks/memory.py --sizes small --optimizers adamw,swan_ddagger --estimate small \
        --estimate-optimizers adamw,swan_ddagger --no-write
fi
step optimizer_step 90 $PY benchmarks/optimizer_step.py "${NOWRITE[@]}"
# the bookkeeping step on many small matrices (one GPU: W=1 only; writes `lean-step-cuda`)
step lean_step 60 $PY benchmarks/lean_step.py --world 0 $([ "$CUDA" = 1 ] || echo "--steps 5") "${NOWRITE[@]}"
# SWAN's numerics on the GPU against the CPU's (tests/test_cuda_numerics.py)
step cuda_numerics 90 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_numerics.py
# megatron-core at W=1 on NCCL, a ~150M model (writes `megatron-cuda`)
step megatron 120 $PY -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/megatron.py "${BIG[@]}" \
    "${NOWRITE[@]}"
# torchtitan at W=1: AdamW vs DistMuon vs SWAN (torchtitan and its pure-Python dependencies carried as wheels in
# .whl/; prints a message and exits 0 where torchtitan does not import)
step torchtitan_cuda 150 $PY benchmarks/torchtitan.py --cuda --steps 10 "${NOWRITE[@]}"

# Megatron-LM end to end (when a checkout is carried in .mlm/: pretrain_gpt.py and megatron/ of tag
# core_v0.16.1): bf16, the distributed optimizer, NCCL; a torch_dist checkpoint at iteration 20 of 40,
# then a resume from it, whose iterations 25..40 must log the uninterrupted run's losses.
mlm() {
    local ck=/tmp/mlm_ckpt flags=(--optimizer swan --transformer-impl local --mock-data --tokenizer-type NullTokenizer
        --vocab-size 32000 --num-layers 4 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8
        --group-query-attention --num-query-groups 4 --swiglu --position-embedding-type rope --normalization RMSNorm
        --disable-bias-linear --seq-length 512 --max-position-embeddings 512 --micro-batch-size 8
        --global-batch-size 16 --swan-from-adamw --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1
        --clip-grad 1.0 --bf16 --use-distributed-optimizer --train-iters 40 --log-interval 5 --eval-iters 0
        --eval-interval 1000 --ckpt-format torch_dist --seed 1234 --no-gradient-accumulation-fusion --no-rope-fusion
        --no-persist-layer-norm --no-masked-softmax-fusion)  # (fusions that need Transformer Engine or apex)
    rm -rf "$ck"
    # megatron from the checkout (not the wheel in $SITE): everything else $SITE holds (swan_dist's links, pydantic)
    local site2=/tmp/site_no_mcore f
    rm -rf "$site2" && mkdir -p "$site2"
    for f in "$SITE"/*; do
        case "$(basename "$f")" in megatron*) ;; *) cp -a "$f" "$site2/" ;; esac
    done
    PYTHONSAFEPATH=1 PYTHONPATH="$site2" PYTHON=$PY NPROC=1 bash launch/megatron_lm.sh .mlm/pretrain_gpt.py "${flags[@]}" || return 1
    PYTHONSAFEPATH=1 PYTHONPATH="$site2" PYTHON=$PY NPROC=1 bash launch/megatron_lm.sh .mlm/pretrain_gpt.py "${flags[@]}" \
        --save "$ck" --save-interval 20 --exit-interval 20 || return 1
    PYTHONSAFEPATH=1 PYTHONPATH="$site2" PYTHON=$PY NPROC=1 bash launch/megatron_lm.sh .mlm/pretrain_gpt.py "${flags[@]}" --load "$ck"
}
if [ "$CUDA" = 1 ] && [ -f .mlm/pretrain_gpt.py ]; then
    step megatron_lm 240 env SITE="$SITE" PY="$PY" bash -c "$(declare -f mlm); mlm"
fi

cp docs/benchmarks.md "$OUT/benchmarks.md"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
echo "== total $(($(date +%s) - START)) s" | tee -a "$SUMMARY"
cat "$SUMMARY"
