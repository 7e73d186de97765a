"""Float64 oracles, computed by methods independent of the reference's.

- entmax: plain bisection on the threshold τ of docs/maths.md (no sorting, no Newton): the
  bracket [max x − 1, max x − n^{1−α}] halved in float64 until it is two neighbouring doubles
  (at most 200 times), then normalisation.
- attention: the dense composition scores → oracle entmax → weights @ V in float64, with the
  score options (softcap, ALiBi, window, lower-right causal masks, sinks) written from their
  definitions as dense (Lq, Lk) tensors.
- gradients: autograd through the dense composition. The bisection's threshold is taken as a
  constant plus one Newton step from it, which leaves its value and gives it the implicit
  function's derivative (with respect to the scores and α), not the hand-written backward
  formula of the implementations.
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
    # −inf entries (masked keys) stay out of the support through `masked` below, not through
    # x = −inf: its derivative in α would be −inf, and 0·(−inf) is NaN in the backward.
    masked = torch.isneginf(X)
    x = (a_safe - 1) * torch.where(masked, torch.zeros_like(X), X - row_max)
    lo = torch.minimum(-torch.ones_like(a), -n.pow(1 - a_safe))
    hi = torch.maximum(-torch.ones_like(a), -n.pow(1 - a_safe))

    # A float α gives a python exponent: torch's pow then takes its fast paths (1, 2, ...).
    exponent = 1 / (a_safe - 1) if isinstance(alpha, torch.Tensor) or alpha == 1 else 1 / (float(alpha) - 1)

    def power(tau, exponent):
        """[x − τ]_+^exponent, 0 off the support. The power is taken of 1 there, so that no
        derivative of it is evaluated at 0 (0·log 0 would be NaN)."""
        inner = (x - tau).clamp(min=0)
        inside = (inner > 0) & ~masked
        return torch.where(inside, torch.where(inside, inner, torch.ones_like(inner)).pow(exponent),
                           torch.zeros_like(inner))

    def mass(tau):
        # α < 1: every finite entry is inside (inner > 0).
        return power(tau, exponent)

    # f(τ) = Σ mass − 1 is decreasing in τ for α > 1 and increasing for α < 1.
    increasing = a_safe < 1
    # The bracket is searched without a graph: only the last Newton step below carries one.
    lo, hi = lo.detach(), hi.detach()
    with torch.no_grad():
        for _ in range(200):
            mid = (lo + hi) / 2
            if bool(((mid == lo) | (mid == hi)).all()):
                break  # every bracket is down to two neighbouring doubles
            f = mass(mid).sum(-1, keepdim=True) - 1
            go_right = (f > 0) ^ increasing
            lo = torch.where(go_right, mid, lo)
            hi = torch.where(go_right, hi, mid)
    tau = (lo + hi) / 2
    if torch.is_grad_enabled() and (x.requires_grad or isinstance(exponent, torch.Tensor) and exponent.requires_grad):
        # One Newton step from the root moves it by f(τ)/f'(τ) ≈ 0 and has the derivative of
        # the root itself (implicit function theorem): τ(z, α) is differentiable this way.
        slope = (exponent * power(tau, exponent - 1)).sum(-1, keepdim=True)
        tau = tau + (mass(tau).sum(-1, keepdim=True) - 1) / torch.where(slope > 0, slope, torch.ones_like(slope))
    p = mass(tau)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)
    p = torch.where(is_softmax, softmax, p)
    p = torch.where(empty, torch.zeros_like(p), p)
    return p.movedim(-1, dim)


def attention_leaves(q, k, v, alpha, options):
    """The tensors an attention call differentiates: q, k, v, a tensor α, the sinks."""
    leaves = [q, k, v]
    if isinstance(alpha, torch.Tensor):
        leaves.append(alpha)
    if options.get("sinks") is not None:
        leaves.append(options["sinks"])
    return leaves


def as_float64(tensors):
    """Float64 copies, leaves again where the originals require grad (the oracle's inputs)."""
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def oracle_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, alpha=1.5, *,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """Dense float64 entmax attention (no dropout); GQA by repeating key/value heads.

    attn_mask: bool, float, or a torch.nn.attention.bias.CausalBias (upper-left: j ≤ i;
    lower-right: j ≤ i + Lk − Lq). Scores: scale, softcap·tanh(s/softcap), −slope·|pos − j|
    with pos = i + Lk − Lq, the float mask, the boolean masks and the window
    pos − left ≤ j ≤ pos + right (−1 unbounded); then each head's sink logit is appended as
    a key with a zero value, and its weight dropped after the mapping."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    q, k, v = (t.to(torch.float64) for t in (query, key, value))
    batch, heads, lq = q.shape[:3]
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    lk = k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(lq).view(-1, 1)
    j = torch.arange(lk).view(1, -1)
    pos = i + lk - lq
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float64).reshape(-1 if alibi_slopes.dim() == 1 else batch, heads)
        distance = (pos - j).abs().to(torch.float64)
        scores = scores - slopes.view(slopes.shape[0], heads, 1, 1) * distance
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if isinstance(attn_mask, CausalBias):
        if attn_mask.variant == CausalVariant.UPPER_LEFT:
            allowed &= j <= i
        else:
            allowed &= j <= pos
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(torch.float64)
    if is_causal:
        allowed &= j <= i
    left, right = window_size
    if left >= 0:
        allowed &= j >= pos - left
    if right >= 0:
        allowed &= j <= pos + right
    scores = scores.masked_fill(~allowed, -math.inf)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(torch.float64).reshape(-1).expand(heads).view(1, -1, 1, 1)
    if sinks is None:
        return oracle_entmax(scores, alpha, dim=-1) @ v
    sink_column = sinks.to(torch.float64).view(1, heads, 1, 1).expand(scores.shape[0], heads, lq, 1)
    weights = oracle_entmax(torch.cat([scores, sink_column], dim=-1), alpha, dim=-1)
    return weights[..., :lk] @ v


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
