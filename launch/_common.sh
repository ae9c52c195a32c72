# Sourced by the launch scripts: repository root, config argument, python, GPU count.
# Sets: config (first argument, default $DEFAULT_CONFIG or configs/train/main.yaml), args (the rest, after an optional
# "--"), py ($PYTHON or .venv/bin/python), gpus (CUDA device count).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
config="${1:-${DEFAULT_CONFIG:-configs/train/main.yaml}}"
shift || true
[ "${1:-}" = "--" ] && shift
args=("$@")
py="${PYTHON:-.venv/bin/python}"
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
