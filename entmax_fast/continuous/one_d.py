"""1-D continuous densities over t in [0, 1] and their expected basis ``E_p[psi(t)]``.

The score is the concave quadratic ``f(t) = -(t - mu)^2 / (2 sigma_sq)``, and each density
solves ``p = argmax_p E_p[f] - Omega(p)`` over densities on R:

- continuous softmax (Shannon Omega): ``p = N(mu, sigma_sq)``;
- continuous sparsemax (Omega = Tsallis alpha = 2): truncated parabola
  ``p(t) = 3 (a^2 - (t - mu)^2)_+ / (4 a^3)``, ``a = (3 sigma_sq / 2)^(1/3)``;
- continuous 1.5-entmax (Tsallis alpha = 1.5): biweight
  ``p(t) = 15 (a^2 - (t - mu)^2)_+^2 / (16 a^5)``, ``a = (15 sigma_sq^2)^(1/5)``
  (from ``p = [f/2 - tau]_+^2`` normalised; its variance is a^2 / 7).

Note that ``sigma_sq`` is the parameter of the score, and the variance of p only for softmax.

The public functions return ``E_p[psi(t)]`` for Gaussian RBFs ``psi_j(t) = N(t; m_j, s_j^2)``
in closed form, with closed-form gradients w.r.t. ``mu`` and ``sigma_sq``.
"""

import math

import torch
from torch import Tensor

from ._checks import DENSITIES_1D, check_basis_1d, check_density_1d, check_params_1d
from ._integrals import ExpectationFunction, _poly_gauss_integrals, integration_dtype


def _family_1d(density: str):
    """(a = scale * sigma_sq^power, polynomials [w(y) on [-1, 1], -w'(y), -(w + y w'(y))])."""
    if density == "sparsemax":
        scale, power = 1.5 ** (1.0 / 3.0), 1.0 / 3.0
        rows = [[0.75, 0.0, -0.75], [0.0, 1.5, 0.0], [-0.75, 0.0, 2.25]]
    elif density == "entmax15":
        scale, power = 15.0 ** 0.2, 0.4
        c = 15.0 / 16.0
        rows = [[c, 0.0, -2 * c, 0.0, c], [0.0, 4 * c, 0.0, -4 * c, 0.0], [-c, 0.0, 6 * c, 0.0, -5 * c]]
    else:
        raise ValueError(f"density must be one of {DENSITIES_1D}, got {density!r}")
    return scale, power, rows


class _ContinuousExpectation1d(ExpectationFunction):
    """E_p[psi_j] for p in {softmax, sparsemax, entmax15}; gradients w.r.t. mu, sigma_sq.

    Truncated densities: p(t) = w((t - mu)/a)/a on [mu - a, mu + a], so with z = (mu - m_j)/s_j,
    h = a/s_j, E_p[psi_j] = T_w(z, h)/s_j, T_P(z, h) = int_{-1}^{1} P(y) phi(z + h y) dy.
    Integrating by parts (w(+-1) = 0): dT_w/dz = -T_{w'}/h and dT_w/dh = -T_{w + y w'}/h, so
    all three quantities are integrals of the same kind, computed together.
    """

    @staticmethod
    def forward(ctx, mu, sigma_sq, centers, variances, density):
        work = integration_dtype(mu.device)
        d_mu = d_sigma_sq = None  # the truncated densities skip them when no gradient is needed
        mu_w = mu.to(work)[..., None]  # [..., 1]
        s2_w = sigma_sq.to(work)[..., None]
        m = centers.to(work)  # [N]
        v = variances.to(work)
        if density == "softmax":
            total_var = s2_w + v  # [..., N]
            diff = mu_w - m
            expectation = torch.exp(-0.5 * diff * diff / total_var) / torch.sqrt(2 * math.pi * total_var)
            d_mu = -diff / total_var * expectation
            d_sigma_sq = expectation * (0.5 * diff * diff / total_var - 0.5) / total_var
        else:
            scale, power, polys = _family_1d(density)
            if not any(ctx.needs_input_grad[:2]):
                polys = polys[:1]
            sd = torch.sqrt(v)
            a = scale * s2_w**power  # [..., 1]
            z = (mu_w - m) / sd  # [..., N]
            h = a / sd
            z, h = torch.broadcast_tensors(z, h)
            integrals = _poly_gauss_integrals(polys, z, h)  # [..., N, 3]
            expectation = integrals[..., 0] / sd
            if len(polys) == 3:
                d_mu = integrals[..., 1] / (sd * a)
                d_sigma_sq = integrals[..., 2] * (power / s2_w) / sd
        return ExpectationFunction._save(ctx, mu, sigma_sq, expectation, d_mu, d_sigma_sq, (0, 0),
                                         n_constants=3)


