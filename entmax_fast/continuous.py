"""Continuous attention (Martins et al., NeurIPS 2020; docs/maths.md, "Continuous attention").

Attention over t in [0, 1] (1-D) or R^2 (2-D). The score is a concave quadratic in t, so
the attention density is parametrised by a location ``mu`` and a scale ``sigma_sq``
(1-D: ``f(t) = -(t - mu)^2 / (2 sigma_sq)``; 2-D: ``f(t) = -(t - mu)^T Sigma^-1 (t - mu) / 2``).
Each density solves ``p = argmax_p E_p[f] - Omega(p)`` over densities on R^d:

- continuous softmax (Shannon Omega): ``p = N(mu, sigma_sq)``;
- continuous sparsemax (Omega = Tsallis alpha = 2): truncated parabola
  ``p(t) = 3 (a^2 - (t - mu)^2)_+ / (4 a^3)``, ``a = (3 sigma_sq / 2)^(1/3)``;
- continuous 1.5-entmax (Tsallis alpha = 1.5): biweight
  ``p(t) = 15 (a^2 - (t - mu)^2)_+^2 / (16 a^5)``, ``a = (15 sigma_sq^2)^(1/5)``
  (from ``p = [f/2 - tau]_+^2`` normalised; its variance is a^2 / 7).

Note that ``sigma_sq`` is the parameter of the score, and the variance of p only for softmax.

Values enter through a function ``V(t) = B psi(t)`` with Gaussian RBFs
``psi_j(t) = N(t; m_j, s_j^2)``; the context is ``c = B E_p[psi(t)]``. The public functions
below return ``E_p[psi(t)]`` in closed form with closed-form gradients w.r.t. ``mu`` and
``sigma_sq``; :class:`GaussianBasis1d` fits ``B`` by ridge regression; and
:class:`ContinuousAttention` puts both together.

Precision: the truncated densities give ``E_p[psi_j]`` as a difference of terms of size
``(1 + |z|)^d / h^d`` relative to the result (``h`` = support half-width over basis width),
so every expectation is computed in float64 (float32 on devices without float64, e.g. MPS)
and cast back. Where the support is narrow compared with the basis (``h (|z| + 5) <= 8``)
a Taylor series in ``h`` replaces the closed form; its truncation error is below 1e-16
relative there. The cost is ``O(batch * num_basis)``, negligible next to the attention.

Value checks (``sigma_sq > 0``, finite ``mu``, non-empty rows) never synchronise the host with
an accelerator: on CPU they raise ``ValueError`` at once, elsewhere they are device-side
assertions (``torch._assert_async``) that surface at the next synchronisation.
"""

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

__all__ = [
    "continuous_softmax",
    "continuous_sparsemax",
    "continuous_entmax15",
    "continuous_softmax_2d",
    "continuous_sparsemax_2d",
    "continuous_sparsemax_2d_error_bound",
    "continuous_density",
    "GaussianBasis1d",
    "ContinuousAttention",
    "sequence_positions",
]

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Series branch where h (|z| + 5) <= 8: term n is about (h (|z| + sqrt n))^n / n! relative to
# phi(z), so 48 terms leave < 1e-16. Elsewhere the closed form, whose cancellation
# ((|z| + h) / h)^degree is then harmless except far in the tails (|z| - h > 4), where the
# values themselves are below 1e-6. Against 40-digit quadrature (tests) the absolute error is
# <= 2e-12 for every (z, h) (the integrals are <= 1).
_SERIES_TERMS = 48
_SERIES_RADIUS = 8.0
_DENSITIES_1D = ("softmax", "sparsemax", "entmax15")


# ----------------------------------------------------------------------------- checks


def _compute_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64


def _check_tensor(x, name: str, ndim_min: int = 0) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dimension(s), got shape {tuple(x.shape)}")


def _assert_values(ok: Tensor, message: str, bad_values: Optional[Tensor] = None) -> None:
    """Raise on CPU; device-side assertion elsewhere (no host synchronisation)."""
    if ok.device.type == "cpu":
        if not bool(ok.all()):
            if bad_values is not None and bad_values.numel() > 0:
                message = f"{message}; got {bad_values.flatten()[0].item()!r}"
            raise ValueError(message)
    else:
        torch._assert_async(ok.all(), message)


