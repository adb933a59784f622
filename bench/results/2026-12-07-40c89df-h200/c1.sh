#!/usr/bin/env bash
# Call 1: build new (tests + step bench) and old (step bench), CUDA tests (+ memcheck of the
# element-wise ones), Lion rows A/B on gpt-1b and llama-7b, lion_kernel under ncu.
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
DION3_GPU_CHECK_SKIP_BENCH=1 DION3_GPU_CHECK_TARGETS="dion3-cuda-tests dion3-cuda-step-bench" \
  DION3_GPU_CHECK_MEMCHECK="*Elementwise*:*AdamWAndLion*" bash tools/gpu-check > /tmp/gpu-check.out 2>&1
stamp "gpu-check done"; tail -30 /tmp/gpu-check.out
cp /tmp/gpu-check.out $OUT/
wait $pb
stamp "old built"; tail -3 /tmp/old.build.log
A=/tmp/dion3-build-gpu/dion3-cuda-step-bench; B=/tmp/dion3-old/dion3-cuda-step-bench
ls -la $A $B
{
  nvidia-smi --query-gpu=name --format=csv,noheader
  for m in gpt-1b llama-7b; do
  for r in 1 2 3; do
    [ $m = llama-7b ] && [ $r = 3 ] && continue
    for v in A B; do
      bin=$A; [ $v = B ] && bin=$B
      $bin --model $m --only =Lion --iters 15 --warmup 3 --out /tmp/r.md > /dev/null 2>&1
      grep -E "^\| Lion" /tmp/r.md | sed "s/^/$m round $r $v /" | cut -c1-150
    done
  done
  done
  $A --model gpt-1b --only AdamW --iters 15 --warmup 3 --out /tmp/r.md > /dev/null 2>&1; grep -E "^\|" /tmp/r.md | head -4
} | tee $OUT/ab-lion.txt
stamp "rows done"
cat > /tmp/ncu-sum.py <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr = next(i for i, r in enumerate(rows) if "ID" in r)
h = rows[hdr]
for k in sys.argv[3].split(","):
    data = [dict(zip(h, r)) for r in rows[hdr + 1:] if len(r) == len(h) and k in r[h.index("Kernel Name")]]
    if not data: continue
    t = sum(float(d["gpu__time_duration.sum"]) for d in data); rb = sum(float(d["dram__bytes_read.sum"]) for d in data)
    wb = sum(float(d["dram__bytes_write.sum"]) for d in data)
    print(f"{sys.argv[2]} {k}: {len(data)} launches, {t/1e6:.3f} ms, read {rb/1e9:.3f} GB, write {wb/1e9:.3f} GB, {(rb+wb)/t:.0f} GB/s")
PY
for v in A B; do
  bin=$A; [ $v = B ] && bin=$B
  for row in =Lion =AdamW; do
    [ $v = B ] && [ $row = =AdamW ] && continue
    /usr/local/cuda/bin/ncu --csv --page raw --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      -k regex:'lion_kernel|adamw_kernel|check_step' $bin --model gpt-1b --only $row --iters 1 --warmup 1 > /tmp/ncu-$v.csv 2>/tmp/ncu.err
    tail -2 /tmp/ncu.err
    python3 /tmp/ncu-sum.py /tmp/ncu-$v.csv "$v $row" lion_kernel,adamw_kernel,check_step
  done
done 2>&1 | tee $OUT/ncu-lion.txt
python3 - <<'PY' 2>&1 | tee -a $OUT/ncu-lion.txt
import torch
x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20): y.copy_(x)
e.record(); torch.cuda.synchronize()
t = s.elapsed_time(e) / 20 / 1e3
print(f"copy 2 GiB -> 2 GiB: {2 * x.numel() * 2 / t / 1e9:.0f} GB/s (read + write)")
PY
stamp "done"
