"""2-D continuous densities over t in R^2 and their expected basis ``E_p[psi(t)]``.

The score is ``f(t) = -(t - mu)^T Sigma^-1 (t - mu) / 2``; continuous softmax gives
``p = N(mu, Sigma)`` (closed form), continuous sparsemax the truncated paraboloid (radial
integral in closed form, angular one by the trapezoid rule, with an error bound). The basis
is isotropic Gaussian RBFs ``psi_j = N(m_j, s_j^2 I)``.
"""

import math
from typing import Tuple

import torch
from torch import Tensor

from ._checks import (check_basis_2d, check_num_angles, check_params_2d, check_positive, check_sigma_2d,
                      check_sigma_shape_2d, check_tensor)
from ._integrals import ExpectationFunction, _poly_gauss_integrals, integration_dtype


def _sym_entries(sigma: Tensor, work: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """(a, b, d) of (sigma + sigma^T) / 2 = [[a, b], [b, d]], in ``work`` dtype."""
    s = sigma.to(work)
    return s[..., 0, 0], 0.5 * (s[..., 0, 1] + s[..., 1, 0]), s[..., 1, 1]


def _symmetric_2x2(x11: Tensor, x12: Tensor, x22: Tensor) -> Tensor:
    """[[x11, x12], [x12, x22]] stacked into the last two dims."""
    return torch.stack([torch.stack([x11, x12], -1), torch.stack([x12, x22], -1)], -2)


class _ContinuousSoftmax2d(ExpectationFunction):
    @staticmethod
    def forward(ctx, mu, sigma, centers, variances):
        work = integration_dtype(mu.device)
        a, b, d = (x[..., None] for x in _sym_entries(sigma, work))  # [..., 1]
        v = variances.to(work)
        ca, cd = a + v, d + v  # C = sigma + s_j^2 I: [..., N]
        cb = b.expand_as(ca)
        det = ca * cd - cb * cb
        delta = mu.to(work)[..., None, :] - centers.to(work)  # [..., N, 2]
        y1 = (cd * delta[..., 0] - cb * delta[..., 1]) / det  # C^-1 delta
        y2 = (ca * delta[..., 1] - cb * delta[..., 0]) / det
        expectation = torch.exp(-0.5 * (delta[..., 0] * y1 + delta[..., 1] * y2)) / (2 * math.pi * torch.sqrt(det))
        y = torch.stack([y1, y2], -1)
        c_inv = _symmetric_2x2(cd, -cb, ca) / det[..., None, None]
        d_mu = -expectation[..., None] * y
        d_sigma = 0.5 * expectation[..., None, None] * (y[..., :, None] * y[..., None, :] - c_inv)
        return ExpectationFunction._save(ctx, mu, sigma, expectation, d_mu, d_sigma, (1, 2), n_constants=2)


def continuous_softmax_2d(mu: Tensor, sigma: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` for p = N(mu, Sigma) on R^2 (Shannon-regularised maximiser of E_p[f],
    ``f(t) = -(t - mu)^T Sigma^-1 (t - mu) / 2``) and psi_j = N(m_j, s_j^2 I), in closed form
    ``N(mu; m_j, Sigma + s_j^2 I)``.

    Args:
        mu: ``[..., 2]``.
        sigma: ``[..., 2, 2]`` symmetric positive definite (its symmetric part is used; the
            gradient returned for it is symmetric).
        basis_centers: ``[N, 2]``.
        basis_variances: ``[N]`` (s_j^2).

    Returns:
        ``[..., N]``, differentiable w.r.t. mu and sigma (closed form).

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> mu, sigma = torch.tensor([0.5, 0.5], dtype=torch.float64), 0.02 * torch.eye(2, dtype=torch.float64)
        >>> centers = torch.tensor([[0.5, 0.5], [0.25, 0.5]], dtype=torch.float64)
        >>> variances = torch.tensor([0.01, 0.01], dtype=torch.float64)
        >>> continuous.continuous_softmax_2d(mu, sigma, centers, variances)
        tensor([5.3052, 1.8720], dtype=torch.float64)
    """
    check_params_2d(mu, sigma)
    check_basis_2d(basis_centers, basis_variances)
    return _ContinuousSoftmax2d.apply(mu, sigma, basis_centers, basis_variances)


def _cholesky_entries(a: Tensor, b: Tensor, d: Tensor):
    l11 = torch.sqrt(a)
    l21 = b / l11
    l22 = torch.sqrt(d - l21 * l21)
    return l11, l21, l22


# radial weights (1 + y)^(k+1), k = 0, 1, 2, for r = rho (1 + y) / 2 (ascending powers of y)
_RADIAL_POLYS = ((1.0, 1.0, 0.0, 0.0), (1.0, 2.0, 1.0, 0.0), (1.0, 3.0, 3.0, 1.0))


class _ContinuousSparsemax2d(ExpectationFunction):
    """Truncated paraboloid ``p(t) = (rho^2 - |u|^2)_+ / 2``, u = L^-1 (t - mu), Sigma = L L^T,
    ``rho^4 = 4 / (pi |L|)``. With D0 = |L| int_disk psi du, D_u = |L| int_disk psi u du,
    D_uu = |L| int_disk psi u u^T du (polar: radial integral in closed form, angles by the
    trapezoid rule):
        E = (rho^2 D0 - tr D_uu) / 2,
        dE/dmu = L^-T D_u,
        dE/dSigma = L^-T (D_uu - rho^2 D0 I / 4) L^-1 / 2
    (the support moves with mu and Sigma, but p vanishes on its boundary).
    """

    @staticmethod
    def forward(ctx, mu, sigma, centers, variances, num_angles):
        work = integration_dtype(mu.device)
        a, b, d = _sym_entries(sigma, work)
        l11, l21, l22 = (x[..., None, None] for x in _cholesky_entries(a, b, d))  # [..., 1, 1]
        det_l = l11 * l22
        rho_sq = 2.0 / torch.sqrt(math.pi * det_l)
        rho = torch.sqrt(rho_sq)
        theta = torch.arange(num_angles, dtype=work, device=mu.device) * (2 * math.pi / num_angles)
        cos, sin = torch.cos(theta), torch.sin(theta)  # [K]
        le1, le2 = l11 * cos, l21 * cos + l22 * sin  # L e(theta): [..., 1, K]
        delta = mu.to(work)[..., None, :] - centers.to(work)  # [..., N, 2]
        along = delta[..., 0:1] * le1 + delta[..., 1:2] * le2  # delta . L e: [..., N, K]
        length_sq = le1 * le1 + le2 * le2  # |L e|^2 > 0: [..., 1, K]
        v = variances.to(work)[:, None]  # [N, 1]
        sd = torch.sqrt(v)
        length = torch.sqrt(length_sq)
        # |delta + r L e|^2 = (length r + along/length)^2 + perp_sq, r = rho (1 + y) / 2
        perp_sq = ((delta * delta).sum(-1, keepdim=True) - along * along / length_sq).clamp_min(0)
        z = (length * rho / 2 + along / length) / sd
        h = (length * rho / 2 / sd).expand_as(z)
        prefactor = torch.exp(-0.5 * perp_sq / v) / (math.sqrt(2 * math.pi) * v)
        radial = _poly_gauss_integrals(_RADIAL_POLYS, z, h) * prefactor[..., None]  # [..., N, K, 3]
        half = rho[..., None] / 2
        radial = radial * torch.stack([half**2, half**3, half**4], -1)[..., 0, :]
        step = det_l * (2 * math.pi / num_angles)  # [..., 1, 1]
        d0 = (radial[..., 0] * step).sum(-1)  # [..., N]
        du1 = (radial[..., 1] * cos * step).sum(-1)
        du2 = (radial[..., 1] * sin * step).sum(-1)
        duu11 = (radial[..., 2] * cos * cos * step).sum(-1)
        duu12 = (radial[..., 2] * cos * sin * step).sum(-1)
        duu22 = (radial[..., 2] * sin * sin * step).sum(-1)
        rho_sq, l11, l21, l22 = rho_sq[..., 0], l11[..., 0], l21[..., 0], l22[..., 0]  # [..., 1]
        expectation = 0.5 * (rho_sq * d0 - duu11 - duu22)

        inv11, inv21, inv22 = 1 / l11, -l21 / (l11 * l22), 1 / l22  # L^-1 = [[inv11, 0], [inv21, inv22]]
        d_mu = torch.stack([inv11 * du1 + inv21 * du2, (inv22 * du2).expand_as(du2)], -1)
        m11, m12, m22 = duu11 - rho_sq * d0 / 4, duu12, duu22 - rho_sq * d0 / 4
        # L^-T M L^-1 with L^-1 lower triangular
        g11 = inv11 * inv11 * m11 + 2 * inv11 * inv21 * m12 + inv21 * inv21 * m22
        g12 = inv11 * inv22 * m12 + inv21 * inv22 * m22
        g22 = inv22 * inv22 * m22
        d_sigma = 0.5 * _symmetric_2x2(g11, g12, g22)
        return ExpectationFunction._save(ctx, mu, sigma, expectation, d_mu, d_sigma, (1, 2), n_constants=3)


def continuous_sparsemax_2d(
    mu: Tensor, sigma: Tensor, basis_centers: Tensor, basis_variances: Tensor, num_angles: int = 128
) -> Tensor:
    """``E_p[psi(t)]`` for the 2-D continuous sparsemax (Tsallis alpha = 2 maximiser of E_p[f],
    ``f(t) = -(t - mu)^T Sigma^-1 (t - mu) / 2``): the truncated paraboloid
    ``p(t) = (rho^2 - (t - mu)^T Sigma^-1 (t - mu))_+ / 2``, ``rho^4 = 4 / (pi sqrt(det Sigma))``,
    with psi_j = N(m_j, s_j^2 I).

    The radial integral is exact (closed form); the angular one is the ``num_angles``-point
    trapezoid rule, whose error is at most :func:`continuous_sparsemax_2d_error_bound`
    (geometric in ``num_angles``). Shapes as in :func:`continuous_softmax_2d`.

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> mu, sigma = torch.tensor([0.5, 0.5], dtype=torch.float64), 0.02 * torch.eye(2, dtype=torch.float64)
        >>> centers = torch.tensor([[0.5, 0.5], [0.25, 0.5]], dtype=torch.float64)
        >>> variances = torch.tensor([0.01, 0.01], dtype=torch.float64)
        >>> continuous.continuous_sparsemax_2d(mu, sigma, centers, variances, num_angles=32)
        tensor([3.4896, 2.0179], dtype=torch.float64)
    """
    check_num_angles(num_angles)
    check_params_2d(mu, sigma)
    check_basis_2d(basis_centers, basis_variances)
    return _ContinuousSparsemax2d.apply(mu, sigma, basis_centers, basis_variances, num_angles)


def _log_expm1(x: Tensor) -> Tensor:
    """log(exp(x) - 1) for x > 0 without overflow."""
    return x + torch.log(-torch.expm1(-x))


def continuous_sparsemax_2d_error_bound(sigma: Tensor, basis_variances: Tensor, num_angles: int) -> Tensor:
    """Bound on ``|continuous_sparsemax_2d(...)[..., j] - E_p[psi_j]|`` (angular quadrature only;
    float64 rounding, ~1e-12 relative, comes on top).

    The angular integrand f(theta) = |L| int_0^rho (rho^2 - r^2)/2 r psi_j(mu + r L e(theta)) dr is
    2 pi-periodic and entire; on the strip |Im theta| <= eta, |f| <= M = exp(kappa sinh^2 eta) /
    (4 pi^2 s_j^2) with kappa = rho^2 lambda_max(Sigma) / (2 s_j^2) (the imaginary part of
    r L e(theta) has norm <= rho ||L|| sinh eta, and |L| rho^4 / 8 = 1 / (2 pi)). The K-point
    trapezoid rule then errs by at most 4 pi M / (exp(eta K) - 1) (Trefethen & Weideman 2014,
    Thm 3.2), minimised here over eta. Roughly exp(-K^2 / (4 kappa)) relative to max psi_j:
    K ~ 8 sqrt(kappa) gives ~1e-7.

    sigma ``[..., 2, 2]``, basis_variances ``[N]`` -> ``[..., N]`` (float64).

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> sigma, variances = 0.02 * torch.eye(2, dtype=torch.float64), torch.tensor([0.01], dtype=torch.float64)
        >>> continuous.continuous_sparsemax_2d_error_bound(sigma, variances, num_angles=32) < 1e-7
        tensor([True])
    """
    check_tensor(sigma, "sigma", 2)
    check_sigma_shape_2d(sigma)
    check_sigma_2d(sigma)
    check_tensor(basis_variances, "basis_variances", 1)
    check_positive(basis_variances.detach(), "basis_variances")
    check_num_angles(num_angles)
    a, b, d = (x[..., None] for x in _sym_entries(sigma.detach(), torch.float64))
    v = basis_variances.detach().to(torch.float64)
    lambda_max = 0.5 * (a + d) + torch.sqrt((0.5 * (a - d)) ** 2 + b * b)
    det_l = torch.sqrt(a * d - b * b)
    rho_sq = 2.0 / torch.sqrt(math.pi * det_l)
    kappa = rho_sq * lambda_max / (2 * v)  # [..., N]
    eta = torch.logspace(-5, 1.5, 600, dtype=torch.float64, device=sigma.device)
    log_bound = (
        kappa[..., None] * torch.sinh(eta) ** 2
        - _log_expm1(eta * num_angles)
        - torch.log(math.pi * v)[..., None]
    )
    return torch.exp(log_bound.min(-1).values)
