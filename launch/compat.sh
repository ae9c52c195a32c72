#!/usr/bin/env bash
# The compatibility job: install swan_dist with its test extras into a separate venv at the versions
# given, then run the suite, or a part of it, there. CI keeps running the pinned set (constraints.txt).
#
#   bash launch/compat.sh SPEC [SPEC ...] [-- PYTEST_ARGS ...]
#
# SPEC: a pip requirement, e.g. torch==2.14.1, 'deepspeed==0.19.0', transformers==5.0.0. Without
# PYTEST_ARGS the compat part runs: every test that exercises a framework API swan_dist relies on
# (DTensor, FSDP2, FSDP1, DDP, TP, DeepSpeed, megatron-core, Transformers, Accelerate, Lightning, torchtitan) at
# W <= 4, without the long checkpoint and launch runs, except that tests/test_torchtitan.py runs whole, its
# checkpoint resume included (it shares that file's launches); `-- tests` runs the whole suite. The venv is
# kept under .venv-compat/ (one per SPEC set); the versions it ran and pytest's summary line are appended to
# runs/compat/results.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
specs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do specs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#specs[@]} -gt 0 ] || { echo "usage: bash launch/compat.sh SPEC [SPEC ...] [-- PYTEST_ARGS]" >&2; exit 2; }
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then  # every framework API swan_dist relies on, without the long checkpoint/launch runs
  # tests/test_torchtitan.py whole, its checkpoint resume included: the file's launches are shared by all its
  # cases (the resume runs whether or not its test is selected), so the resume costs no launch of its own
  short="not eight_ranks and not 8-3 and not checkpoint and not universal and not resume and not dcp and not sigkill"
  tests=(tests/test_imports.py tests/test_functional.py tests/test_optimizer.py tests/test_bad_input.py
         tests/test_inflight.py tests/test_engine.py tests/test_schedules.py tests/test_distributed_optimizer.py
         tests/test_expert_parallel.py tests/test_tensor_parallel.py tests/test_fsdp1.py tests/test_deepspeed.py
         tests/test_megatron_core.py tests/test_megatron_moe.py tests/test_huggingface.py tests/test_lightning.py
         tests/test_torchtitan.py
         -k "($short) or test_torchtitan.py")
fi
name=$(printf '%s_' "${specs[@]}" | tr -c 'A-Za-z0-9._=-' '_' | sed 's/_$//')
venv=".venv-compat/$name"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e ".[test]" "${specs[@]}"
mkdir -p runs/compat
versions=$("$venv/bin/python" - <<'PY'
from importlib.metadata import version
names = ["torch", "deepspeed", "megatron-core", "transformers", "accelerate", "lightning", "torchtitan", "triton"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
echo "compat: $versions"
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "runs/compat/$name.log" || status=$?
summary=$(grep -E "[0-9]+ (passed|failed|errors?)[ ,].* in [0-9.]+s" "runs/compat/$name.log" | tail -1)
echo "$(date -u +%F) | ${specs[*]} | $versions | exit $status | $summary" >> runs/compat/results.txt
exit $status
