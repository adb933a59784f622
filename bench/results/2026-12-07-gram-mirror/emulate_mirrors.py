# Which mirrored product costs float16 Gram NS its band: a NumPy transcription of the Gram loop
# (docs/algorithm.md §2, W = Z + a·I formed directly) with every stored matrix rounded to float16,
# products accumulated in float32, and each symmetric product either mirrored from its lower
# triangle (as the kernels store it) or kept whole. Prints the largest singular value per variant.
#   OMP_NUM_THREADS=2 python emulate_mirrors.py
import numpy as np

PE = [(7.892582874424408, -20.383013945879568, 13.555306149406924), (3.911484868135431, -2.546463592906088, 0.426898831967307),
      (3.760657955697423, -2.512819018216563, 0.432364734907007), (3.160399673686287, -2.149649518898498, 0.399636690766439),
      (2.191097161861730, -1.441662010214663, 0.328146487623155)]


def f16(m):
    return m.astype(np.float16).astype(np.float32)


def mirrored(m):
    return np.tril(m) + np.tril(m, -1).T


def gram_ns(X, restarts, whole=lambda name, t: False):
    """whole(name, t): keep product `name` ("S" = R·W, "R" = W·S, "Q" = Q·W, "W") of step t unmirrored."""
    sym = lambda m, name, t: m if whole(name, t) else mirrored(m)
    X = f16(X / np.linalg.norm(X))
    eye = np.eye(X.shape[0], dtype=np.float32)
    R, Q = f16(mirrored(X @ X.T)), None
    for t, (a, b, c) in enumerate(PE):
        if t > 0 and t in restarts:
            X = f16(Q @ X)
            R, Q = f16(mirrored(X @ X.T)), None
        W = f16(sym(a * eye + b * R + c * (R @ R), "W", t))
        Q = W if Q is None else f16(sym(Q @ W, "Q", t))
        if t < len(PE) - 1 and t + 1 not in restarts:
            S = f16(sym(R @ W, "S", t))
            R = f16(sym(W @ S, "R", t))
    return Q @ X


rng = np.random.default_rng(0)
p, q = 512, 1536
U, _ = np.linalg.qr(rng.standard_normal((p, p)))
V, _ = np.linalg.qr(rng.standard_normal((q, p)))
two = np.ones(p)
two[p // 2:] = 1e-2
inputs = {"two clusters 1e2": ((U * two) @ V.T).astype(np.float32),
          "rank p/4": (rng.standard_normal((p, p // 4)) @ rng.standard_normal((p // 4, q))).astype(np.float32),
          "rank p/2": (rng.standard_normal((p, p // 2)) @ rng.standard_normal((p // 2, q))).astype(np.float32)}
variants = [
    ("every product mirrored (the kernels before)", {2}, lambda n, t: False),
    ("nothing mirrored", {2}, lambda n, t: True),
    ("S = R·W whole at t = 0 only", {2}, lambda n, t: n == "S" and t == 0),
    ("S whole at t = 3 only", {2}, lambda n, t: n == "S" and t == 3),
    ("S whole at t = 2 (after the restart: this change)", {2}, lambda n, t: n == "S" and t == 2),
    ("S whole at every update", {2}, lambda n, t: n == "S"),
    ("S and Q·W whole everywhere", {2}, lambda n, t: n in ("S", "Q")),
    ("restarts {2, 4}, every product mirrored", {2, 4}, lambda n, t: False),
    ("restarts {2, 3}, every product mirrored", {2, 3}, lambda n, t: False),
]
print(f"{p}x{q}, float16; largest singular value (the standard iteration reaches about 1.12)")
print(f"{'variant':52}" + "".join(f"{k:>18}" for k in inputs))
for name, restarts, whole in variants:
    row = [np.linalg.norm(gram_ns(X, restarts, whole), 2) for X in inputs.values()]
    print(f"{name:52}" + "".join(f"{v:18.4f}" for v in row), flush=True)