def _check_finite(x: Tensor, name: str) -> None:
    finite = torch.isfinite(x)
    _assert_values(finite, f"{name} must be finite (no NaN or inf)", x[~finite] if x.device.type == "cpu" else None)


def _check_positive(x: Tensor, name: str) -> None:
    ok = x > 0  # NaN compares False, so NaN is reported here too
    _assert_values(ok, f"{name} must be > 0 and not NaN", x[~ok] if x.device.type == "cpu" else None)


def _check_basis_1d(centers: Tensor, variances: Tensor) -> None:
    _check_tensor(centers, "basis_centers", 1)
    _check_tensor(variances, "basis_variances", 1)
    if centers.dim() != 1 or centers.numel() == 0:
        raise ValueError(f"basis_centers must have shape (N,) with N >= 1, got {tuple(centers.shape)}")
    if variances.shape != centers.shape:
        raise ValueError(
            f"basis_variances must have the shape of basis_centers {tuple(centers.shape)}, got {tuple(variances.shape)}"
        )
    if centers.requires_grad or variances.requires_grad:
        raise ValueError("basis_centers and basis_variances must not require grad: the basis is fixed")
    _check_finite(centers, "basis_centers")
    _check_positive(variances, "basis_variances")


def _check_params_1d(mu: Tensor, sigma_sq: Tensor) -> None:
    _check_tensor(mu, "mu")
    _check_tensor(sigma_sq, "sigma_sq")
    try:
        torch.broadcast_shapes(mu.shape, sigma_sq.shape)
    except RuntimeError:
        raise ValueError(
            f"mu and sigma_sq must be broadcastable, got shapes {tuple(mu.shape)} and {tuple(sigma_sq.shape)}"
        ) from None
    _check_finite(mu.detach(), "mu")
    _check_positive(sigma_sq.detach(), "sigma_sq")
    _check_finite(sigma_sq.detach(), "sigma_sq")


# ------------------------------------------------------- polynomial x Gaussian integrals


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


# ------------------------------------------------------------------------------ 1-D


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
        raise ValueError(f"density must be one of {_DENSITIES_1D}, got {density!r}")
    return scale, power, rows


