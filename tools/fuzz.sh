#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz with clang (-fsanitize=fuzzer,address,undefined;
# the library itself with coverage, ASan and UBSan) and runs each for a bounded time, starting
# from the committed seed corpus tests/fuzz/corpus/<harness>/.
#
#   tools/fuzz.sh [SECONDS_PER_HARNESS]      (default 60)
#
# Environment: QJLKV_FUZZ_BUILD (build directory, default build-fuzz), QJLKV_FUZZ_HARNESSES
# (default "config api import"), QJLKV_JOBS (build jobs, default nproc), QJLKV_FUZZ_SEED (libFuzzer's
# seed, default 1: every CI run explores the same inputs, as far as its time allows, so a
# failure there points at a change rather than at luck; "random" or another number explores
# further by hand).
# New interesting inputs go to $QJLKV_FUZZ_BUILD/corpus/<harness>/, never into the repository.
# A crash leaves its input in $QJLKV_FUZZ_BUILD/artifacts/<harness>/ and fails the script: fix
# the bug, then commit the input to tests/fuzz/corpus/<harness>/ (the ctest
# qjlkv_fuzz_replay_<harness> replays it in every build from then on) and add a unit test to
# tests/reliability/test_regressions.cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SECONDS_EACH=${1:-60}
BUILD=${QJLKV_FUZZ_BUILD:-$ROOT/build-fuzz}
HARNESSES=${QJLKV_FUZZ_HARNESSES:-"config api import"}
JOBS=${QJLKV_JOBS:-$(nproc)}
SEED=${QJLKV_FUZZ_SEED:-1}
[ "$SEED" = random ] && SEED=0  # libFuzzer: 0 picks a seed from the clock
case $SECONDS_EACH in '' | *[!0-9]*) echo "usage: $0 [seconds per harness]" >&2; exit 2 ;; esac

command -v clang++ >/dev/null || { echo "clang++ not found (apt-get install clang)" >&2; exit 1; }
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"

echo "== building the library with clang: coverage for libFuzzer, ASan, UBSan"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -g" -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" \
  -DCMAKE_C_FLAGS="$SAN -fsanitize=fuzzer-no-link" -DCMAKE_CXX_FLAGS="$SAN -fsanitize=fuzzer-no-link" \
  -DQJLKV_CUDA=OFF -DQJLKV_BUILD_TESTS=OFF -DQJLKV_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$BUILD" --target qjlkv_static -j "$JOBS"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for h in $HARNESSES; do
  echo "== fuzz_$h: building"
  clang++ -std=c++20 -O1 -g $SAN -fsanitize=fuzzer -I"$ROOT/include" -I"$ROOT/src" -I"$ROOT/tests/fuzz" \
    "$ROOT/tests/fuzz/fuzz_$h.cpp" "$BUILD/libqjlkv.a" -lpthread -o "$BUILD/fuzz_$h"
  mkdir -p "$BUILD/corpus/$h" "$BUILD/artifacts/$h"
  echo "== fuzz_$h: ${SECONDS_EACH} s from $(ls "$ROOT/tests/fuzz/corpus/$h" | wc -l) seed inputs"
  start=$SECONDS
  # -timeout: one input running 20 s is a hang; -rss_limit_mb: a leak or an unbounded allocation.
  if "$BUILD/fuzz_$h" -seed="$SEED" -max_total_time="$SECONDS_EACH" -timeout=20 -rss_limit_mb=2048 -max_len=4096 \
      -print_final_stats=1 -artifact_prefix="$BUILD/artifacts/$h/" \
      "$BUILD/corpus/$h" "$ROOT/tests/fuzz/corpus/$h" >"$BUILD/fuzz_$h.log" 2>&1; then
    echo "   ok after $((SECONDS - start)) s: $(grep -E '^stat::number_of_executed_units' "$BUILD/fuzz_$h.log" | awk '{print $2}') runs," \
      "coverage $(grep -oE 'cov: [0-9]+' "$BUILD/fuzz_$h.log" | tail -1)"
  else
    status=1
    echo "   FAILED after $((SECONDS - start)) s (full log: $BUILD/fuzz_$h.log):"
    grep -m 12 -E "runtime error|invariant failed|^  [a-z]|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|^SUMMARY|#[0-9]+ .* in (qjlkv|\(anonymous)" \
      "$BUILD/fuzz_$h.log" | sed 's/^/     /'
    echo "   crashing inputs: $(ls "$BUILD/artifacts/$h");" \
      "QJLKV_FUZZ_TRACE=1 $BUILD/fuzz_$h <input> replays one with a trace of its calls"
  fi
done
exit $status
