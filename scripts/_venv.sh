# Sourced by quickstart.sh and test.sh: create/update .venv and install the package.
# Usage: source scripts/_venv.sh [EXTRA]   (EXTRA: e.g. "test")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned, so no dependency range ever pulls a multi-GB CUDA build on a CPU machine.
# On a GPU machine, install your CUDA torch beforehand; a satisfied torch>=2.11 is kept.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# megatron-core next, pinned to the version the whole suite runs on (setup.py allows 0.16.1 to
# 0.19.x; scripts/test_mcore019.sh runs the subset on 0.19.x). An installed one is kept.
python -c "import megatron.core" 2>/dev/null || python -m pip install -q "megatron-core==0.16.1"
if [ -n "${1:-}" ]; then
  python -m pip install -q -e ".[$1]"
else
  python -m pip install -q -e .
fi
