#!/usr/bin/env bash
# Megatron-LM with --optimizer swan: an unmodified pretrain_gpt.py (or another Megatron-LM script) run
# through swan_dist's launcher, which adds the flag and the --swan-* options before the script parses.
#   bash launch/megatron_lm.sh /path/to/Megatron-LM/pretrain_gpt.py --optimizer swan [Megatron-LM flags...]
#   NPROC=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 bash launch/megatron_lm.sh ...   (multi-node)
# Megatron-LM checkout at the tag matching the megatron-core pin (core_v0.16.1). NPROC defaults to the
# GPU count. docs/integrations/megatron.md lists the flags.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 PATH/pretrain_gpt.py --optimizer swan [flags...]" >&2; exit 2; }
script="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
shift
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
nproc="${NPROC:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # Megatron requires it with TP > 1
rdzv=(--standalone)
[ -n "${NNODES:-}" ] && rdzv=(--nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:?}" \
  --master_port "${MASTER_PORT:-29500}")
exec "$py" -m torch.distributed.run "${rdzv[@]}" --nproc_per_node "$nproc" \
  -m swan_dist.integrations.megatron_lm "$script" "$@"
