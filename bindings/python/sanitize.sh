#!/usr/bin/env bash
# The Python extension under a sanitizer: builds qjlkv._qjlkv and the static C library with
# -fsanitize=thread (or address,undefined) and runs the thread-safety and error tests with the
# sanitizer runtime preloaded into the interpreter (Python itself is not instrumented: the
# checks cover the binding and the library, and see the GIL as the mutex it is).
#
#   bindings/python/sanitize.sh [tsan|asan] [BUILD_DIR]     (default: tsan build)
#
# Needs the test environment bindings/python/run_tests.sh makes (BUILD_DIR/python-venv).
# Any sanitizer report fails the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIND=${1:-tsan}
BUILD=$(cd "${2:-build}" && pwd)
VENV=$BUILD/python-venv
OUT=$BUILD/python-$KIND
# Reports go to files (pytest captures the test's stderr, and a halted run would lose them).
REPORT=$OUT/report
case $KIND in
  tsan) FLAGS="-fsanitize=thread"; RUNTIME="libtsan.so libstdc++.so"
    export TSAN_OPTIONS="halt_on_error=1 exitcode=66 second_deadlock_stack=1 log_path=$REPORT" ;;
  asan) FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all"
    # libstdc++ preloaded too: ASan's __cxa_throw interceptor must find the real one at start-up
    # (python itself does not link libstdc++), or the first C++ exception aborts.
    RUNTIME="libasan.so libstdc++.so"
    # Python's own allocations are not freed at exit by design: leaks are not checked here.
    export ASAN_OPTIONS="detect_leaks=0 abort_on_error=1 log_path=$REPORT" \
      UBSAN_OPTIONS="print_stacktrace=1 log_path=$REPORT" ;;
  *) echo "usage: $0 [tsan|asan] [BUILD_DIR]" >&2; exit 2 ;;
esac
[ -x "$VENV/bin/python" ] || { echo "$VENV missing: run bindings/python/run_tests.sh $BUILD first" >&2; exit 2; }
echo "building the extension with $FLAGS in $OUT"
cmake -S bindings/python -B "$OUT/cmake" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -g" \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" \
  -DCMAKE_MODULE_LINKER_FLAGS="$FLAGS" -DPython_EXECUTABLE="$VENV/bin/python" \
  -Dpybind11_DIR="$("$VENV/bin/python" -m pybind11 --cmakedir)" >/dev/null
cmake --build "$OUT/cmake" -j "${QJLKV_JOBS:-$(nproc)}" --target _qjlkv
# The package as it is installed: the Python files next to the instrumented extension.
rm -rf "$OUT/site" "$REPORT".*
mkdir -p "$OUT/site"
cp -r bindings/python/qjlkv "$OUT/site/"
cp "$OUT"/cmake/_qjlkv*.so "$OUT/site/qjlkv/"
echo "running tests/python/test_threads.py and test_errors.py under $KIND"
preload=()
for lib in $RUNTIME; do preload+=("$(${CXX:-c++} -print-file-name=$lib)"); done
status=0
LD_PRELOAD="${preload[*]}" PYTHONPATH="$OUT/site" \
  "$VENV/bin/python" -m pytest tests/python/test_threads.py tests/python/test_errors.py -q -p no:cacheprovider ||
  status=$?
if compgen -G "$REPORT.*" >/dev/null; then
  cat "$REPORT".*
  echo "$KIND: reports above (also in $REPORT.*)" >&2
  exit 1
fi
exit $status
