# tools/ncu_csv.py — reading ncu's `--csv --page raw --print-units base` output, for the ncu tools
# beside it (ncu-kernels.py, sym-ncu.py, cutlass-ncu.py): its kernel rows, its numbers, the
# kernels a bench's --once run launches after each of its marker kernels, and the tensor-pipe
# counters this ncu knows.
import csv
import io
import re
import subprocess

TIME = "gpu__time_duration.sum"


def number(text):
    """ncu's numbers, with thousands separators ("14,016") in some versions; "n/a" and "" read as 0."""
    try:
        return float(text.replace(",", "") or 0)
    except ValueError:
        return 0.0


def kernels(text):
    """One dict a profiled kernel (column -> text; "name": the kernel's name), in launch order.
    ValueError where the output holds no kernel table."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r or "Function Name" in r), None)
    if head is None:
        raise ValueError("no ncu table in the output (was any kernel profiled?)")
    h = rows[head]
    name = "Kernel Name" if "Kernel Name" in h else "Function Name"
    out = []
    for r in rows[head + 1:]:
        row = dict(zip(h, r))
        if len(r) == len(h) and row.get(TIME, "")[:1].isdigit():  # not the units row
            row["name"] = row[name]
            out.append(row)
    return out


def marker_groups(text):
    """{k: kernels}: those launched after the marker kernel (ncu_marker) of a grid of k blocks,
    which a bench's --once run launches before its k-th candidate."""
    groups, current = {}, None
    for k in kernels(text):
        if "ncu_marker" in k["name"]:
            current = int(number(k["launch__grid_size"]))
            groups[current] = []
        elif current is not None:
            groups[current].append(k)
    return groups


def tensor_metrics(ncu):
    """The tensor-pipe activity counters this ncu knows (wgmma's first), as percent-of-peak metrics."""
    out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout
    names = sorted(set(re.findall(r"^(sm__pipe_tensor\w*cycles_active)\b", out, re.M)))
    names.sort(key=lambda n: ("gmma" not in n, n))
    return [n + ".avg.pct_of_peak_sustained_active" for n in names]
