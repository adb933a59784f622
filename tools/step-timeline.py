#!/usr/bin/env python3
# tools/step-timeline.py — where one optimizer step's device time goes, kernel by kernel: the
# step is recorded with torch.profiler (CUPTI), and the kernels of one step are listed by name
# with their count and time, beside the idle time between consecutive kernels (launch gaps and
# pipeline drains the kernels themselves do not show). Also times the same step eagerly and as
# a replayed CUDA graph. Needs the CUDA build of dion3 on a GPU machine; a developer's tool, not
# a test. Usage: python3 tools/step-timeline.py --model gpt-1b --fraction 0.25 [--out trace.json]
import argparse
import collections
import json
import os
import statistics
import tempfile

import torch

import dion3
from dion3.benchmark import model_shapes


def make_optimizer(model, fraction):
    mats, vecs = model_shapes(model)
    torch.manual_seed(0)
    pm = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in mats]
    pv = [torch.nn.Parameter(torch.ones(s, device="cuda", dtype=torch.bfloat16)) for s in vecs]
    for p in pm + pv:
        p.grad = torch.randn_like(p) * 1e-3
    return dion3.Dion3([dict(params=pm), dict(params=pv, algorithm="adamw", lr=1e-3)], lr=0.01,
                       fraction=fraction, on_nonfinite="skip")


def time_ms(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def kernels_of_one_step(opt, trace_path):
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt._engine.step_async()
        torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = [e for e in events if e.get("cat") == "kernel"]
    return sorted(ks, key=lambda e: e["ts"])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-1b")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    opt = make_optimizer(args.model, args.fraction)
    for _ in range(3):
        opt.step()
    eager = time_ms(lambda: opt._engine.step_async(), args.reps)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opt.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt._engine.step_async()
    replay = time_ms(graph.replay, args.reps)

    path = args.out or os.path.join(tempfile.mkdtemp(), "step-trace.json")
    ks = kernels_of_one_step(opt, path)
    busy = sum(k["dur"] for k in ks)
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ks, ks[1:])]
    by_name = collections.OrderedDict()
    for k in ks:
        name = k["name"].split("(")[0][:90]
        c, t = by_name.get(name, (0, 0.0))
        by_name[name] = (c + 1, t + k["dur"])
    print(f"# step timeline: {args.model}, Dion3 f={args.fraction}, {torch.cuda.get_device_name()}")
    print()
    print(f"- eager step (events): {eager:.3f} ms; replayed CUDA graph: {replay:.3f} ms")
    print(f"- one profiled step: {len(ks)} kernels, span {span / 1e3:.3f} ms, kernels busy {busy / 1e3:.3f} ms, "
          f"gaps {sum(gaps) / 1e3:.3f} ms (median gap {statistics.median(gaps):.2f} us, max {max(gaps):.1f} us)")
    print()
    print("| kernel | count | total us | mean us |")
    print("|---|---|---|---|")
    for name, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{name}` | {c} | {t:.1f} | {t / c:.1f} |")
    print()
    print("In order (us: start offset, duration, gap before):")
    print()
    print("```")
    t0 = ks[0]["ts"]
    for i, k in enumerate(ks):
        gap = 0.0 if i == 0 else gaps[i - 1]
        print(f"{k['ts'] - t0:9.1f} {k['dur']:8.1f} {gap:6.1f}  {k['name'][:100]}")
    print("```")


if __name__ == "__main__":
    main()