class _ContinuousExpectation1d(torch.autograd.Function):
    """E_p[psi_j] for p in {softmax, sparsemax, entmax15}; gradients w.r.t. mu, sigma_sq.

    Truncated densities: p(t) = w((t - mu)/a)/a on [mu - a, mu + a], so with z = (mu - m_j)/s_j,
    h = a/s_j, E_p[psi_j] = T_w(z, h)/s_j, T_P(z, h) = int_{-1}^{1} P(y) phi(z + h y) dy.
    Integrating by parts (w(+-1) = 0): dT_w/dz = -T_{w'}/h and dT_w/dh = -T_{w + y w'}/h, so
    all three quantities are integrals of the same kind, computed together.
    """

    @staticmethod
    def forward(ctx, mu, sigma_sq, centers, variances, density):
        out_dtype = torch.promote_types(mu.dtype, sigma_sq.dtype)
        work = _compute_dtype(mu.device)
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
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(d_mu, d_sigma_sq)
        ctx.shapes = (mu.shape, sigma_sq.shape, mu.dtype, sigma_sq.dtype)
        return expectation.to(out_dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        d_mu, d_sigma_sq = ctx.saved_tensors
        mu_shape, s2_shape, mu_dtype, s2_dtype = ctx.shapes
        g = grad.to(d_mu.dtype)
        grad_mu = grad_s2 = None
        if ctx.needs_input_grad[0]:
            grad_mu = (g * d_mu).sum(-1).sum_to_size(mu_shape).to(mu_dtype)
        if ctx.needs_input_grad[1]:
            grad_s2 = (g * d_sigma_sq).sum(-1).sum_to_size(s2_shape).to(s2_dtype)
        return grad_mu, grad_s2, None, None, None


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
    """
    if density not in _DENSITIES_1D:
        raise ValueError(f"density must be one of {_DENSITIES_1D}, got {density!r}")
    _check_params_1d(mu, sigma_sq)
    _check_basis_1d(basis_centers, basis_variances)
    return _ContinuousExpectation1d.apply(mu, sigma_sq, basis_centers, basis_variances, density)


def continuous_softmax(mu: Tensor, sigma_sq: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` with p = N(mu, sigma_sq), the maximiser of ``E_p[f] + H(p)`` (Shannon)
    for ``f(t) = -(t - mu)^2 / (2 sigma_sq)``: ``E_p[psi_j] = N(mu; m_j, sigma_sq + s_j^2)``.
    Shapes as in :func:`continuous_density`."""
    return continuous_density("softmax", mu, sigma_sq, basis_centers, basis_variances)


def continuous_sparsemax(mu: Tensor, sigma_sq: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` with p the maximiser of ``E_p[f] - (integral p^2 - 1)/2`` (Tsallis
    alpha = 2) for ``f(t) = -(t - mu)^2 / (2 sigma_sq)``: the truncated parabola
    ``3 (a^2 - (t - mu)^2)_+ / (4 a^3)``, ``a = (3 sigma_sq / 2)^(1/3)``.
    Shapes as in :func:`continuous_density`."""
    return continuous_density("sparsemax", mu, sigma_sq, basis_centers, basis_variances)


def continuous_entmax15(mu: Tensor, sigma_sq: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` with p the Tsallis alpha = 1.5 maximiser for
    ``f(t) = -(t - mu)^2 / (2 sigma_sq)``: the biweight ``15 (a^2 - (t - mu)^2)_+^2 / (16 a^5)``,
    ``a = (15 sigma_sq^2)^(1/5)``. Shapes as in :func:`continuous_density`."""
    return continuous_density("entmax15", mu, sigma_sq, basis_centers, basis_variances)


# -------------------------------------------------------------- value function (1-D)


def sequence_positions(length: int, mask: Optional[Tensor] = None, dtype=torch.float64, device=None) -> Tensor:
    """Positions t_l = (l - 1/2) / L of the L items of a sequence in [0, 1].

    Without ``mask``: ``[length]``. With ``mask`` ``[B, length]`` (bool, True = item present, any
    pattern): the present items of row b get ``(rank + 1/2) / L_b`` in order, L_b their count;
    absent items get 0. Returns ``[B, length]``.
    """
    if mask is None:
        return (torch.arange(length, dtype=dtype, device=device) + 0.5) / length
    count = mask.sum(-1, keepdim=True)
    rank = mask.cumsum(-1) - 1
    positions = (rank.to(dtype) + 0.5) / count.clamp_min(1).to(dtype)
    return torch.where(mask, positions, torch.zeros_like(positions))


def _gaussian_features(t: Tensor, centers: Tensor, variances: Tensor) -> Tensor:
    """psi_j(t): ``[...]`` x ``[N]`` -> ``[..., N]``."""
    diff = t[..., None] - centers
    return torch.exp(-0.5 * diff * diff / variances) / torch.sqrt(2 * math.pi * variances)


class GaussianBasis1d(nn.Module):
    """Gaussian RBFs ``psi_j(t) = N(t; m_j, s_j^2)`` and the ridge fit of ``V(t) = B psi(t)``.

    For L value vectors X (``[L, e]``) at t_l = (l - 1/2)/L, ``B = X^T G`` with
    ``G = F^T (F F^T + ridge I)^-1`` (``[L, N]``, F_jl = psi_j(t_l)); the context for a density
    p is ``B E_p[psi] = X^T (G E_p[psi])``, i.e. the L weights ``w = G E_p[psi]`` applied to X.
    G depends only on L: it is computed in float64 once per (L, device, dtype) and cached.
    Ragged rows (a mask) reuse the cached G of each length when the mask is on the CPU, and
    are solved per call, batched, in float64 otherwise (see :meth:`fit_weights`).
    The basis is fixed (buffers); do not modify ``centers``/``variances`` in place.
    """

    def __init__(self, centers: Tensor, variances: Tensor, ridge: float = 0.01):
        super().__init__()
        centers = torch.as_tensor(centers, dtype=torch.float64)
        variances = torch.as_tensor(variances, dtype=torch.float64)
        _check_basis_1d(centers, variances)
        if not (isinstance(ridge, (int, float)) and ridge > 0 and math.isfinite(ridge)):
            raise ValueError(f"ridge must be a finite float > 0, got {ridge!r}")
        self.register_buffer("centers", centers)
        self.register_buffer("variances", variances)
        self.ridge = float(ridge)
        self._fit_cache = {}

    @classmethod
    def grid(cls, num_centers: int = 16, widths: Sequence[float] = (0.03, 0.1, 0.3), ridge: float = 0.01):
        """``num_centers`` equally spaced centers on [0, 1] for each standard deviation in ``widths``."""
        if num_centers < 1:
            raise ValueError(f"num_centers must be >= 1, got {num_centers}")
        if len(widths) == 0 or any(w <= 0 for w in widths):
            raise ValueError(f"widths must be a non-empty list of positive floats, got {list(widths)}")
        centers = torch.linspace(0, 1, num_centers, dtype=torch.float64).repeat(len(widths))
        variances = torch.tensor([w * w for w in widths], dtype=torch.float64).repeat_interleave(num_centers)
        return cls(centers, variances, ridge)

    @property
    def num_basis(self) -> int:
        return self.centers.shape[0]

    def _apply(self, fn, *args, **kwargs):
        self._fit_cache = {}
        return super()._apply(fn, *args, **kwargs)

    def forward(self, t: Tensor) -> Tensor:
        """psi(t): ``[...]`` -> ``[..., N]``."""
        return _gaussian_features(t, self.centers.to(t.dtype), self.variances.to(t.dtype))

    def fit_matrix(self, length: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """G (``[length, N]``) for sequences of exactly ``length`` items, cached."""
        if length < 1:
            raise ValueError(f"length must be >= 1 (empty sequences have no value function), got {length}")
        device = self.centers.device
        key = (length, device, dtype)
        if key not in self._fit_cache:
            work = _compute_dtype(device)
            t = sequence_positions(length, dtype=work, device=device)
            features = _gaussian_features(t, self.centers.to(work), self.variances.to(work))  # [L, N]
            gram = features.T @ features + self.ridge * torch.eye(self.num_basis, dtype=work, device=device)
            chol = torch.linalg.cholesky_ex(gram).L  # gram + ridge I is SPD; _ex skips the syncing check
            self._fit_cache[key] = torch.cholesky_solve(features.T, chol).T.to(dtype)
        return self._fit_cache[key]

    def fit_weights(
        self, expected_basis: Tensor, length: int, mask: Optional[Tensor] = None, solve_per_call: Optional[bool] = None
    ) -> Tensor:
        """Weights ``w = G E_p[psi]`` over the L items; context = ``w @ values``.

        expected_basis: ``[B, ..., N]`` (``[..., N]`` without mask). mask: ``[B, length]`` bool,
        True = item present; every row needs at least one. Returns ``[B, ..., length]``.

        Ragged rows: with a CPU mask (lengths known on the host, no synchronisation) the cached
        G of each row's length is scattered to its items; with a mask on an accelerator the
        ridge systems are solved per call, batched, in float64 (reading the lengths would
        synchronise). ``solve_per_call`` forces one or the other.
        """
        _check_tensor(expected_basis, "expected_basis", 1)
        if expected_basis.shape[-1] != self.num_basis:
            raise ValueError(
                f"expected_basis must end in the basis size {self.num_basis}, got shape {tuple(expected_basis.shape)}"
            )
        if length < 1:
            raise ValueError(f"length must be >= 1 (empty sequences have no value function), got {length}")
        if mask is None:
            return expected_basis @ self.fit_matrix(length, expected_basis.dtype).T
        if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[1] != length:
            raise ValueError(f"mask must be a bool tensor [B, {length}], got {mask.dtype} {tuple(mask.shape)}")
        if expected_basis.dim() < 2 or expected_basis.shape[0] != mask.shape[0]:
            raise ValueError(
                f"expected_basis must be [B, ..., N] with B = mask.shape[0] = {mask.shape[0]}, "
                f"got {tuple(expected_basis.shape)}"
            )
        _assert_values(mask.any(-1), "mask has a row with no item: empty sequences have no value function")
        if solve_per_call is None:
            solve_per_call = mask.device.type != "cpu"
        if not solve_per_call:
            return self._fit_weights_cached(expected_basis, length, mask)
        work = _compute_dtype(mask.device)
        t = sequence_positions(length, mask, dtype=work)
        features = _gaussian_features(t, self.centers.to(work), self.variances.to(work)) * mask[..., None]  # [B, L, N]
        eye = torch.eye(self.num_basis, dtype=work, device=mask.device)
        gram = features.transpose(-1, -2) @ features + self.ridge * eye  # [B, N, N], SPD
        chol = torch.linalg.cholesky_ex(gram).L  # _ex: no info check, so no host synchronisation
        batch = expected_basis.shape[0]
        rhs = expected_basis.reshape(batch, -1, self.num_basis).transpose(-1, -2).to(work)  # [B, N, Q]
        weights = features @ torch.cholesky_solve(rhs, chol)  # [B, L, Q]
        return weights.transpose(-1, -2).reshape(*expected_basis.shape[:-1], length).to(expected_basis.dtype)

    def _fit_weights_cached(self, expected_basis: Tensor, length: int, mask: Tensor) -> Tensor:
        dtype, device = expected_basis.dtype, self.centers.device
        counts = mask.sum(-1).tolist()  # host-side mask: no device synchronisation
        stacked = torch.cat([self.fit_matrix(count, dtype) for count in counts])  # [sum(counts), N]
        fit = torch.zeros(mask.shape[0], length, self.num_basis, dtype=dtype, device=device)
        fit.masked_scatter_(mask.to(device)[..., None].expand_as(fit), stacked)  # row-major: row b, its items in order
        batch = expected_basis.shape[0]
        weights = expected_basis.reshape(batch, -1, self.num_basis) @ fit.to(expected_basis.device).transpose(-1, -2)
        return weights.reshape(*expected_basis.shape[:-1], length)


# ------------------------------------------------------------------------- the module


class ContinuousAttention(nn.Module):
    """1-D continuous attention over a sequence of L key/value vectors.

    A discrete softmax attention ``p = softmax(q W k^T / sqrt(d_k))`` over the positions
    t_l = (l - 1/2)/L gives ``mu = sum p_l t_l`` and ``sigma_sq = sum p_l (t_l - mu)^2 +
    min_sigma_sq``; the continuous density (``"softmax"``, ``"sparsemax"`` or ``"entmax15"``)
    with these parameters weighs the ridge-fitted value function, giving
    ``context = sum_l (G E_p[psi])_l v_l``. With ``combine="sum"`` the discrete context
    ``sum_l p_l v_l`` is added (discrete + continuous attention).

    forward(query ``[B, Dq]`` or ``[B, Q, Dq]``, keys ``[B, L, Dk]``, values ``[B, L, Dv]``,
    mask ``[B, L]`` bool (True = present) or None) -> context ``[B, Dv]`` or ``[B, Q, Dv]``;
    with ``return_params=True`` also ``(mu, sigma_sq)`` (``[B]`` or ``[B, Q]``).
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        density: str = "sparsemax",
        basis: Optional[GaussianBasis1d] = None,
        combine: str = "none",
        min_sigma_sq: float = 1e-4,
    ):
        super().__init__()
        if density not in _DENSITIES_1D:
            raise ValueError(f"density must be one of {_DENSITIES_1D}, got {density!r}")
        if combine not in ("none", "sum"):
            raise ValueError(f"combine must be 'none' or 'sum', got {combine!r}")
        if not min_sigma_sq > 0:
            raise ValueError(f"min_sigma_sq must be > 0 (sigma_sq <= 0 is not a density), got {min_sigma_sq!r}")
        self.density = density
        self.combine = combine
        self.min_sigma_sq = float(min_sigma_sq)
        self.query_proj = nn.Linear(query_dim, key_dim, bias=False)
        self.basis = basis if basis is not None else GaussianBasis1d.grid()

    def forward(self, query: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor] = None, return_params: bool = False):
        _check_tensor(query, "query", 2)
        _check_tensor(keys, "keys", 3)
        _check_tensor(values, "values", 3)
        single_query = query.dim() == 2
        if single_query:
            query = query[:, None, :]
        if query.dim() != 3 or keys.dim() != 3 or values.dim() != 3:
            raise ValueError(
                f"expected query [B, Dq] or [B, Q, Dq], keys [B, L, Dk], values [B, L, Dv]; got "
                f"{tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
            )
        batch, length = keys.shape[0], keys.shape[1]
        if length == 0:
            raise ValueError("keys must hold at least one position (L >= 1), got L = 0")
        if values.shape[:2] != keys.shape[:2] or query.shape[0] != batch:
            raise ValueError(
                f"query, keys, values must share B (and keys/values L); got {tuple(query.shape)}, "
                f"{tuple(keys.shape)}, {tuple(values.shape)}"
            )
        if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (batch, length)):
            raise ValueError(f"mask must be a bool tensor [B, L] = [{batch}, {length}], got {mask.dtype} {tuple(mask.shape)}")

        scores = self.query_proj(query) @ keys.transpose(-1, -2) / math.sqrt(keys.shape[-1])  # [B, Q, L]
        if mask is not None:
            _assert_values(mask.any(-1), "mask has a row with no item: empty sequences cannot be attended")
            scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        discrete = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1)
        if mask is None:
            positions = sequence_positions(length, dtype=discrete.dtype, device=keys.device)
        else:
            positions = sequence_positions(length, mask, dtype=discrete.dtype)[:, None, :]
        mu = (discrete * positions).sum(-1)
        sigma_sq = (discrete * (positions - mu[..., None]) ** 2).sum(-1) + self.min_sigma_sq
        expected = continuous_density(self.density, mu, sigma_sq, self.basis.centers, self.basis.variances)
        weights = self.basis.fit_weights(expected, length, mask)  # [B, Q, L]
        context = weights.to(values.dtype) @ values
        if self.combine == "sum":
            context = context + discrete.to(values.dtype) @ values
        if single_query:
            context, mu, sigma_sq = context[:, 0], mu[:, 0], sigma_sq[:, 0]
        return (context, (mu, sigma_sq)) if return_params else context


