#!/usr/bin/env bash
# tests/fuzz/run_fuzz.sh — one time-bounded libFuzzer run of a dion3 harness (CTest's fuzz.*
# tests, and the longer runs of docs/testing.md).
#
#   run_fuzz.sh HARNESS SEEDS_DIR WORK_DIR SECONDS [libFuzzer flags...]
#
# Starts from the committed seeds (read only) and WORK_DIR/corpus (what earlier runs found; new
# inputs go there). A crash, sanitizer report, leak, timeout or out-of-memory stops the run and
# fails it; the input that caused it is left in WORK_DIR/crashes/ and printed with the command
# that replays it.
set -euo pipefail

if [ $# -lt 4 ]; then
  echo "usage: $0 HARNESS SEEDS_DIR WORK_DIR SECONDS [libFuzzer flags...]" >&2
  exit 2
fi
harness=$1 seeds=$2 work=$3 seconds=$4
shift 4
mkdir -p "$work/corpus" "$work/crashes"

# One BLAS thread: deterministic replays, and the run does not compete with itself.
export OPENBLAS_NUM_THREADS=1
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}

status=0
"$harness" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$work/crashes/" "$@" "$work/corpus" "$seeds" || status=$?
if [ $status -ne 0 ]; then
  echo "fuzz: $(basename "$harness") failed (exit $status). Inputs that failed it, in $work/crashes/:" >&2
  ls -l "$work/crashes" >&2
  echo "replay one with: OPENBLAS_NUM_THREADS=1 $harness $work/crashes/<file>" >&2
fi
exit $status
