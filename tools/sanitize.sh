#!/usr/bin/env bash
# The sanitizer checks of libqjlkv, for CI (2 cores):
#   asan      the library and the whole C++ test suite (ctest) built with
#             -fsanitize=address,undefined -fno-sanitize-recover=all, run with leak detection,
#             but the estimator's many-sample statistics (label statistical: single-threaded
#             arithmetic that the plain build runs and the other tests cover under ASan with fewer
#             samples; 110 s of the suite's CPU time in CI); of the CUDA emulator's tests, every
#             unparametrized one, every odd shape (Corners) and the f16 case of each
#             parametrized family (103 of 246): the f32/bf16 cases run the same host code and kernels
#             with another element type; all of them took about 80 % of the step's CPU time;
#   asan-O0   the same sanitizers at -O0 on the tests that pass every class of bad argument
#             (labels api, errors, badinput, fuzz_replay): at -O1 the compiler folds away loads
#             that UBSan checks, such as an out-of-range value loaded as a C++ enum;
#   tsan      the same under ThreadSanitizer (the stress test runs many threads sharing a sketch,
#             and caches with internal worker threads), but the per-instruction-set sweeps of
#             tests/cpu_paths (the same threading code once per ISA; their thread-count test
#             stays), about 40 % of the step's CPU time; the CUDA emulator's tests are neither
#             built nor run (QJLKV_BUILD_EMULATOR_TESTS=OFF);
#   valgrind  memcheck on the C example (qjlkv_demo 256 4, every preset): no invalid access, no
#             leak. It runs the demo of $QJLKV_VALGRIND_BUILD when set (tools/test-all.sh passes
#             its release build), else builds one at -O1 -g.
# Sanitizer builds use -O1 -g (asan-O0: -O0 -g), in their own directories. Any report fails the
# script.
#
#   tools/sanitize.sh [asan] [asan-O0] [tsan] [valgrind]      (default: all four)
#
# Environment: QJLKV_SANITIZE_DIR (where the build directories go, default the repository
# root: build-asan, build-asan-O0, build-tsan, build-valgrind), QJLKV_JOBS (default nproc),
# QJLKV_ASAN_EXCLUDE (ctest -LE regex of the labels skipped under ASan; default "statistical"),
# QJLKV_TSAN_EXCLUDE (ctest -LE regex of test labels skipped under TSan; default
# "statistical|emulator": the estimator's many-sample statistics and the CUDA emulator's tests,
# single-threaded, minutes each under TSan (whose model does not cover the emulator's fibers),
# and run by the plain and ASan builds). CC/CXX choose the compiler (default cc/c++).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${QJLKV_SANITIZE_DIR:-$ROOT}
JOBS=${QJLKV_JOBS:-$(nproc)}
TSAN_EXCLUDE=${QJLKV_TSAN_EXCLUDE:-statistical|emulator}
ASAN_EXCLUDE=${QJLKV_ASAN_EXCLUDE:-statistical}
STEPS=${*:-asan asan-O0 tsan valgrind}
ASAN_EMULATOR_CASES='^[A-Za-z]+\.|^Corners/|_f16'
TSAN_SKIP='^Presets/CachePaths\.(OutputsWithinErrorBudget|VariantsWithinErrorBudget|StoredNumbersIdenticalOnEveryPath|PathsAgreeWithScalar|AttentionMatchesSoftmaxOverReconstruction)/'
ASAN_O0_LABELS="api|errors|badinput|fuzz_replay"
ASAN_O0_TARGETS="qjlkv_test_api qjlkv_test_errors qjlkv_test_bad_input qjlkv_fuzz_replay_config qjlkv_fuzz_replay_api qjlkv_fuzz_replay_import"
failed=()

# configure_and_build DIR FLAGS [TARGETS]: the library, tests and examples (or only TARGETS), at
# $OPT (default -O1), with the CMake options in $OPTIONS.
configure_and_build() {
  local build=$1 flags=$2 targets=${3:-} opt=${OPT:--O1}
  cmake -S "$ROOT" -B "$build" -DQJLKV_CUDA=OFF -DQJLKV_BUILD_BENCH=OFF ${OPTIONS:-} \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="$opt -g" -DCMAKE_CXX_FLAGS_DEBUG="$opt -g" \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null &&
    cmake --build "$build" -j "$JOBS" ${targets:+--target $targets}
}

