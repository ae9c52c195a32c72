#!/usr/bin/env bash
# Single-node run of the reference trainer.
#   bash launch/torchrun_single.sh [CONFIG] [-- trainer args...]
#   NPROC=4 bash launch/torchrun_single.sh configs/train/main.yaml --set steps=100
# NPROC defaults to the GPU count, or 2 on a CPU-only machine. gloo on CPU, NCCL on GPU (the
# trainer's backend: auto; override with --set backend=gloo).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
nproc="${NPROC:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}"
exec "$py" -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
  -m swan_dist.reference.train --config "$config" "${args[@]}"
