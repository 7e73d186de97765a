"""Numerical-quadrature twin of ``entmax_fast.continuous`` (float64 ground truth).

No closed forms: every expectation is a composite Gauss-Legendre sum (1-D) or a polar
Gauss-Legendre x trapezoid sum (2-D) of ``p(t) psi_j(t)``, written as a differentiable torch
expression so that autograd gives the reference gradients w.r.t. ``mu`` and ``sigma_sq`` /
``sigma``. Slow by design (host-side loops, value-dependent node counts); for tests.
"""

import math
from typing import Tuple

import torch
from torch import Tensor

__all__ = [
    "gauss_legendre",
    "density_1d",
    "density_2d",
    "expected_basis_1d",
    "expected_basis_2d",
    "fit_matrix",
]

_F64 = torch.float64


def gauss_legendre(order: int, device=None) -> Tuple[Tensor, Tensor]:
    """Nodes and weights on [-1, 1] (Golub-Welsch: eigen-decomposition of the Jacobi matrix)."""
    k = torch.arange(1, order, dtype=_F64, device=device)
    off_diagonal = k / torch.sqrt(4 * k * k - 1)
    jacobi = torch.diag(off_diagonal, 1) + torch.diag(off_diagonal, -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    weights = 2 * vectors[0] ** 2
    return nodes, weights


def _composite(lo: Tensor, hi: Tensor, panels: int, order: int) -> Tuple[Tensor, Tensor]:
    """Composite Gauss-Legendre nodes/weights on [lo, hi] (broadcast): shapes [..., panels*order]."""
    x, w = gauss_legendre(order, lo.device)
    edges = torch.linspace(0, 1, panels + 1, dtype=_F64, device=lo.device)
    left, width = edges[:-1], edges[1:] - edges[:-1]
    unit_nodes = (left[:, None] + width[:, None] * (x[None, :] + 1) / 2).reshape(-1)
    unit_weights = (width[:, None] * w[None, :] / 2).reshape(-1)
    span = (hi - lo)[..., None]
    return lo[..., None] + span * unit_nodes, span * unit_weights


def _gaussian(t: Tensor, center: Tensor, variance: Tensor) -> Tensor:
    return torch.exp(-0.5 * (t - center) ** 2 / variance) / torch.sqrt(2 * math.pi * variance)


def _half_width(density: str, sigma_sq: Tensor) -> Tensor:
    if density == "sparsemax":
        return (1.5 * sigma_sq) ** (1.0 / 3.0)
    if density == "entmax15":
        return (15.0 * sigma_sq**2) ** 0.2
    raise ValueError(f"unknown truncated density {density!r}")


def density_1d(density: str, t: Tensor, mu: Tensor, sigma_sq: Tensor) -> Tensor:
    """p(t) for the 1-D densities of ``entmax_fast.continuous`` (broadcast)."""
    if density == "softmax":
        return _gaussian(t, mu, sigma_sq)
    a = _half_width(density, sigma_sq)
    inside = torch.clamp(a**2 - (t - mu) ** 2, min=0)
    if density == "sparsemax":
        return 3 * inside / (4 * a**3)
    return 15 * inside**2 / (16 * a**5)


def expected_basis_1d(
    density: str, mu: Tensor, sigma_sq: Tensor, centers: Tensor, variances: Tensor, panels: int = 160, order: int = 16
) -> Tensor:
    """``E_p[psi_j]`` by quadrature: ``[...]`` parameters, ``[N]`` basis -> ``[..., N]`` (float64).

    The integration window of (element, j) is the density's support (softmax: mu +- 12 sigma)
    intersected with m_j +- 40 s_j, so ``panels`` panels resolve both the density and psi_j.
    """
    mu, sigma_sq = torch.broadcast_tensors(mu.to(_F64), sigma_sq.to(_F64))
    m, v = centers.to(_F64), variances.to(_F64)
    mu_, s2_ = mu[..., None], sigma_sq[..., None]
    reach = 12 * torch.sqrt(s2_) if density == "softmax" else _half_width(density, s2_)
    lo = torch.maximum(mu_ - reach, m - 40 * torch.sqrt(v))
    hi = torch.minimum(mu_ + reach, m + 40 * torch.sqrt(v))
    hi = torch.maximum(hi, lo)
    t, w = _composite(lo, hi, panels, order)  # [..., N, Q]
    integrand = density_1d(density, t, mu_[..., None], s2_[..., None]) * _gaussian(t, m[:, None], v[:, None])
    return (integrand * w).sum(-1)


def _cholesky_2x2(sigma: Tensor) -> Tensor:
    sym = 0.5 * (sigma + sigma.transpose(-1, -2))
    return torch.linalg.cholesky(sym)


def density_2d(density: str, t: Tensor, mu: Tensor, sigma: Tensor) -> Tensor:
    """p(t) for t ``[..., 2]``, mu ``[..., 2]``, sigma ``[..., 2, 2]`` (broadcast)."""
    sym = 0.5 * (sigma + sigma.transpose(-1, -2))
    diff = (t - mu)[..., None]
    quad = (diff.transpose(-1, -2) @ torch.linalg.solve(sym, diff))[..., 0, 0]
    det = torch.linalg.det(sym)
    if density == "softmax":
        return torch.exp(-0.5 * quad) / (2 * math.pi * torch.sqrt(det))
    if density == "sparsemax":
        rho_sq = 2 / torch.sqrt(math.pi * torch.sqrt(det))
        return torch.clamp(rho_sq - quad, min=0) / 2
    raise ValueError(f"density must be 'softmax' or 'sparsemax', got {density!r}")


def expected_basis_2d(
    density: str,
    mu: Tensor,
    sigma: Tensor,
    centers: Tensor,
    variances: Tensor,
    num_angles: int = 0,
    order: int = 8,
) -> Tensor:
    """``E_p[psi_j]``, psi_j = N(m_j, s_j^2 I), by polar quadrature in u = L^-1 (t - mu).

    mu ``[B, 2]``, sigma ``[B, 2, 2]``, centers ``[N, 2]``, variances ``[N]`` -> ``[B, N]``.
    Radial: composite Gauss-Legendre on [0, R] with panels no wider than s_min / 2 in t;
    angular: trapezoid rule (spectrally accurate for this periodic integrand) with arcs no
    longer than s_min / 4 (at least 512 angles unless ``num_angles`` is given).
    """
    mu, sigma = mu.to(_F64), sigma.to(_F64)
    m, v = centers.to(_F64), variances.to(_F64)
    chol = _cholesky_2x2(sigma)  # [B, 2, 2]
    det_chol = chol[..., 0, 0] * chol[..., 1, 1]
    if density == "softmax":
        radius = torch.full_like(det_chol, 9.0)
    elif density == "sparsemax":
        radius = torch.sqrt(2 / torch.sqrt(math.pi * det_chol))
    else:
        raise ValueError(f"density must be 'softmax' or 'sparsemax', got {density!r}")
    spread = float((radius * torch.linalg.matrix_norm(chol, ord=2)).detach().max())
    s_min = float(torch.sqrt(v.detach().min()))
    panels = max(8, math.ceil(2 * spread / s_min))
    angles = num_angles or max(512, 4 * math.ceil(2 * math.pi * spread / s_min))
    theta = torch.arange(angles, dtype=_F64, device=mu.device) * (2 * math.pi / angles)
    direction = torch.stack([torch.cos(theta), torch.sin(theta)], -1)  # [K, 2]
    out = []
    for b in range(mu.shape[0]):
        r, wr = _composite(torch.zeros((), dtype=_F64), radius[b], panels, order)  # [Q]
        if density == "softmax":
            weight = torch.exp(-0.5 * r**2) / (2 * math.pi)
        else:
            weight = (radius[b] ** 2 - r**2) / 2 * det_chol[b]
        # t = mu + L (r e): [K, Q, 2]
        offsets = (direction @ chol[b].T)[:, None, :] * r[None, :, None]
        t = (mu[b] + offsets).reshape(-1, 2)  # [K*Q, 2]
        node_weight = (weight * r * wr).repeat(angles) * (2 * math.pi / angles)  # [K*Q]
        chunk = max(1, 2**22 // t.shape[0])
        for j in range(0, m.shape[0], chunk):
            sq_dist = ((t[:, None, :] - m[None, j : j + chunk]) ** 2).sum(-1)  # [K*Q, chunk]
            psi = torch.exp(-0.5 * sq_dist / v[j : j + chunk]) / (2 * math.pi * v[j : j + chunk])
            out.append(node_weight @ psi)
    return torch.cat(out).reshape(mu.shape[0], m.shape[0])


def fit_matrix(length: int, centers: Tensor, variances: Tensor, ridge: float) -> Tensor:
    """G = F^T (F F^T + ridge I)^-1, ``[length, N]``, F_jl = psi_j((l - 1/2) / length), float64."""
    t = (torch.arange(length, dtype=_F64) + 0.5) / length
    features = _gaussian(t[None, :], centers.to(_F64)[:, None], variances.to(_F64)[:, None])  # [N, L]
    gram = features @ features.T + ridge * torch.eye(features.shape[0], dtype=_F64)
    return torch.linalg.solve(gram, features).T
