#!/usr/bin/env bash
# Call 3: AdamW experiment A (two divisions, packed maxima) vs B (without), CUDA tests, ncu.
set -uo pipefail
ROOT=$(pwd)
t0=$SECONDS
stamp() { echo "[c3 +$((SECONDS - t0))s] $*"; }
EXTRA=()
if [ -f "$ROOT/.deps/blas/lib/libblas.so" ]; then
  EXTRA+=(-DBLAS_LIBRARIES="$ROOT/.deps/blas/lib/libblas.so" -DCMAKE_CXX_FLAGS="-isystem $ROOT/.deps/blas/include")
  export LD_LIBRARY_PATH="$ROOT/.deps/blas/lib:${LD_LIBRARY_PATH:-}" LIBRARY_PATH="$ROOT/.deps/blas/lib:${LIBRARY_PATH:-}"
fi
SRC_B=/tmp/dion3-b-src
rm -rf $SRC_B && mkdir -p $SRC_B
tar --exclude=./.deps --exclude=./build-gpu -cf - . | tar -xf - -C $SRC_B
(cd $SRC_B && patch -p1 < ab-run/noadamw.patch > /dev/null) || { echo "patch does not apply"; exit 1; }
( cmake -S $SRC_B -B /tmp/dion3-b -G Ninja -DCMAKE_BUILD_TYPE=Release -DDION3_CUDA=ON -DDION3_TESTS=OFF \
    -DDION3_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" "${EXTRA[@]}" > /tmp/b.configure.log 2>&1 &&
  ninja -C /tmp/dion3-b -j8 dion3-cuda-step-bench > /tmp/b.build.log 2>&1; echo "B build rc=$?" ) &
pb=$!
DION3_GPU_CHECK_SKIP_BENCH=1 DION3_GPU_CHECK_TARGETS="dion3-cuda-tests dion3-cuda-step-bench" \
  DION3_GPU_CHECK_FILTER='*AdamW*:*Elementwise*:*Lion*:*NonFinite*:*CudaStep*:*CudaOps*' bash tools/gpu-check > /tmp/gpu-check.out 2>&1
stamp "gpu-check done"; grep -E "PASSED|FAILED|tests ran" /tmp/gpu-check.out | head
wait $pb
A=/tmp/dion3-build-gpu/dion3-cuda-step-bench; B=/tmp/dion3-b/dion3-cuda-step-bench
ls -la $A $B || exit 1
for v in A B; do
  bin=$A; [ $v = B ] && bin=$B
  /usr/local/cuda/bin/ncu --csv --page raw --print-units base \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,smsp__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    -k regex:'adamw' $bin --model gpt-1b --only AdamW --iters 1 --warmup 1 > /tmp/ncu.csv 2>/tmp/ncu.err
  grep -E '"ID"|adamw' /tmp/ncu.csv | cut -c1-2000 > $OUT/ncu-adamw-$v.csv; tail -2 /tmp/ncu.err
done
stamp "ncu done"
{
  nvidia-smi --query-gpu=name --format=csv,noheader
  for r in 1 2 3; do
    for v in A B; do
      bin=$A; [ $v = B ] && bin=$B
      for model in gpt-1b llama-7b; do
        $bin --model $model --only AdamW --out /tmp/r.md > /dev/null 2>&1
        grep -E "^\| AdamW" /tmp/r.md | sed "s/^/round $r $v $model /" | cut -c1-80
      done
    done
  done
} 2>&1 | tee $OUT/ab-adamw.txt
stamp "done"
