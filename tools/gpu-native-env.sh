# shellcheck shell=bash
# tools/gpu-native-env.sh — sourced by the GPU tools that build the native library (ROOT set):
# what a bare GPU machine lacks, from the carried .deps/ (tools/prepare-device-deps) and the
# image's NCCL wheel. After sourcing, DION3_CMAKE_DEPS holds the CMake arguments that find them
# (the BLAS, NCCL where the wheel has its headers), and the library paths name the folders the
# built programs load them from.
#   dion3_gtest [JOBS]   builds GoogleTest from .deps/googletest once per machine (into
#                        /tmp/dion3-deps) and adds its prefix to DION3_CMAKE_DEPS; 1 if it fails
# Sourced a second time (a tool and the Python env it sources), it keeps what the first set up.
[ -n "${DION3_NATIVE_ENV:-}" ] && return 0
DION3_NATIVE_ENV=1
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
DION3_DEPS_PREFIX=/tmp/dion3-deps
DION3_CMAKE_DEPS=()
if [ -f "$ROOT/.deps/blas/lib/libblas.so" ]; then
  DION3_CMAKE_DEPS+=(-DBLAS_LIBRARIES="$ROOT/.deps/blas/lib/libblas.so" -DCMAKE_CXX_FLAGS="-isystem $ROOT/.deps/blas/include")
  export LD_LIBRARY_PATH="$ROOT/.deps/blas/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LIBRARY_PATH="$ROOT/.deps/blas/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
fi
# NCCL for the native GPU communicator: the image's nvidia-nccl wheel, where it carries headers.
DION3_NCCL_ROOT=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
if [ -n "$DION3_NCCL_ROOT" ] && [ -f "$DION3_NCCL_ROOT/include/nccl.h" ]; then
  DION3_CMAKE_DEPS+=(-DDION3_NCCL_ROOT="$DION3_NCCL_ROOT")
  export LD_LIBRARY_PATH="$DION3_NCCL_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

dion3_gtest() {
  if [ -d "$ROOT/.deps/googletest" ] && [ ! -f "$DION3_DEPS_PREFIX/lib/cmake/GTest/GTestConfig.cmake" ]; then
    cmake -S "$ROOT/.deps/googletest" -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_INSTALL_PREFIX="$DION3_DEPS_PREFIX" -DBUILD_GMOCK=ON >/dev/null &&
      ninja -C /tmp/gtest-build -j"${1:-16}" install >/dev/null || return 1
  fi
  if [ -d "$DION3_DEPS_PREFIX" ]; then DION3_CMAKE_DEPS+=(-DCMAKE_PREFIX_PATH="$DION3_DEPS_PREFIX"); fi
  return 0
}
