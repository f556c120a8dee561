#!/usr/bin/env bash
# ABI guard for libqjlkv.so: the exported symbols must be exactly the header's QJLKV_API
# functions, and the ABI (functions, their types, the public structs and enums) must equal
# the committed baseline abi/libqjlkv.abi. Policy and the steps of an intentional change:
# packaging/VERSIONING.md.
#
# Usage: tests/packaging/abi_check.sh [--update] [BUILD_DIR]
#   BUILD_DIR  a build of this repository with debug info (-g); without it the script
#              configures and builds build-abi/ (Release + -g, CPU only), about 10 s.
#   --update   write the current ABI to abi/libqjlkv.abi instead of comparing.
# Needs abigail-tools (abidw, abidiff) and binutils (nm, readelf).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
baseline=$repo/abi/libqjlkv.abi

update=0
build=""
for arg in "$@"; do
  case $arg in
    --update) update=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "abi_check: unknown option $arg" >&2; exit 2 ;;
    *) build=$arg ;;
  esac
done

for tool in abidw abidiff nm readelf; do
  if ! command -v "$tool" >/dev/null; then
    echo "abi_check: $tool not found (apt-get install abigail-tools binutils)" >&2
    exit 2
  fi
done

if [[ -z $build ]]; then
  build=$repo/build-abi
  cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS=-g -DCMAKE_CXX_FLAGS=-g \
    -DQJLKV_CUDA=OFF -DQJLKV_BUILD_TESTS=OFF -DQJLKV_BUILD_EXAMPLES=OFF -DQJLKV_BUILD_BENCH=OFF >/dev/null
  cmake --build "$build" --target qjlkv -j "$(nproc)" >/dev/null
fi
lib=$build/libqjlkv.so
[[ -f $lib ]] || { echo "abi_check: $lib not found" >&2; exit 2; }
if ! readelf -S "$lib" | grep -q '\.debug_info'; then
  echo "abi_check: $lib has no debug info; build it with -g (e.g. RelWithDebInfo)" >&2
  exit 2
fi

"$repo/tests/packaging/check_exports.sh" "$lib" "$repo/include/qjlkv/qjlkv.h"

# Only what the public header makes visible, with no locations and no paths of this machine:
# translation unit names are made relative to the repository.
current=$(mktemp "${TMPDIR:-/tmp}/qjlkv-abi.XXXXXX")
trap 'rm -f "$current"' EXIT
abidw --exported-interfaces-only --headers-dir "$repo/include/qjlkv" --drop-private-types \
  --no-corpus-path --no-comp-dir-path --no-show-locs --no-elf-needed --type-id-style hash "$lib" |
  sed "s|path='$repo/|path='|g" >"$current"
if grep -q "='/" "$current"; then
  echo "abi_check: the ABI dump still holds absolute paths:" >&2
  grep "='/" "$current" | head -5 >&2
  exit 1
fi

if [[ $update == 1 ]]; then
  cp "$current" "$baseline"
  echo "abi_check: wrote ${baseline#"$repo"/} ($(grep -c '<elf-symbol ' "$baseline") functions," \
    "soname $(grep -o "soname='[^']*'" "$baseline" | cut -d"'" -f2))"
  exit 0
fi

[[ -f $baseline ]] || { echo "abi_check: no baseline ${baseline#"$repo"/}; run with --update" >&2; exit 1; }
set +e
# --harmless: appended enumerators count as changes too, so the baseline never goes stale.
report=$(abidiff --harmless --no-show-locs "$baseline" "$current" 2>&1)
status=$?
set -e
# abidiff's status is a bit set: 1 error, 2 usage error, 4 ABI change, 8 incompatible change.
if [[ $status == 0 ]]; then
  echo "abi_check: ABI identical to ${baseline#"$repo"/}"
  exit 0
fi
echo "$report"
if (( status & 3 )); then
  echo "abi_check: abidiff failed (status $status)" >&2
elif (( status & 8 )); then
  echo "abi_check: INCOMPATIBLE ABI change: this needs a new SONAME (MAJOR bump); see packaging/VERSIONING.md" >&2
else
  echo "abi_check: the ABI differs from the baseline. Without a new SONAME only additions are" \
    "allowed (functions, fields appended to struct_size structs, appended enumerators); if that" \
    "is all this is, bump MINOR and record it: tests/packaging/abi_check.sh --update." \
    "Anything else: packaging/VERSIONING.md" >&2
fi
exit 1
