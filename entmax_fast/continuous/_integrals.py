"""The integral every truncated density reduces to, the dtype it is computed in, and the
autograd half the expectations share (`ExpectationFunction`).

``T_P(z, h) = integral_{-1}^{1} P(y) phi(z + h y) dy`` for polynomials P (phi the standard
normal pdf): the 1-D truncated densities and the radial part of the 2-D sparsemax are such
integrals (docs/maths.md, "Continuous attention", "Expectations of the basis").

Precision: the closed form is a difference of terms of size ``(1 + |z|)^d / h^d`` relative
to the result (``h`` = support half-width over basis width), so every expectation is computed
in float64 (float32 on devices without float64, e.g. MPS) and cast back. Where the support is
narrow compared with the basis (``h (|z| + 5) <= 8``) a Taylor series in ``h`` replaces the
closed form; its truncation error is below 1e-16 relative there. The cost is
``O(batch * num_basis)``, negligible next to the attention.
"""

import math
from typing import Sequence

import torch
from torch import Tensor

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Series branch where h (|z| + 5) <= 8: term n is about (h (|z| + sqrt n))^n / n! relative to
# phi(z), so 48 terms leave < 1e-16. Elsewhere the closed form, whose cancellation
# ((|z| + h) / h)^degree is then harmless except far in the tails (|z| - h > 4), where the
# values themselves are below 1e-6. Against 40-digit quadrature (tests) the absolute error is
# <= 2e-12 for every (z, h) (the integrals are <= 1).
_SERIES_TERMS = 48
_SERIES_RADIUS = 8.0


def integration_dtype(device: torch.device) -> torch.dtype:
    """The dtype the continuous expectations and ridge fits run in on ``device``: float64,
    or float32 where the device has no float64 (MPS). Unlike ``entmax_fast.common.compute_dtype``
    it does not follow the input dtype: the cancellation above needs float64 for every input."""
    return torch.float32 if device.type == "mps" else torch.float64


def _normal_pdf(x: Tensor) -> Tensor:
    return torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _normal_mass(lo: Tensor, hi: Tensor) -> Tensor:
    """Phi(hi) - Phi(lo), taken in the tail where both cdf values are small."""
    upper = lo > 0
    return torch.where(
        upper,
        torch.special.ndtr(-lo) - torch.special.ndtr(-hi),
        torch.special.ndtr(hi) - torch.special.ndtr(lo),
    )


def _series_coefficients(polys: Sequence[Sequence[float]], num_terms: int):
    """[n][p] = integral_{-1}^{1} P_p(y) y^n dy / n!, as Python floats (host constants)."""
    table = []
    for n in range(num_terms):
        row = []
        for poly in polys:
            total = sum(c * 2.0 / (n + k + 1) for k, c in enumerate(poly) if (n + k) % 2 == 0)
            row.append(total / math.factorial(n))
        table.append(row)
    return table


