# reference.py — an independent float64 PyTorch transcription of docs/algorithm.md (§1 one matrix step,
# §2 orthogonalization, §4 AdamW / Lion), written from the spec alone, for the parity tests.
# Slow and simple on purpose: loops over matrices and rows, everything in float64.
import math

import torch

POLAR_EXPRESS = [
    (7.892582874424408, -20.383013945879568, 13.555306149406924),
    (3.911484868135431, -2.546463592906088, 0.426898831967307),
    (3.760657955697423, -2.512819018216563, 0.432364734907007),
    (3.160399673686287, -2.149649518898498, 0.399636690766439),
    (2.191097161861730, -1.441662010214663, 0.328146487623155),
]
YOU = [
    (4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012),
]


def normalized(X, eps=1e-7, floor=False):
    """algorithm.md §2's input: X / (||X||_F + eps), or with floor (torch.optim.Muon's rule) X / max(||X||_F, eps)."""
    norm = torch.linalg.norm(X)
    return X / (norm.clamp(min=eps) if floor else norm + eps)


def orth_standard(X, coeffs=POLAR_EXPRESS, eps=1e-7, floor=False):
    """algorithm.md §2 standard Newton–Schulz on one k x n matrix, in float64."""
    X = X.double()
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.T
    X = normalized(X, eps, floor)
    for a, b, c in coeffs:
        A = X @ X.T
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.T if transposed else X


def orth_gram(X, coeffs=POLAR_EXPRESS, restarts=(2,)):
    """algorithm.md §2 Gram Newton–Schulz with restarts, in float64 (equal to orth_standard in exact math)."""
    X = X.double()
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.T
    X = normalized(X)
    p = X.shape[0]
    eye = torch.eye(p, dtype=X.dtype)
    R = X @ X.T
    Q = eye.clone()
    T = len(coeffs)
    for t, (a, b, c) in enumerate(coeffs):
        if t in restarts and t > 0:
            X = Q @ X
            R = X @ X.T
            Q = eye.clone()
        Z = b * R + c * (R @ R)
        Q = Z + a * eye if (t == 0 or t in restarts) else Q @ Z + a * Q
        if t < T - 1 and (t + 1) not in restarts:
            RZ = R @ Z + a * R
            R = Z @ RZ + a * RZ
    X = Q @ X
    return X.T if transposed else X


def adjusted_lr(lr, m, n, adjust_lr):
    if adjust_lr == "spectral_norm":
        return lr * math.sqrt(m / n)
    if adjust_lr == "rms_norm":
        return lr * 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "spectral_norm_clamped":
        return lr * math.sqrt(max(1.0, m / n))
    if adjust_lr in (None, "none"):
        return lr
    raise ValueError(f"reference: unknown adjust_lr {adjust_lr!r}")


def matrices(t, flatten):
    """View of a parameter as (count, m, n): 2-D as is, >= 3-D as (dim0, rest) when flatten,
    else as a batch of its trailing 2-D matrices."""
    if t.dim() == 2 or flatten:
        return t.reshape(1, t.shape[0], -1)
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def normuon(O, v_rows, beta2):
    """algorithm.md §1 step 6 on the rows of O with their variance entries; returns (Õ, new variance)."""
    r = (O * O).mean(dim=1)
    v_new = beta2 * v_rows + (1 - beta2) * r
    Ot = O / (v_new.sqrt() + 1e-8)[:, None]
    Ot = Ot * torch.linalg.norm(O) / max(torch.linalg.norm(Ot).item(), 1e-8)
    return Ot, v_new


def top_rows(M, k):
    """The k rows of largest l1 score (ties: lower index), ascending (algorithm.md §1 step 2)."""
    order = torch.sort(-M.abs().sum(dim=1), stable=True).indices
    return torch.sort(order[:k]).values


def normuon_per_shard(O, v_rows, shard, beta2):
    """NorMuon on O's rows shard by shard (shard[i]: row i's shard): each shard's own Frobenius
    rescale."""
    Ot, v_new = torch.empty_like(O), torch.empty_like(v_rows)
    for s in torch.unique(shard):
        sel = shard == s
        Ot[sel], v_new[sel] = normuon(O[sel], v_rows[sel], beta2)
    return Ot, v_new


DEFAULTS = dict(algorithm="dion3", lr=0.01, fraction=0.25, mu=0.95, muon_beta2=0.95, betas=(0.9, 0.95),
                weight_decay=0.01, epsilon=1e-8, adjust_lr="spectral_norm", flatten=False, nesterov=False,
                cautious_wd=False, scale_lr_by_fraction=False, coefficients=None, use_polar_express=True,
                method="standard")


