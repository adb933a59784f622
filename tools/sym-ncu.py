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
import csv
import io
import re
import subprocess
import sys

CANDIDATES = ["cuBLAS full GEMM", "fused", "fused banded", "fused main loop only"]


def tensor_metrics(ncu):
    """The tensor-pipe activity counters this ncu knows (wgmma's first), as percent-of-peak metrics."""
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    names = sorted(set(re.findall(r"^(sm__pipe_tensor\w*cycles_active)\b", out, re.M)))
    names.sort(key=lambda n: ("gmma" not in n, n))
    return [n + ".avg.pct_of_peak_sustained_active" for n in names]


def profile(ncu, bench, shape, metrics, extra=()):
    cmd = [ncu, *extra, "--csv", "--page", "raw", "--print-units", "base", "--metrics", ",".join(["gpu__time_duration.sum", "launch__grid_size"] + metrics),
           bench, "--once", "--shapes", shape]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rows = [line for line in run.stdout.splitlines() if line.startswith('"')]
    if len(rows) < 3:
        raise RuntimeError(f"ncu gave no kernels for {shape}:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    table = list(csv.reader(io.StringIO("\n".join(rows))))
    head, body = table[0], table[2:]  # the second row holds the units
    name_col = head.index("Kernel Name") if "Kernel Name" in head else head.index("Function Name")
    col = {m: head.index(m) for m in ["gpu__time_duration.sum", "launch__grid_size"] + metrics if m in head}
    groups, current = {}, None
    for r in body:
        if "ncu_marker" in r[name_col]:
            current = int(float(r[col["launch__grid_size"]].replace(",", "")))
            groups[current] = []
        elif current is not None:
            groups[current].append(r)
    num = lambda r, m: float(r[col[m]].replace(",", "") or 0)  # ncu may group digits
    result = {}
    for k, ks in groups.items():
        if not ks:
            continue
        # The candidate's longest kernel: the GEMM, not a mirror or conversion pass beside it.
        ks = [max(ks, key=lambda r: num(r, "gpu__time_duration.sum"))]
        dur = num(ks[0], "gpu__time_duration.sum")
        pct = {}
        for m in metrics:
            if m in col and dur > 0:
                pct[m] = sum(num(r, m) * num(r, "gpu__time_duration.sum") for r in ks) / dur
        result[CANDIDATES[k - 1]] = dict(us=dur / 1e3, pct=pct, kernels=[r[name_col][:60] for r in ks])
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
    metrics = tensor_metrics(a.ncu)
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
