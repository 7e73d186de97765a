"""Fenchel–Young losses of the entmax family, drop-in for ``entmax.losses``.

``L(X, y) = max_p [pᵀX + H_α(p)] − X_y = H_α(p*) + (p* − e_y)ᵀX`` with ``p* = entmax(X)``.
By the envelope theorem the gradient w.r.t. X is ``p* − e_y`` and the gradient w.r.t. α
is ``∂H_α(p*)/∂α`` at fixed p* (α may be a tensor that requires grad).

Twice differentiable: under ``create_graph=True`` the backward recomputes p* through the
(twice differentiable) mapping, so Hessian-vector products see p*'s dependence on X and α.

A −inf logit is a masked class, as in ``F.cross_entropy``: the loss, and the gradient on the
other classes, are those of the row without it, its own gradient is 0, and a target on it
gives +inf. (Its term of ``(p* − e_y)ᵀX`` is 0, not 0·(−inf) = NaN.)

Targets are class indices in [0, n_classes): anything else raises (on a GPU without a host
sync, asynchronously). The modules' ``ignore_index`` works as in ``F.cross_entropy``: those
positions get loss 0 and are left out of the mean (default −100; ``entmax`` only honoured
it when >= 0).
"""
from __future__ import annotations

import torch
from torch import nn

from ._validation import _assert_values, check_floating, mapping_alpha
from .mappings import checked_entmax, normmax_bisect, row_parameter

__all__ = [
    "sparsemax_loss", "sparsemax_bisect_loss", "entmax15_loss", "entmax_bisect_loss", "normmax_bisect_loss",
    "SparsemaxLoss", "SparsemaxBisectLoss", "Entmax15Loss", "EntmaxBisectLoss", "NormmaxBisectLoss",
]


def _check_loss_args(X, target, ignore_index=None):
    check_floating("X", X)
    if X.dim() != 2:
        raise ValueError(f"X must be 2-D (n_samples, n_classes), got shape {tuple(X.shape)}")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError("target must be an integer tensor of class indices")
    if target.shape != X.shape[:1]:
        raise ValueError(f"target must have shape ({X.shape[0]},), got {tuple(target.shape)}")
    if target.device != X.device:
        raise ValueError(f"target must be on X's device {X.device}, got {target.device}")
    valid = (target >= 0) & (target < X.shape[1])
    if ignore_index is not None:
        valid = valid | (target == ignore_index)
    _assert_values(valid, f"target must hold class indices in [0, {X.shape[1]})"
                          + (f" or ignore_index={ignore_index}" if ignore_index is not None else ""))


def _one_hot(p, target):
    return torch.zeros_like(p).scatter_(1, target.long().unsqueeze(1), 1.0)


def _tsallis_and_alpha_derivative(p: torch.Tensor, alpha: torch.Tensor):
    """(H_α(p), ∂H_α(p)/∂α at fixed p) per row, in float64, in torch ops (differentiable).

    ``H_α = (1 − S)/(α(α − 1))`` with ``S = Σ p^α``; ``∂H/∂α = −(T + H(2α − 1))/(α(α − 1))``
    with ``T = Σ p^α log p``. At α = 1, Shannon's ``H = −Σ p log p`` and the limit
    ``∂H/∂α = −(H + ½ Σ p log² p)``, written with its first-order term in (α − 1) so that its
    own α-derivative (double backward) is the limit ``∂²H/∂α² = 2H + L₂ − L₃/3`` too
    (``L_k = Σ p log^k p``).
    """
    p = p.to(torch.float64)
    a = alpha.to(torch.float64)
    positive = p > 0
    log_p = torch.where(positive, torch.log(torch.where(positive, p, torch.ones_like(p))), torch.zeros_like(p))
    is_shannon = a == 1
    a_safe = torch.where(is_shannon, torch.full_like(a, 2.0), a)
    p_pow = torch.where(positive, torch.exp(a_safe * log_p), torch.zeros_like(p))
    denominator = a_safe * (a_safe - 1)
    tsallis = (1 - p_pow.sum(1, keepdim=True)) / denominator
    d_tsallis = -((p_pow * log_p).sum(1, keepdim=True) + tsallis * (2 * a_safe - 1)) / denominator
    shannon = -(p * log_p).sum(1, keepdim=True)
    log_sq_sum = (p * log_p.square()).sum(1, keepdim=True)
    log_cube_sum = (p * log_p.pow(3)).sum(1, keepdim=True)
    d_shannon = -(shannon + 0.5 * log_sq_sum) + (a - 1) * (2 * shannon + log_sq_sum - log_cube_sum / 3)
    return (torch.where(is_shannon, shannon, tsallis).squeeze(1),
            torch.where(is_shannon, d_shannon, d_tsallis).squeeze(1))


