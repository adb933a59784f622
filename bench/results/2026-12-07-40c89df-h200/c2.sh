#!/usr/bin/env bash
# Call 2: the PyTorch front end on CUDA (pytest, NVTX, Python-overhead bench on gpt-1b), then the
# gpt-1b step table from call 1's build while the machine stays warm.
set -uo pipefail
t0=$SECONDS
stamp() { echo "[c2 +$((SECONDS - t0))s] $*"; }
DION3_PY_BENCH_MODELS="gpt-1b" timeout 420 bash tools/gpu-python-check > /tmp/pycheck.out 2>&1
echo "python check rc=$?"; tail -25 /tmp/pycheck.out
stamp "python check done"
[ -f .deps/blas/lib/libblas.so ] && export LD_LIBRARY_PATH="$(pwd)/.deps/blas/lib:${LD_LIBRARY_PATH:-}"
A=/tmp/dion3-build-gpu/dion3-cuda-step-bench
if [ -x $A ] && [ $((SECONDS - t0)) -lt 450 ]; then
  timeout $((560 - (SECONDS - t0))) $A --model gpt-1b --iters 15 --warmup 3 --out $OUT/step-gpt-1b.md > /tmp/step.log 2>&1
  echo "step rc=$?"; cat $OUT/step-gpt-1b.md 2>/dev/null | head -30
fi
stamp "done"
