#!/usr/bin/env python3
# bench/cpu_threads.py — dion3's CPU step inside a PyTorch training loop, under several thread
# settings, each in a fresh process (thread pools are set up when the libraries load).
#
# Each step of the loop runs a forward and backward pass of a model made of the preset's matrices
# (PyTorch's own parallel work, as in training), then dion3.Dion3.step() on those matrices; the
# step time is what a trainer pays for the optimizer right after PyTorch's threads have worked.
# Configurations run in turns, trial after trial, so a machine whose speed drifts biases none of
# them; the table gives medians over trials of each trial's median, and ratios taken within a
# trial. Not a test: it asserts nothing.
#
#   python bench/cpu_threads.py                      # the installed dion3: default vs OPENBLAS_NUM_THREADS=1
#   python bench/cpu_threads.py --build before=/tmp/site-main --build after=/tmp/site-branch
#
# --build NAME=DIR runs the configurations once per dion3 found in DIR (put first on PYTHONPATH,
# e.g. a `pip install --target DIR .` of another checkout), so builds compare in the same run.
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import builds  # bench/builds.py

MODELS = {  # (layers, d_model, d_mlp)
    "tiny": (2, 256, 1024),
    "gpt-small": (12, 768, 3072),
}
# name: (environment, worker flags). The last three are diagnostics: torch's OpenMP threads sleep
# at once after their work instead of spinning; OpenBLAS's threads likewise; no PyTorch work
# between the steps at all.
SETTINGS = {
    "default": ({}, []),
    "OPENBLAS_NUM_THREADS=1": ({"OPENBLAS_NUM_THREADS": "1"}, []),
    "OMP_NUM_THREADS=1": ({"OMP_NUM_THREADS": "1"}, []),
    "OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "OPENBLAS_THREAD_TIMEOUT=4": ({"OPENBLAS_THREAD_TIMEOUT": "4"}, []),
    "step-only": ({}, ["--step-only"]),
    "step-only+OPENBLAS_NUM_THREADS=1": ({"OPENBLAS_NUM_THREADS": "1"}, ["--step-only"]),
}


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import dion3

    n_layers, d, mlp = MODELS[args.model]
    n_layers = args.layers or n_layers
    torch.manual_seed(0)
    mats = []
    for _ in range(n_layers):
        mats += [torch.randn(d, d) / d**0.5 for _ in range(4)]
        mats += [torch.randn(mlp, d) / d**0.5, torch.randn(d, mlp) / mlp**0.5]
    params = [torch.nn.Parameter(m) for m in mats]
    x0 = torch.randn(args.tokens, d)

    def loss_fn():
        x = x0
        for i in range(n_layers):
            q, k, v, o, up, down = params[6 * i:6 * i + 6]
            h = x
            for w in (q, k, v, o):
                h = F.linear(h, w)
            x = x + h
            x = x + F.linear(F.gelu(F.linear(x, up)), down)
        return x.square().mean()

    opt = dion3.Dion3(params, lr=0.01, fraction=args.fraction)
    fb_ms, step_ms, loop_ms = [], [], []
    for it in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        if not args.step_only or it == 0:  # step only: the gradients of the first pass, reused
            loss_fn().backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if not args.step_only:
            opt.zero_grad(set_to_none=False)
        if it >= args.warmup:
            fb_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t1) * 1e3)
            loop_ms.append((t2 - t0) * 1e3)
    med = statistics.median
    print(json.dumps({"step_ms": med(step_ms), "fwd_bwd_ms": med(fb_ms), "loop_ms": med(loop_ms),
                      "torch_threads": torch.get_num_threads(), "dion3": os.path.dirname(dion3.__file__)}))


def run_config(args, build_dir, setting):
    env_extra, flags = SETTINGS[setting]
    out = builds.run(__file__, build_dir, ["--worker", "--model", args.model, "--layers", str(args.layers),
                                           "--tokens", str(args.tokens), "--fraction", str(args.fraction),
                                           "--steps", str(args.steps), "--warmup", str(args.warmup)] + flags,
                     env_extra)
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the model's)")
    ap.add_argument("--tokens", type=int, default=512, help="rows of the forward pass's input")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=20, help="timed loop steps per trial")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trials", type=int, default=5, help="processes per configuration, taken in turns")
    ap.add_argument("--settings", default="default,OPENBLAS_NUM_THREADS=1",
                    help="comma-separated, from: " + ", ".join(SETTINGS))
    builds.add_option(ap)
    ap.add_argument("--configs", default="", metavar="BUILD:SETTING,...",
                    help="the configurations to run (default: every build with every setting)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--step-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return

    found = builds.parse(ap, args.build)
    settings = args.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r} (known: {', '.join(SETTINGS)})")
    configs = [(b, p, s) for b, p in found for s in settings]
    if args.configs:
        paths = dict(found)
        configs = []
        for c in args.configs.split(","):
            b, _, s = c.partition(":")
            if b not in paths or s not in SETTINGS:
                ap.error(f"--configs: {c!r} is not BUILD:SETTING with a --build name and a known setting")
            configs.append((b, paths[b], s))
    results = {c: [] for c in configs}
    for t in range(args.trials):
        for c in configs:
            r = run_config(args, c[1], c[2])
            results[c].append(r)
            print(f"trial {t + 1}/{args.trials} {c[0]} {c[2]}: step {r['step_ms']:.2f} ms, "
                  f"fwd+bwd {r['fwd_bwd_ms']:.2f} ms", file=sys.stderr, flush=True)

    med = statistics.median
    ref = configs[0]
    layers = args.layers or MODELS[args.model][0]
    print(f"dion3 CPU step in a PyTorch loop: {args.model} ({layers} layers), Dion3 f={args.fraction}, "
          f"{args.tokens} tokens, {os.cpu_count()} CPUs, torch threads {results[ref][0]['torch_threads']}; "
          f"{args.trials} trials x {args.steps} steps (medians; ratios within a trial, vs the first row)\n")
    print("| build | setting | step ms | fwd+bwd ms | loop ms | step vs first | loop vs first | step min..max |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in configs:
        rs = results[c]
        step_ratio = med([r["step_ms"] / q["step_ms"] for r, q in zip(rs, results[ref])])
        loop_ratio = med([r["loop_ms"] / q["loop_ms"] for r, q in zip(rs, results[ref])])
        steps = [r["step_ms"] for r in rs]
        print(f"| {c[0]} | {c[2]} | {med(steps):.2f} | {med([r['fwd_bwd_ms'] for r in rs]):.2f} | "
              f"{med([r['loop_ms'] for r in rs]):.2f} | {step_ratio:.2f}x | {loop_ratio:.2f}x | "
              f"{min(steps):.2f}..{max(steps):.2f} |")


if __name__ == "__main__":
    main()
