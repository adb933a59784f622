#!/usr/bin/env bash
# The CUTLASS bench's candidates under ncu: tensor-pipe share (the metrics this ncu knows).
set -uo pipefail
NCU=/usr/local/cuda/bin/ncu
M=$($NCU --query-metrics | grep -oE "^sm__pipe_tensor\w*cycles_active" | sort -u | tr '\n' ' ')
echo "metrics: $M"
MET=gpu__time_duration.sum,launch__grid_size
for m in $M; do MET=$MET,$m.avg.pct_of_peak_sustained_active; done
B=/tmp/dion3-cutlass/dion3-cuda-cutlass-bench
if [ ! -x $B ]; then
  EXTRA=()
  if [ -f "$PWD/.deps/blas/lib/libblas.so" ]; then
    EXTRA+=(-DBLAS_LIBRARIES="$PWD/.deps/blas/lib/libblas.so" -DCMAKE_CXX_FLAGS="-isystem $PWD/.deps/blas/include")
  fi
  cmake -S . -B /tmp/dion3-cutlass -G Ninja -DCMAKE_BUILD_TYPE=Release -DDION3_CUDA=ON -DDION3_TESTS=OFF \
    -DDION3_CUTLASS_INCLUDE=$PWD/.deps/cutlass/include "${EXTRA[@]}" \
    -DDION3_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" > /tmp/cc.log 2>&1 && ninja -C /tmp/dion3-cutlass -j8 dion3-cuda-cutlass-bench > /tmp/cb.log 2>&1 || { tail -20 /tmp/cb.log; exit 1; }
fi
for sh in sym:bf16:16x2048 gram:bf16:16x2048x2048 gram:f16:64x512x2048 sym:f16:64x512 gram:f16:16x2048x8192 gram:f16:8x4096x11008 sym:f16:32x1024; do
  f=$OUT/ncu-$(echo $sh | tr ':' '_').csv
  $NCU --csv --page raw --print-units base --metrics $MET $B --once --shapes $sh > $f 2>$OUT/ncu-err.txt
  echo "$sh rc=$? $(wc -l < $f)"
done