class Reference:
    """Float64 optimizer over a list of (tensor, options) params; step(grads) updates its copies."""

    def __init__(self, params, **group):
        self.opts = dict(DEFAULTS, **group)
        self.w = [p.detach().double().cpu().clone() for p in params]  # the reference runs on the CPU
        self.state = [dict(step=0) for _ in params]

    def _orth(self, U):
        o = self.opts
        coeffs = o["coefficients"] or (POLAR_EXPRESS if o["use_polar_express"] else YOU)
        return orth_gram(U, coeffs) if o["method"] == "gram" else orth_standard(U, coeffs)

    def step(self, grads):
        for i, g in enumerate(grads):
            if g is not None:  # torch.optim's rule: a parameter without a gradient is not stepped
                self._step_one(i, g.detach().double().cpu())

    def _step_one(self, i, G):
        o, W, st = self.opts, self.w[i], self.state[i]
        algo = o["algorithm"]
        lr, wd = o["lr"], o["weight_decay"]
        if algo in ("adamw", "lion"):
            b1, b2 = o["betas"]
            m = st.setdefault("exp_avg", torch.zeros_like(W))
            if algo == "adamw":
                v = st.setdefault("exp_avg_sq", torch.zeros_like(W))
                st["step"] += 1
                t = st["step"]
                m.lerp_(G, 1 - b1)
                v.lerp_(G * G, 1 - b2)
                mhat = m / (1 - b1 ** t)
                vhat = v / (1 - b2 ** t)
                W.mul_(1 - lr * wd).sub_(lr * mhat / (vhat.sqrt() + o["epsilon"]))
            else:
                u = torch.sign(torch.lerp(m, G, 1 - b1))
                m.lerp_(G, 1 - b2)
                W.mul_(1 - lr * wd).sub_(lr * u)
            return
        Wm = matrices(W, o["flatten"])
        Gm = matrices(G, o["flatten"])
        count, m_rows, n = Wm.shape
        M = st.setdefault("momentum", torch.zeros_like(Wm))
        V = st.setdefault("variance", torch.zeros(count, m_rows, dtype=torch.float64))
        selects = algo in ("dion3", "nordion2", "dion2")
        base = lr / math.sqrt(o["fraction"]) if (selects and o["scale_lr_by_fraction"]) else lr
        lr_adj = adjusted_lr(base, m_rows, n, o["adjust_lr"])
        mu = o["mu"]
        # algorithm.md §3 row sharding over `ranks` (contiguous chunks of c = ceil(m / ranks) rows): the
        # local scope selects ceil(f * c) rows per shard; NorMuon's rescale runs per shard.
        # `row_shards(m)` gives another cut as (first row, rows) per shard (FSDP2 over tensor
        # parallel cuts rows twice); the largest shard sizes every shard's selection.
        ranks = o.get("ranks", 1)
        c = -(-m_rows // ranks)
        shards = o["row_shards"](m_rows) if o.get("row_shards") else [(lo, min(c, m_rows - lo))
                                                                      for lo in range(0, m_rows, c)]
        c = max(n for _, n in shards)
        shard_of_row = torch.empty(m_rows, dtype=torch.long)
        for i, (lo, size) in enumerate(shards):
            shard_of_row[lo:lo + size] = i
        # Dion2 on a tall matrix no rank cuts selects columns: the same steps on transposed views.
        by_columns = algo == "dion2" and m_rows > n and ranks == 1 and not o.get("row_shards")
        for b in range(count):
            if selects:
                Mv = M[b].T if by_columns else M[b]  # views: edits reach M
                Mv += Gm[b].T if by_columns else Gm[b]
                rows_v = Mv.shape[0]
                k = max(1, math.ceil(o["fraction"] * rows_v))
                if len(shards) > 1 and o.get("selection_scope", "local") == "local":
                    k_loc = max(1, math.ceil(o["fraction"] * c))
                    S = torch.sort(torch.cat([lo + top_rows(Mv[lo:lo + size], min(k_loc, size))
                                              for lo, size in shards if size > 0])).values
                else:
                    S = top_rows(Mv, k)
                U = Mv[S].clone()
                Mv[S] = mu * Mv[S]
                O = self._orth(U)
                if algo == "dion2":
                    Ot = O
                else:
                    Ot, V[b][S] = normuon_per_shard(O, V[b][S], shard_of_row[S], o["muon_beta2"])
            else:
                M[b] = mu * M[b] + Gm[b]
                U = mu * M[b] + Gm[b] if o["nesterov"] else M[b].clone()
                S = torch.arange(m_rows)
                O = self._orth(U)
                if algo == "normuon":
                    Ot, V[b] = normuon_per_shard(O, V[b], shard_of_row[S], o["muon_beta2"])
                else:
                    Ot = O
            # scale_lr_by_fraction scales η itself, so the decoupled decay uses the scaled η too.
            decay = torch.full_like(Wm[b], 1 - base * wd)
            full = torch.zeros_like(Wm[b])
            (full.T if by_columns else full)[S] = Ot
            if o["cautious_wd"]:
                decay = torch.where(full * Wm[b] > 0, decay, torch.ones_like(decay))
            Wm[b] = Wm[b] * decay - lr_adj * full
        st["step"] += 1
