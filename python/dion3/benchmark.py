# benchmark.py — `python -m dion3.benchmark`: the Python front end's own cost on model-shaped
# parameter sets. Times dion3.<Optimizer>.step() end to end, the host time
# it takes to return (host_ms; step() waits for its non-finite verdict), the time spent in the
# engine call inside it (the difference is the Python-side overhead, as a share of the step), and
# the host launch time of the engine's synchronisation-free step (launch_ms).
# `--optimizers torch.AdamW` times PyTorch's own AdamW (fused on CUDA) on the same parameters:
# the baseline a user compares with. `torch.Muon` times torch.optim.Muon and `optim.Muon`
# dion3.optim.Muon, its drop-in, both on the matrices alone (torch's Muon takes no vectors). Not a
# test: it asserts nothing and prints one JSON line per configuration.
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import dion3

# (layers, d_model, d_mlp) of the model-shaped sets of algorithm.md §5; "tiny" is for CPU smoke runs.
MODELS = {
    "gpt-1b": (16, 2048, 4 * 2048),
    "llama-7b": (32, 4096, 11008),
    "tiny": (2, 256, 1024),
}


# The optimizers that take a fraction (--fractions).
SELECTING = ("Dion3", "NorDion2", "Dion2")
OPTIMIZERS = ("Dion3", "NorDion2", "Dion2", "NorMuon", "Muon", "optim.Muon", "torch.AdamW", "torch.Muon")


