"""Plain-torch reference of the two other mappings of the ``entmax`` package.

- α-normmax: ``argmax_{p ∈ Δ} pᵀz − ‖p‖_α`` (α > 1). Stationarity gives
  ``p = r / Σr`` with ``r_i = [z_i − τ]_+^{1/(α−1)}`` and ``Σ r_i^α = 1``.
- budget-sparsemax: ``argmax_{0 ≤ p ≤ 1, Σp = b} pᵀz − ½‖p‖²`` → ``p = clip(z − τ, 0, 1)``.

Both thresholds come from safeguarded Newton iteration on a monotone function of τ, stopped
at a tolerance (like ``mappings.entmax_threshold_root``). For budget the function is
piecewise linear, so the last Newton step is exact on the found active set.
Rows are along the last dimension; arithmetic in float64 for float64 input, else float32.
Both shift by the row max first, and follow the entmax mappings' rule for bad values: a row
holding NaN or +inf gives NaN (and NaN gradients), −inf entries get zero weight, a row with
no finite entry gives zeros. ``alpha``/``budget``: a float, or a tensor of one value per row
((R,), or 0-d for every row).
"""
from __future__ import annotations

import torch

from ..common import compute_dtype
from .mappings import finish_rows, on_support, shifted_rows

__all__ = ["normmax_forward", "normmax_backward", "budget_forward", "budget_backward"]


def _safeguarded_newton(value_and_slope, lo, hi, start, max_iter, eps, bisect_every=4):
    """Root of a decreasing function on [lo, hi] per row (keepdim tensors).

    Newton steps that leave the bracket are replaced by bisection, and so is every
    ``bisect_every``-th step, which keeps Newton from cycling on a piecewise-linear function
    (budget). ``bisect_every=None``: only the former, for a convex function started left of
    its root, where Newton climbs monotonically to the root and forced bisections only slow
    it down (normmax: 6 to 10 steps instead of 16 to 40 on rows of 50, α from 1.01 to 1000).
    """
    tau = start
    done = torch.zeros_like(tau, dtype=torch.bool)
    for it in range(max_iter):
        f, slope = value_and_slope(tau)
        lo = torch.where(f > 0, tau, lo)
        hi = torch.where(f > 0, hi, tau)
        newton = tau - f / torch.where(slope < 0, slope, -torch.ones_like(slope))
        resolution = 2 * eps * tau.abs().clamp(min=1)
        done = done | (f == 0) | ((newton - tau).abs() <= resolution) | (hi - lo <= 2 * resolution)
        use_newton = (slope < 0) & (newton >= lo) & (newton <= hi)
        if bisect_every is not None and it % bisect_every == bisect_every - 1:
            use_newton = torch.zeros_like(use_newton)
        tau = torch.where(done, tau, torch.where(use_newton, newton, (lo + hi) / 2))
        # CPU only: stopping early costs no device sync there; on a GPU the loop runs its
        # bounded length so that the op stays capturable.
        if tau.device.type == "cpu" and it % 2 == 1 and bool(done.all()):
            break
    return tau


def _per_row(parameter, dtype: torch.dtype):
    """A float as it is; a tensor of one value per row as a column, to broadcast along rows."""
    return parameter.to(dtype).reshape(-1, 1) if isinstance(parameter, torch.Tensor) else parameter


def normmax_forward(X: torch.Tensor, alpha) -> torch.Tensor:
    cdt = compute_dtype(X.dtype)
    alpha = _per_row(alpha, cdt)
    u, empty_row, invalid = shifted_rows(X, -1)
    row_max = u.amax(-1, keepdim=True)
    power = alpha / (alpha - 1)
    n = (~torch.isneginf(u)).sum(-1, keepdim=True).clamp(min=1).to(cdt)

    def value_and_slope(tau):
        d = (u - tau).clamp(min=0)
        return d.pow(power).sum(-1, keepdim=True) - 1, -power * d.pow(power - 1).sum(-1, keepdim=True)

    lo = -torch.ones_like(row_max)
    hi = -n.pow(-1 / power)
    eps = torch.finfo(cdt).eps
    # Σ [u − τ]_+^{α/(α−1)} is convex in τ (the exponent is > 1) and ≥ 1 at τ = −1 (the max
    # entry alone gives 1): Newton from there never leaves the bracket.
    tau = _safeguarded_newton(value_and_slope, lo, hi, lo.clone(), 4 * (160 if cdt == torch.float64 else 80), eps,
                              bisect_every=None)
    r = (u - tau).clamp(min=0).pow(1 / (alpha - 1))
    total = r.sum(-1, keepdim=True)
    p = r / torch.where(total > 0, total, torch.ones_like(total))
    return finish_rows(p, empty_row, invalid).to(X.dtype)


