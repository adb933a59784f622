#!/usr/bin/env python3
# bench/host_overhead.py — the PyTorch front end's host time where models have many tensors or
# many groups, on the CPU: a step after the set of parameters with a gradient changed (a matrix
# without one keeps the plan, an AdamW vector without one makes the engine plan again), steps under
# an lr schedule on one group per parameter, and load_state_dict. Each case in a fresh process, per
# build. Not a test: it asserts nothing.
#
#   python bench/host_overhead.py                                  # the installed dion3
#   python bench/host_overhead.py --build before=/tmp/site-a --build after=/tmp/site-b
#
# --build NAME=DIR puts DIR (a `pip install --target DIR .` of a checkout) first on PYTHONPATH.
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import builds  # bench/builds.py

CASES = {
    "absent": "a step when one different matrix of N 16x16 matrices has no gradient (ms)",
    "absent-5pc": "a step when a different 5% of N 16x16 matrices have no gradient, from the first step on (ms)",
    "replan": "a step of N 16x16 matrices when an AdamW vector's gradient comes or goes (plans again, ms)",
    "all-grads": "a step of the same N matrices, every gradient there (ms)",
    "schedule": "a step of N one-matrix groups under LambdaLR, less one without it, per group (us)",
    "load": "load_state_dict of N 16x16 matrices' state (ms)",
}


def worker(case: str, n: int) -> float:
    import torch
    import dion3

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(16, 16)) for _ in range(n)]
    grads = [torch.randn(16, 16) for _ in range(n)]
    for p, g in zip(ps, grads):
        p.grad = g

    def timed(step, k=7):
        times = []
        for s in range(k):
            t = time.perf_counter()
            step(s)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    if case in ("absent", "all-grads"):
        opt = dion3.Dion3(ps, lr=0.01)
        opt.step()

        def step(s):
            for i, p in enumerate(ps):
                p.grad = None if case == "absent" and i == s % n else grads[i]
            opt.step()
        return timed(step) * 1e3
    if case == "absent-5pc":
        opt = dion3.Dion3(ps, lr=0.01)

        def step(s):
            for i, p in enumerate(ps):
                p.grad = None if (i + s) % 20 == 0 else grads[i]
            opt.step()
        step(0)
        return timed(lambda s: step(s + 1)) * 1e3
    if case == "replan":
        bias = torch.nn.Parameter(torch.zeros(16))
        opt = dion3.Dion3([dict(params=ps), dict(params=[bias], algorithm="adamw")], lr=0.01)
        bias.grad = torch.ones(16)
        opt.step()

        def step(s):
            bias.grad = torch.ones(16) if s % 2 else None
            opt.step()
        return timed(step) * 1e3
    if case == "schedule":
        opt = dion3.Dion3([dict(params=[p]) for p in ps], lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        opt.step()
        plain = timed(lambda s: opt.step())
        scheduled = timed(lambda s: (opt.step(), sched.step()))
        return (scheduled - plain) / n * 1e6
    opt = dion3.Dion3(ps, lr=0.01)
    opt.step()
    saved = opt.state_dict()
    return timed(lambda s: dion3.Dion3(ps, lr=0.01).load_state_dict(saved), k=4) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description="dion3's host time with many tensors or groups (CPU)")
    builds.add_option(ap)
    ap.add_argument("--sizes", default="1000,5000,20000", help="N, comma-separated")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(f"{worker(a.worker[0], int(a.worker[1])):.1f}")
        return 0
    found = builds.parse(ap, a.build)
    sizes = [int(x) for x in a.sizes.split(",")]
    print(f"load {os.getloadavg()[0]:.2f}; OMP_NUM_THREADS=1\n")
    print("| case | N | " + " | ".join(name for name, _ in found) + " |")
    print("|---|---|" + "---|" * len(found))
    for case, what in CASES.items():
        for n in sizes:
            cells = [builds.run(__file__, site, ["--worker", case, str(n)], {"OMP_NUM_THREADS": "1"}).strip()
                     for _, site in found]
            print(f"| {case}: {what} | {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