class _FenchelYoungLoss(torch.autograd.Function):
    """Per-sample Fenchel–Young loss of α-entmax (``kind`` "entmax") or α-normmax."""

    @staticmethod
    def forward(ctx, X, alpha, target, kind):
        p = _FenchelYoungLoss._mapping(X, alpha, kind)
        if kind == "entmax":
            regulariser = _tsallis_and_alpha_derivative(p, alpha if isinstance(alpha, torch.Tensor)
                                                        else torch.tensor(alpha, dtype=torch.float64,
                                                                          device=X.device))[0]
        else:
            regulariser = (1 - p.to(torch.float64).pow(alpha).sum(1, keepdim=True).pow(1 / alpha)).squeeze(1)
        one_hot = _one_hot(p, target)
        # A −inf logit has p = 0: a masked class adds nothing, unless it is the target, whose
        # (0 − 1)·(−inf) = +inf is the loss. A row holding NaN or +inf keeps its NaN (p is NaN).
        linear = torch.where(torch.isneginf(X) & (one_hot == 0), torch.zeros_like(X), (p - one_hot) * X)
        loss = regulariser.to(X.dtype) + linear.sum(1)
        ctx.kind = kind
        ctx.alpha_float = None if isinstance(alpha, torch.Tensor) else alpha
        ctx.save_for_backward(X, alpha if isinstance(alpha, torch.Tensor) else None, target, p)
        return loss

    @staticmethod
    def _mapping(X, alpha, kind):
        if kind == "entmax":
            return checked_entmax(X, alpha, 1)
        return normmax_bisect(X, alpha, dim=1)

    @staticmethod
    def backward(ctx, grad):
        X, alpha_tensor, target, p = ctx.saved_tensors
        alpha = ctx.alpha_float if alpha_tensor is None else alpha_tensor
        if torch.is_grad_enabled():
            # create_graph=True: p* again, through the twice-differentiable mapping, so that
            # the gradient below depends on X and α as p* does.
            p = _FenchelYoungLoss._mapping(X, alpha, ctx.kind)
        g = grad.unsqueeze(1)
        dX = g * (p - _one_hot(p, target)) if ctx.needs_input_grad[0] else None
        dalpha = None
        if alpha_tensor is not None and ctx.needs_input_grad[1]:
            d_entropy = _tsallis_and_alpha_derivative(p, alpha_tensor)[1]
            dalpha = (g * d_entropy.unsqueeze(1).to(g.dtype)).to(alpha_tensor.dtype)
        return dX, dalpha, None, None


def _fy_loss(X: torch.Tensor, target: torch.Tensor, alpha) -> torch.Tensor:
    _check_loss_args(X, target)
    alpha = mapping_alpha(alpha, X, 1)
    return _FenchelYoungLoss.apply(X, alpha, target, "entmax")


def sparsemax_loss(X, target, k=None):
    """sparsemax loss (``entmax.sparsemax_loss``); ``k`` never changes the result.

    Args:
        X: (N, C) scores.
        target: (N,) class indices in [0, C).
        k: ignored (``entmax``'s partial sort size).

    Returns:
        (N,) losses; the gradient w.r.t. X is ``sparsemax(X) − one_hot(target)``.

    Examples:
        >>> import torch, entmax_fast
        >>> X = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]], requires_grad=True)
        >>> loss = entmax_fast.sparsemax_loss(X, torch.tensor([0, 2]))
        >>> loss
        tensor([0.1600, 0.3900], grad_fn=<_FenchelYoungLossBackward>)
        >>> loss.sum().backward()
        >>> X.grad
        tensor([[-0.4000,  0.4000,  0.0000],
                [ 0.2000,  0.5000, -0.7000]])
    """
    return _fy_loss(X, target, 2.0)


