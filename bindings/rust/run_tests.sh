#!/usr/bin/env bash
# The Rust suite: bindings freshness (bindgen), cargo test, cargo clippy, and a short run of
# the decode example. Offline: the crates have no dependencies.
#
#   bindings/rust/run_tests.sh [BUILD_DIR]
#
# BUILD_DIR: a CMake build directory of libqjlkv holding libqjlkv.a (tools/test-all.sh passes
# its build); the crates then link it instead of building the library again in target/.
# Needs cargo with clippy and rustfmt, and the bindgen CLI (apt-get install bindgen) for the
# freshness check, which otherwise skips saying so.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CARGO_NET_OFFLINE=true
if [ -n "${1:-}" ]; then
  QJLKV_BUILD_DIR="$(cd "$1" && pwd)"
  export QJLKV_BUILD_DIR
  echo "linking libqjlkv.a from $QJLKV_BUILD_DIR"
fi
cargo=(cargo --locked)
manifest=(--manifest-path "$here/Cargo.toml")

"$here/qjlkv-sys/regen.sh" --check
"${cargo[@]}" test "${manifest[@]}" --workspace
"${cargo[@]}" clippy "${manifest[@]}" --workspace --all-targets -- -D warnings
"${cargo[@]}" run "${manifest[@]}" -p qjlkv --example decode -- 1024
