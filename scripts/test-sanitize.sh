#!/usr/bin/env bash
# scripts/test-sanitize.sh — the sanitizer job: the library (CPU backend, C API), the GoogleTest
# suite and the C API program built with clang under AddressSanitizer + UndefinedBehaviorSanitizer
# (leak detection on) in build-asan/, then every CTest test there, which includes a bounded run
# of each libFuzzer harness of tests/fuzz. No CUDA, MPI or benchmarks. A sanitizer report fails
# the test that triggered it; a fuzzer crash leaves its input in build-asan/fuzz/<target>/crashes/.
#
# Called by scripts/test.sh; alone it needs clang and its runtime (scripts/setup.sh installs them).
#   DION3_ASAN_BUILD_DIR=path   build folder (default <repo>/build-asan)
#   DION3_FUZZ_SECONDS=n        seconds each fuzz harness runs (default 30; 0: no fuzz runs)
#   JOBS=n                      parallel build jobs and tests (default 2)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD_DIR=${DION3_ASAN_BUILD_DIR:-$ROOT/build-asan}
FUZZ_SECONDS=${DION3_FUZZ_SECONDS:-30}
JOBS=${JOBS:-2}

log() { printf '[sanitize] %4ss %s\n' "$SECONDS" "$*" >&2; }

for tool in clang clang++; do
  command -v "$tool" >/dev/null 2>&1 || { log "$tool not found: run scripts/setup.sh (it installs clang)"; exit 1; }
done
# A build folder configured with another compiler or generator cannot be switched: start afresh.
if [ -f "$BUILD_DIR/CMakeCache.txt" ] &&
   ! { grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$BUILD_DIR/CMakeCache.txt" &&
       grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++' "$BUILD_DIR/CMakeCache.txt"; }; then
  log "removing $BUILD_DIR (configured with another compiler or generator)"
  rm -rf "$BUILD_DIR"
fi

# -O1 and line tables: fast enough to fuzz, quick to build, stack traces with file:line.
log "configuring $BUILD_DIR (clang, ASan + UBSan, fuzz harnesses)"
cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-O1 -gline-tables-only" \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -gline-tables-only" \
  -DDION3_FUZZ=ON -DDION3_FUZZ_SECONDS="$FUZZ_SECONDS" \
  -DDION3_CUDA=OFF -DDION3_MPI=OFF -DDION3_BENCH=OFF >/dev/null
log "building with $JOBS jobs"
cmake --build "$BUILD_DIR" -j "$JOBS" >&2

# Leaks are reported at exit (LeakSanitizer) and fail the test; UBSan prints where it fired.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
export OPENBLAS_NUM_THREADS=1
exclude=()
if [ "$FUZZ_SECONDS" = 0 ]; then exclude=(-E '^fuzz\.(state|capi)$'); fi
log "running the tests"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" "${exclude[@]}"
log "done"
