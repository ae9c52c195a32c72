#!/usr/bin/env bash
# Megatron's Muon, for benchmarks/megatron.py. megatron-core 0.16.1's muon.py is written against
# emerging-optimizers v0.1.0 (NVIDIA-NeMo/Emerging-Optimizers, the git tag megatron-core's pyproject pins;
# PyPI carries only later releases, whose optimizer arguments differ, and which declare Python >= 3.12).
# It imports triton at load (its kernels are not used on the CPU).
# Usage: bash launch/install_muon.sh [CHECKOUT]   (into ./.venv, after launch/setup.sh megatron)
#   CHECKOUT: a local checkout of that tag (an absolute path), where github.com is not reachable
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:+file://$1}"; src="${src:-git+https://github.com/NVIDIA-NeMo/Emerging-Optimizers.git@v0.1.0}"
.venv/bin/python -m pip install -q -c constraints.txt "emerging-optimizers @ $src" "triton>=3.4"
.venv/bin/python -c "from megatron.core.optimizer import muon; assert muon.HAVE_EMERGING_OPTIMIZERS, 'emerging-optimizers did not import'"
