#!/usr/bin/env python3
# tools/cutlass-ncu.py — dion3-cuda-cutlass-bench's candidates under ncu: each candidate's kernels
# (as the bench's marker kernels split them), their time at ncu's locked clocks and their
# tensor-pipe share, and each candidate's GEMM share over cuBLAS's (issue 21's item 3 measure).
# A developer's tool for the GPU machine (ncu on PATH), not a test.
# Usage: python3 tools/cutlass-ncu.py --bench BUILD/dion3-cuda-cutlass-bench --shapes sym:bf16:16x2048,...
#        [--ncu ncu] [--csv-dir DIR] --out FILE.md
#        python3 tools/cutlass-ncu.py --from-csv DIR --out FILE.md   (CSVs written before)
import argparse
import csv
import glob
import importlib.util
import io
import os
import subprocess
import sys

CANDIDATES = ["cuBLAS", "fused", "CUTLASS 1x2", "CUTLASS 1x1", "triangle + mirror", "triangle", "CUTLASS sym", "CUTLASS sym pingpong",
              "fused banded"]
HERE = os.path.dirname(os.path.abspath(__file__))


def tensor_metrics(ncu):
    spec = importlib.util.spec_from_file_location("sym_ncu", os.path.join(HERE, "sym-ncu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.tensor_metrics(ncu)


def number(text):
    """ncu's raw numbers, with thousands separators in some versions; "n/a" and empty read as 0."""
    try:
        return float(text.replace(",", "") or 0)
    except ValueError:
        return 0.0


def groups(text, metric):
    """{candidate: [(kernel, us, share)]} from ncu's raw CSV of one `--once` run."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r or "Function Name" in r), None)
    if head is None:
        raise ValueError("no ncu table (was any kernel profiled?)")
    h = rows[head]
    kernel_col = "Kernel Name" if "Kernel Name" in h else "Function Name"
    name, dur, grid, share = (h.index(k) for k in [kernel_col, "gpu__time_duration.sum", "launch__grid_size", metric])
    out, current = {}, None
    for r in rows[head + 1:]:
        if len(r) != len(h) or not r[dur][:1].isdigit():
            continue  # the units row
        if "ncu_marker" in r[name]:
            current = CANDIDATES[int(number(r[grid])) - 1]
            out[current] = []
        elif current is not None:
            out[current].append((r[name].split("(")[0][:60], number(r[dur]) / 1e3, number(r[share])))
    return out


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
        metrics = tensor_metrics(a.ncu)
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
