#!/usr/bin/env bash
# The named subset of the tests on megatron-core 0.19.x, in a second virtual environment.
#
#   scripts/test_mcore019.sh [PYTEST_ARGS...]
#
# megatron-autohet supports megatron-core 0.16.1 to 0.19.x (setup.py). scripts/test.sh runs the
# whole suite in .venv on 0.16.1; this script builds .venv-mcore019 (kept between runs; delete
# it to start over) with the newest 0.19.x and runs there what differs between the versions:
# the heterogeneous 1F1B and its warm-up depths, the parallel state, the equivalence with a
# single process and with stock megatron-core, megatron-core's fused kernels, checkpoints,
# megatron-core's known-benign warnings and log records, and one elastic run (preemption, loss and
# a join). Extra arguments go to pytest, e.g. -x. With --prepare as its only argument it installs torch, megatron-core and
# triton in the venv and stops (.ci/run does that while scripts/test.sh builds .venv); the
# package itself is installed by the run that tests, so two editable installs of this tree never
# run at once.
#
# megatron-core 0.17 and later declare Python >= 3.12. On an older Python (this project's
# machines and CI have 3.11) it is built from its source release with --ignore-requires-python:
# megatron.core itself runs there (only megatron.training, which this subset does not import,
# uses 3.12's typing.override). torch and megatron-core are pinned while the rest installs, so
# nothing swaps them behind the run's back.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
VENV=.venv-mcore019
MCORE="megatron-core>=0.19,<0.20"
# torch 2.13's CUDA builds pin this triton; megatron-core 0.19's schedules import triton (its MoE
# paged-stash kernels) even where no kernel runs, as on a CPU.
TRITON="triton==3.7.1"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
"$py" -m pip install -q --upgrade pip
# torch first and pinned, as in scripts/_venv.sh: never a multi-GB CUDA build on a CPU machine.
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "torch==2.13.0"
if ! "$py" -c "import megatron.core, sys; sys.exit(not megatron.core.__version__.startswith('0.19.'))" \
    2>/dev/null; then
  if "$py" -c "import sys; sys.exit(sys.version_info >= (3, 12))"; then
    echo "test_mcore019.sh: Python $("$py" -c 'import platform; print(platform.python_version())')" \
         "< 3.12: building $MCORE from source with --ignore-requires-python"
    "$py" -m pip install -q --no-deps --ignore-requires-python --no-binary megatron-core "$MCORE"
  else
    "$py" -m pip install -q --no-deps "$MCORE"
  fi
fi
"$py" -c "import triton" 2>/dev/null || "$py" -m pip install -q "$TRITON"
if [ "${1:-}" = "--prepare" ] && [ $# -eq 1 ]; then
  exit 0
fi
pins="$VENV/pins.txt"
"$py" - > "$pins" <<'EOF'
from importlib.metadata import version
print(f"torch=={version('torch')}")
print(f"megatron-core=={version('megatron-core')}")
EOF
"$py" -m pip install -q -c "$pins" -e ".[test]"
echo "test_mcore019.sh: $(tr '\n' ' ' < "$pins")in $VENV"

# The venv's bin first on PATH, as scripts/test.sh has it (the tests start `autohet` and torchrun).
# What megatron-core does in a job - schedule, parallel state, DDP, optimizer, fused kernels,
# dist_checkpointing - is in the first five; the elastic run adds the fleet around them:
# torchrun's agents, warm workers, a notice, a loss and a join, recovery from the checkpoint tiers.
PATH="$ROOT/$VENV/bin:$PATH" "$py" -m pytest -q \
  tests/runtime/test_schedule.py \
  tests/runtime/test_parallel_state.py \
  tests/runtime/test_equivalence.py \
  tests/runtime/test_fusions.py \
  tests/checkpoint/test_checkpoint.py \
  tests/cli/test_known_warnings.py \
  "tests/elastic/test_elastic.py::test_preemption_loss_and_join_match_an_uninterrupted_run" \
  "$@"
