"""Plain-torch reference of the α-entmax mappings: the ground truth for every backend.

Every mapping solves, row by row, ``p = argmax_{p ∈ Δ} pᵀz + H_α(p)`` with the Tsallis
α-entropy ``H_α(p) = (1 − Σ p_i^α) / (α(α − 1))`` (Shannon's entropy at α = 1).

The threshold is kept in a shift-invariant form that is continuous at α = 1:

    u = z − max(z),    p_i = [1 + (α − 1)(u_i − μ)]_+ ^ (1/(α − 1)),

with ``μ ∈ [0, (1 − n^{1−α}) / (α − 1)]`` (n = number of finite entries) chosen so that
``Σ p = 1``. At α → 1 this is ``exp(u_i − μ)`` with μ the log-sum-exp. The τ of
docs/maths.md ("Threshold of the row-wise mappings") is ``(α − 1)(max z + μ) − 1``.

- α = 2 and α = 1.5 (python floats): exact, by sorting (``sparsemax_threshold``,
  ``entmax15_threshold``).
- any other α > 0, α ≠ 1 (float or one per row): safeguarded Newton on μ to a tolerance,
  then exact normalisation on the found support (``entmax_threshold_root``).
- α = 1: ``torch.softmax``.

Every mapping shifts by the row max first and computes p from ``u``, never from ``X``: a
score of 1e30 and one of 1 give the same p as scores of 1e30 − 1 and 0 would in exact
arithmetic, as far as the input dtype resolves them.

Every threshold is found, and p formed from it, in float64 whatever the input dtype; the
output has the input's dtype. In float32 the threshold's rounding would be shared by every
entry of the support, so that a wide row's sum drifts by about support size × ulp (1 + 2.7e-4
for sparsemax of 10007 zeros), and the general-α exponent 1/(α − 1) amplifies it further
(1e4-fold at α = 1.0001). Softmax runs in ``compute_dtype`` (its normalisation is a division).

Bad input follows ``torch.softmax``: a row holding NaN or +inf gives an all-NaN row (and
NaN gradients); −inf entries get zero weight; a row with no finite entry gives zeros (and
zero gradients). Nothing here syncs with the host when the input lives on a GPU.
"""
from __future__ import annotations

import torch

from ..common import compute_dtype

__all__ = [
    "sparsemax_threshold",
    "entmax15_threshold",
    "entmax_threshold_root",
    "entmax_forward",
    "entmax_backward",
    "entmax_rowwise_forward",
    "entmax_rowwise_backward",
    "tsallis_entropy",
]


