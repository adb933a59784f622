#!/usr/bin/env bash
# The two experiments of this folder, run from the repository root on the device (carry .deps):
#   EXP=trace:  builds the sym bench with trace.patch applied here, runs the traced shapes
#               (SHAPES, MODES: DION3_SYM_TRACE 1 full, 2 main loop only, 3 banded).
#   EXP=stores: expects trace.patch and store-variants.patch applied (git apply) before the call; checks
#               correctness of variants B and E, then traces (TVARIANTS) and times (VARIANTS, ROUNDS)
#               DION3_SYM_GSTORE variants A (TMA) .. E.
#   EXP=pace:   expects pace.patch applied; times SHAPES with DION3_SYM_PACE in PACES (ns).
set -uo pipefail
ROOT=$(pwd)
HERE=bench/results/2026-12-03-48b6f6b-h200
if [ "${EXP:-trace}" = trace ]; then git apply $HERE/trace.patch || { echo "patch failed"; exit 1; }; fi
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
ninja -C $B -j16 dion3-cuda-sym-bench dion3-cuda-tests >/tmp/build.log 2>&1 || { grep -E "error" -A3 /tmp/build.log | head -40; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
if [ "${EXP:-trace}" = pace ]; then
for sh in $SHAPES; do
  echo "=== $sh"
  for r in 1 2; do for pc in $PACES; do
    echo "pace $pc $(DION3_SYM_PACE=$pc timeout 60 $B/dion3-cuda-sym-bench --shapes $sh --iters 20 2>&1 | grep -E '^\| (gram|sym)' | awk -F'|' '{print "kernel", $11, "banded", $15, "mainloop", $16}')"
  done; done
done
exit 0
fi
if [ "${EXP:-trace}" = trace ]; then
for sh in ${SHAPES:-sym:f16:64x512 gram:f16:64x512x2048 sym:f16:16x512 gram:f16:16x512x8192 sym:f16:32x1024 sym:f16:128x1024 sym:bf16:16x2048 gram:bf16:16x2048x2048 sym:f16:8x4096}; do
  echo "=== $sh"
  for m in ${MODES:-1}; do echo "--- trace mode $m"; DION3_SYM_TRACE=$m timeout 60 $B/dion3-cuda-sym-bench --shapes $sh --iters 3 2>&1 | grep -E "TRACE (C|P|H chain|slack)"; done
  timeout 60 $B/dion3-cuda-sym-bench --shapes $sh --iters 20 2>&1 | grep -E "^\| (gram|sym)"
done
exit 0
fi
if [ "${CHECK:-1}" = 1 ]; then
for gv in ${CHECK_VARIANTS:-1 4}; do
echo "=== correctness with DION3_SYM_GSTORE=$gv"
DION3_SYM_GSTORE=$gv timeout 150 $B/dion3-cuda-sym-bench --quick --iters 3 2>&1 | grep -E "correctness failures|FAIL|fail" | head -20
DION3_SYM_GSTORE=$gv timeout 150 $B/tests/cuda/dion3-cuda-tests --gtest_filter="${FILTER:-*Sym*:*Orth*:*Gram*}" 2>&1 | grep -E "^\[  (PASSED|FAILED)|Failure" | head -20
done
fi
for sh in ${SHAPES}; do
  echo "=== $sh"
  for m in ${TVARIANTS:-A B}; do
    v=""; [ $m = B ] && v=1; [ $m = C ] && v=2; [ $m = D ] && v=3; [ $m = E ] && v=4
    echo "--- variant $m"; DION3_SYM_GSTORE=$v DION3_SYM_TRACE=1 timeout 60 $B/dion3-cuda-sym-bench --shapes $sh --iters 3 2>&1 | grep -E "TRACE (C (mainloop|ready|stage|tile)|H chain|slack)"
  done
  for r in ${ROUNDS:-1 2}; do for m in ${VARIANTS:-A B}; do
    v=""; [ $m = B ] && v=1; [ $m = C ] && v=2; [ $m = D ] && v=3; [ $m = E ] && v=4
    echo "$m $(DION3_SYM_GSTORE=$v timeout 60 $B/dion3-cuda-sym-bench --shapes $sh --iters 20 2>&1 | grep -E '^\| (gram|sym)')"
  done; done
done
