"""The value function of 1-D continuous attention: Gaussian RBFs and their ridge fit.

Values enter through a function ``V(t) = B psi(t)`` with Gaussian RBFs
``psi_j(t) = N(t; m_j, s_j^2)``; the context is ``c = B E_p[psi(t)]``.
:class:`GaussianBasis1d` fits ``B`` by ridge regression on the L value vectors of a sequence
at the positions :func:`sequence_positions` gives them.
"""

import contextlib
import math
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from .._validation import _assert_values
from ._checks import check_basis_1d, check_tensor
from ._integrals import integration_dtype


def sequence_positions(length: int, mask: Optional[Tensor] = None, dtype=torch.float64, device=None) -> Tensor:
    """Positions t_l = (l - 1/2) / L of the L items of a sequence in [0, 1].

    Without ``mask``: ``[length]``. With ``mask`` ``[B, length]`` (bool, True = item present, any
    pattern): the present items of row b get ``(rank + 1/2) / L_b`` in order, L_b their count;
    absent items get 0. Returns ``[B, length]``.

    Examples:
        >>> import torch
        >>> from entmax_fast import continuous
        >>> continuous.sequence_positions(4)
        tensor([0.1250, 0.3750, 0.6250, 0.8750], dtype=torch.float64)
        >>> continuous.sequence_positions(4, torch.tensor([[True, True, False, True]]))
        tensor([[0.1667, 0.5000, 0.0000, 0.8333]], dtype=torch.float64)
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

    Examples:
        >>> import torch, entmax_fast
        >>> basis = entmax_fast.GaussianBasis1d(torch.tensor([0.25, 0.5, 0.75]), torch.full((3,), 0.01))
        >>> basis(torch.tensor([0.5], dtype=torch.float64))                # psi_j(0.5) = N(0.5; m_j, 0.01)
        tensor([[0.1753, 3.9894, 0.1753]], dtype=torch.float64)
        >>> entmax_fast.GaussianBasis1d.grid(num_centers=16, widths=(0.03, 0.1, 0.3)).num_basis
        48
    """

    def __init__(self, centers: Tensor, variances: Tensor, ridge: float = 0.01):
        super().__init__()
        centers = torch.as_tensor(centers, dtype=torch.float64)
        variances = torch.as_tensor(variances, dtype=torch.float64)
        check_basis_1d(centers, variances)
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
            # One cache serves calls in and out of inference mode. Built under inference mode,
            # G would be an inference tensor, which a later call under autograd cannot save
            # for backward; so it is always built as a normal tensor (the basis has no grad).
            with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
                work = integration_dtype(device)
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
        check_tensor(expected_basis, "expected_basis", 1)
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
        work = integration_dtype(mask.device)
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
