# Gram NS against standard NS on rank-deficient inputs (CPU): the largest singular value of the
# result (healthy: the polynomial's band, about 1.2 at most), per coefficient list and its growth g
# between restarts. Ran on a build whose bound was g^2 * u <= 128, so lists beyond that are "refused".
import torch, dion3, sys, math
from common import classic, pe, you, growth, sigma
cases = [("default", None, None), ("pe[1:]x3 r4,8", pe[1:]*3, [4, 8]), ("classic3", [classic]*3, []), ("classic4", [classic]*4, []),
         ("you", you, []), ("classic5", [classic]*5, []), ("pe", pe, []), ("you+1", you + [you[-1]], []),
         ("classic6", [classic]*6, []), ("pe+pe[-1]x2", pe + [pe[-1]]*2, []), ("classic7", [classic]*7, []),
         ("classic 9 r2 +pe", [classic]*9 + [pe[4]], [2]), ("classic8", [classic]*8, []), ("classic 10 r2 +pe", [classic]*10 + [pe[4]], [2]),
         ("classic9", [classic]*9, [])]
dts = [torch.float16, torch.float32] if len(sys.argv) < 2 else [getattr(torch, sys.argv[1])]
for dt in dts:
    u = {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(dt, 2**-24)
    for name, coefs, restarts in cases:
        kw = {} if coefs is None else dict(coefficients=coefs, restarts=restarts)
        g = growth(coefs, set(restarts)) if coefs else 31.0
        worst_g = worst_s = 0.0; n = 0
        for p, q in [(16, 512), (64, 256), (96, 384), (128, 512)]:
            if worst_g < 0: break
            for rank in (1, 2, p // 4, p // 2, p - 1):
                torch.manual_seed(rank)
                X = (torch.randn(p, rank) @ torch.randn(rank, q)).expand(2, p, q).contiguous()
                try:
                    Yg = dion3.orthogonalize(X, "gram", iteration_dtype=dt, **kw)
                except ValueError:
                    worst_g = -1; break
                Ys = dion3.orthogonalize(X, "standard", iteration_dtype=dt, **kw)
                sg, ss = sigma(Yg), sigma(Ys)
                worst_g = max(worst_g, sg if math.isfinite(sg) else float("inf")); worst_s = max(worst_s, ss); n += 1
        print(f"{str(dt)[6:]:8s} {name:18s} g {g:9.4g} u*g^2 {u*g*g:9.3g}  max sigma: gram {'  refused' if worst_g < 0 else format(worst_g, '9.4g')}  standard {worst_s:7.4g}  ({n} inputs x2)", flush=True)
