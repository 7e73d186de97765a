"""Float64 oracles, computed by methods independent of the reference's.

- entmax: plain bisection on the threshold τ of docs/maths.md (no sorting, no Newton): the
  bracket [max x − 1, max x − n^{1−α}] halved in float64 until it is two neighbouring doubles
  (at most 200 times), then normalisation.
- attention: the dense composition scores → oracle entmax → weights @ V in float64.
- normmax / budget: bisection on their thresholds in float64.
- fusedmax / oscarmax: each prox solved as a bounded least-squares dual by scipy's BVLS
  (an active-set method, not the Condat / PAV algorithms of the implementations), then an
  exact sparsemax by sorting.
"""
import math

import numpy as np
import torch
from scipy.optimize import lsq_linear


def oracle_entmax(X: torch.Tensor, alpha, dim: int = -1) -> torch.Tensor:
    """α-entmax of X along dim in float64; alpha float or tensor broadcastable (size 1 on dim)."""
    X = X.to(torch.float64).movedim(dim, -1)
    if isinstance(alpha, torch.Tensor):
        a = alpha.to(torch.float64).movedim(dim, -1).expand(*X.shape[:-1], 1)
    else:
        a = torch.full((*X.shape[:-1], 1), float(alpha), dtype=torch.float64)
    finite = torch.isfinite(X)
    n = finite.sum(-1, keepdim=True).clamp(min=1).to(torch.float64)
    row_max = torch.where(finite, X, torch.full_like(X, -math.inf)).amax(-1, keepdim=True)
    empty = torch.isneginf(row_max)
    row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    softmax = torch.softmax(X - row_max, dim=-1)
    is_softmax = a == 1
    a_safe = torch.where(is_softmax, torch.full_like(a, 2.0), a)
    x = (a_safe - 1) * (X - row_max)
    lo = torch.minimum(-torch.ones_like(a), -n.pow(1 - a_safe))
    hi = torch.maximum(-torch.ones_like(a), -n.pow(1 - a_safe))

    # A float α gives a python exponent: torch's pow then takes its fast paths (1, 2, ...).
    exponent = 1 / (a_safe - 1) if isinstance(alpha, torch.Tensor) or alpha == 1 else 1 / (float(alpha) - 1)

    def mass(tau):
        # α < 1: every finite entry is inside (inner > 0); −inf entries give inf^(neg) = 0.
        inner = (x - tau).clamp(min=0)
        return torch.where(inner > 0, inner.pow(exponent), torch.zeros_like(inner))

    # f(τ) = Σ mass − 1 is decreasing in τ for α > 1 and increasing for α < 1.
    increasing = a_safe < 1
    for _ in range(200):
        mid = (lo + hi) / 2
        if bool(((mid == lo) | (mid == hi)).all()):
            break  # every bracket is down to two neighbouring doubles
        f = mass(mid).sum(-1, keepdim=True) - 1
        go_right = (f > 0) ^ increasing
        lo = torch.where(go_right, mid, lo)
        hi = torch.where(go_right, hi, mid)
    p = mass((lo + hi) / 2)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)
    p = torch.where(is_softmax, softmax, p)
    p = torch.where(empty, torch.zeros_like(p), p)
    return p.movedim(-1, dim)


def oracle_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, alpha=1.5):
    """Dense float64 entmax attention (no dropout); GQA by repeating key/value heads."""
    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    heads = q.shape[1]
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(torch.float64)
    if is_causal:
        lq, lk = scores.shape[-2:]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(torch.float64).reshape(-1).expand(heads).view(1, -1, 1, 1)
    return oracle_entmax(scores, alpha, dim=-1) @ v


def _bisect_decreasing(f, lo, hi, iterations=200):
    for _ in range(iterations):
        mid = (lo + hi) / 2
        positive = f(mid) > 0
        lo = torch.where(positive, mid, lo)
        hi = torch.where(positive, hi, mid)
    return (lo + hi) / 2


