# Gram NS against standard NS on rank-deficient inputs (CPU): the largest singular value of the
# result (healthy: the polynomial's band, about 1.2 at most), per coefficient list and its growth g
# between restarts. Ran on a build whose bound was g^2 * u <= 128, so lists beyond that are "refused".
import torch, dion3, sys, math
classic = (3.4445, -4.775, 2.0315)
pe = [(7.892582874424408, -20.383013945879568, 13.555306149406924),(3.911484868135431, -2.546463592906088, 0.426898831967307),(3.760657955697423, -2.512819018216563, 0.432364734907007),(3.160399673686287, -2.149649518898498, 0.399636690766439),(2.191097161861730, -1.441662010214663, 0.328146487623155)]
you = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
def growth(coefs, restarts):
    worst, prod = 0.0, 1.0
    for t, c in enumerate(coefs):
        if t > 0 and t in restarts: prod = 1.0
        prod *= abs(c[0]); worst = max(worst, prod)
    return worst
cases = [("default", None, None), ("pe[1:]x3 r4,8", pe[1:]*3, [4, 8]), ("classic3", [classic]*3, []), ("classic4", [classic]*4, []),
         ("you", you, []), ("classic5", [classic]*5, []), ("pe", pe, []), ("you+1", you + [you[-1]], []),
         ("classic6", [classic]*6, []), ("pe+pe[-1]x2", pe + [pe[-1]]*2, []), ("classic7", [classic]*7, []),
         ("classic 9 r2 +pe", [classic]*9 + [pe[4]], [2]), ("classic8", [classic]*8, []), ("classic 10 r2 +pe", [classic]*10 + [pe[4]], [2]),
         ("classic9", [classic]*9, [])]
def sigma(Y):
    return torch.linalg.matrix_norm(Y.double(), ord=2).max().item() if torch.isfinite(Y).all() else float("inf")
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
