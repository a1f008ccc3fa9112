#!/usr/bin/env bash
# One command for one GPU machine: profile, plan, train, ours vs stock megatron-core, kill -9
# during a save and resume, checkpoint verify; prints a pass/fail table and writes it as JSON
# and as the README's section in Markdown ($OUT/gpu_check.json and gpu_check.md when OUT is set,
# the command logs packed beside them; else in bench-out/). Arguments go to
# scripts/gpu_check.py (--help lists them; the defaults: GPT-3 1.3B on this machine's GPU).
#
# The machine needs python3 with torch; megatron-core, pyscipopt and xxhash may come as wheels in
# .whl/ (scripts/gpu_wheels.sh fetches them for the CPython versions it is given: pip picks the
# ones this interpreter runs), installed into a scratch directory; the package itself runs from
# this checkout (PYTHONPATH).
# The interpreter: $PYTHON, else the checkout's .venv/bin/python when there is one, else python3.
# Relative paths in the arguments are from the current directory.
# Without CUDA every step still runs and the rows with a GPU target say skip.
set -euo pipefail
# The 7-minute budget counts from here, the wheels' installation included.
export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$(date +%s)}"
root="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  if [[ -x "$root/.venv/bin/python" ]]; then PYTHON="$root/.venv/bin/python"; fi
fi
if ! "$PYTHON" -c "import megatron.core, pyscipopt, xxhash" 2>/dev/null; then
  wheels=("$root"/.whl/*.whl)
  if [[ ! -e "${wheels[0]}" ]]; then
    echo "gpu_check.sh: $PYTHON lacks megatron-core, pyscipopt or xxhash and .whl/ has no" \
         "wheels to install (allowed: install them, or fetch their wheels with" \
         "scripts/gpu_wheels.sh)" >&2
    exit 2
  fi
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check-wheels.XXXXXX")"
  trap 'rm -rf "$scratch"' EXIT
  if ! "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps \
      --find-links "$root/.whl" --target "$scratch" megatron-core pyscipopt xxhash; then
    echo "gpu_check.sh: .whl/ has no megatron-core, pyscipopt or xxhash wheel for" \
         "$("$PYTHON" -c 'import sys; print("CPython %d.%d" % sys.version_info[:2])')" \
         "(allowed: scripts/gpu_wheels.sh VERSION fetches them for that version)" >&2
    exit 2
  fi
  export PYTHONPATH="$scratch${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" "$root/scripts/gpu_check.py" "$@"
