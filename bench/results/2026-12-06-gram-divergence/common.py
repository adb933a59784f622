# The coefficient lists and helpers the sweeps share.
import dion3
import torch

classic = (3.4445, -4.775, 2.0315)
pe = [(7.892582874424408, -20.383013945879568, 13.555306149406924), (3.911484868135431, -2.546463592906088, 0.426898831967307),
      (3.760657955697423, -2.512819018216563, 0.432364734907007), (3.160399673686287, -2.149649518898498, 0.399636690766439),
      (2.191097161861730, -1.441662010214663, 0.328146487623155)]
you = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
       (2.8366, -3.0525, 1.2012)]


def growth(coefs, restarts):
    """The largest product of |a| between restarts (OrthConfig::gram_growth)."""
    worst, prod = 0.0, 1.0
    for t, c in enumerate(coefs):
        if t > 0 and t in restarts:
            prod = 1.0
        prod *= abs(c[0])
        worst = max(worst, prod)
    return worst


def sigma(Y):
    """The largest singular value over a batch (inf where a value is not finite)."""
    return torch.linalg.matrix_norm(Y.double(), ord=2).max().item() if torch.isfinite(Y).all() else float("inf")


def nonfinite_count(shapes, iteration_dtype, device="cpu", batch=None, **kw):
    """Gram NS forced on rank-deficient p x q inputs (ranks 1, 2, p/4, p/2, p - 1; two seeds each,
    in batches of `batch` copies where given): (results holding a non-finite value, results), or
    None where the configuration is refused."""
    bad = n = 0
    for p, q in shapes:
        for rank in (1, 2, p // 4, p // 2, p - 1):
            for seed in range(2):
                torch.manual_seed(seed * 100 + rank)
                X = torch.randn(p, rank, device=device) @ torch.randn(rank, q, device=device)
                if batch:
                    X = X.expand(batch, p, q).contiguous()
                try:
                    Y = dion3.orthogonalize(X, "gram", iteration_dtype=iteration_dtype, **kw)
                except ValueError:
                    return None
                n += 1
                bad += int(not torch.isfinite(Y).all())
    return bad, n
