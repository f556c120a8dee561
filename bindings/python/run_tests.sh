#!/usr/bin/env bash
# Builds and tests the Python package on a fresh machine:
#   bindings/python/run_tests.sh [BUILD_DIR]
# A virtual environment in BUILD_DIR/python-venv gets the pinned test requirements, then the
# package is built from this tree (extension + static C library, CPU only unless
# QJLKV_CUDA=ON|AUTO is set) and pytest runs tests/python.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
VENV=$BUILD/python-venv
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r bindings/python/requirements-test.txt
# No build isolation: the pinned scikit-build-core and pybind11 above build it.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps \
  ./bindings/python
exec "$VENV/bin/python" -m pytest tests/python -q -rs