# ------------------------------------------------------------------------------ 2-D


def _check_basis_2d(centers: Tensor, variances: Tensor) -> None:
    _check_tensor(centers, "basis_centers", 2)
    _check_tensor(variances, "basis_variances", 1)
    if centers.dim() != 2 or centers.shape[-1] != 2 or centers.shape[0] == 0:
        raise ValueError(f"basis_centers must have shape (N, 2) with N >= 1, got {tuple(centers.shape)}")
    if variances.shape != centers.shape[:1]:
        raise ValueError(f"basis_variances must have shape ({centers.shape[0]},), got {tuple(variances.shape)}")
    if centers.requires_grad or variances.requires_grad:
        raise ValueError("basis_centers and basis_variances must not require grad: the basis is fixed")
    _check_finite(centers, "basis_centers")
    _check_positive(variances, "basis_variances")


def _check_params_2d(mu: Tensor, sigma: Tensor) -> None:
    _check_tensor(mu, "mu", 1)
    _check_tensor(sigma, "sigma", 2)
    if mu.shape[-1] != 2:
        raise ValueError(f"mu must have shape [..., 2], got {tuple(mu.shape)}")
    if sigma.shape[-2:] != (2, 2):
        raise ValueError(f"sigma must have shape [..., 2, 2], got {tuple(sigma.shape)}")
    try:
        torch.broadcast_shapes(mu.shape[:-1], sigma.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"mu [..., 2] and sigma [..., 2, 2] must have broadcastable batch shapes, got "
            f"{tuple(mu.shape)} and {tuple(sigma.shape)}"
        ) from None
    _check_finite(mu.detach(), "mu")
    _check_sigma_2d(sigma)


