#!/usr/bin/env bash
# The evaluation's tests: installs the models and this checkout's qjlkv (rebuilt, so a
# stale installed copy is never tested) into the evaluation's virtual environment, then runs
# pytest on tests/eval with it.
set -euo pipefail
cd "$(dirname "$0")/../.."
QJLKV_REINSTALL=1 tools/eval/install.sh
source tools/python-env.sh
"$QJLKV_EVAL_VENV/bin/python" -m pytest tests/eval -q -rs