def invalid_rows(X: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows (keepdim along ``dim``) holding a NaN or +inf: their output is all NaN."""
    return (torch.isnan(X) | torch.isposinf(X)).any(dim=dim, keepdim=True)


def shifted_rows(X: torch.Tensor, dim: int, dtype: torch.dtype | None = None):
    """u = X − max(X) in the compute dtype (or ``dtype``), with the rows to zero (no finite
    entry) and the rows to make NaN (a NaN or +inf entry) flagged. Flagged rows get u = 0
    or −inf entries only, so that the solvers run on them without NaN."""
    X = X.to(dtype or compute_dtype(X.dtype))
    invalid = invalid_rows(X, dim)
    X = torch.where(invalid, torch.zeros_like(X), X)
    row_max = X.amax(dim=dim, keepdim=True)
    empty_row = torch.isneginf(row_max)
    # An all −inf row would give (−inf) − (−inf) = NaN; shift it by 0 and zero it later.
    u = X - torch.where(empty_row, torch.zeros_like(row_max), row_max)
    return u, empty_row, invalid


def finish_rows(p: torch.Tensor, empty_row: torch.Tensor, invalid: torch.Tensor) -> torch.Tensor:
    """p with the rows :func:`shifted_rows` flagged set: zeros where empty, NaN where invalid."""
    p = torch.where(empty_row, torch.zeros_like(p), p)
    return torch.where(invalid, torch.full_like(p, float("nan")), p)


def _alpha_like(alpha, ref: torch.Tensor) -> torch.Tensor:
    if isinstance(alpha, torch.Tensor):
        return alpha.to(device=ref.device, dtype=ref.dtype)
    return torch.tensor(float(alpha), device=ref.device, dtype=ref.dtype)


def _sparsemax_shifted_threshold(u: torch.Tensor, dim: int):
    """Sparsemax threshold of rows already shifted to max 0: ``(tau_u, support_size)``
    with ``sparsemax = [u − tau_u]_+``."""
    u_sorted = torch.sort(u, dim=dim, descending=True).values
    # Only entries above max − 1 can be in the support; masking the rest keeps −inf and
    # huge magnitudes out of the prefix sums.
    candidate = u_sorted > -1
    u_cand = torch.where(candidate, u_sorted, torch.zeros_like(u_sorted))
    prefix_sum = u_cand.cumsum(dim)
    shape = [1] * u.dim()
    shape[dim] = -1
    k = torch.arange(1, u.shape[dim] + 1, device=u.device, dtype=u.dtype).view(shape)
    in_support = candidate & (1 + k * u_sorted > prefix_sum)
    support_size = in_support.sum(dim=dim, keepdim=True)
    last = (support_size - 1).clamp(min=0)
    tau_u = (prefix_sum.gather(dim, last) - 1) / support_size.clamp(min=1).to(u.dtype)
    return tau_u, support_size


def _unshift(tau_u, X, empty_row, dim, factor=1.0):
    row_max = X.to(tau_u.dtype).amax(dim=dim, keepdim=True)
    return torch.where(empty_row, torch.zeros_like(tau_u), tau_u + torch.where(empty_row, 0, row_max) * factor)


def sparsemax_threshold(X: torch.Tensor, dim: int = -1):
    """Exact sparsemax threshold by sorting.

    Returns ``(tau, support_size)`` with ``sparsemax(X) = [X − tau]_+`` (tau in the
    compute dtype, keepdim along ``dim``). Rows without finite entries get support 0.
    For scores far from 0, tau is rounded at the scale of max(X): ``entmax_forward``
    works on ``X − max(X)`` instead.
    """
    u, empty_row, _ = shifted_rows(X, dim)
    tau_u, support_size = _sparsemax_shifted_threshold(u, dim)
    return _unshift(tau_u, X, empty_row, dim), support_size


def _entmax15_shifted_threshold(u: torch.Tensor, dim: int):
    """1.5-entmax threshold of rows shifted to max 0: ``(tau_u, support_size)`` with
    ``entmax15 = [u/2 − tau_u]_+²`` (docs/maths.md, "Threshold of the row-wise mappings")."""
    y_sorted = torch.sort(u / 2, dim=dim, descending=True).values
    candidate = y_sorted > -1
    y_cand = torch.where(candidate, y_sorted, torch.zeros_like(y_sorted))
    shape = [1] * u.dim()
    shape[dim] = -1
    k = torch.arange(1, u.shape[dim] + 1, device=u.device, dtype=u.dtype).view(shape)
    mean = y_cand.cumsum(dim) / k
    mean_sq = (y_cand * y_cand).cumsum(dim) / k
    ss = k * (mean_sq - mean * mean)
    delta = ((1 - ss) / k).clamp(min=0)
    tau_k = mean - torch.sqrt(delta)
    in_support = candidate & (tau_k <= y_sorted)
    support_size = in_support.sum(dim=dim, keepdim=True)
    tau_u = tau_k.gather(dim, (support_size - 1).clamp(min=0))
    return tau_u, support_size


def entmax15_threshold(X: torch.Tensor, dim: int = -1):
    """Exact 1.5-entmax threshold by sorting (docs/maths.md, "Threshold of the row-wise mappings").

    Returns ``(tau, support_size)`` with ``entmax15(X) = [X/2 − tau]_+²`` (rounded at the
    scale of max(X), as ``sparsemax_threshold``).
    """
    u, empty_row, _ = shifted_rows(X, dim)
    tau_u, support_size = _entmax15_shifted_threshold(u, dim)
    return _unshift(tau_u, X, empty_row, dim, factor=0.5), support_size


def _max_root_iterations(dtype: torch.dtype) -> int:
    # The safeguard makes the step at least halve every two iterations; this bound takes any
    # bracket below the dtype's resolution.
    return 2 * (160 if dtype == torch.float64 else 80)


def entmax_threshold_root(X: torch.Tensor, alpha, dim: int = -1, tol: float | None = None):
    """μ of α-entmax (module docstring) by safeguarded Newton iteration.

    Stops per row when ``|Σp − 1| ≤ tol`` (default: 4·eps of the compute dtype), when the
    Newton step or the bracket is below the dtype's resolution at μ. Newton steps that leave
    the bracket, or that are not at least half the step before last, are replaced by
    bisection (rtsafe), which bounds the number of steps.
    α must be > 0 and ≠ 1 (broadcastable to X with size 1 along ``dim``).
    Runs in float64 whatever X's dtype. Returns ``(mu, u, empty_row)``; rows holding NaN or
    +inf are solved as if they held zeros (``entmax_forward`` makes them NaN).
    """
    u, empty_row, _ = shifted_rows(X, dim, torch.float64)
    a = _alpha_like(alpha, u)
    am1 = a - 1
    exponent = 1 / am1
    n_valid = (~torch.isneginf(u)).sum(dim=dim, keepdim=True).clamp(min=1).to(u.dtype)
    lo = torch.zeros_like(n_valid * am1)
    hi = (1 - n_valid.pow(-am1)) / am1
    eps = torch.finfo(u.dtype).eps
    if tol is None:
        tol = 4 * eps
    mu = lo.clone()
    done = torch.zeros_like(lo, dtype=torch.bool) | empty_row
    step_before_last = hi - lo
    last_step = step_before_last.clone()
    check_every = 2 if u.device.type == "cpu" and not torch.compiler.is_compiling() else 0
    for it in range(_max_root_iterations(u.dtype)):
        q = (1 + am1 * (u - mu)).clamp(min=0)
        p = q.pow(exponent)
        f = p.sum(dim=dim, keepdim=True) - 1
        # q^(e−1) = p / q on the support: one pow per iteration instead of two.
        slope = -torch.where(q > 0, p / q.clamp(min=torch.finfo(q.dtype).tiny), torch.zeros_like(q)).sum(
            dim=dim, keepdim=True)
        lo = torch.where(f > 0, mu, lo)
        hi = torch.where(f > 0, hi, mu)
        newton = mu - f / torch.where(slope < 0, slope, -torch.ones_like(slope))
        resolution = 2 * eps * mu.abs().clamp(min=1)
        converged = (f.abs() <= tol) | ((newton - mu).abs() <= resolution) | (hi - lo <= 2 * resolution)
        done = done | converged
        # rtsafe's safeguard: bisect when Newton leaves the bracket or the step did not at
        # least halve over the last two steps, so the bracket keeps shrinking.
        too_slow = (2 * f).abs() > (step_before_last * slope).abs()
        use_newton = (slope < 0) & (newton > lo) & (newton < hi) & ~too_slow
        step = torch.where(use_newton, newton, (lo + hi) / 2)
        step_before_last = last_step
        last_step = (step - mu).abs()
        mu = torch.where(done, mu, step)
        # CPU only: stopping early costs no device sync there; on a GPU the loop runs its
        # bounded length so that the op stays capturable.
        if check_every and it % check_every == check_every - 1 and bool(done.all()):
            break
    return mu, u, empty_row


def _softmax(X: torch.Tensor, dim: int) -> torch.Tensor:
    u, empty_row, invalid = shifted_rows(X, dim)
    return finish_rows(torch.softmax(u, dim=dim), empty_row, invalid)


def _entmax_root(X: torch.Tensor, alpha, dim: int) -> torch.Tensor:
    mu, u, empty_row = entmax_threshold_root(X, alpha, dim)
    a = _alpha_like(alpha, u)
    p = (1 + (a - 1) * (u - mu)).clamp(min=0).pow(1 / (a - 1))
    total = p.sum(dim=dim, keepdim=True)
    p = p / torch.where(total > 0, total, torch.ones_like(total))
    return finish_rows(p, empty_row, invalid_rows(X, dim)).to(compute_dtype(X.dtype))


def entmax_forward(X: torch.Tensor, alpha=1.5, dim: int = -1) -> torch.Tensor:
    """α-entmax of X along ``dim``; ``alpha`` a float or a tensor broadcastable to X with
    size 1 along ``dim`` (any value > 0; 1 is softmax). Output in X's dtype."""
    out_dtype = X.dtype
    if not isinstance(alpha, torch.Tensor):
        alpha = float(alpha)
        if alpha == 2.0:
            u, empty_row, invalid = shifted_rows(X, dim, torch.float64)
            tau_u, _ = _sparsemax_shifted_threshold(u, dim)
            p = finish_rows((u - tau_u).clamp(min=0), empty_row, invalid)
        elif alpha == 1.5:
            u, empty_row, invalid = shifted_rows(X, dim, torch.float64)
            tau_u, _ = _entmax15_shifted_threshold(u, dim)
            p = finish_rows((u / 2 - tau_u).clamp(min=0).square(), empty_row, invalid)
        elif alpha == 1.0:
            p = _softmax(X, dim)
        else:
            p = _entmax_root(X, alpha, dim)
        return p.to(out_dtype)
    a = alpha.to(device=X.device, dtype=compute_dtype(X.dtype))
    is_softmax = a == 1
    p = _entmax_root(X, torch.where(is_softmax, torch.full_like(a, 2.0), a), dim)
    p = torch.where(is_softmax, _softmax(X, dim), p)
    return p.to(out_dtype)


def on_support(p: torch.Tensor) -> torch.Tensor:
    """p with the entries outside the support replaced by 1: a pow or log of it stays finite,
    and so do their derivatives, which double backward evaluates even where masked."""
    return torch.where(p > 0, p, torch.ones_like(p))


def _weights_of_jacobian(p: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """s = p^(2−α) on the support, 0 elsewhere (docs/maths.md, "Backward")."""
    return torch.where(p > 0, on_support(p).pow(2 - a), torch.zeros_like(p))


def entmax_backward(p: torch.Tensor, grad: torch.Tensor, alpha=1.5, dim: int = -1,
                    need_alpha_grad: bool = True):
    """Vector–Jacobian products of α-entmax from its output ``p`` (docs/maths.md, "Backward"
    and "Gradient of alpha").

    Returns ``(dX, dalpha)``: dX like ``grad`` (in p's compute dtype cast back to grad's
    dtype), dalpha keepdim along ``dim`` (un-reduced over broadcast dimensions of alpha) or
    None. At α = 1 dalpha is the exact limit ``∂p/∂α = −½ (p ⊙ log²p − p Σ_j p_j log² p_j)``.
    """
    cdt = compute_dtype(p.dtype)
    p = p.to(cdt)
    g = grad.to(cdt)
    a = _alpha_like(alpha, p)
    s = _weights_of_jacobian(p, a)
    s_sum = s.sum(dim=dim, keepdim=True)
    s_sum_safe = torch.where(s_sum > 0, s_sum, torch.ones_like(s_sum))
    dX = s * g - s * (s * g).sum(dim=dim, keepdim=True) / s_sum_safe
    # A NaN row (NaN or +inf input) passes NaN on, as torch.softmax's backward does.
    nan_row = torch.isnan(p).any(dim=dim, keepdim=True)
    dX = torch.where(nan_row, torch.full_like(dX, float("nan")), dX)
    dalpha = None
    if need_alpha_grad:
        # Float64 on p renormalised there: the two terms below are O(1/(α−1)) and cancel,
        # and a p that sums to 1 only to float32 rounding would leave (Σp − 1)/(α−1)²,
        # O(1) at α = 1.0001.
        p64 = p.to(torch.float64)
        total = p64.sum(dim=dim, keepdim=True)
        p64 = p64 / torch.where(total > 0, total, torch.ones_like(total))
        g64 = g.to(torch.float64)
        a64 = a.to(torch.float64)
        s64 = _weights_of_jacobian(p64, a64)
        s64_sum = s64.sum(dim=dim, keepdim=True)
        log_p = torch.where(p64 > 0, torch.log(on_support(p64)), torch.zeros_like(p64))
        is_softmax = a64 == 1
        am1 = torch.where(is_softmax, torch.ones_like(a64), a64 - 1)
        p_skewed = s64 / torch.where(s64_sum > 0, s64_sum, torch.ones_like(s64_sum))
        h = -p64 * log_p
        dp_dalpha = (p64 - p_skewed) / am1.square() + (h - p_skewed * h.sum(dim=dim, keepdim=True)) / am1
        p_log_sq = p64 * log_p.square()
        log_sq_mean = p_log_sq.sum(dim=dim, keepdim=True)
        dp_dalpha_at_1 = -0.5 * (p_log_sq - p64 * log_sq_mean)
        # Plus (α − 1)·E, zero in value, for double backward in α at α = 1: autograd gets
        # the part of ∂²p/∂α² = 2p(c − Σ p c) (c = −½ L₂ log p + ⅓ log³p + ⅛ (L₂ − log²p)²,
        # L₂ = Σ p log²p) that flows through p in the line above; E is the rest.
        c = -0.5 * log_sq_mean * log_p + log_p.pow(3) / 3 + (log_sq_mean - log_p.square()).square() / 8
        d2p_dalpha2 = 2 * p64 * (c - (p64 * c).sum(dim=dim, keepdim=True))
        through_p = (dp_dalpha_at_1 * (0.5 * log_sq_mean - 0.5 * log_p.square() - log_p)
                     + 0.5 * p64 * ((log_p.square() + 2 * log_p) * dp_dalpha_at_1).sum(dim=dim, keepdim=True))
        dp_dalpha_at_1 = dp_dalpha_at_1 + (a64 - 1) * (d2p_dalpha2 - through_p).detach()
        dp_dalpha = torch.where(is_softmax, dp_dalpha_at_1, dp_dalpha)
        dalpha = (g64 * dp_dalpha).sum(dim=dim, keepdim=True).to(cdt)
        dalpha = torch.where(nan_row, torch.full_like(dalpha, float("nan")), dalpha)
    return dX.to(grad.dtype), dalpha


def entmax_rowwise_forward(x: torch.Tensor, alpha) -> torch.Tensor:
    """Backend contract of the row-wise op: x (R, n), alpha float or tensor (R,)."""
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.view(-1, 1)
    return entmax_forward(x, alpha, dim=-1)


def entmax_rowwise_backward(p: torch.Tensor, grad: torch.Tensor, alpha, need_alpha_grad: bool):
    """Backend contract of the row-wise op: returns (dx (R, n), dalpha (R,) or None)."""
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.view(-1, 1)
    dx, dalpha = entmax_backward(p, grad, alpha, dim=-1, need_alpha_grad=need_alpha_grad)
    return dx, (dalpha.view(-1) if dalpha is not None else None)


def tsallis_entropy(p: torch.Tensor, alpha, dim: int = -1) -> torch.Tensor:
    """H_α(p) = (1 − Σ p^α)/(α(α−1)); Shannon's −Σ p log p at α = 1. Differentiable in α."""
    cdt = compute_dtype(p.dtype)
    p = p.to(cdt)
    a = _alpha_like(alpha, p)
    is_shannon = a == 1
    a_safe = torch.where(is_shannon, torch.full_like(a, 2.0), a)
    p_pow = torch.where(p > 0, on_support(p).pow(a_safe), torch.zeros_like(p))
    tsallis = (1 - p_pow.sum(dim=dim, keepdim=True)) / (a_safe * (a_safe - 1))
    log_p = torch.where(p > 0, torch.log(on_support(p)), torch.zeros_like(p))
    shannon = -(p * log_p).sum(dim=dim, keepdim=True)
    return torch.where(is_shannon, shannon, tsallis).squeeze(dim)

