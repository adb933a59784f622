# The rule on the GPU: Gram NS forced ("gram") on rank-deficient inputs, on CUDA, over coefficient
# lists on both sides of the bound; every list the rule lets through should give finite results.
import torch, dion3
from common import classic, pe, you, growth, nonfinite_count
cases = [("default", None, None), ("pe", pe, []), ("you", you, []), ("you+1", you + [you[-1]], []),
         ("classic4", [classic]*4, []), ("classic5", [classic]*5, []), ("classic6", [classic]*6, []),
         ("pe[1:]x3", pe[1:]*3, [4,8]), ("classic9", [classic]*9, []), ("classic 10 r2 +pe", [classic]*10 + [pe[4]], [2])]
print(torch.cuda.get_device_name(), "dion3", dion3.__version__)
for dt in (torch.float16, torch.float32):
    for name, coefs, restarts in cases:
        kw = {} if coefs is None else dict(coefficients=coefs, restarts=restarts)
        g = growth(coefs, set(restarts)) if coefs else float("nan")
        counted = nonfinite_count([(16, 512), (64, 1024), (48, 256), (320, 1024), (512, 2048), (1024, 4096)], dt,
                                  device="cuda", batch=4, **kw)
        u = 2**-11 if dt == torch.float16 else 2**-24
        print(f"{str(dt)[6:]:8s} {name:18s} growth {g:9.4g} u*g^2 {u*g*g:9.3g}", "refused" if counted is None else "nonfinite %d/%d (batches of 4)" % counted, flush=True)
