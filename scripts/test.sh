#!/usr/bin/env bash
# Create/update .venv, install megatron-autohet with its test extra, run the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/layout/test_plan.py -x
set -euo pipefail
# shellcheck source=scripts/_venv.sh
source "$(dirname "$0")/_venv.sh" test
python -m pytest -q "$@"
