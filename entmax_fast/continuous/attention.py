"""The continuous-attention layer: a discrete attention gives (mu, sigma_sq), a 1-D
continuous density with those parameters weighs the ridge-fitted value function."""

import math
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .._validation import _assert_values
from ._checks import check_density_1d, check_tensor
from .basis import GaussianBasis1d, sequence_positions
from .one_d import continuous_density


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

    Examples:
        >>> import torch, entmax_fast
        >>> layer = entmax_fast.ContinuousAttention(query_dim=16, key_dim=16, density="sparsemax")
        >>> query, keys, values = torch.randn(2, 16), torch.randn(2, 30, 16), torch.randn(2, 30, 8)
        >>> context, (mu, sigma_sq) = layer(query, keys, values, return_params=True)
        >>> context.shape, mu.shape
        (torch.Size([2, 8]), torch.Size([2]))
        >>> bool(((mu > 0) & (mu < 1)).all())                               # positions lie in [0, 1]
        True
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
        check_density_1d(density)
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
        check_tensor(query, "query", 2)
        check_tensor(keys, "keys", 3)
        check_tensor(values, "values", 3)
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
