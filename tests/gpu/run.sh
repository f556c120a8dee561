#!/usr/bin/env bash
# GPU checks of the CUDA backend, for a machine with an NVIDIA GPU (sm_90: H100/H200). Ends in
# under 6 minutes on one H200: every step has its own time limit and all of them share one
# deadline (QJLKV_GPU_BUDGET_S seconds, default 345).
#
#   OUT=/path/to/logs tests/gpu/run.sh        # OUT defaults to build-gpu/logs
#
#   1. build for sm_90: the library, the GPU tests (when GoogleTest is installed), the benchmark
#   2. GPU tests: the CUDA backend against the CPU backend (tests/gpu/test_cuda_backend.cpp)
#   3. compute-sanitizer: memcheck on a short run of the tests, racecheck and synccheck on one test
#   4. benchmarks: bench/gpu/bench_gpu.cu (q2/q3/q4/qjl/kivi/exact, contexts 4k..128k, batch 1 and 32, copy
#      bandwidth, append throughput, export/import of one layer) and torch SDPA on a bf16 cache
#      when torch is importable
#
# Logs (six files at most): summary.txt, build.log, tests.log, tests.xml, sanitizer.log, bench.log.
# Exit status 0 when every step passed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${QJLKV_GPU_BUILD:-$ROOT/build-gpu}
OUT=${OUT:-$BUILD/logs}
DEADLINE=$((SECONDS + ${QJLKV_GPU_BUDGET_S:-345}))
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$PATH:$CUDA_HOME/bin"
JOBS=$(nproc)
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
for log in build tests sanitizer bench; do : >"$OUT/$log.log"; done
failures=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME LOG LIMIT_S COMMAND...: runs COMMAND for at most min(LIMIT_S, time left), appending
# its output to $OUT/LOG.log; prints ok/FAIL with the time taken.
step() {
  local name=$1 log=$OUT/$2.log limit=$3
  shift 3
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 5 ]; then
    note "FAIL $name: not started, the time budget is spent"
    failures=$((failures + 1))
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local part=$OUT/.step.log start=$SECONDS rc=0
  timeout --kill-after=5 "$limit" "$@" >"$part" 2>&1 || rc=$?
  { echo "==================== $name (limit $limit s, exit $rc): $*"; cat "$part"; } >>"$log"
  if [ "$rc" -eq 0 ]; then
    rm -f "$part"
    note "ok   $name ($((SECONDS - start)) s)"
    return 0
  fi
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    note "FAIL $name: timed out after $limit s"
  else
    note "FAIL $name: exit status $rc after $((SECONDS - start)) s"
  fi
  tail -n 30 "$part" | sed 's/^/    /' | tee -a "$SUMMARY"
  rm -f "$part"
  failures=$((failures + 1))
  return 1
}

note "libqjlkv GPU checks, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' |
    tee -a "$SUMMARY" || true
else
  note "gpu: nvidia-smi not found"
fi
command -v nvcc >/dev/null || { note "FAIL nvcc not found (PATH or CUDA_HOME)"; exit 1; }

# ---- 1. build ----
have_tests=1
configure=(cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DQJLKV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90
  -DQJLKV_BUILD_EXAMPLES=OFF -DQJLKV_BUILD_BENCH=OFF)
if ! step configure build 90 "${configure[@]}" -DQJLKV_BUILD_TESTS=ON; then
  note "     (GoogleTest missing? building without the tests)"
  have_tests=0
  step configure-library build 60 "${configure[@]}" -DQJLKV_BUILD_TESTS=OFF || true
fi
targets=(qjlkv_static)
[ "$have_tests" = 1 ] && targets+=(qjlkv_test_gpu)
step build build 200 cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}" || true
BENCH=$BUILD/bench_gpu
step build-bench build 60 nvcc -O3 -std=c++17 -arch=sm_90 -I"$ROOT/include" "$ROOT/bench/gpu/bench_gpu.cu" \
  "$BUILD/libqjlkv.a" -o "$BENCH" -lpthread -ldl -lrt || true

