# Largest singular value of float16 Gram NS (the default coefficients and restart) against the
# standard iteration on the same inputs, over spectra where rounding weighs most.
#   PYTHONPATH=<site> OMP_NUM_THREADS=2 python sweep_spectra.py [cpu|cuda]
import sys

import dion3
import torch

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"


def inputs(p, q, seed):
    g = torch.Generator().manual_seed(seed)
    out = [(f"rank {r}", torch.randn(p, r, generator=g) @ torch.randn(r, q, generator=g))
           for r in (1, 3, p // 8, p // 4, p // 2, 3 * p // 4, p - 1)]
    U, _ = torch.linalg.qr(torch.randn(p, p, generator=g))
    V, _ = torch.linalg.qr(torch.randn(q, p, generator=g))
    for kappa in (1e2, 1e3, 1e4):
        out.append((f"log-spaced 1e{len(str(int(kappa))) - 1}", (U * torch.logspace(0, -torch.log10(torch.tensor(kappa)).item(), p)) @ V.T))
        two = torch.ones(p)
        two[p // 2:] = 1 / kappa
        out.append((f"two clusters 1e{len(str(int(kappa))) - 1}", (U * two) @ V.T))
    out.append(("rank 4 x 10 + noise", torch.randn(p, 4, generator=g) @ torch.randn(4, q, generator=g) * 10 + torch.randn(p, q, generator=g)))
    out.append(("gaussian", torch.randn(p, q, generator=g)))
    return out


def largest(Y):
    return torch.linalg.matrix_norm(Y.double(), ord=2).item()


print(f"dion3 {dion3.__version__}, {device}, iteration dtype float16")
print(f"{'shape':>10} {'seed':>4} {'worst input for gram':>24} {'gram':>7} {'standard':>8} {'max |gram - standard| / max |standard|':>40}")
worst = {"gram": 0.0, "standard": 0.0, "diff": 0.0}
for p, q in ((64, 512), (128, 1024), (320, 1024), (256, 2048), (512, 1536), (1024, 4096)):
    for seed in (0, 1):
        rows = []
        for name, X in inputs(p, q, seed):
            X = X.to(device)
            G = dion3.orthogonalize(X, "gram", iteration_dtype=torch.float16)
            S = dion3.orthogonalize(X, "standard", iteration_dtype=torch.float16)
            d = ((G - S).abs().max() / S.abs().max()).item()
            rows.append((largest(G), largest(S), d, name))
        g, s, d, name = max(rows)
        dmax = max(r[2] for r in rows)
        worst = {"gram": max(worst["gram"], g), "standard": max(worst["standard"], max(r[1] for r in rows)), "diff": max(worst["diff"], dmax)}
        print(f"{p:>4}x{q:<5} {seed:>4} {name:>24} {g:7.4f} {s:8.4f} {dmax:40.3g}", flush=True)
print(f"worst over all: gram {worst['gram']:.4f}, standard {worst['standard']:.4f}, relative difference {worst['diff']:.3g}")
