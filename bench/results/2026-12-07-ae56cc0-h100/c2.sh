#!/usr/bin/env bash
# Call 2: llama-7b Muon rows A/B, and the check kernels under ncu (gpt-1b Muon, NorMuon).
set -uo pipefail
ROOT=$(pwd)
t0=$SECONDS
stamp() { echo "[c2 +$((SECONDS - t0))s] $*"; }
[ -f "$ROOT/.deps/blas/lib/libblas.so" ] && export LD_LIBRARY_PATH="$ROOT/.deps/blas/lib:${LD_LIBRARY_PATH:-}"
A=/tmp/dion3-build-gpu/dion3-cuda-step-bench; B=/tmp/dion3-old/dion3-cuda-step-bench
ls -la $A $B || exit 1
for v in A B; do
  bin=$A; [ $v = B ] && bin=$B
  for row in =Muon =NorMuon; do
    /usr/local/cuda/bin/ncu --csv --page raw --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      -k regex:'check_step' $bin --model gpt-1b --only $row --iters 2 --warmup 1 > /tmp/ncu.csv 2>/tmp/ncu.err
    grep -E '"ID"|check_step' /tmp/ncu.csv > $OUT/ncu-$v-${row#=}.csv; tail -3 /tmp/ncu.err
    echo "== $v $row: $(grep -c check_step /tmp/ncu.csv) kernels"
  done
done 2>&1
stamp "ncu done"
{
  nvidia-smi --query-gpu=name --format=csv,noheader
  for r in 1 2; do
    for v in A B; do
      bin=$A; [ $v = B ] && bin=$B
      $bin --model llama-7b --only Muon --out /tmp/r.md > /dev/null 2>&1
      grep -E "^\| (Muon|NorMuon)" /tmp/r.md | sed "s/^/round $r $v /" | cut -c1-90
      stamp "round $r $v"
    done
  done
} 2>&1 | tee $OUT/ab-llama-7b.txt
stamp "done"
