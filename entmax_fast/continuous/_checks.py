"""Argument checks of the continuous-attention functions, on top of ``entmax_fast._validation``.

Value checks (``sigma_sq > 0``, finite ``mu``, non-empty rows) never synchronise the host with
an accelerator: on CPU they raise ``ValueError`` at once, elsewhere they are device-side
assertions (``torch._assert_async``) that surface at the next synchronisation.
"""

import torch
from torch import Tensor

from .._validation import _assert_values, check_floating

# the names continuous_density and ContinuousAttention accept for a 1-D density
DENSITIES_1D = ("softmax", "sparsemax", "entmax15")


def check_tensor(x, name: str, ndim_min: int = 0) -> None:
    # check_floating words the dtype error "a floating-point dtype"; this API has always said
    # "a floating-point tensor" and callers match on it, so that one case is answered first
    if isinstance(x, Tensor) and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    check_floating(name, x)
    if x.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dimension(s), got shape {tuple(x.shape)}")


def check_density_1d(density: str) -> None:
    if density not in DENSITIES_1D:
        raise ValueError(f"density must be one of {DENSITIES_1D}, got {density!r}")


def check_num_angles(num_angles) -> None:
    if not isinstance(num_angles, int) or num_angles < 3:
        raise ValueError(f"num_angles must be an int >= 3, got {num_angles!r}")


def assert_values_naming_one(ok: Tensor, message: str, values: Tensor) -> None:
    """``_assert_values(ok, message)``, the message naming the first entry of ``values`` where
    ``ok`` is False when the check runs eagerly on the CPU (elsewhere reading it would sync)."""
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = values[~ok]
        if bad.numel() > 0:
            message = f"{message}; got {bad.flatten()[0].item()!r}"
    _assert_values(ok, message)


def check_finite(x: Tensor, name: str) -> None:
    assert_values_naming_one(torch.isfinite(x), f"{name} must be finite (no NaN or inf)", x)


def check_positive(x: Tensor, name: str) -> None:
    ok = x > 0  # NaN compares False, so NaN is reported here too
    assert_values_naming_one(ok, f"{name} must be > 0 and not NaN", x)


def check_basis_1d(centers: Tensor, variances: Tensor) -> None:
    check_tensor(centers, "basis_centers", 1)
    check_tensor(variances, "basis_variances", 1)
    if centers.dim() != 1 or centers.numel() == 0:
        raise ValueError(f"basis_centers must have shape (N,) with N >= 1, got {tuple(centers.shape)}")
    if variances.shape != centers.shape:
        raise ValueError(
            f"basis_variances must have the shape of basis_centers {tuple(centers.shape)}, got {tuple(variances.shape)}"
        )
    if centers.requires_grad or variances.requires_grad:
        raise ValueError("basis_centers and basis_variances must not require grad: the basis is fixed")
    check_finite(centers, "basis_centers")
    check_positive(variances, "basis_variances")


def check_params_1d(mu: Tensor, sigma_sq: Tensor) -> None:
    check_tensor(mu, "mu")
    check_tensor(sigma_sq, "sigma_sq")
    try:
        torch.broadcast_shapes(mu.shape, sigma_sq.shape)
    except RuntimeError:
        raise ValueError(
            f"mu and sigma_sq must be broadcastable, got shapes {tuple(mu.shape)} and {tuple(sigma_sq.shape)}"
        ) from None
    check_finite(mu.detach(), "mu")
    check_positive(sigma_sq.detach(), "sigma_sq")
    check_finite(sigma_sq.detach(), "sigma_sq")


def check_basis_2d(centers: Tensor, variances: Tensor) -> None:
    check_tensor(centers, "basis_centers", 2)
    check_tensor(variances, "basis_variances", 1)
    if centers.dim() != 2 or centers.shape[-1] != 2 or centers.shape[0] == 0:
        raise ValueError(f"basis_centers must have shape (N, 2) with N >= 1, got {tuple(centers.shape)}")
    if variances.shape != centers.shape[:1]:
        raise ValueError(f"basis_variances must have shape ({centers.shape[0]},), got {tuple(variances.shape)}")
    if centers.requires_grad or variances.requires_grad:
        raise ValueError("basis_centers and basis_variances must not require grad: the basis is fixed")
    check_finite(centers, "basis_centers")
    check_positive(variances, "basis_variances")


def check_params_2d(mu: Tensor, sigma: Tensor) -> None:
    check_tensor(mu, "mu", 1)
    check_tensor(sigma, "sigma", 2)
    if mu.shape[-1] != 2:
        raise ValueError(f"mu must have shape [..., 2], got {tuple(mu.shape)}")
    check_sigma_shape_2d(sigma)
    try:
        torch.broadcast_shapes(mu.shape[:-1], sigma.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"mu [..., 2] and sigma [..., 2, 2] must have broadcastable batch shapes, got "
            f"{tuple(mu.shape)} and {tuple(sigma.shape)}"
        ) from None
    check_finite(mu.detach(), "mu")
    check_sigma_2d(sigma)


def check_sigma_shape_2d(sigma: Tensor) -> None:
    if sigma.shape[-2:] != (2, 2):
        raise ValueError(f"sigma must have shape [..., 2, 2], got {tuple(sigma.shape)}")


def check_sigma_2d(sigma: Tensor) -> None:
    sig = sigma.detach()
    check_finite(sig, "sigma")
    a, b, d = sig[..., 0, 0], 0.5 * (sig[..., 0, 1] + sig[..., 1, 0]), sig[..., 1, 1]
    det = a * d - b * b
    assert_values_naming_one((a > 0) & (det > 0),
                             "sigma must be symmetric positive definite (sigma[0,0] > 0 and det > 0)", det)
