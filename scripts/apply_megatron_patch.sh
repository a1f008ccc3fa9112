#!/usr/bin/env bash
# Apply megatron-autohet's patch to a Megatron-LM checkout at tag core_v0.16.1 or core_v0.19.0.
#
#   scripts/apply_megatron_patch.sh MEGATRON_LM_DIR
#
# The checkout's megatron/core/package_info.py picks the patch (0.16.1: core_v0.16.1's; 0.19.x:
# core_v0.19.0's, whose two files are unchanged on the core_r0.19.0 branch). Idempotent: on an
# already patched checkout it says so and changes nothing. It refuses (exit 1, nothing changed) a
# checkout of another version, or one whose patched files were edited locally: the files must be
# byte-identical to the tag (checked by SHA-256). See patches/README.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "apply_megatron_patch.sh: error: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 MEGATRON_LM_DIR (a Megatron-LM checkout at tag core_v0.16.1" \
  "or core_v0.19.0)"
DIR="$1"
[ -d "$DIR" ] || die "$DIR is not a directory"
INFO="$DIR/megatron/core/package_info.py"
[ -f "$INFO" ] || die "$DIR is not a Megatron-LM checkout (no megatron/core/package_info.py)"
[ -f "$DIR/pretrain_gpt.py" ] || die "$DIR is not a Megatron-LM checkout (no pretrain_gpt.py;" \
  "the megatron-core wheel alone has no training scripts)"

version="$(sed -n -e 's/^MAJOR = \([0-9]*\)/\1/p' -e 's/^MINOR = \([0-9]*\)/\1/p' \
  -e 's/^PATCH = \([0-9]*\)/\1/p' "$INFO" | paste -sd. -)"
# The files the patch touches, as released in its tag.
case "$version" in
  0.16.1)
    TAG=core_v0.16.1
    declare -A PRISTINE_SHA256=(
      [pretrain_gpt.py]=5a5b8fe909610892146e4d2ef5b303bd9b73bb31dfc96d73f2d0afb8937d4b22
      [megatron/training/training.py]=457cd234a88659aa395a988366e60e61f2c9d16a51df7efc8cc09c1f22fd48b1
    ) ;;
  0.19.*)
    TAG=core_v0.19.0
    declare -A PRISTINE_SHA256=(
      [pretrain_gpt.py]=7283c4aeb5a00c694bbf2930527a184fc0d5f607f548c74707c71cc240d05fae
      [megatron/training/training.py]=d968ef8216f63d6373372190ac895fc905234c116bba3e804d2951876e6ad98c
    ) ;;
  *) die "$DIR is megatron-core $version; this patch is for core_v0.16.1 (or core_v0.19.0)" \
       "(git -C $DIR checkout core_v0.16.1)" ;;
esac
PATCH="$ROOT/patches/megatron-lm-$TAG.patch"

if patch -d "$DIR" -p1 -R --dry-run --force --silent < "$PATCH" >/dev/null 2>&1; then
  echo "apply_megatron_patch.sh: $DIR already has the megatron-autohet patch; nothing to do"
  exit 0
fi

for file in "${!PRISTINE_SHA256[@]}"; do
  [ -f "$DIR/$file" ] || die "$DIR/$file is missing"
  actual="$(sha256sum "$DIR/$file" | cut -d' ' -f1)"
  [ "$actual" = "${PRISTINE_SHA256[$file]}" ] || die "$DIR/$file differs from $TAG" \
    "(sha256 $actual); restore it (git -C $DIR checkout $TAG -- $file) and retry"
done

patch -d "$DIR" -p1 --forward --silent < "$PATCH" || die "the patch did not apply cleanly"
echo "apply_megatron_patch.sh: patched $DIR ($TAG): ${!PRISTINE_SHA256[*]}"
