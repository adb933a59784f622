#!/usr/bin/env bash
# CUTLASS bench with the mirrored-store candidate: build, time all shapes, then under ncu.
set -uo pipefail
t0=$SECONDS
EXTRA=()
if [ -f "$PWD/.deps/blas/lib/libblas.so" ]; then
  EXTRA+=(-DBLAS_LIBRARIES="$PWD/.deps/blas/lib/libblas.so" -DCMAKE_CXX_FLAGS="-isystem $PWD/.deps/blas/include")
  export LD_LIBRARY_PATH="$PWD/.deps/blas/lib:${LD_LIBRARY_PATH:-}" LIBRARY_PATH="$PWD/.deps/blas/lib:${LIBRARY_PATH:-}"
fi
cmake -S . -B /tmp/dion3-cutlass -G Ninja -DCMAKE_BUILD_TYPE=Release -DDION3_CUDA=ON -DDION3_TESTS=OFF \
  -DDION3_CUTLASS_INCLUDE=$PWD/.deps/cutlass/include "${EXTRA[@]}" \
  -DDION3_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" > /tmp/cc.log 2>&1 &&
  ninja -C /tmp/dion3-cutlass -j16 dion3-cuda-cutlass-bench > /tmp/cb.log 2>&1 || { tail -30 /tmp/cb.log; exit 1; }
echo "[+$((SECONDS - t0))s] built"
B=/tmp/dion3-cutlass/dion3-cuda-cutlass-bench
nvidia-smi --query-gpu=name --format=csv,noheader
$B --iters 10 --out $OUT/cutlass.md > /tmp/cutlass.out 2>&1; echo "bench rc=$?"; cat /tmp/cutlass.out | tail -18
echo "[+$((SECONDS - t0))s] timed"
mkdir -p $OUT/ncu
python3 tools/cutlass-ncu.py --ncu /usr/local/cuda/bin/ncu --bench $B --csv-dir $OUT/ncu --out $OUT/cutlass-ncu.md \
  --shapes sym:bf16:16x2048,gram:bf16:16x2048x2048,gram:f16:64x512x2048,sym:f16:64x512,gram:f16:16x2048x8192,gram:f16:8x4096x11008,sym:f16:32x1024,sym:f16:8x4096 2>&1 | tail -12
echo "[+$((SECONDS - t0))s] done"