# ---- 2. GPU tests ----
TEST=$BUILD/tests/gpu/qjlkv_test_gpu
if [ -x "$TEST" ]; then
  step gpu-tests tests 150 "$TEST" --gtest_output=xml:"$OUT/tests.xml" || true
  if grep -q "no CUDA device" "$OUT/tests.log"; then
    note "FAIL gpu-tests skipped: $(grep -m1 'no CUDA device' "$OUT/tests.log")"
    failures=$((failures + 1))
  fi
  # The counts, then the names of failed tests (at most 40).
  grep -E "^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?" "$OUT/tests.log" | sed 's/^/     /' | tee -a "$SUMMARY" || true
  grep -E "^\[  FAILED  \] [A-Za-z]" "$OUT/tests.log" | sort -u | head -n 40 | sed 's/^/     /' |
    tee -a "$SUMMARY" || true
else
  note "FAIL gpu-tests: $TEST was not built"
  failures=$((failures + 1))
fi

# ---- 3. compute-sanitizer ----
SAN=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
if [ ! -x "$SAN" ]; then
  note "FAIL compute-sanitizer not found"
  failures=$((failures + 1))
elif [ -x "$TEST" ]; then
  short='AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/qjl_f16_d64_g4'
  short+=':AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/kivi_bf16_d128_g7'
  short+=':AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/exact_f32_d256_g1'
  short+=':AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/q3_bf16_d128_g7'
  short+=':AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/q2_bf16_d128_g7'
  short+=':Presets/CudaExportImport.StreamsAreBackendIndependentAndRoundTrip/q4_f32_sinks20_b8'
  short+=':CudaBackend.RejectsBadDataAndStaysUnchanged:CudaBackend.StreamsOrderWork'
  # Windows: the kernel must not read the blocks (and block-table entries) a window freed.
  short+=':Presets/CudaLayerAttention.WindowsMatchTheCpu/ott_f16'
  short+=':Presets/CudaSequenceOps.WindowFreesTheBlocksTheCpuFrees/q3_bf16'
  step memcheck sanitizer 100 "$SAN" --tool memcheck --error-exitcode 9 --leak-check full "$TEST" \
    --gtest_filter="$short" || true
  # Shared memory hazards and barrier misuse: small tests that reach every kernel (QJL, OTT, KIVI,
  # mixed).
  step racecheck sanitizer 75 "$SAN" --tool racecheck --racecheck-report all --error-exitcode 9 "$TEST" \
    --gtest_filter='CudaBackend.RejectsBadDataAndStaysUnchanged:AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/ott_f16_d64_g4:AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/q2_f16_d64_g4' ||
    true
  step synccheck sanitizer 45 "$SAN" --tool synccheck --error-exitcode 9 "$TEST" \
    --gtest_filter='CudaBackend.StreamsOrderWork:AllMethods/CudaVsCpu.SameBytesScoresAndOutputs/exact_bf16_d64_g7' || true
elif [ -x "$BENCH" ]; then
  step memcheck sanitizer 100 "$SAN" --tool memcheck --error-exitcode 9 "$BENCH" --quick || true
fi

# ---- 4. benchmarks ----
if [ -x "$BENCH" ]; then
  step bench bench 150 "$BENCH" || true
else
  note "FAIL bench: $BENCH was not built"
  failures=$((failures + 1))
fi
if command -v python3 >/dev/null; then
  step bench-sdpa bench 60 python3 "$ROOT/bench/gpu/bench_sdpa.py" || true
else
  note "     (no python3: the torch SDPA baseline is skipped)"
fi
{
  echo "---- benchmark lines (time_us per call; read_GBps = compressed bytes read / time) ----"
  grep -E "^(copy_bandwidth|attend|append|append_batch|export_import|sdpa:) " "$OUT/bench.log" || true
} | tee -a "$SUMMARY"

note "total $SECONDS s, $failures failed step(s)"
[ "$failures" -eq 0 ]
