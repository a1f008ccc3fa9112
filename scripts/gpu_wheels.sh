#!/usr/bin/env bash
# Fetches into .whl/ the wheels scripts/gpu_check.sh installs on a GPU machine whose python3 lacks
# them and that has no network: megatron-core, pyscipopt and xxhash at the versions CI runs, for
# each CPython version given (default 3.12 3.13; about 21 MB each, x86-64 Linux). gpu_check.sh
# lets pip pick the ones its interpreter runs. Run it where the package index is reachable.
#
#   scripts/gpu_wheels.sh             # then copy the checkout, .whl/ included, to the GPU machine
#   scripts/gpu_wheels.sh 3.11 3.12   # CPython 3.11's and 3.12's
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage() {
  echo "usage: scripts/gpu_wheels.sh [-h|--help] [VERSION ...]"
  echo
  # the header above, what the script does and how it is run
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then usage; exit 0; fi
done
versions=("$@")
if [[ ${#versions[@]} -eq 0 ]]; then versions=(3.12 3.13); fi
for version in "${versions[@]}"; do
  if [[ "$version" == -* ]]; then
    echo "gpu_wheels.sh: error: unknown option '$version' (allowed: -h, --help, or Python" \
         "versions 3.11, 3.12, ...)" >&2
    exit 2
  fi
  if [[ ! "$version" =~ ^3\.[0-9]+$ ]]; then
    echo "gpu_wheels.sh: error: '$version' is not a Python version (allowed: 3.11, 3.12, ...)" >&2
    exit 2
  fi
done
mkdir -p "$root/.whl"
for version in "${versions[@]}"; do
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --implementation cp --python-version "$version" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 -d "$root/.whl" \
    megatron-core==0.16.1 pyscipopt==6.3.0 xxhash==4.1.0
done
count="$(find "$root/.whl" -type f -name "*.whl" | wc -l)"
echo "> .whl/: $count wheels, $(du -sh "$root/.whl" | cut -f1)"