def _check_sigma_2d(sigma: Tensor) -> None:
    sig = sigma.detach()
    _check_finite(sig, "sigma")
    a, b, d = sig[..., 0, 0], 0.5 * (sig[..., 0, 1] + sig[..., 1, 0]), sig[..., 1, 1]
    det = a * d - b * b
    _assert_values((a > 0) & (det > 0), "sigma must be symmetric positive definite (sigma[0,0] > 0 and det > 0)",
                   det[~((a > 0) & (det > 0))] if sig.device.type == "cpu" else None)


def _sym_entries(sigma: Tensor, work: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """(a, b, d) of (sigma + sigma^T) / 2 = [[a, b], [b, d]], in ``work`` dtype."""
    s = sigma.to(work)
    return s[..., 0, 0], 0.5 * (s[..., 0, 1] + s[..., 1, 0]), s[..., 1, 1]


def _out_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _reduce_grads_2d(ctx, grad, d_mu, d_sigma):
    """grad [..., N]; d_mu [..., N, 2]; d_sigma [..., N, 2, 2] -> grads shaped like the inputs."""
    mu_shape, sigma_shape, mu_dtype, sigma_dtype = ctx.shapes
    g = grad.to(d_mu.dtype)
    grad_mu = grad_sigma = None
    if ctx.needs_input_grad[0]:
        grad_mu = (g[..., None] * d_mu).sum(-2).sum_to_size(mu_shape).to(mu_dtype)
    if ctx.needs_input_grad[1]:
        grad_sigma = (g[..., None, None] * d_sigma).sum(-3).sum_to_size(sigma_shape).to(sigma_dtype)
    return grad_mu, grad_sigma


class _ContinuousSoftmax2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mu, sigma, centers, variances):
        work = _compute_dtype(mu.device)
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
        c_inv = torch.stack([torch.stack([cd, -cb], -1), torch.stack([-cb, ca], -1)], -2) / det[..., None, None]
        d_mu = -expectation[..., None] * y
        d_sigma = 0.5 * expectation[..., None, None] * (y[..., :, None] * y[..., None, :] - c_inv)
        ctx.save_for_backward(d_mu, d_sigma)
        ctx.shapes = (mu.shape, sigma.shape, mu.dtype, sigma.dtype)
        return expectation.to(_out_dtype(mu, sigma))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        d_mu, d_sigma = ctx.saved_tensors
        return (*_reduce_grads_2d(ctx, grad, d_mu, d_sigma), None, None)


