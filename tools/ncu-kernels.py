#!/usr/bin/env python3
# tools/ncu-kernels.py — time and DRAM bytes of the kernels a command launches, under ncu, summed
# per kernel family (the name up to its template arguments): launches, time, bytes read and
# written, and their rate. A developer's tool for the GPU machine (ncu on PATH), not a test; ncu
# locks clocks and flushes caches between launches, so compare its rows with each other, and
# take a step's time from the step bench.
# Usage: python3 tools/ncu-kernels.py [--kernels REGEX] [--label L] [--csv-out FILE] -- CMD ARGS...
#        python3 tools/ncu-kernels.py --from FILE [--label L]   (a CSV ncu wrote before)
import argparse
import collections
import re
import subprocess
import sys

import ncu_csv

METRICS = [ncu_csv.TIME, "dram__bytes_read.sum", "dram__bytes_write.sum"]


def family(name):
    """A kernel's name without return type, namespaces, template arguments or parameters: the row
    it adds to."""
    base = re.split(r"[<(]", name, maxsplit=1)[0].strip()
    return base.split()[-1].split("::")[-1] if base else name


def summarize(text):
    """{family: [launches, ns, bytes read, bytes written]} from ncu --csv --page raw output."""
    try:
        found = ncu_csv.kernels(text)
    except ValueError as e:
        raise SystemExit(str(e))
    out = collections.OrderedDict()
    for k in found:
        acc = out.setdefault(family(k["name"]), [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        for j, m in enumerate(METRICS):
            acc[1 + j] += ncu_csv.number(k.get(m, ""))
    return out


def table(summary, label):
    lines = [f"| {'variant | ' if label else ''}kernel | launches | ms | GB read | GB written | GB/s |",
             f"|{'---|' if label else ''}---|---|---|---|---|---|"]
    for name, (n, ns, rd, wr) in summary.items():
        rate = (rd + wr) / ns if ns > 0 else 0.0
        lines.append(f"| {label + ' | ' if label else ''}{name} | {n} | {ns / 1e6:.3f} | {rd / 1e9:.3f} | "
                     f"{wr / 1e9:.3f} | {rate:.0f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kernels", default=None, help="ncu -k regex: which kernels to profile")
    ap.add_argument("--label", default="", help="a first column naming this run (A, B, ...)")
    ap.add_argument("--from", dest="source", default=None, help="read this CSV instead of running ncu")
    ap.add_argument("--csv-out", default=None, help="keep ncu's CSV here")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to profile")
    a = ap.parse_args()
    if a.source:
        with open(a.source) as f:
            text = f.read()
    else:
        cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
        if not cmd:
            ap.error("give a command after --, or --from FILE")
        ncu = [a.ncu, "--csv", "--page", "raw", "--print-units", "base", "--metrics", ",".join(METRICS)]
        if a.kernels:
            ncu += ["-k", f"regex:{a.kernels}"]
        run = subprocess.run(ncu + cmd, capture_output=True, text=True)
        text = run.stdout
        if run.returncode != 0:
            sys.stderr.write(run.stderr[-2000:])
        if a.csv_out:
            with open(a.csv_out, "w") as f:
                f.write(text)
    print(table(summarize(text), a.label))


if __name__ == "__main__":
    main()
