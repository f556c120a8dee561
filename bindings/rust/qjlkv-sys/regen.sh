#!/usr/bin/env bash
# Regenerates src/bindings.rs from include/qjlkv/qjlkv.h with the bindgen CLI.
#
#   regen.sh          rewrite src/bindings.rs
#   regen.sh --check  fail (exit 1, with the diff) if the committed file differs from a
#                     fresh generation; skip (exit 0, with the reason) only when the bindgen
#                     CLI is missing. Install it with: apt-get install bindgen
#
# The bindings were generated with Debian bookworm's bindgen 0.60.1 (its version is written
# in the first line of the output, so a different bindgen shows up in the diff).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
header="$here/../../../include/qjlkv/qjlkv.h"
committed="$here/src/bindings.rs"

mode=write
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

if ! command -v bindgen >/dev/null 2>&1; then
  if [ "$mode" = check ]; then
    echo "SKIP qjlkv-sys bindings check: the bindgen CLI is not installed (apt-get install bindgen)"
    exit 0
  fi
  echo "error: the bindgen CLI is not installed (apt-get install bindgen)" >&2
  exit 1
fi
# bindgen formats its output with rustfmt (with the workspace's rustfmt.toml, named so that no
# other config found on the way changes the result); without rustfmt the output is one line.
if ! command -v rustfmt >/dev/null 2>&1; then
  echo "error: rustfmt is not installed (rustup component add rustfmt)" >&2
  exit 1
fi

generated="$(mktemp)"
trap 'rm -f "$generated"' EXIT

# The pinned flags. Enums stay integer constants (a Rust enum would be undefined behaviour
# for a status value added by a newer library); only the library's own names are emitted.
bindgen "$header" \
  --output "$generated" \
  --rust-target 1.47 \
  --allowlist-function 'qjlkv_.*' \
  --allowlist-type 'qjlkv_.*' \
  --allowlist-var 'QJLKV_.*' \
  --default-enum-style consts \
  --no-prepend-enum-name \
  --size_t-is-usize \
  --rustfmt-configuration-file "$(cd "$here/.." && pwd)/rustfmt.toml" \
  -- -x c -std=c99

if [ "$mode" = write ]; then
  cp "$generated" "$committed"
  echo "wrote $committed ($(bindgen --version))"
  exit 0
fi

if diff -u "$committed" "$generated"; then
  echo "PASS qjlkv-sys bindings check: src/bindings.rs matches $(bindgen --version)"
else
  echo "FAIL qjlkv-sys bindings check: src/bindings.rs is stale; run bindings/rust/qjlkv-sys/regen.sh ($(bindgen --version))" >&2
  exit 1
fi
