#!/usr/bin/env bash
# Multi-node run of the reference trainer with torchrun's c10d rendezvous. Run it once per node.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 bash launch/torchrun_multinode.sh configs/train/main.yaml
# Under SLURM (srun, one task per node) the node count, node rank and first node of the job are read
# from SLURM_NNODES, SLURM_NODEID and SLURM_JOB_NODELIST. NPROC_PER_NODE defaults to the GPU count,
# or 1 on a CPU-only node. RDZV_ID names the job (default: SLURM_JOB_ID or "swan").
set -euo pipefail
source "$(dirname "$0")/_common.sh"
nnodes="${NNODES:-${SLURM_NNODES:-1}}"
node_rank="${NODE_RANK:-${SLURM_NODEID:-0}}"
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
addr="${MASTER_ADDR:?set MASTER_ADDR (the first node) or run under SLURM}"
port="${MASTER_PORT:-29500}"
nproc="${NPROC_PER_NODE:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 1)}"
exec "$py" -m torch.distributed.run --nnodes "$nnodes" --node_rank "$node_rank" --nproc_per_node "$nproc" \
  --rdzv_backend c10d --rdzv_endpoint "$addr:$port" --rdzv_id "${RDZV_ID:-${SLURM_JOB_ID:-swan}}" \
  -m swan_dist.reference.train --config "$config" "${args[@]}"