def at_least(low: int):
    """An argparse type: an int of at least `low` (argparse's own error otherwise)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    return parse


def listed(parse_item, what: str):
    """An argparse type: a comma-separated list, each item read by parse_item."""
    def parse(text: str):
        try:
            items = [parse_item(t) for t in text.split(",")]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what} ({e})") from None
        return items
    return parse


def optimizer_name(text: str) -> str:
    if text not in OPTIMIZERS:
        raise ValueError(f"{text!r} is none of {', '.join(OPTIMIZERS)}")
    return text


def fraction(text: str) -> float:
    """A fraction in (0, 1]; as an argparse type its ValueError names the value (listed, fraction_arg)."""
    v = float(text)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{text} is not in (0, 1]")
    return v


def fraction_arg(text: str) -> float:
    try:
        return fraction(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1] ({e})") from None


def model_shapes(name: str, layers: int = 0):
    n_layers, d, mlp = MODELS[name]
    n_layers = layers or n_layers
    gated = name.startswith("llama")
    per_layer = [(d, d)] * 4 + ([(mlp, d), (mlp, d), (d, mlp)] if gated else [(mlp, d), (d, mlp)])
    return per_layer * n_layers, [(d,)] * (2 * n_layers)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_params(args):
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    mats, vecs = model_shapes(args.model, args.layers)
    torch.manual_seed(0)  # weights drawn on the device itself: llama-7b is 6.5e9 numbers
    params_m = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in mats]
    params_v = [torch.nn.Parameter(torch.ones(s, device=device, dtype=dtype)) for s in vecs]
    for p in params_m + params_v:
        p.grad = torch.randn_like(p) * 1e-3
    return device, params_m, params_v


def run_torch(args, name):
    device, params_m, params_v = make_params(args)
    fused = device.type == "cuda"
    if name == "torch.Muon":
        opt, label, params_v = torch.optim.Muon(params_m, lr=0.02), "torch.optim.Muon", []
    else:
        opt = torch.optim.AdamW(params_m + params_v, lr=1e-3, weight_decay=0.01, fused=fused)
        label = "torch.optim.AdamW" + (" (fused)" if fused else "")
    for _ in range(args.warmup):
        opt.step()
    step_ms = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return {
        "optimizer": label, "model": args.model,
        "layers": args.layers or MODELS[args.model][0], "device": str(device), "dtype": args.dtype,
        "matrices": len(params_m), "vectors": len(params_v), "step_ms": round(statistics.median(step_ms), 3),
    }


def run(args, cls_name, fraction):
    if cls_name in ("torch.AdamW", "torch.Muon"):
        return run_torch(args, cls_name)
    device, params_m, params_v = make_params(args)
    if cls_name == "optim.Muon":  # torch.optim.Muon's drop-in: matrices only, as torch's
        params_v = []
        opt = dion3.optim.Muon(params_m, lr=0.02, on_nonfinite=args.on_nonfinite)
    else:
        cls = getattr(dion3, cls_name)
        kw = dict(fraction=fraction) if cls_name in SELECTING else {}
        opt = cls([dict(params=params_m), dict(params=params_v, algorithm="adamw", lr=1e-3)], lr=0.01,
                  on_nonfinite=args.on_nonfinite, **kw)
    opt._record_orthogonalizer = not args.op_by_op
    for _ in range(args.warmup):
        opt.step()
    sync(device)

    # The engine call is timed inside each opt.step(), so the Python share is measured on the
    # same calls (robust to a noisy machine): overhead = host time of step() - time in engine.step.
    class TimedEngine:
        def __init__(self, engine):
            self.engine, self.seconds = engine, 0.0

        def step(self):
            t = time.perf_counter()
            try:
                return self.engine.step()
            finally:
                self.seconds += time.perf_counter() - t

        def __getattr__(self, name):
            return getattr(self.engine, name)

    timed = TimedEngine(opt._engine)
    opt._engine = timed
    step_ms, host_ms, inside_ms = [], [], []
    for _ in range(args.steps):
        sync(device)
        timed.seconds = 0.0
        t0 = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        host_ms.append((t1 - t0) * 1e3)
        step_ms.append((t2 - t0) * 1e3)
        inside_ms.append(timed.seconds * 1e3)
    opt._engine = timed.engine
    # Host time of a step that does not wait for the GPU (blocking=False): what a training loop
    # pays before it can queue the next forward pass.
    nonblocking_ms = []
    opt._blocking = False
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        opt.step()
        nonblocking_ms.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    opt.check_nonfinite()
    opt._blocking = None
    # Host launch time of a whole step: the engine's synchronisation-free step (what a CUDA graph
    # captures), timed on the host only; the device work it queued is waited for afterwards.
    launch_ms = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        opt._engine.step_async()
        launch_ms.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    med = statistics.median
    overhead = med([h - e for h, e in zip(host_ms, inside_ms)])
    return {
        "optimizer": cls_name, "fraction": fraction if cls_name in SELECTING else None,
        "model": args.model, "layers": args.layers or MODELS[args.model][0], "device": str(device),
        "dtype": args.dtype, "matrices": len(params_m), "vectors": len(params_v),
        "step_ms": round(med(step_ms), 3), "host_ms": round(med(host_ms), 3),
        "engine_host_ms": round(med(inside_ms), 3),
        "launch_ms": round(med(launch_ms), 3),
        "nonblocking_host_ms": round(med(nonblocking_ms), 3),
        "python_overhead_ms": round(overhead, 4),
        "python_overhead_pct": round(100.0 * overhead / med(step_ms), 3),
        "megabatches": len(opt.plan()), "recorded": not args.op_by_op,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m dion3.benchmark",
        description="The Python front end's own cost on model-shaped parameter sets: each optimizer's step "
                    "timed end to end, the time inside the engine call, the Python-side overhead, and the host "
                    "launch time of the synchronisation-free step. One JSON line per configuration.")
    ap.add_argument("--model", default="llama-7b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=at_least(0), default=0, help="override the layer count (0: the model's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="parameter dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--optimizers", type=listed(optimizer_name, "optimizer names"), default="Dion3,NorMuon,Muon",
                    help=f"comma-separated, from {', '.join(OPTIMIZERS)} (torch.*: PyTorch's own; optim.Muon: "
                         "dion3's drop-in for torch.optim.Muon)")
    ap.add_argument("--fractions", type=listed(fraction, "fractions in (0, 1]"), default="0.25,0.5,1.0",
                    help=f"comma-separated fractions for {', '.join(SELECTING)}")
    ap.add_argument("--steps", type=at_least(1), default=10, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=at_least(1), default=2,
                    help="untimed steps first (at least one: the first step builds the engine)")
    ap.add_argument("--on-nonfinite", default="raise", choices=["raise", "skip"])
    ap.add_argument("--op-by-op", action="store_true",
                    help="launch each orthogonalization op by op instead of replaying its recording "
                         "(OptimizerOptions::record_orthogonalizer), for an A/B of the host time")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device}: {e}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: PyTorch sees no GPU here")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for name in args.optimizers:
        fractions = args.fractions if name in SELECTING else [1.0]
        for f in fractions:
            print(json.dumps(run(args, name, f)), flush=True)
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
