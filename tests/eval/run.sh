#!/usr/bin/env bash
# The evaluation's tests: installs the models and this checkout's qjlkv (rebuilt, so a
# stale installed copy is never tested) into a virtual environment of the checkout
# (build/eval-venv, seeing the system's packages), then runs pytest on tests/eval.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv --system-site-packages build/eval-venv
export PATH="$PWD/build/eval-venv/bin:$PATH"
QJLKV_REINSTALL=1 tools/eval/install.sh
python3 -m pytest tests/eval -q -rs
