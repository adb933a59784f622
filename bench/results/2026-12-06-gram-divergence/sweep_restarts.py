import torch, dion3, itertools, math
torch.manual_seed(0)
from common import classic, growth as gram_growth
from dion3 import polar
sets = {"classic": None}
res = []
for dt in (torch.float16, torch.float32):
  for steps in range(3, 17):
    for restarts in ([], [2], [3], [2, 5], [2,4,6,8]):
      if any(r >= steps for r in restarts): continue
      coefs = [classic] * steps
      g = gram_growth(coefs, set(restarts))
      bad = 0; n = 0
      for rows, cols, rank in [(16, 512, 1), (64, 1024, 4), (32, 256, 8), (48, 512, 47)]:
        for seed in range(2):
          torch.manual_seed(seed)
          X = torch.randn(rows, rank) @ torch.randn(rank, cols)
          try:
            Y = dion3.orthogonalize(X, "gram", coefficients=coefs, restarts=restarts, iteration_dtype=dt)
          except ValueError as e:
            bad = -1; break
          n += 1
          bad += int(not torch.isfinite(Y).all())
        if bad < 0: break
      res.append((str(dt)[6:], steps, restarts, g, bad, n))
      print(str(dt)[6:], steps, restarts, f"growth {g:.3g}", "refused" if bad < 0 else f"nonfinite {bad}/{n}", flush=True)
