#!/usr/bin/env bash
# Create ./.venv (if missing) and install swan_dist into it, editable, with CPU torch pinned by
# constraints.txt. Usage: bash launch/setup.sh [EXTRAS]   e.g. `bash launch/setup.sh test`
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q -c constraints.txt -e "$spec"
