#!/usr/bin/env bash
# The reference trainer under the `deepspeed` launcher (the JSON named by the config's deepspeed_config
# picks the ZeRO stage; "optimizer": {"type": "SWAN"}).
#   bash launch/deepspeed.sh [CONFIG] [-- trainer args...]      # default configs/train/deepspeed_tiny.yaml
#   bash launch/deepspeed.sh configs/train/deepspeed_tiny.yaml -- --set deepspeed_config=configs/deepspeed/zero3.json
# One node (no HOSTFILE): NPROC processes, default the GPU count, or 2 on a CPU-only machine.
# Several nodes: HOSTFILE=path, lines "hostname slots=N". DeepSpeed then starts every node from this
# one over passwordless ssh (pdsh); with NO_SSH=1 run this script on every node yourself, with
# NODE_RANK=i and MASTER_ADDR=<first node's address> (as with torchrun). MASTER_PORT default 29500.
# gloo on CPU, NCCL on GPU (the trainer's backend: auto; override with --set backend=gloo).
set -euo pipefail
DEFAULT_CONFIG=configs/train/deepspeed_tiny.yaml
source "$(dirname "$0")/_common.sh"
port="${MASTER_PORT:-29500}"
if [ -z "${HOSTFILE:-}" ]; then
  nproc="${NPROC:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}"
  where=(--num_gpus "$nproc" --master_port "$port")
elif [ -n "${NO_SSH:-}" ]; then
  where=(--hostfile "$HOSTFILE" --no_ssh --node_rank "${NODE_RANK:?set NODE_RANK with NO_SSH=1}"
         --master_addr "${MASTER_ADDR:?set MASTER_ADDR (the first node) with NO_SSH=1}" --master_port "$port")
else
  where=(--hostfile "$HOSTFILE" --master_port "$port" ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"})
fi
exec "$py" -m deepspeed.launcher.runner "${where[@]}" \
  --module swan_dist.reference.train --config "$config" "${args[@]}"
