#!/usr/bin/env bash
# Call 1: build new (tests + step bench) and old (step bench), CUDA tests, gpt-1b Muon rows A/B.
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
  ninja -C /tmp/dion3-old -j8 dion3-cuda-step-bench > /tmp/old.build.log 2>&1; echo "old build rc=$?" ) &
pb=$!
DION3_GPU_CHECK_SKIP_BENCH=1 DION3_GPU_CHECK_TARGETS="dion3-cuda-tests dion3-cuda-step-bench" bash tools/gpu-check > /tmp/gpu-check.out 2>&1
stamp "gpu-check done"; tail -25 /tmp/gpu-check.out
wait $pb
stamp "old built"; tail -5 /tmp/old.build.log
A=/tmp/dion3-build-gpu/dion3-cuda-step-bench; B=/tmp/dion3-old/dion3-cuda-step-bench
ls -la $A $B
{
  nvidia-smi --query-gpu=name --format=csv,noheader
  for r in 1 2 3; do
    for v in A B; do
      bin=$A; [ $v = B ] && bin=$B
      $bin --model gpt-1b --only Muon --out /tmp/r.md > /dev/null 2>&1
      grep -E "^\| (Muon|NorMuon)" /tmp/r.md | sed "s/^/round $r $v /" | cut -c1-90
    done
  done
} | tee $OUT/ab-gpt-1b.txt
stamp "done"
