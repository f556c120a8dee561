#!/usr/bin/env bash
# The README demo: SmolLM2-135M (numpy) answers a question about a ~750-token text with
# an exact KV cache and with libqjlkv's default preset; prints both texts, the cache
# memory and the KL divergence. Options go to the demo (--preset, --tokens, --question).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/eval/install.sh
exec python3 -m tools.eval.demo "$@"
