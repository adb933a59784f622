import torch, dion3
from common import classic, pe, you, growth, nonfinite_count
cases = [("pe", pe, []), ("pe+pe[-1]x2", pe + [pe[-1]]*2, []), ("you", you, []), ("you+1", you + [you[-1]], []),
         ("pe+you", pe + you, [5]), ("pe x2 norestart-first", pe + pe, [5]), ("pe+pe", pe + pe, []),
         ("classic6", [classic]*6, []), ("classic5+pe4", [classic]*5 + [pe[4]], []), ("pe[1:]x3", pe[1:]*3, [4,8]),
         ("classic9", [classic]*9, []), ("classic9+r2", [classic]*11, [2]), ("classic 10 r2 +pe", [classic]*10 + [pe[4]], [2])]
for dt in (torch.float16, torch.float32):
    for name, coefs, restarts in cases:
        g = growth(coefs, set(restarts))
        counted = nonfinite_count([(16, 512), (64, 1024), (48, 256)], dt, coefficients=coefs, restarts=restarts)
        u = 2**-11 if dt == torch.float16 else 2**-24
        print(f"{str(dt)[6:]:8s} {name:22s} growth {g:9.4g} u*g^2 {u*g*g:9.3g}", "refused" if counted is None else "nonfinite %d/%d" % counted, flush=True)