def sparsemax_bisect_loss(X, target, n_iter=50):
    """sparsemax loss (``entmax.sparsemax_bisect_loss``), :func:`sparsemax_loss`'s values;
    ``n_iter`` never changes the result.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.sparsemax_bisect_loss(torch.tensor([[1.0, 0.8, 0.1]]), torch.tensor([0]))
        tensor([0.1600])
    """
    return _fy_loss(X, target, 2.0)


def entmax15_loss(X, target, k=None):
    """1.5-entmax loss (``entmax.entmax15_loss``); ``k`` never changes the result.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.entmax15_loss(torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]]), torch.tensor([0, 2]))
        tensor([0.3140, 0.6105])
    """
    return _fy_loss(X, target, 1.5)


def entmax_bisect_loss(X, target, alpha=1.5, n_iter=50):
    """α-entmax loss; ``alpha`` a float or per-row tensor (it receives a gradient).

    Examples:
        >>> import torch, entmax_fast
        >>> X, target = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]]), torch.tensor([0, 2])
        >>> entmax_fast.entmax_bisect_loss(X, target, alpha=torch.tensor([[1.2], [1.8]]))
        tensor([0.5395, 0.4582])
    """
    return _fy_loss(X, target, alpha)


def normmax_bisect_loss(X, target, alpha=2, n_iter=50):
    """α-normmax Fenchel–Young loss: ``1 − ‖p*‖_α + (p* − e_y)ᵀX``; ``alpha`` as
    ``normmax_bisect`` takes it (a number > 1 or one per row, not differentiated).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.normmax_bisect_loss(torch.tensor([[1.0, 0.8, 0.1]]), torch.tensor([0]), alpha=2)
        tensor([0.2000])
    """
    _check_loss_args(X, target)
    alpha = row_parameter("alpha", alpha, X, 1, "normmax_bisect_loss", minimum=1.0, inclusive=False)
    return _FenchelYoungLoss.apply(X, alpha, target, "normmax")


class _GenericLoss(nn.Module):
    def __init__(self, ignore_index=-100, reduction="elementwise_mean"):
        if reduction not in ("elementwise_mean", "mean", "sum", "none"):
            raise ValueError(f"reduction must be 'elementwise_mean', 'mean', 'sum' or 'none', got {reduction!r}")
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction

    def forward(self, X, target):
        _check_loss_args(X, target, self.ignore_index)
        ignored = target == self.ignore_index
        loss = self.loss(X, torch.where(ignored, torch.zeros_like(target), target)).masked_fill(ignored, 0.0)
        size = (~ignored).sum().to(loss.dtype)
        if self.reduction == "sum":
            return loss.sum()
        if self.reduction in ("elementwise_mean", "mean"):
            return loss.sum() / size
        return loss


