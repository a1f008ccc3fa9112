#!/usr/bin/env bash
# Lint the package, the scripts and the tests with ruff (rules in ruff.toml; ruff is pinned in
# setup.py's test extra, which _venv.sh installs). Extra arguments go to ruff check, e.g.
#   scripts/lint.sh --statistics
set -euo pipefail
# shellcheck source=scripts/_venv.sh
source "$(dirname "$0")/_venv.sh" test
ruff check "$@" megatron_autohet scripts tests