# run_ctest DIR [ctest args...]: the whole suite; fails when the reliability tests are missing.
run_ctest() {
  local build=$1 count
  shift
  count=$(ctest --test-dir "$build" -N -L reliability | sed -n 's/^Total Tests: //p')
  if [ "${count:-0}" -eq 0 ]; then
    echo "no tests labelled 'reliability': tests/CMakeLists.txt must add_subdirectory(reliability)" >&2
    return 1
  fi
  ctest --test-dir "$build" --output-on-failure -j "$JOBS" --timeout 1800 "$@"
}

step() {  # step NAME COMMAND...
  local name=$1 start=$SECONDS
  shift
  echo
  echo "==================== sanitize: $name ===================="
  if "$@"; then
    echo "---- $name: clean ($((SECONDS - start)) s)"
  else
    echo "---- $name: FAILED ($((SECONDS - start)) s)"
    failed+=("$name")
  fi
}

asan() {
  # Leaks, use-after-free, overflows (stack and heap), undefined behaviour: each aborts the test.
  # (No detect_stack_use_after_return: its fake stacks break the fibers of the CUDA emulator
  # that tests/gpu runs on the CPU.)
  export ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1:halt_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  configure_and_build "$DIR/build-asan" "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" &&
    run_ctest "$DIR/build-asan" -LE "$ASAN_EXCLUDE|emulator" &&
    ctest --test-dir "$DIR/build-asan" --output-on-failure -j "$JOBS" --timeout 1800 -L emulator \
      -R "$ASAN_EMULATOR_CASES" --no-tests=error
}

# -O0: every load stays a load, so UBSan sees e.g. an int outside an enum loaded as the enum.
asan_O0() {
  export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  OPT=-O0 configure_and_build "$DIR/build-asan-O0" \
    "-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" "$ASAN_O0_TARGETS" &&
    ctest --test-dir "$DIR/build-asan-O0" --output-on-failure -j "$JOBS" --timeout 1800 -L "$ASAN_O0_LABELS" \
      --no-tests=error
}

tsan() {
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  # The emulator's tests are not run here (TSAN_EXCLUDE), so they are not built either: they
  # were about 40 % of this build's compile time.
  OPTIONS=-DQJLKV_BUILD_EMULATOR_TESTS=OFF configure_and_build "$DIR/build-tsan" \
    "-fsanitize=thread -fno-omit-frame-pointer" &&
    run_ctest "$DIR/build-tsan" -LE "$TSAN_EXCLUDE" -E "$TSAN_SKIP"
}

valgrind_demo() {
  command -v valgrind >/dev/null || { echo "valgrind not found (apt-get install valgrind)" >&2; return 1; }
  local build=${QJLKV_VALGRIND_BUILD:-}
  if [ -z "$build" ]; then
    build=$DIR/build-valgrind
    cmake -S "$ROOT" -B "$build" -DQJLKV_CUDA=OFF -DQJLKV_BUILD_TESTS=OFF -DQJLKV_BUILD_EXAMPLES=ON \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
      -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" >/dev/null &&
      cmake --build "$build" --target qjlkv_demo -j "$JOBS" || return 1
  fi
  valgrind --error-exitcode=1 --leak-check=full --show-leak-kinds=definite,indirect,possible \
      --errors-for-leak-kinds=definite,indirect,possible --track-origins=yes \
      "$build/examples/qjlkv_demo" 256 4
}

for s in $STEPS; do
  case $s in
    asan) step "ASan+UBSan ctest" asan ;;
    asan-O0) step "ASan+UBSan -O0 ctest (bad input)" asan_O0 ;;
    tsan) step "TSan ctest" tsan ;;
    valgrind) step "valgrind qjlkv_demo" valgrind_demo ;;
    *) echo "unknown step '$s' (asan, asan-O0, tsan, valgrind)" >&2; exit 2 ;;
  esac
done
echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "sanitize: FAILED: ${failed[*]}"
  exit 1
fi
echo "sanitize: all clean ($STEPS)"