def oracle_normmax(X: torch.Tensor, alpha: float) -> torch.Tensor:
    """α-normmax along the last dim in float64: bisection on Σ [z − τ]_+^{α/(α−1)} = 1, on
    z shifted to max 0 (the bracket [−1, 0] is then resolved at any offset)."""
    z = X.to(torch.float64)
    z = z - z.amax(-1, keepdim=True)
    power = alpha / (alpha - 1)
    top = torch.zeros_like(z[..., :1])
    tau = _bisect_decreasing(lambda t: (z - t).clamp(min=0).pow(power).sum(-1, keepdim=True) - 1,
                             top - 1, top)
    r = (z - tau).clamp(min=0).pow(1 / (alpha - 1))
    return r / r.sum(-1, keepdim=True)


def oracle_budget(X: torch.Tensor, budget: float) -> torch.Tensor:
    """budget-sparsemax along the last dim in float64: bisection on Σ clip(z − τ, 0, 1) = b,
    on z shifted to max 0."""
    z = X.to(torch.float64)
    z = z - z.amax(-1, keepdim=True)
    tau = _bisect_decreasing(lambda t: (z - t).clamp(0, 1).sum(-1, keepdim=True) - budget,
                             z.amin(-1, keepdim=True) - 1, z.amax(-1, keepdim=True))
    return (z - tau).clamp(0, 1)


def oracle_tv_prox(z: np.ndarray, lam: float) -> np.ndarray:
    """argmin_y ½‖y − z‖² + lam ‖Dy‖₁ through its dual min_{|u|≤lam} ½‖z − Dᵀu‖², y = z − Dᵀu."""
    n = z.size
    if n <= 1 or lam == 0:
        return z.copy()
    D = np.zeros((n - 1, n))
    D[np.arange(n - 1), np.arange(n - 1)] = -1.0
    D[np.arange(n - 1), np.arange(1, n)] = 1.0
    u = lsq_linear(D.T, z, bounds=(-lam, lam), method="bvls", tol=1e-14).x
    return z - D.T @ u


def oracle_oscar_prox(z: np.ndarray, beta: float) -> np.ndarray:
    """argmin_y ½‖y − z‖² + beta Σ_{i<j} max(|y_i|, |y_j|) (= OWL with w_i = beta (n − i)).

    With y = sign(z)·t, t ≥ 0, and max(t_i, t_j) = max_{λ∈[0,1]} λ t_i + (1 − λ) t_j, the dual
    is min ‖β(Bλ + d) − ν − |z|‖² over λ ∈ [0,1]^pairs, ν ≥ 0, and t = −residual."""
    n = z.size
    if n == 0 or beta == 0:
        return z.copy()
    a = np.abs(z)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    B = np.zeros((n, len(pairs)))
    for c, (i, j) in enumerate(pairs):
        B[i, c], B[j, c] = 1.0, -1.0
    A = np.hstack([beta * B, -np.eye(n)])
    b = a - beta * np.arange(n, dtype=np.float64)
    lower = np.zeros(A.shape[1])
    upper = np.concatenate([np.ones(len(pairs)), np.full(n, np.inf)])
    x = lsq_linear(A, b, bounds=(lower, upper), method="bvls", tol=1e-14).x
    t = np.maximum(b - A @ x, 0.0)
    return np.sign(z) * t


def oracle_sparsemax(y: np.ndarray) -> np.ndarray:
    if y.size == 0:
        return y.copy()
    ordered = np.sort(y)[::-1]
    cumulative = np.cumsum(ordered)
    k = np.arange(1, y.size + 1)
    support = k[1 + k * ordered > cumulative].max()
    tau = (cumulative[support - 1] - 1) / support
    return np.maximum(y - tau, 0.0)


def oracle_rows(X: torch.Tensor, reg: float, kind: str, lengths=None):
    """(p, y) of every row of a 2-D tensor over its valid entries; y is −inf where masked."""
    prox = oracle_tv_prox if kind == "fused" else oracle_oscar_prox
    Xn = X.double().numpy()
    P = np.zeros_like(Xn)
    Y = np.full_like(Xn, -np.inf)
    for r, row in enumerate(Xn):
        length = row.size if lengths is None else int(lengths[r])
        valid = np.isfinite(row) & (np.arange(row.size) < length)
        y = prox(row[valid], reg)
        Y[r, valid] = y
        P[r, valid] = oracle_sparsemax(y)
    return torch.from_numpy(P), torch.from_numpy(Y)
