#!/usr/bin/env python3
# tools/cutlass-ncu.py — dion3-cuda-cutlass-bench's candidates under ncu: each candidate's kernels
# (as the bench's marker kernels split them), their time at ncu's locked clocks and their
# tensor-pipe share, and each candidate's GEMM share over cuBLAS's (issue 21's item 3 measure).
# A developer's tool for the GPU machine (ncu on PATH), not a test.
# Usage: python3 tools/cutlass-ncu.py --bench BUILD/dion3-cuda-cutlass-bench --shapes sym:bf16:16x2048,...
#        [--ncu ncu] [--csv-dir DIR] --out FILE.md
#        python3 tools/cutlass-ncu.py --from-csv DIR --out FILE.md   (CSVs written before)
import argparse
import glob
import os
import subprocess
import sys

import ncu_csv

CANDIDATES = ["cuBLAS", "fused", "CUTLASS 1x2", "CUTLASS 1x1", "triangle + mirror", "triangle", "CUTLASS sym", "CUTLASS sym pingpong",
              "fused banded"]
def groups(text, metric):
    """{candidate: [(kernel, us, share)]} from ncu's raw CSV of one `--once` run."""
    return {CANDIDATES[k - 1]: [(r["name"].split("(")[0][:60], ncu_csv.number(r[ncu_csv.TIME]) / 1e3,
                                 ncu_csv.number(r.get(metric, ""))) for r in ks]
            for k, ks in ncu_csv.marker_groups(text).items()}


def table(results, metric):
    lines = ["| shape | " + " | ".join(f"{c} us (tensor %)" for c in CANDIDATES) + " | triangle / cuBLAS share | "
             "CUTLASS sym / cuBLAS share | pingpong / cuBLAS share | fused / cuBLAS share |",
             "|---|" + "---|" * (len(CANDIDATES) + 4)]
    for shape, g in results:
        def cell(c):
            ks = g.get(c, [])
            if not ks:
                return "-", None
            gemm = max(ks, key=lambda k: k[1])  # the GEMM, not a mirror pass beside it
            return f"{sum(k[1] for k in ks):.1f} ({gemm[2]:.1f})", gemm[2]
        cells = {c: cell(c) for c in CANDIDATES}
        base = cells["cuBLAS"][1]
        ratio = lambda c: "-" if not base or cells[c][1] is None else f"{100 * cells[c][1] / base:.0f}%"
        lines.append(f"| {shape} | " + " | ".join(cells[c][0] for c in CANDIDATES) +
                     f" | {ratio('triangle')} | {ratio('CUTLASS sym')} | {ratio('CUTLASS sym pingpong')} | {ratio('fused')} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--csv-dir", default="")
    ap.add_argument("--from-csv", default="")
    ap.add_argument("--metric", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = []
    if a.from_csv:
        metric = a.metric or "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active"
        for f in sorted(glob.glob(os.path.join(a.from_csv, "ncu-*.csv"))):
            shape = os.path.basename(f)[4:-4].replace("_", ":")
            results.append((shape, groups(open(f).read(), metric)))
    else:
        metrics = ncu_csv.tensor_metrics(a.ncu)
        metric = a.metric or metrics[0]
        for shape in [s for s in a.shapes.split(",") if s]:
            cmd = [a.ncu, "--csv", "--page", "raw", "--print-units", "base", "--metrics",
                   ",".join(["gpu__time_duration.sum", "launch__grid_size"] + metrics), a.bench, "--once", "--shapes", shape]
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            text = run.stdout
            if a.csv_dir:
                open(os.path.join(a.csv_dir, "ncu-" + shape.replace(":", "_") + ".csv"), "w").write(text)
            if run.returncode != 0 or "(WRONG)" in text:
                print(f"{shape}: ncu or the bench failed (rc {run.returncode}); "
                      f"{'a candidate is WRONG; ' if '(WRONG)' in text else ''}{run.stderr[-400:]}", file=sys.stderr)
            try:
                results.append((shape, groups(text, metric)))
            except ValueError as e:  # one shape's failure leaves the others' rows
                print(f"{shape}: {e}", file=sys.stderr)
    lines = ["# Symmetric products under ncu: cuBLAS, the fused kernel and CUTLASS", "",
             f"Metric: `{metric}`; times at ncu's locked clocks, each candidate's kernels summed, its share that of "
             "its longest kernel (the GEMM). Each shape: `dion3-cuda-cutlass-bench --once --shapes SHAPE`.", ""]
    lines += table(results, metric)
    open(a.out, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
