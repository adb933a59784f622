# The rule on the GPU, judged by the result's largest singular value (healthy: about 1.2 at most)
# rather than finiteness: Gram NS forced on rank-deficient inputs on CUDA, per coefficient list
# (growth g between restarts) and shape, in float16 and float32, against standard NS on the same
# inputs. Lists past the rule are refused.
import torch, dion3
from common import classic, pe, you, growth, sigma
cases = [("default", None, None), ("classic3", [classic]*3, []), ("pe[1:]x3 r4,8", pe[1:]*3, [4, 8]),
         ("you", you, []), ("classic6", [classic]*6, []), ("pe+pe[-1]x2", pe + [pe[-1]]*2, []),
         ("classic7", [classic]*7, []), ("classic 9 r2 +pe", [classic]*9 + [pe[4]], [2])]
print(torch.cuda.get_device_name(), "dion3", dion3.__version__)
for dt in (torch.float16, torch.float32):
    u = 2**-11 if dt == torch.float16 else 2**-24
    for name, coefs, restarts in cases:
        kw = {} if coefs is None else dict(coefficients=coefs, restarts=restarts)
        g = growth(coefs, set(restarts)) if coefs else 30.87
        row = []
        for p, q in [(16, 512), (96, 384), (320, 1024), (512, 2048), (1024, 4096)]:
            wg = ws = 0.0
            try:
                for rank in (1, 2, p // 4, p // 2, p - 1):
                    torch.manual_seed(rank)
                    X = (torch.randn(p, rank, device="cuda") @ torch.randn(rank, q, device="cuda")).expand(2, p, q).contiguous()
                    wg = max(wg, sigma(dion3.orthogonalize(X, "gram", iteration_dtype=dt, **kw)))
                    ws = max(ws, sigma(dion3.orthogonalize(X, "standard", iteration_dtype=dt, **kw)))
            except ValueError:
                row = ["refused"]; break
            row.append(f"{p}x{q} {wg:.4g} ({ws:.4g})")
        print(f"{str(dt)[6:]:8s} {name:16s} g {g:9.4g} u*g^2 {u*g*g:9.3g} | max sigma gram (standard): " + " | ".join(row), flush=True)
