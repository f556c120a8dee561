#!/usr/bin/env bash
# The evaluation's tests: installs the model package and this checkout's qjlkv (rebuilt, so a
# stale installed copy is never tested), then runs pytest on tests/eval.
set -euo pipefail
cd "$(dirname "$0")/../.."
QJLKV_REINSTALL=1 tools/eval/install.sh
python3 -m pytest tests/eval -q -rs