def normmax_backward(p: torch.Tensor, grad: torch.Tensor, alpha) -> torch.Tensor:
    """VJP of normmax from its output, by implicit differentiation of the stationarity
    conditions on the support (same closed form as the ``entmax`` package)."""
    cdt = compute_dtype(p.dtype)
    alpha = _per_row(alpha, cdt)
    p, g = p.to(cdt), grad.to(cdt)
    a = torch.where(p > 0, p, torch.zeros_like(p))
    b = torch.where(p > 0, on_support(p).pow(2 - alpha), torch.zeros_like(p))
    dX = g * b
    dX = dX - dX.sum(-1, keepdim=True) * a
    dX = dX - (g * a).sum(-1, keepdim=True) * (b - b.sum(-1, keepdim=True) * a)
    dX = dX * a.pow(alpha).sum(-1, keepdim=True).pow((alpha - 1) / alpha) / (alpha - 1)
    return _nan_rows_stay_nan(p, dX).to(grad.dtype)


def _nan_rows_stay_nan(p: torch.Tensor, dX: torch.Tensor) -> torch.Tensor:
    nan_row = torch.isnan(p).any(-1, keepdim=True)
    return torch.where(nan_row, torch.full_like(dX, float("nan")), dX)


def budget_forward(X: torch.Tensor, budget) -> torch.Tensor:
    cdt = compute_dtype(X.dtype)
    z, empty_row, invalid = shifted_rows(X, -1)
    b = _per_row(budget, cdt) if isinstance(budget, torch.Tensor) else torch.tensor(float(budget), dtype=cdt,
                                                                                    device=z.device)
    finite = ~torch.isneginf(z)
    n = finite.sum(-1, keepdim=True).to(cdt)
    big = torch.finfo(cdt).max
    row_max = torch.where(finite, z, torch.full_like(z, -big)).amax(-1, keepdim=True)
    row_min = torch.where(finite, z, torch.full_like(z, big)).amin(-1, keepdim=True)
    n_safe = n.clamp(min=1)

    def value_and_slope(tau):
        p = (z - tau).clamp(0, 1)
        active = (z - tau > 0) & (z - tau < 1)
        return p.sum(-1, keepdim=True) - b, -active.sum(-1, keepdim=True).to(cdt)

    lo = row_min - b / n_safe
    hi = row_max - b / n_safe
    eps = torch.finfo(cdt).eps
    tau = _safeguarded_newton(value_and_slope, lo, hi, lo.clone(), 4 * (160 if cdt == torch.float64 else 80), eps)
    # Budget 0 leaves p = 0 the only feasible point, which the threshold, exact only to
    # rounding, could miss by leaving the top entry a rounding error above 0.
    p = torch.where(b == 0, torch.zeros_like(z), (z - tau).clamp(0, 1))
    return finish_rows(p, empty_row, invalid).to(X.dtype)


def budget_backward(p: torch.Tensor, grad: torch.Tensor, budget=None) -> torch.Tensor:
    """VJP of budget-sparsemax; the Jacobian depends only on the active set (0 < p < 1), so
    ``budget`` is accepted for the uniform backend contract and not needed."""
    cdt = compute_dtype(p.dtype)
    p, g = p.to(cdt), grad.to(cdt)
    active = (p > 0) & (p < 1)
    count = active.sum(-1, keepdim=True).to(cdt)
    mean = torch.where(active, g, torch.zeros_like(g)).sum(-1, keepdim=True) / count.clamp(min=1)
    return _nan_rows_stay_nan(p, torch.where(active, g - mean, torch.zeros_like(g))).to(grad.dtype)
