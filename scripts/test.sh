#!/usr/bin/env bash
# scripts/test.sh — the whole test suite: sets up and builds when needed (scripts/setup.sh is
# idempotent and incremental), then runs every CTest test (GoogleTest suites and the C API
# program), the Python suite, the packaging tests (scripts/test-packaging.sh: sdist, wheel, a
# fresh virtualenv) and the sanitizer job (scripts/test-sanitize.sh: the same C++ and C tests
# under ASan + UBSan, and a bounded run of each fuzz harness; DION3_SANITIZE_JOB=0 skips it).
# Exit status is non-zero when anything fails.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD_DIR=${DION3_BUILD_DIR:-$ROOT/build}

scripts/setup.sh
ctest --test-dir "$BUILD_DIR" --output-on-failure
scripts/test-python.sh
scripts/test-packaging.sh
if [ "${DION3_SANITIZE_JOB:-1}" != 0 ]; then
  scripts/test-sanitize.sh
fi