def continuous_density(density: str, mu: Tensor, sigma_sq: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` for ``density`` in ``("softmax", "sparsemax", "entmax15")``.

    Args:
        mu: ``[...]`` location of the density.
        sigma_sq: ``[...]`` (broadcastable with ``mu``), > 0: the score is
            ``-(t - mu)^2 / (2 sigma_sq)``.
        basis_centers, basis_variances: ``[N]`` Gaussian RBFs ``psi_j = N(m_j, s_j^2)``.

    Returns:
        ``[..., N]`` in the promoted dtype of ``mu``/``sigma_sq`` (computed in float64).
        Differentiable w.r.t. ``mu`` and ``sigma_sq`` (closed form).

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> centers = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
        >>> variances = torch.full((3,), 0.01, dtype=torch.float64)
        >>> mu, sigma_sq = torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.02], dtype=torch.float64)
        >>> continuous.continuous_density("entmax15", mu, sigma_sq, centers, variances)
        tensor([[0.8572, 2.2513, 0.8572]], dtype=torch.float64)
    """
    check_density_1d(density)
    check_params_1d(mu, sigma_sq)
    check_basis_1d(basis_centers, basis_variances)
    return _ContinuousExpectation1d.apply(mu, sigma_sq, basis_centers, basis_variances, density)


def continuous_softmax(mu: Tensor, sigma_sq: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` with p = N(mu, sigma_sq), the maximiser of ``E_p[f] + H(p)`` (Shannon)
    for ``f(t) = -(t - mu)^2 / (2 sigma_sq)``: ``E_p[psi_j] = N(mu; m_j, sigma_sq + s_j^2)``.
    Shapes as in :func:`continuous_density`.

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> centers = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
        >>> variances = torch.full((3,), 0.01, dtype=torch.float64)
        >>> mu, sigma_sq = torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.02], dtype=torch.float64)
        >>> continuous.continuous_softmax(mu, sigma_sq, centers, variances)
        tensor([[0.8128, 2.3033, 0.8128]], dtype=torch.float64)
        >>> total = sigma_sq[:, None] + variances                          # N(mu; m_j, sigma_sq + s_j^2)
        >>> torch.exp(-(mu[:, None] - centers) ** 2 / (2 * total)) / torch.sqrt(2 * torch.pi * total)
        tensor([[0.8128, 2.3033, 0.8128]], dtype=torch.float64)
    """
    return continuous_density("softmax", mu, sigma_sq, basis_centers, basis_variances)


def continuous_sparsemax(mu: Tensor, sigma_sq: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` with p the maximiser of ``E_p[f] - (integral p^2 - 1)/2`` (Tsallis
    alpha = 2) for ``f(t) = -(t - mu)^2 / (2 sigma_sq)``: the truncated parabola
    ``3 (a^2 - (t - mu)^2)_+ / (4 a^3)``, ``a = (3 sigma_sq / 2)^(1/3)``.
    Shapes as in :func:`continuous_density`.

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> centers = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
        >>> variances = torch.full((3,), 0.01, dtype=torch.float64)
        >>> mu, sigma_sq = torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.02], dtype=torch.float64)
        >>> continuous.continuous_sparsemax(mu, sigma_sq, centers, variances)
        tensor([[0.9029, 2.1646, 0.9029]], dtype=torch.float64)
    """
    return continuous_density("sparsemax", mu, sigma_sq, basis_centers, basis_variances)


def continuous_entmax15(mu: Tensor, sigma_sq: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` with p the Tsallis alpha = 1.5 maximiser for
    ``f(t) = -(t - mu)^2 / (2 sigma_sq)``: the biweight ``15 (a^2 - (t - mu)^2)_+^2 / (16 a^5)``,
    ``a = (15 sigma_sq^2)^(1/5)``. Shapes as in :func:`continuous_density`.

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> centers = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
        >>> variances = torch.full((3,), 0.01, dtype=torch.float64)
        >>> mu, sigma_sq = torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.02], dtype=torch.float64)
        >>> continuous.continuous_entmax15(mu, sigma_sq, centers, variances)
        tensor([[0.8572, 2.2513, 0.8572]], dtype=torch.float64)
    """
    return continuous_density("entmax15", mu, sigma_sq, basis_centers, basis_variances)
