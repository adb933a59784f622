#!/usr/bin/env bash
# device: build the sym bench with bench/results/2026-12-03-48b6f6b-h200/trace.patch, run traced shapes
set -uo pipefail
ROOT=$(pwd)
git apply bench/results/2026-12-03-48b6f6b-h200/trace.patch || { echo "patch failed"; exit 1; }
PREFIX=/tmp/dion3-deps; EXTRA=()
if [ -d .deps/googletest ] && [ ! -f $PREFIX/lib/cmake/GTest/GTestConfig.cmake ]; then
  cmake -S .deps/googletest -B /tmp/gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=$PREFIX -DBUILD_GMOCK=ON >/dev/null && ninja -C /tmp/gtest-build -j16 install >/dev/null
fi
[ -d $PREFIX ] && EXTRA+=(-DCMAKE_PREFIX_PATH=$PREFIX)
if [ -f .deps/blas/lib/libblas.so ]; then
  EXTRA+=(-DBLAS_LIBRARIES="$ROOT/.deps/blas/lib/libblas.so" -DCMAKE_CXX_FLAGS="-isystem $ROOT/.deps/blas/include")
  export LD_LIBRARY_PATH="$ROOT/.deps/blas/lib:${LD_LIBRARY_PATH:-}"; export LIBRARY_PATH="$ROOT/.deps/blas/lib:${LIBRARY_PATH:-}"
fi
B=/tmp/dion3-build-trace
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DDION3_CUDA=ON "${EXTRA[@]}" >/tmp/cfg.log 2>&1 || { tail -20 /tmp/cfg.log; exit 1; }
ninja -C $B -j16 dion3-cuda-sym-bench >/tmp/build.log 2>&1 || { grep -E "error" -A3 /tmp/build.log | head -40; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for sh in ${SHAPES:-sym:f16:64x512 gram:f16:64x512x2048 sym:f16:16x512 gram:f16:16x512x8192 sym:f16:32x1024 sym:f16:128x1024 sym:bf16:16x2048 gram:bf16:16x2048x2048 sym:f16:8x4096}; do
  echo "=== $sh"
  for m in ${MODES:-1}; do echo "--- trace mode $m"; DION3_SYM_TRACE=$m timeout 60 $B/dion3-cuda-sym-bench --shapes $sh --iters 3 2>&1 | grep -E "TRACE (C|P|H chain|slack)"; done
  timeout 60 $B/dion3-cuda-sym-bench --shapes $sh --iters 20 2>&1 | grep -E "^\| (gram|sym)"
done