def _poly_gauss_integrals(polys: Sequence[Sequence[float]], z: Tensor, h: Tensor) -> Tensor:
    """integral_{-1}^{1} P_p(y) phi(z + h y) dy for every polynomial p.

    polys: P lists of ascending coefficients in y (equal lengths D+1). z, h: same shape S,
    h > 0. Returns S + [P].
    """
    degree = len(polys[0]) - 1
    use_series = h * (z.abs() + 5.0) <= _SERIES_RADIUS
    h_closed = torch.where(use_series, torch.ones_like(h), h)  # keeps the unused branch finite

    # closed form: moments M_j = int_{lo}^{hi} x^j phi(x) dx, then expand ((x - z)/h)^k
    lo, hi = z - h_closed, z + h_closed
    pdf_lo, pdf_hi = _normal_pdf(lo), _normal_pdf(hi)
    moments = [_normal_mass(lo, hi), pdf_lo - pdf_hi]
    for j in range(2, degree + 1):
        moments.append((j - 1) * moments[j - 2] + lo ** (j - 1) * pdf_lo - hi ** (j - 1) * pdf_hi)
    neg_z = -z
    closed = [torch.zeros_like(z) for _ in polys]
    for k in range(degree + 1):
        y_moment = moments[k].clone()
        for j in range(k):
            y_moment += math.comb(k, j) * neg_z ** (k - j) * moments[j]
        y_moment /= h_closed ** (k + 1)
        for acc, poly in zip(closed, polys):
            if poly[k] != 0.0:
                acc.add_(y_moment, alpha=poly[k])

    # series: phi(z + hy) = phi(z) sum_n y^n t_n / n!, t_n = (-h)^n He_n(z), computed as
    # t_{n+1} = u t_n - n h^2 t_{n-1} with u = -h z (bounded by the branch condition, so no
    # overflow even where phi(z) underflows); the unused branch is zeroed for the same reason
    u = torch.where(use_series, -h * z, torch.zeros_like(z))
    h_sq = torch.where(use_series, h * h, torch.zeros_like(h))
    series = [torch.zeros_like(z) for _ in polys]
    t_prev, t_cur = torch.zeros_like(z), torch.ones_like(z)
    for n, row in enumerate(_series_coefficients(polys, _SERIES_TERMS)):
        for acc, coefficient in zip(series, row):
            if coefficient != 0.0:
                acc.add_(t_cur, alpha=coefficient)
        t_prev, t_cur = t_cur, torch.addcmul(u * t_cur, h_sq, t_prev, value=-n)
    pdf_z = _normal_pdf(z)
    out = [torch.where(use_series, s_p * pdf_z, c_p) for s_p, c_p in zip(series, closed)]
    return torch.stack(out, dim=-1)


class ExpectationFunction(torch.autograd.Function):
    """The autograd half every continuous expectation shares: a forward computes ``E``
    [..., N] with its derivatives with respect to its two differentiable inputs (the mean
    and a variance parameter) and returns through ``_save``; the backward contracts them
    with the incoming gradient. The inputs after those two are constants."""

    @staticmethod
    def _save(ctx, mu, scale, expectation, d_mu, d_scale, param_dims, n_constants):
        """Saves what the backward needs (nothing when neither input needs a gradient) and
        returns ``E`` in the inputs' promoted dtype. ``param_dims``: the number of the
        mean's and the variance parameter's own dims, e.g. (1, 2) for a 2-D mu and Sigma."""
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(d_mu, d_scale)
        ctx.shapes = (mu.shape, scale.shape, mu.dtype, scale.dtype)
        ctx.param_dims = param_dims
        ctx.n_constants = n_constants
        return expectation.to(torch.promote_types(mu.dtype, scale.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        d_mu, d_scale = ctx.saved_tensors
        mu_shape, scale_shape, mu_dtype, scale_dtype = ctx.shapes
        mu_dims, scale_dims = ctx.param_dims
        grad_mu = grad_scale = None
        if ctx.needs_input_grad[0]:
            grad_mu = _parameter_gradient(grad, d_mu, mu_dims, mu_shape, mu_dtype)
        if ctx.needs_input_grad[1]:
            grad_scale = _parameter_gradient(grad, d_scale, scale_dims, scale_shape, scale_dtype)
        return (grad_mu, grad_scale, *(None,) * ctx.n_constants)


def _parameter_gradient(grad: Tensor, derivative: Tensor, param_dims: int, shape: torch.Size,
                        dtype: torch.dtype) -> Tensor:
    """The gradient of a parameter of ``shape`` and ``dtype`` from the gradient ``grad``
    [..., N] of the expectations and their derivatives ``derivative`` [..., N, *d] with
    respect to it (``param_dims`` = len(d)): summed over the N basis functions and over the
    dims the parameter was broadcast along."""
    g = grad.to(derivative.dtype).reshape(grad.shape + (1,) * param_dims)
    return (g * derivative).sum(-1 - param_dims).sum_to_size(shape).to(dtype)
