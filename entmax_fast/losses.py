"""Fenchel–Young losses of the entmax family, drop-in for ``entmax.losses``.

``L(X, y) = max_p [pᵀX + H_α(p)] − X_y = H_α(p*) + (p* − e_y)ᵀX`` with ``p* = entmax(X)``.
By the envelope theorem the gradient w.r.t. X is ``p* − e_y`` and the gradient w.r.t. α
is ``∂H_α(p*)/∂α`` at fixed p*, so the loss is written with p* detached and autograd
gives exactly those gradients (α may be a tensor that requires grad).
"""
from __future__ import annotations

import torch
from torch import nn

from ._validation import check_floating, mapping_alpha
from .mappings import _entmax, normmax_bisect
from .reference.mappings import tsallis_entropy

__all__ = [
    "sparsemax_loss", "sparsemax_bisect_loss", "entmax15_loss", "entmax_bisect_loss", "normmax_bisect_loss",
    "SparsemaxLoss", "SparsemaxBisectLoss", "Entmax15Loss", "EntmaxBisectLoss", "NormmaxBisectLoss",
]


def _check_loss_args(X, target):
    check_floating("X", X)
    if X.dim() != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_classes), got shape {tuple(X.shape)}")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError("target must be an integer tensor of class indices")
    if target.shape != X.shape[:1]:
        raise ValueError(f"target must have shape ({X.shape[0]},), got {tuple(target.shape)}")
    if target.device != X.device:
        raise ValueError(f"target must be on X's device {X.device}, got {target.device}")


def _one_hot_term(p_star, X, target):
    one_hot = torch.zeros_like(p_star).scatter_(1, target.long().clamp(min=0).unsqueeze(1), 1.0)
    return ((p_star - one_hot) * X).sum(dim=1)


def _fy_loss(X: torch.Tensor, target: torch.Tensor, alpha) -> torch.Tensor:
    _check_loss_args(X, target)
    alpha = mapping_alpha(alpha, X, 1)
    with torch.no_grad():
        p_star = _entmax(X.detach(), alpha.detach() if isinstance(alpha, torch.Tensor) else alpha, 1)
    p_star = p_star.to(X.dtype)
    entropy = tsallis_entropy(p_star, alpha, dim=1).to(X.dtype)
    return entropy + _one_hot_term(p_star, X, target)


def sparsemax_loss(X, target, k=None):
    """sparsemax loss (``entmax.sparsemax_loss``); ``k`` never changes the result."""
    return _fy_loss(X, target, 2.0)


def sparsemax_bisect_loss(X, target, n_iter=50):
    return _fy_loss(X, target, 2.0)


def entmax15_loss(X, target, k=None):
    """1.5-entmax loss (``entmax.entmax15_loss``); ``k`` never changes the result."""
    return _fy_loss(X, target, 1.5)


def entmax_bisect_loss(X, target, alpha=1.5, n_iter=50):
    """α-entmax loss; ``alpha`` a float or per-row tensor (it receives a gradient)."""
    return _fy_loss(X, target, alpha)


def normmax_bisect_loss(X, target, alpha=2, n_iter=50):
    """α-normmax Fenchel–Young loss: ``1 − ‖p*‖_α + (p* − e_y)ᵀX``."""
    _check_loss_args(X, target)
    with torch.no_grad():
        p_star = normmax_bisect(X.detach(), alpha, dim=1)
    return 1 - p_star.pow(float(alpha)).sum(dim=1).pow(1 / float(alpha)) + _one_hot_term(p_star, X, target)


class _GenericLoss(nn.Module):
    def __init__(self, ignore_index=-100, reduction="elementwise_mean"):
        if reduction not in ("elementwise_mean", "mean", "sum", "none"):
            raise ValueError(f"reduction must be 'elementwise_mean', 'mean', 'sum' or 'none', got {reduction!r}")
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, X, target):
        loss = self.loss(X, target)
        if self.ignore_index >= 0:
            ignored = target == self.ignore_index
            loss = loss.masked_fill(ignored, 0.0)
            size = (~ignored).sum().to(loss.dtype)
        else:
            size = torch.tensor(float(target.shape[0]), dtype=loss.dtype, device=loss.device)
        if self.reduction == "sum":
            return loss.sum()
        if self.reduction in ("elementwise_mean", "mean"):
            return loss.sum() / size
        return loss


class SparsemaxLoss(_GenericLoss):
    def __init__(self, k=None, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.k = k

    def loss(self, X, target):
        return sparsemax_loss(X, target, self.k)


class SparsemaxBisectLoss(_GenericLoss):
    def __init__(self, n_iter=50, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.n_iter = n_iter

    def loss(self, X, target):
        return sparsemax_bisect_loss(X, target, self.n_iter)


class Entmax15Loss(_GenericLoss):
    def __init__(self, k=100, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.k = k

    def loss(self, X, target):
        return entmax15_loss(X, target, self.k)


class EntmaxBisectLoss(_GenericLoss):
    def __init__(self, alpha=1.5, n_iter=50, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.alpha = alpha
        self.n_iter = n_iter

    def loss(self, X, target):
        return entmax_bisect_loss(X, target, self.alpha, self.n_iter)


class NormmaxBisectLoss(_GenericLoss):
    def __init__(self, alpha=2, n_iter=50, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.alpha = alpha
        self.n_iter = n_iter

    def loss(self, X, target):
        return normmax_bisect_loss(X, target, self.alpha, self.n_iter)
