#!/usr/bin/env bash
# scripts/setup.sh — installs dion3's build dependencies on a Debian/Ubuntu machine and builds
# the C++ library, its tests and dion3-bench into build/.
#
# Idempotent: packages already installed are not touched (apt runs only for missing ones, via
# sudo when not root), and the build is incremental. Environment knobs:
#   DION3_CUDA=ON|OFF      build the CUDA backend (see below; default ON where nvcc exists)
#   DION3_BUILD_DIR=path   build folder (default <repo>/build)
#   CMAKE_BUILD_TYPE=...   Release (default), Debug, RelWithDebInfo
#   JOBS=n                 parallel build jobs (default 2)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# ===================================== CUDA backend switch ====================================
# ON wherever nvcc is installed (CI too: it has no GPU but compiles every CUDA source, and the
# CUDA tests skip themselves there); OFF otherwise. Override per call: DION3_CUDA=OFF scripts/setup.sh
if [ -z "${DION3_CUDA:-}" ]; then
  if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then DION3_CUDA=ON; else DION3_CUDA=OFF; fi
fi
# ==============================================================================================

BUILD_DIR=${DION3_BUILD_DIR:-$ROOT/build}
BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release}
JOBS=${JOBS:-2}

log() { printf '[setup] %s\n' "$*" >&2; }

# --- system packages ---------------------------------------------------------------------------
# clang and its compiler runtime (sanitizers, libFuzzer): the sanitizer job, scripts/test-sanitize.sh.
PACKAGES=(cmake ninja-build g++ libopenblas-dev libgtest-dev googletest python3-venv libopenmpi-dev openmpi-bin
          clang libclang-rt-dev)
if command -v dpkg-query >/dev/null 2>&1; then
  missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then
      command -v sudo >/dev/null 2>&1 || { log "need root or sudo to install: ${missing[*]}"; exit 1; }
      SUDO=(sudo)
    fi
    log "installing ${missing[*]}"
    "${SUDO[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    log "system packages present"
  fi
else
  log "no dpkg: not a Debian system, install by hand: ${PACKAGES[*]}"
fi

# --- configure and build ------------------------------------------------------------------------
cmake_args=(-S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DDION3_CUDA="$DION3_CUDA")
if [ "$DION3_CUDA" = ON ] && ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  cmake_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
fi
# A build folder made by another generator cannot be reused with Ninja: start it afresh.
if [ -f "$BUILD_DIR/CMakeCache.txt" ] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$BUILD_DIR/CMakeCache.txt"; then
  log "removing $BUILD_DIR (configured with another generator)"
  rm -rf "$BUILD_DIR"
fi
log "configuring $BUILD_DIR (DION3_CUDA=$DION3_CUDA, $BUILD_TYPE)"
cmake "${cmake_args[@]}" >/dev/null
log "building with $JOBS jobs"
cmake --build "$BUILD_DIR" -j "$JOBS" >&2  # build log on stderr: stdout stays the bench/test output
log "done: $BUILD_DIR/dion3-bench, tests: scripts/test.sh"
