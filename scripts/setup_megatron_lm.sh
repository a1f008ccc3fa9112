#!/usr/bin/env bash
# Prepare a Megatron-LM checkout at tag core_v0.16.1 (or core_v0.19.0, see patches/README.md) for
# `pretrain_gpt.py --autohet-plan`.
#
#   scripts/setup_megatron_lm.sh [--python PYTHON] MEGATRON_LM_DIR
#
# 1. applies megatron-autohet's patch (scripts/apply_megatron_patch.sh: idempotent, refuses other
#    versions and locally edited files);
# 2. makes sure PYTHON can import what Megatron-LM's training package needs besides
#    megatron-autohet's own requirements: pybind11 (the dataset helpers' build) and triton
#    (imported by megatron.training even on a CPU; no kernel of it runs there), installing the
#    missing ones with PYTHON's pip;
# 3. builds Megatron's dataset helpers (megatron/core/datasets/Makefile, helpers_cpp) for PYTHON.
#    The Makefile asks `python3` and `python3-config` on PATH, which need not be PYTHON: pyenv
#    honours Megatron-LM's `.python-version` and answers with another version, whose helper
#    PYTHON cannot import. So the build is given PYTHON's include flags and extension suffix,
#    and helper builds for other Pythons are removed.
#
# PYTHON defaults to the active virtual environment's python, else python3 on PATH. Megatron's
# first rank runs the Makefile again at start-up; with --autohet-plan it is given the same
# variables for the running Python (megatron/hooks.py), so that is a no-op after this script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="$(basename "$0")"

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

die() { echo "$PROG: error: $*" >&2; exit 1; }

PYTHON=""
DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --python) [ $# -ge 2 ] || die "--python needs a value"; PYTHON="$2"; shift 2 ;;
    --python=*) PYTHON="${1#--python=}"; shift ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$DIR" ] || die "one MEGATRON_LM_DIR only (see --help)"; DIR="$1"; shift ;;
  esac
done
[ -n "$DIR" ] || die "usage: $PROG [--python PYTHON] MEGATRON_LM_DIR (see --help)"
if [ -z "$PYTHON" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then PYTHON="$VIRTUAL_ENV/bin/python"; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || die "$PYTHON: no such Python"

bash "$ROOT/scripts/apply_megatron_patch.sh" "$DIR"

missing=()
for module in pybind11 triton; do
  "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "$PROG: installing ${missing[*]} for $PYTHON"
  "$PYTHON" -m pip install -q "${missing[@]}"
fi

DATASETS="$DIR/megatron/core/datasets"
[ -f "$DATASETS/Makefile" ] || die "$DATASETS/Makefile is missing"
suffix="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
includes="$("$PYTHON" -m pybind11 --includes)"
for built in "$DATASETS"/helpers_cpp*; do
  [ -e "$built" ] || continue
  if [ "$(basename "$built")" != "helpers_cpp$suffix" ]; then
    echo "$PROG: removing $built (built for another Python)"
    rm -f "$built"
  fi
done
# Command-line variables override the Makefile's `python3` / `python3-config` answers.
make -s -C "$DATASETS" CPPFLAGS="$includes" LIBEXT="$suffix"

helper="$DATASETS/helpers_cpp$suffix"
# Loaded by path, as `from megatron.core.datasets import helpers_cpp` finds it.
"$PYTHON" - "$helper" <<'EOF' || die "$PYTHON cannot import $helper"
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("helpers_cpp", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
EOF
echo "$PROG: $DIR is ready for $PYTHON (dataset helpers: $helper)"
