#!/usr/bin/env bash
# Call 1: build HEAD (tests + step bench) and 40c89df (step bench), CUDA tests (+ memcheck of the
# element-wise ones), AdamW and Lion rows A/B, their kernels under ncu.
set -uo pipefail
ROOT=$(pwd)
t0=$SECONDS
stamp() { echo "[c1 +$((SECONDS - t0))s] $*"; }
EXTRA=()
if [ -f "$ROOT/.deps/blas/lib/libblas.so" ]; then
  EXTRA+=(-DBLAS_LIBRARIES="$ROOT/.deps/blas/lib/libblas.so" -DCMAKE_CXX_FLAGS="-isystem $ROOT/.deps/blas/include")
  export LD_LIBRARY_PATH="$ROOT/.deps/blas/lib:${LD_LIBRARY_PATH:-}" LIBRARY_PATH="$ROOT/.deps/blas/lib:${LIBRARY_PATH:-}"
fi
SRC_B=/tmp/dion3-old-src
rm -rf $SRC_B && mkdir -p $SRC_B
tar --exclude=./.deps --exclude=./build-gpu -cf - . | tar -xf - -C $SRC_B
(cd $SRC_B && patch -p1 < ab-run/old.patch > /dev/null) || { echo "patch does not apply"; exit 1; }
( cmake -S $SRC_B -B /tmp/dion3-old -G Ninja -DCMAKE_BUILD_TYPE=Release -DDION3_CUDA=ON -DDION3_TESTS=OFF \
    -DDION3_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" "${EXTRA[@]}" > /tmp/old.configure.log 2>&1 &&
  ninja -C /tmp/dion3-old -j6 dion3-cuda-step-bench > /tmp/old.build.log 2>&1; echo "old build rc=$?" ) &
pb=$!
# The CUTLASS experiment in its own build (one long translation unit: started first).
( cmake -S $ROOT -B /tmp/dion3-cutlass -G Ninja -DCMAKE_BUILD_TYPE=Release -DDION3_CUDA=ON -DDION3_TESTS=OFF \
    -DDION3_CUTLASS_INCLUDE=$ROOT/.deps/cutlass/include \
    -DDION3_CUDA_GENCODE="-gencode=arch=compute_90a,code=sm_90a" "${EXTRA[@]}" > /tmp/cutlass.configure.log 2>&1 &&
  ninja -C /tmp/dion3-cutlass -j4 dion3-cuda-cutlass-bench > /tmp/cutlass.build.log 2>&1; echo "cutlass build rc=$?" ) &
pc=$!
DION3_GPU_CHECK_SKIP_BENCH=1 DION3_GPU_CHECK_TARGETS="dion3-cuda-tests dion3-cuda-step-bench" \
  DION3_GPU_CHECK_MEMCHECK="*Elementwise*:*AdamWAndLion*:*MultiTensor*" bash tools/gpu-check > /tmp/gpu-check.out 2>&1
stamp "gpu-check done"; tail -30 /tmp/gpu-check.out
cp /tmp/gpu-check.out $OUT/
wait $pb
stamp "old built"; tail -3 /tmp/old.build.log
wait $pc
stamp "cutlass built"; tail -3 /tmp/cutlass.build.log
/tmp/dion3-cutlass/dion3-cuda-cutlass-bench --iters 10 --out $OUT/cutlass.md > /tmp/cutlass.out 2>&1
echo "cutlass bench rc=$?"; tail -25 /tmp/cutlass.out
stamp "cutlass bench done"
A=/tmp/dion3-build-gpu/dion3-cuda-step-bench; B=/tmp/dion3-old/dion3-cuda-step-bench
ls -la $A $B
{
  nvidia-smi --query-gpu=name --format=csv,noheader
  for m in gpt-1b llama-7b; do
  for r in 1 2; do
    [ $((SECONDS - t0)) -gt 470 ] && break
    for row in =AdamW =Lion; do
    for v in A B; do
      bin=$A; [ $v = B ] && bin=$B
      $bin --model $m --only $row --iters 15 --warmup 3 --out /tmp/r.md > /dev/null 2>&1
      grep -E "^\| (AdamW|Lion)" /tmp/r.md | sed "s/^/$m round $r $v /" | cut -c1-150
    done
    done
  done
  done
} | tee $OUT/ab-mt.txt
stamp "rows done"
for v in A B; do
  bin=$A; [ $v = B ] && bin=$B
  for row in AdamW Lion; do
    [ $((SECONDS - t0)) -gt 540 ] && break
    python3 tools/ncu-kernels.py --kernels 'multi_tensor_kernel|adamw_kernel|lion_kernel|check_step' --label "$v $row" \
      --csv-out $OUT/ncu-$v-$row.csv -- $bin --model gpt-1b --only =$row --iters 1 --warmup 1
  done
done 2>&1 | tee $OUT/ncu-mt.txt
stamp "done"