def continuous_softmax_2d(mu: Tensor, sigma: Tensor, basis_centers: Tensor, basis_variances: Tensor) -> Tensor:
    """``E_p[psi(t)]`` for p = N(mu, Sigma) on R^2 (Shannon-regularised maximiser of E_p[f],
    ``f(t) = -(t - mu)^T Sigma^-1 (t - mu) / 2``) and psi_j = N(m_j, s_j^2 I), in closed form
    ``N(mu; m_j, Sigma + s_j^2 I)``.

    Args:
        mu: ``[..., 2]``; sigma: ``[..., 2, 2]`` symmetric positive definite (its symmetric
            part is used; the gradient returned for it is symmetric).
        basis_centers: ``[N, 2]``; basis_variances: ``[N]`` (s_j^2).
    Returns ``[..., N]``, differentiable w.r.t. mu and sigma (closed form).
    """
    _check_params_2d(mu, sigma)
    _check_basis_2d(basis_centers, basis_variances)
    return _ContinuousSoftmax2d.apply(mu, sigma, basis_centers, basis_variances)


def _cholesky_entries(a: Tensor, b: Tensor, d: Tensor):
    l11 = torch.sqrt(a)
    l21 = b / l11
    l22 = torch.sqrt(d - l21 * l21)
    return l11, l21, l22


