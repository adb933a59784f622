#!/usr/bin/env python3
# tools/host-profile.py — where the host time of one non-blocking optimizer step goes: the
# engine's stage ranges and the CUDA runtime calls under them (torch.profiler, CPU side), and
# the Python functions of step() (cProfile). Prints markdown. A developer's tool for the GPU
# machine, not a test. Usage: python3 tools/host-profile.py --model llama-7b --fraction 0.25
import argparse
import cProfile
import collections
import io
import pstats
import statistics
import time

import torch

import dion3
from dion3.benchmark import model_shapes, sync


def make_optimizer(model, fraction, device):
    mats, vecs = model_shapes(model)
    torch.manual_seed(0)
    dt = torch.bfloat16
    pm = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dt) * 0.02) for s in mats]
    pv = [torch.nn.Parameter(torch.ones(s, device=device, dtype=dt)) for s in vecs]
    for p in pm + pv:
        p.grad = torch.randn_like(p) * 1e-3
    return dion3.Dion3([dict(params=pm), dict(params=pv, algorithm="adamw", lr=1e-3)], lr=0.01,
                       fraction=fraction, on_nonfinite="skip", blocking=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--op-by-op", action="store_true", help="no recorded orthogonalizations")
    ap.add_argument("--fresh-grads", action="store_true",
                    help="new gradient tensors before every step, as zero_grad(set_to_none=True) and a "
                         "backward pass leave them (made outside the timed call)")
    a = ap.parse_args()
    device = torch.device(a.device)
    opt = make_optimizer(a.model, a.fraction, device)
    opt._record_orthogonalizer = not a.op_by_op
    params = [p for g in opt.param_groups for p in g["params"]]

    def fresh():
        if a.fresh_grads:
            for p in params:
                p.grad = None
            for p in params:
                p.grad = torch.empty_like(p).normal_(0, 1e-3)
    for _ in range(3):
        opt.step()
    sync(device)

    def median_ms(fn):
        """fn's host time, the median over a.steps calls, each after fresh() and an idle GPU."""
        ts = []
        for _ in range(a.steps):
            fresh()
            sync(device)
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        sync(device)
        return statistics.median(ts)

    host = median_ms(opt.step)
    engine = median_ms(lambda: opt._engine.step_async())
    behind = None
    if device.type == "cuda":
        # An lr that changes every step (a schedule), with GPU work still queued (the backward
        # pass): a step that waited for the GPU before enqueuing would take that work's time.
        cycles = int(20e-3 * torch.cuda.get_device_properties(device).clock_rate * 1e3)  # about 20 ms
        ts, lrs = [], [0.01, 0.011]
        for i in range(a.steps):
            fresh()
            sync(device)
            opt.param_groups[0]["lr"] = lrs[i % 2]
            torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            opt.step()
            ts.append((time.perf_counter() - t0) * 1e3)
        sync(device)
        opt.param_groups[0]["lr"] = 0.01
        behind = statistics.median(ts)
    mode = "op by op" if a.op_by_op else "recorded orthogonalizations"
    grads = "fresh gradient tensors every step" if a.fresh_grads else "the same gradient tensors"
    print(f"## {a.model}, Dion3 f = {a.fraction}, bf16, {a.device}: {mode}, {grads}\n")
    print(f"- megabatches: {len(opt.plan())}; parameters: {sum(len(g['params']) for g in opt.param_groups)}")
    print(f"- host ms per step(), median of {a.steps}: {host:.3f}")
    print(f"- host ms of the engine's step_async() alone: {engine:.3f}")
    if behind is not None:
        print(f"- host ms per step() with a new lr each step, behind about 20 ms of queued GPU work: {behind:.3f}")
    # The Python layer's pieces, each timed alone.
    eng = opt._engine
    states = opt._engine_states
    groups = [(i, opt.param_groups[gi]) for i, gi in enumerate(opt._engine_groups)]
    from dion3.optimizer import _engine_config

    def push_all():
        for i, g in groups:
            eng.update_group(i, _engine_config(g))

    def push():  # as step() does it: only groups whose plain values changed
        opt._push_groups(eng)

    key = opt._registration_key

    def count():
        for st in states:
            st["step"] += 1

    # The non-blocking step() path piece by piece, in sequence, as step() runs it.
    split = collections.defaultdict(list)
    for _ in range(a.steps):
        fresh()
        sync(device)
        t = [time.perf_counter()]
        key()
        t.append(time.perf_counter())
        push()
        t.append(time.perf_counter())
        opt._raise_deferred(poll=True)
        t.append(time.perf_counter())
        eng.step_async()
        t.append(time.perf_counter())
        count()
        t.append(time.perf_counter())
        eng.posted_counters()  # what the next step's poll reads (the engine posted it)
        t.append(time.perf_counter())
        for i, name in enumerate(["key", "group push", "deferred check", "engine", "counters", "counters poll"]):
            split[name].append((t[i + 1] - t[i]) * 1e3)
    print("- step()'s pieces in sequence (ms): " +
          ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in split.items()))
    pieces = [("group push", push), ("every group pushed", push_all), ("step counters", count), ("engine key", key),
              ("counters poll", eng.posted_counters)]
    for name, fn in pieces:
        print(f"- host ms of {name}: {median_ms(fn):.3f}")
    print()

    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    n = 5
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            fresh()
            sync(device)
            opt.step()
        sync(device)
    rows = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        r = rows[e.name]
        r[0] += 1
        r[1] += e.cpu_time_total / 1e3
    print("### Host ranges and runtime calls per step (torch.profiler, CPU side)\n")
    print("| name | calls per step | host ms per step |\n|---|---|---|")
    for name, (c, ms) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"| `{name[:70]}` | {c / n:.1f} | {ms / n:.3f} |")
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\nDevice activities per step (kernels, copies, memsets): {kernels / n:.1f}\n")

    pr = cProfile.Profile()
    sync(device)
    for _ in range(a.steps):
        fresh()
        sync(device)
        pr.enable()
        opt.step()
        pr.disable()
        sync(device)
    sync(device)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15)
    print(f"### cProfile of {a.steps} step() calls (tottime)\n\n```")
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:6000])
    print("```")


if __name__ == "__main__":
    main()
