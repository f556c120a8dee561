#!/usr/bin/env bash
# Runs every test suite of libqjlkv on a fresh machine: installs what it needs (apt-get, pip),
# builds the library once and reuses that build across the suites.
#
#   tools/test-all.sh            # everything
#   QJLKV_SUITES="cpp python" tools/test-all.sh   # a subset of:
#       deps cpp cuda packaging python rust eval sanitize fuzz
# (sanitize: ASan+UBSan and TSan builds running the whole ctest suite, ASan+UBSan at -O0 on the
# bad-input tests, valgrind on the C demo, and, with python, the Python extension's thread tests
# under TSan;
# fuzz: the libFuzzer harnesses for QJLKV_FUZZ_SECONDS each, default 30: the seed is fixed, so
# CI explores the same inputs each run; longer runs are for by hand, tools/fuzz.sh SECONDS.)
#
# Each suite prints its own closing line; the script ends with "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${QJLKV_BUILD:-$ROOT/build}
JOBS=${QJLKV_JOBS:-$(nproc)}
SUITES=${QJLKV_SUITES:-"deps cpp cuda packaging python rust eval sanitize fuzz"}
passed=0
failed=0
failed_names=()

want() { [[ " $SUITES " == *" $1 "* ]]; }
# count_suite NAME STATUS SECONDS [NOTE]: counts a finished suite and prints its closing line.
count_suite() {
  if [ "$2" -eq 0 ]; then
    passed=$((passed + 1))
    echo "---- $1: ok ($3 s${4:+, $4})"
  else
    failed=$((failed + 1))
    failed_names+=("$1")
    echo "---- $1: FAILED ($3 s${4:+, $4})"
  fi
  return "$2"
}
run_suite() {  # run_suite NAME COMMAND...: fails as the suite does
  local name=$1 start=$SECONDS rc=0
  shift
  echo
  echo "==================== $name ===================="
  "$@" || rc=$?
  count_suite "$name" "$rc" $((SECONDS - start))
}

apt_install() {  # installs the Debian packages that are missing
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "apt-get install ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

deps() {
  apt_install cmake make g++ clang pkg-config libgtest-dev libgmock-dev libbenchmark-dev \
    libeigen3-dev abigail-tools bindgen libclang-dev libclang-rt-dev valgrind file dpkg-dev \
    python3 python3-venv python3-dev  # the Python suites' virtual environments and the extension's build
}

# The main build is CPU-only, with the library's warnings as errors, and serves every suite; the
# CUDA backend is compiled and linked in a build of its own (suite "cuda"), whose GPU tests skip
# with a printed reason where no GPU is. That build makes only what the main build cannot test:
# the library with the CUDA backend, the layout tests against it and the device tests (the
# emulator's tests and the CPU suites run in the main build; building them twice cost CI about
# two minutes).
build_library() {
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DQJLKV_CUDA=OFF -DQJLKV_BUILD_BENCH=ON -DQJLKV_WERROR=ON &&
    cmake --build "$BUILD" -j "$JOBS"
}

cuda_build() {
  local nvcc
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  if [ ! -x "$nvcc" ]; then
    echo "cuda: no nvcc on this machine: the CUDA backend is not built"
    return 0
  fi
  # One architecture: the kernels' source is the same for each, and the released set (80, 90
  # and PTX) compiles every kernel once per real architecture, twice the work for no other check.
  cmake -S "$ROOT" -B "$BUILD-cuda" -DCMAKE_BUILD_TYPE=Release -DQJLKV_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_CUDA_ARCHITECTURES="${QJLKV_CI_CUDA_ARCHITECTURES:-90-real}" -DQJLKV_BUILD_EXAMPLES=OFF &&
    cmake --build "$BUILD-cuda" -j "$JOBS" --target qjlkv qjlkv_static qjlkv_test_cuda_layout qjlkv_test_gpu \
      qjlkv_gpu_probe &&
    ctest --test-dir "$BUILD-cuda" --output-on-failure -j "$JOBS" -L layout --no-tests=error --timeout 900 &&
    device_tests "$BUILD-cuda"
}

# The real-GPU tests: ctest marks a skipped test only "***Skipped"; their own output says why
# (e.g. "no CUDA device: cudaErrorNoDevice"), so each distinct reason is printed with its count.
device_tests() {
  local log=$1/device-tests.log rc=0
  ctest --test-dir "$1" -V -j "$JOBS" -L device --timeout 900 >"$log" 2>&1 || rc=$?
  grep -E "tests passed|tests failed|\(Failed\)" "$log"
  local reasons
  reasons=$(grep -oE "no CUDA device: .*" "$log" | sort | uniq -c)
  [ -n "$reasons" ] && echo "$(grep -c '\*\*\*Skipped' "$log") device tests skipped, with the reason they print:" &&
    echo "$reasons"
  [ $rc -eq 0 ] || tail -n 60 "$log"
  return $rc
}

# One suite may run beside the others: started by start_beside, reported (its log printed whole)
# and counted by join_beside.
beside_pid=""
start_beside() {  # start_beside NAME COMMAND...
  beside_name=$1
  shift
  beside_log=$BUILD/$beside_name-suite.log
  echo
  echo "==================== $beside_name: started beside the next suites ($beside_log) ===================="
  beside_start=$SECONDS
  "$@" >"$beside_log" 2>&1 &
  beside_pid=$!
}
join_beside() {
  [ -n "$beside_pid" ] || return 0
  local rc=0
  wait "$beside_pid" || rc=$?
  beside_pid=""
  echo
  echo "==================== $beside_name (ran beside the suites above) ===================="
  cat "$beside_log"
  count_suite "$beside_name" "$rc" $((SECONDS - beside_start)) "beside other suites"
}

cpp_tests() {
  ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS" --timeout 900
}

want deps && run_suite deps deps
run_suite build build_library
want cpp && run_suite cpp cpp_tests
want cuda && run_suite cuda cuda_build
if want packaging && [ -x tests/packaging/run.sh ]; then run_suite packaging tests/packaging/run.sh "$BUILD"; fi
wheel=""
if want python && [ -x bindings/python/run_tests.sh ]; then
  run_suite python bindings/python/run_tests.sh "$BUILD" &&
    wheel=$(ls "$BUILD"/python-dist/qjlkv-*manylinux*.whl 2>/dev/null | head -n 1)
fi
if want rust && [ -x bindings/rust/run_tests.sh ]; then run_suite rust bindings/rust/run_tests.sh "$BUILD"; fi
# The evaluation installs the wheel the python suite built from this checkout and tested, rather
# than compiling the same package again (about 90 s). Its tests run numpy on one core, so they
# run beside the sanitizers and fuzzing, which share no file with them: about 5 minutes less.
if want eval && [ -x tests/eval/run.sh ]; then start_beside eval env QJLKV_WHEEL="$wheel" tests/eval/run.sh; fi
# valgrind runs the main build's demo; the sanitizer builds are their own.
want sanitize && run_suite sanitize env QJLKV_VALGRIND_BUILD="$BUILD" tools/sanitize.sh
# The Python extension under TSan (one cache hammered from several threads); needs the python
# suite's environment.
if want sanitize && want python && [ -x bindings/python/sanitize.sh ]; then
  run_suite python-tsan bindings/python/sanitize.sh tsan "$BUILD"
fi
want fuzz && run_suite fuzz tools/fuzz.sh "${QJLKV_FUZZ_SECONDS:-30}"
join_beside

echo
[ $failed -gt 0 ] && echo "failed suites: ${failed_names[*]}"
echo "suites: $passed passed, $failed failed"
[ $failed -eq 0 ]
