#!/usr/bin/env python3
# tools/sym-ncu.py — the fused symmetric kernel's tensor-pipe use against cuBLAS's on a full GEMM
# of the same shape, under ncu, for every symmetric product a step runs. The shapes come from the
# step bench's profile ("Symmetric products of one step" lines of dion3-cuda-step-bench --profile)
# or from --shapes; each is run by dion3-cuda-sym-bench --once, which launches the full cuBLAS
# GEMM, the fused kernel, its banded form and its main loop alone behind marker kernels. A
# developer's tool for the GPU machine (ncu on PATH), not a test.
# Usage: python3 tools/sym-ncu.py --bench BUILD/dion3-cuda-sym-bench --from step-llama.md [--from ...]
#        [--shapes gram:f16:16x2752x4096,...] [--ncu-args "--cache-control none"] --out sym-ncu.md
import argparse
import re
import subprocess
import sys

import ncu_csv

CANDIDATES = ["cuBLAS full GEMM", "fused", "fused banded", "fused main loop only"]


def profile(ncu, bench, shape, metrics, extra=()):
    cmd = [ncu, *extra, "--csv", "--page", "raw", "--print-units", "base", "--metrics",
           ",".join([ncu_csv.TIME, "launch__grid_size"] + metrics), bench, "--once", "--shapes", shape]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    try:
        groups = ncu_csv.marker_groups(run.stdout)
    except ValueError:
        groups = {}
    if not groups:
        raise RuntimeError(f"ncu gave no kernels for {shape}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    result = {}
    for k, ks in groups.items():
        if not ks:
            continue
        # The candidate's longest kernel: the GEMM, not a mirror or conversion pass beside it.
        top = max(ks, key=lambda r: ncu_csv.number(r[ncu_csv.TIME]))
        dur = ncu_csv.number(top[ncu_csv.TIME])
        pct = {m: ncu_csv.number(top[m]) for m in metrics if m in top and dur > 0}
        result[CANDIDATES[k - 1]] = dict(us=dur / 1e3, pct=pct, kernels=[top["name"][:60]])
    return result


def shapes_from(path):
    text = open(path).read()
    found = []
    for m in re.finditer(r"Symmetric products of one step[^`]*`([^`]*)`", text):
        found += [s for s in m.group(1).split(",") if s]
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--from", dest="sources", action="append", default=[])
    ap.add_argument("--shapes", default="")
    ap.add_argument("--out", required=True)
    # e.g. "--cache-control none": operands left in L2 by the launch before, as in a step
    ap.add_argument("--ncu-args", default="", help="more ncu options, one string")
    a = ap.parse_args()
    extra = a.ncu_args.split()
    shapes = [s for s in a.shapes.split(",") if s]
    for src in a.sources:
        shapes += shapes_from(src)
    shapes = list(dict.fromkeys(shapes))
    metrics = ncu_csv.tensor_metrics(a.ncu)
    if not metrics:
        sys.exit("ncu knows no sm__pipe_tensor*cycles_active counter")
    main_metric = metrics[0]
    lines = ["# Fused symmetric kernel against cuBLAS under ncu: tensor-pipe use", "",
             f"Metric: `{main_metric}` of each candidate's longest kernel (the GEMM, not a pass beside it), "
             "durations at ncu's locked clocks. " + (f"ncu options: `{a.ncu_args}`. " if a.ncu_args else "") +
             "Each shape: `dion3-cuda-sym-bench --once --shapes SHAPE` under "
             "`ncu --csv --page raw --metrics ...`. ratio: the fused kernel's tensor-pipe share over cuBLAS's "
             "(issue 21 asks >= 90%).", "",
             "| shape | cuBLAS full us | cuBLAS tensor % | fused us | fused tensor % | banded us | banded tensor % | "
             "main loop us | main loop tensor % | ratio fused | ratio banded | ratio main loop | cuBLAS kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        try:
            r = profile(a.ncu, a.bench, shape, metrics, extra)
        except Exception as e:  # one shape's failure leaves the others' rows
            lines.append(f"| {shape} | failed: {str(e).splitlines()[0][:120]} |")
            continue
        def cell(name):
            c = r.get(name)
            return ("-", "-", None) if c is None else (f"{c['us']:.1f}", f"{c['pct'].get(main_metric, 0):.1f}",
                                                        c["pct"].get(main_metric, 0))
        full, fused, banded, loop = (cell(n) for n in CANDIDATES)
        ratio = lambda c: "-" if c[2] is None or not full[2] else f"{100 * c[2] / full[2]:.0f}%"
        kern = ",".join(sorted(set(r.get(CANDIDATES[0], {}).get("kernels", []))))
        lines.append(f"| {shape} | {full[0]} | {full[1]} | {fused[0]} | {fused[1]} | {banded[0]} | {banded[1]} | "
                     f"{loop[0]} | {loop[1]} | {ratio(fused)} | {ratio(banded)} | {ratio(loop)} | {kern} |")
        print(lines[-1], flush=True)
        open(a.out, "w").write("\n".join(lines) + "\n")  # row by row: a timeout keeps the rows so far
    lines += ["", "Other tensor-pipe counters this ncu reports: " + ", ".join(f"`{m}`" for m in metrics[1:])]
    open(a.out, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