class SparsemaxLoss(_GenericLoss):
    """:func:`sparsemax_loss` as a module (``entmax.SparsemaxLoss``): ``forward(X (N, C), target (N,))`` gives
    the mean over the targets not equal to ``ignore_index`` (``reduction="elementwise_mean"``
    or ``"mean"``), their sum (``"sum"``) or the (N,) losses (``"none"``, 0 where ignored).

    Examples:
        >>> import torch, entmax_fast
        >>> X = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]])
        >>> entmax_fast.SparsemaxLoss()(X, torch.tensor([0, 2]))
        tensor(0.2750)
        >>> entmax_fast.SparsemaxLoss(reduction="none")(X, torch.tensor([0, -100]))
        tensor([0.1600, 0.0000])
    """

    def __init__(self, k=None, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.k = k

    def loss(self, X, target):
        return sparsemax_loss(X, target, self.k)


class SparsemaxBisectLoss(_GenericLoss):
    """:func:`sparsemax_bisect_loss` as a module (``entmax.SparsemaxBisectLoss``): ``forward(X (N, C), target (N,))`` gives
    the mean over the targets not equal to ``ignore_index`` (``reduction="elementwise_mean"``
    or ``"mean"``), their sum (``"sum"``) or the (N,) losses (``"none"``, 0 where ignored).

    Examples:
        >>> import torch, entmax_fast
        >>> X = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]])
        >>> entmax_fast.SparsemaxBisectLoss()(X, torch.tensor([0, 2]))
        tensor(0.2750)
        >>> entmax_fast.SparsemaxBisectLoss(reduction="none")(X, torch.tensor([0, -100]))
        tensor([0.1600, 0.0000])
    """

    def __init__(self, n_iter=50, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.n_iter = n_iter

    def loss(self, X, target):
        return sparsemax_bisect_loss(X, target, self.n_iter)


class Entmax15Loss(_GenericLoss):
    """:func:`entmax15_loss` as a module (``entmax.Entmax15Loss``): ``forward(X (N, C), target (N,))`` gives
    the mean over the targets not equal to ``ignore_index`` (``reduction="elementwise_mean"``
    or ``"mean"``), their sum (``"sum"``) or the (N,) losses (``"none"``, 0 where ignored).

    Examples:
        >>> import torch, entmax_fast
        >>> X = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]])
        >>> entmax_fast.Entmax15Loss()(X, torch.tensor([0, 2]))
        tensor(0.4622)
        >>> entmax_fast.Entmax15Loss(reduction="none")(X, torch.tensor([0, -100]))
        tensor([0.3140, 0.0000])
    """

    def __init__(self, k=100, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.k = k

    def loss(self, X, target):
        return entmax15_loss(X, target, self.k)


class EntmaxBisectLoss(_GenericLoss):
    """:func:`entmax_bisect_loss` as a module (``entmax.EntmaxBisectLoss``): ``forward(X (N, C), target (N,))`` gives
    the mean over the targets not equal to ``ignore_index`` (``reduction="elementwise_mean"``
    or ``"mean"``), their sum (``"sum"``) or the (N,) losses (``"none"``, 0 where ignored).

    Examples:
        >>> import torch, entmax_fast
        >>> X = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]])
        >>> entmax_fast.EntmaxBisectLoss()(X, torch.tensor([0, 2]))
        tensor(0.4622)
        >>> entmax_fast.EntmaxBisectLoss(reduction="none")(X, torch.tensor([0, -100]))
        tensor([0.3140, 0.0000])
    """

    def __init__(self, alpha=1.5, n_iter=50, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.alpha = alpha
        self.n_iter = n_iter

    def loss(self, X, target):
        return entmax_bisect_loss(X, target, self.alpha, self.n_iter)


class NormmaxBisectLoss(_GenericLoss):
    """:func:`normmax_bisect_loss` as a module (``entmax.NormmaxBisectLoss``): ``forward(X (N, C), target (N,))`` gives
    the mean over the targets not equal to ``ignore_index`` (``reduction="elementwise_mean"``
    or ``"mean"``), their sum (``"sum"``) or the (N,) losses (``"none"``, 0 where ignored).

    Examples:
        >>> import torch, entmax_fast
        >>> X = torch.tensor([[1.0, 0.8, 0.1], [0.2, 0.5, 0.3]])
        >>> entmax_fast.NormmaxBisectLoss()(X, torch.tensor([0, 2]))
        tensor(0.3348)
        >>> entmax_fast.NormmaxBisectLoss(reduction="none")(X, torch.tensor([0, -100]))
        tensor([0.2000, 0.0000])
    """

    def __init__(self, alpha=2, n_iter=50, ignore_index=-100, reduction="elementwise_mean"):
        super().__init__(ignore_index, reduction)
        self.alpha = alpha
        self.n_iter = n_iter

    def loss(self, X, target):
        return normmax_bisect_loss(X, target, self.alpha, self.n_iter)