# radial weights (1 + y)^(k+1), k = 0, 1, 2, for r = rho (1 + y) / 2 (ascending powers of y)
_RADIAL_POLYS = ((1.0, 1.0, 0.0, 0.0), (1.0, 2.0, 1.0, 0.0), (1.0, 3.0, 3.0, 1.0))


class _ContinuousSparsemax2d(torch.autograd.Function):
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
        work = _compute_dtype(mu.device)
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
        d_sigma = 0.5 * torch.stack([torch.stack([g11, g12], -1), torch.stack([g12, g22], -1)], -2)
        ctx.save_for_backward(d_mu, d_sigma)
        ctx.shapes = (mu.shape, sigma.shape, mu.dtype, sigma.dtype)
        return expectation.to(_out_dtype(mu, sigma))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        d_mu, d_sigma = ctx.saved_tensors
        return (*_reduce_grads_2d(ctx, grad, d_mu, d_sigma), None, None, None)


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
    """
    if not isinstance(num_angles, int) or num_angles < 3:
        raise ValueError(f"num_angles must be an int >= 3, got {num_angles!r}")
    _check_params_2d(mu, sigma)
    _check_basis_2d(basis_centers, basis_variances)
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
    """
    _check_tensor(sigma, "sigma", 2)
    if sigma.shape[-2:] != (2, 2):
        raise ValueError(f"sigma must have shape [..., 2, 2], got {tuple(sigma.shape)}")
    _check_sigma_2d(sigma)
    _check_tensor(basis_variances, "basis_variances", 1)
    _check_positive(basis_variances.detach(), "basis_variances")
    if not isinstance(num_angles, int) or num_angles < 3:
        raise ValueError(f"num_angles must be an int >= 3, got {num_angles!r}")
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
