#!/usr/bin/env python3
# bench/cpu_small_matrices.py — dion3's CPU step on many matrices of one shape, at 1 and at 2
# threads (torch.set_num_threads, alternated in one process so a drifting machine biases neither):
# where the work is small, a second thread must not make the step slower. Not a test: it asserts
# nothing.
#
#   python bench/cpu_small_matrices.py                           # the installed dion3
#   python bench/cpu_small_matrices.py --build before=/tmp/site-a --build after=/tmp/site-b
#
# --build NAME=DIR runs every case once per dion3 found in DIR (put first on PYTHONPATH, e.g. a
# `pip install --target DIR .` of another checkout), each in a fresh process.
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import builds  # bench/builds.py

CASES = ["10x16x16", "1000x16x16", "2000x8x8", "100x64x64", "200x1024x16", "8x512x512", "4x1024x1024",
         "2000x256:adamw"]


def run_case(case: str, rounds: int) -> str:
    import torch
    import dion3

    spec, _, algo = case.partition(":")
    n, *shape = (int(x) for x in spec.split("x"))
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*shape)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = dion3.Dion3([dict(params=ps, algorithm=algo or "dion3")], lr=0.01)
    opt.step()
    medians = {1: [], 2: []}
    for _ in range(rounds):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            opt.step()
            times = []
            for _ in range(5):
                t = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t)
            medians[threads].append(statistics.median(times))
    one, two = (statistics.median(medians[t]) * 1e3 for t in (1, 2))
    return f"| {case} | {one:.2f} | {two:.2f} | {two / one:.2f} |"


def main() -> int:
    ap = argparse.ArgumentParser(description="dion3 CPU step on many small matrices, 1 vs 2 threads")
    builds.add_option(ap)
    ap.add_argument("--cases", default=",".join(CASES), help="NxROWSxCOLS[:algorithm], comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(run_case(a.worker, a.rounds))
        return 0
    print(f"load {os.getloadavg()[0]:.2f}; step ms, medians of {a.rounds} rounds of 5 steps\n")
    for name, site in builds.parse(ap, a.build):
        print(f"### {name}\n\n| matrices | 1 thread | 2 threads | 2 / 1 |\n|---|---|---|---|")
        for case in a.cases.split(","):
            out = builds.run(__file__, site, ["--worker", case, "--rounds", str(a.rounds)], {"OMP_NUM_THREADS": "2"})
            print(out.strip(), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
