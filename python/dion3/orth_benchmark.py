# orth_benchmark.py — `python -m dion3.orth_benchmark`: dion3.orthogonalize (standard and Gram
# Newton–Schulz, "auto") against a plain PyTorch standard Newton–Schulz with the same coefficients
# and iteration dtype, timed in the same run on batches shaped like a model's megabatches (each
# distinct matrix shape, its rows cut to ceil(f * rows) as Dion3 orthogonalizes them). Not a test:
# it prints a markdown table (ms, ratio against torch, effective TFLOP/s) and asserts nothing but
# that the results agree.
from __future__ import annotations

import argparse
import collections
import math
import statistics

import torch

import dion3
from .benchmark import MODELS, model_shapes
from .optimizer import POLAR_EXPRESS

PEAK_TFLOPS_BF16 = 790.0  # the roofline figure the project uses for bf16 tensor-core work on the H200


def torch_newton_schulz(X: torch.Tensor, coefficients, eps: float = 1e-8) -> torch.Tensor:
    """Standard quintic Newton–Schulz in PyTorch (batched, on the wide orientation)."""
    tall = X.size(-2) > X.size(-1)
    Y = X.mT if tall else X
    Y = Y / torch.linalg.matrix_norm(Y.float(), keepdim=True).clamp(min=eps).to(Y.dtype)
    for a, b, c in coefficients:
        A = Y @ Y.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        Y = torch.baddbmm(Y, B, Y, beta=a, alpha=1.0)
    return Y.mT if tall else Y


def standard_flops(batch: int, rows: int, cols: int, steps: int) -> float:
    """The standard iteration's multiply-adds x 2 on the wide orientation (p <= q): per step
    X X^T (2p^2q), A^2 (2p^3), B X (2p^2q)."""
    p, q = min(rows, cols), max(rows, cols)
    return batch * steps * (4.0 * p * p * q + 2.0 * p ** 3)


def time_ms(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cases(model: str, layers: int, fractions):
    mats, _ = model_shapes(model, layers)
    counts = collections.Counter(tuple(s) for s in mats)
    for f in fractions:
        for (m, n), count in sorted(counts.items()):
            yield f, count, max(1, math.ceil(f * m)), n


def main(argv=None):
    ap = argparse.ArgumentParser(description="dion3.orthogonalize against PyTorch Newton–Schulz")
    ap.add_argument("--model", default="gpt-1b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=4, help="layers whose matrices form a batch (default 4)")
    ap.add_argument("--fractions", default="1.0,0.25")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("dion3.orth_benchmark: needs a CUDA GPU (it times kernels with CUDA events)")
    torch.manual_seed(0)
    steps = len(POLAR_EXPRESS)
    print(f"# dion3.orthogonalize against PyTorch standard Newton–Schulz — {args.model}, {args.layers} layers, "
          f"bf16, {steps} Polar Express steps, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("Effective TFLOP/s count the standard iteration's FLOPs for every method (the Gram method "
          f"does fewer); peak {PEAK_TFLOPS_BF16:.0f}.\n")
    print("| f | batch x rows x cols | torch ms | dion3 standard ms | dion3 gram ms | dion3 auto ms | "
          "auto vs torch | auto TFLOP/s | max abs diff auto vs torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for f, batch, rows, cols in cases(args.model, args.layers, [float(x) for x in args.fractions.split(",")]):
        X = torch.randn(batch, rows, cols, device="cuda", dtype=torch.bfloat16)
        ms = {"torch": time_ms(lambda: torch_newton_schulz(X, POLAR_EXPRESS), args.reps, args.warmup)}
        for method in ("standard", "gram", "auto"):
            ms[method] = time_ms(lambda: dion3.orthogonalize(X, method, iteration_dtype=torch.bfloat16),
                                 args.reps, args.warmup)
        ref = torch_newton_schulz(X, POLAR_EXPRESS).float()
        got = dion3.orthogonalize(X, "auto", iteration_dtype=torch.bfloat16).float()
        diff = (got - ref).abs().max().item()
        if not diff < 0.1:  # both are bf16 iterations of one polynomial: far apart means a bug
            raise SystemExit(f"dion3.orth_benchmark: auto and torch disagree by {diff} at {batch}x{rows}x{cols}")
        tflops = standard_flops(batch, rows, cols, steps) / (ms["auto"] * 1e-3) / 1e12
        print(f"| {f:g} | {batch} x {rows} x {cols} | {ms['torch']:.3f} | {ms['standard']:.3f} | {ms['gram']:.3f} | "
              f"{ms['auto']:.3f} | {ms['torch'] / ms['auto']:.2f}x | {tflops:.0f} | {diff:.4f} |", flush=True)
        del X, ref, got
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
