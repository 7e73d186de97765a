"""Public row-wise mappings, drop-in for the ``entmax`` package.

Layers: public function (validates) → :class:`EntmaxFunction` (autograd; flattens to rows)
→ the backend picked by ``dispatch`` for op ``"entmax"`` (reference, Triton or C++), whose
contract is ``entmax_rowwise_forward(x (R, n), alpha float | tensor (R,)) -> p`` and
``entmax_rowwise_backward(p, grad, alpha, need_alpha_grad) -> (dx, dalpha (R,) | None)``.

Every mapping depends only on score differences (rows are shifted by their max), at any
magnitude. Bad values follow ``torch.softmax``: a row holding NaN or +inf gives NaN (and NaN
gradients), −inf entries get weight 0, a row without a finite entry gives zeros. Empty
inputs give empty outputs. Double backward is exact.
"""
from __future__ import annotations

import math

import torch

from . import dispatch
from ._validation import (_assert_values, check_backend_dtype, check_dim, check_floating, expand_to_rows,
                          mapping_alpha)
from .reference import mappings as _reference
from .reference import normmax_budget as _reference_normmax_budget
from .common import compute_dtype

__all__ = ["sparsemax", "entmax15", "entmax_bisect", "sparsemax_bisect", "normmax_bisect", "budget_bisect",
           "EntmaxFunction"]


def _to_rows(X: torch.Tensor, dim: int):
    """(R, n) rows with a unit-stride last dim, as every backend's contract requires."""
    # dim is usually already last, and X often 2-D: each skipped view is a few µs of host
    # time, as much as a small call's kernel on a GPU.
    moved = X if dim == X.dim() - 1 else X.movedim(dim, -1)
    rows = moved if moved.dim() == 2 else moved.reshape(-1, moved.shape[-1])
    if rows.stride(-1) != 1 and rows.shape[-1] > 1:
        rows = rows.contiguous()
    return rows, moved.shape


def _from_rows(rows: torch.Tensor, moved_shape, dim: int):
    if rows.shape != moved_shape:
        rows = rows.reshape(moved_shape)
    return rows if dim == rows.dim() - 1 else rows.movedim(-1, dim)


def _alpha_rows(alpha, X, dim):
    if isinstance(alpha, torch.Tensor):
        return _to_rows(alpha, dim)[0].reshape(-1).to(compute_dtype(X.dtype))
    return alpha


class EntmaxFunction(torch.autograd.Function):
    """α-entmax along ``dim`` with gradients for X and (tensor) α, on the dispatched backend.

    Twice differentiable: under ``create_graph=True`` the backward is the reference's closed
    form in p (plain torch ops on the saved output), so autograd differentiates it again,
    whatever backend ran the forward.
    """

    @staticmethod
    def forward(ctx, X, alpha, dim):
        x_rows, moved_shape = _to_rows(X, dim)
        alpha_rows = _alpha_rows(alpha, X, dim)
        request = dispatch.Request(X.device, X.dtype, {"alpha": alpha if isinstance(alpha, float) else "tensor"})
        (forward, backward), choice = dispatch.select("entmax", request)
        check_backend_dtype(choice, X)
        out = _from_rows(forward(x_rows, alpha_rows), moved_shape, dim)
        ctx.backward_impl = backward
        ctx.dim = dim
        ctx.alpha_float = None if isinstance(alpha, torch.Tensor) else alpha
        ctx.save_for_backward(out, alpha if isinstance(alpha, torch.Tensor) else None)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        out, alpha_input = ctx.saved_tensors
        p_rows, moved_shape = _to_rows(out, ctx.dim)
        alpha = ctx.alpha_float if alpha_input is None else _alpha_rows(alpha_input, out, ctx.dim)
        need_alpha_grad = alpha_input is not None and ctx.needs_input_grad[1]
        g_rows, _ = _to_rows(grad_output, ctx.dim)
        backward = _reference.entmax_rowwise_backward if torch.is_grad_enabled() else ctx.backward_impl
        dx_rows, dalpha_rows = backward(p_rows, g_rows, alpha, need_alpha_grad)
        dX = _from_rows(dx_rows, moved_shape, ctx.dim) if ctx.needs_input_grad[0] else None
        dalpha = None
        if need_alpha_grad:
            moved = list(moved_shape)
            moved[-1] = 1
            dalpha = dalpha_rows.reshape(moved).movedim(-1, ctx.dim).to(alpha_input.dtype)
        return dX, dalpha, None


def checked_entmax(X, alpha, dim):
    """α-entmax of X along dim with X, dim and α checked (the mappings' and losses' entry)."""
    check_floating("X", X)
    dim = check_dim("X", X, dim)
    alpha = mapping_alpha(alpha, X, dim)
    if X.numel() == 0:
        return X.clone()
    if isinstance(alpha, torch.Tensor):
        # Gradients flow to the caller's α through `expand`, which sums over broadcast dims.
        alpha = alpha.to(compute_dtype(X.dtype))
    return EntmaxFunction.apply(X, alpha, dim)


def sparsemax(X, dim=-1, k=None):
    """sparsemax: ``argmin_{p ∈ Δ} ‖p − X‖²`` along ``dim`` (exact).

    ``k`` is accepted for compatibility with ``entmax.sparsemax``; results never depend on it.

    Args:
        X: scores, any shape, floating point.
        dim: the dimension whose entries sum to one.
        k: ignored (``entmax``'s partial sort size).

    Returns:
        A tensor of X's shape and dtype, each slice along ``dim`` on the simplex.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.sparsemax(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.6000, 0.4000, 0.0000, 0.0000]])
    """
    return checked_entmax(X, 2.0, dim)


def entmax15(X, dim=-1, k=None):
    """1.5-entmax: ``argmax_{p ∈ Δ} pᵀX + H_{1.5}(p)`` along ``dim`` (exact).

    ``k`` is accepted for compatibility with ``entmax.entmax15``; results never depend on it.

    Args:
        X: scores, any shape, floating point.
        dim: the dimension whose entries sum to one.
        k: ignored (``entmax``'s partial sort size).

    Returns:
        A tensor of X's shape and dtype, each slice along ``dim`` on the simplex.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.entmax15(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.5292, 0.3937, 0.0770, 0.0000]])
    """
    return checked_entmax(X, 1.5, dim)


def entmax_bisect(X, alpha=1.5, dim=-1, n_iter=50, ensure_sum_one=True):
    """α-entmax: ``argmax_{p ∈ Δ} pᵀX + H_α(p)`` with the Tsallis α-entropy, along ``dim``.

    ``alpha``: float > 0 or a tensor broadcastable to X with size 1 along ``dim`` (per row,
    per head); it receives a gradient. α = 1 is softmax, α = 2 sparsemax, 0 < α < 1 dense.
    The threshold is found to a tolerance, then the output is normalised exactly on the
    found support, so ``n_iter`` and ``ensure_sum_one`` (kept for compatibility with
    ``entmax.entmax_bisect``) do not change the result.

    Args:
        X: scores, any shape, floating point.
        alpha: float > 0, or a tensor broadcastable to X with size 1 along ``dim``.
        dim: the dimension whose entries sum to one.
        n_iter: ignored (``entmax``'s bisection steps).
        ensure_sum_one: ignored (the output always sums to one).

    Returns:
        A tensor of X's shape and dtype, each slice along ``dim`` on the simplex.

    Examples:
        >>> import torch, entmax_fast
        >>> x = torch.tensor([[1.0, 0.8, 0.1, -1.0]])
        >>> entmax_fast.entmax_bisect(x, alpha=1.25)
        tensor([[0.4787, 0.3736, 0.1356, 0.0121]])
        >>> torch.equal(entmax_fast.entmax_bisect(x, alpha=1.0), torch.softmax(x, dim=-1))
        True
        >>> alpha = torch.tensor([[1.5]], requires_grad=True)  # one α for the row, learned
        >>> entmax_fast.entmax_bisect(x, alpha=alpha)[0, 0].backward()
        >>> alpha.grad
        tensor([[0.2048]])
    """
    return checked_entmax(X, alpha, dim)


def sparsemax_bisect(X, dim=-1, n_iter=50, ensure_sum_one=True):
    """sparsemax (``entmax_bisect`` at α = 2); ``n_iter``/``ensure_sum_one`` as there.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.sparsemax_bisect(torch.tensor([[1.0, 0.8, 0.1, -1.0]]))
        tensor([[0.6000, 0.4000, 0.0000, 0.0000]])
    """
    return checked_entmax(X, 2.0, dim)


def row_parameter(name: str, value, X: torch.Tensor, dim: int, what: str, minimum: float, inclusive: bool,
                   maximum: float | None = None, maximum_name: str | None = None):
    """normmax's α or budget-sparsemax's budget, taken as ``entmax`` 1.3 takes them: a number,
    or a real tensor broadcastable to X's shape with size 1 along ``dim`` (one value per row,
    per head, ...), as ``entmax_bisect``'s α.

    Returns a float (a number, or a 0-d CPU tensor: reading it syncs no device), else the
    tensor expanded to that keepdim shape in X's compute dtype, its values checked without a
    host sync. The parameter is not differentiated (``entmax`` passes it no gradient either),
    so a tensor that requires grad is refused rather than silently left without a gradient.
    """
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    above = f"{name} must be {bound} for {what}"
    below = f"{name} must be at most {maximum_name} ({maximum})"
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            raise ValueError(f"{name} of {what} is not differentiated; pass a float or a tensor that does not "
                             f"require grad (e.g. {name}.detach())")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number or tensor for {what}, got dtype {value.dtype}")
        rows = expand_to_rows(value, X, dim, f"{name} must be a number or a tensor", f" for {what}")
        if value.dim() == 0 and value.device.type == "cpu":
            value = value.item()
        else:
            if value.device != X.device:
                raise ValueError(f"{name} must be on X's device {X.device} (or be a 0-d CPU tensor), "
                                 f"got {value.device}")
            rows = rows.to(compute_dtype(X.dtype))
            # Two comparisons also refuse NaN and ±inf.
            _assert_values(((rows >= minimum) if inclusive else (rows > minimum)) & (rows < math.inf),
                           f"{above} (and finite) everywhere")
            if maximum is not None:
                _assert_values(rows <= maximum, f"{below} everywhere")
            return rows
    value = float(value)
    if not (math.isfinite(value) and (value >= minimum if inclusive else value > minimum)):
        raise ValueError(f"{above}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{below}, got {value}")
    return value


class _RowwiseFunction(torch.autograd.Function):
    """normmax / budget along ``dim`` on the dispatched backend (rows flattened; a tensor
    parameter, keepdim along ``dim``, flattened alike to one value per row).

    Twice differentiable: under ``create_graph=True`` the backward is the reference's closed
    form in p, which autograd differentiates again.
    """

    _REFERENCE_BACKWARD = {"normmax": _reference_normmax_budget.normmax_backward,
                           "budget": _reference_normmax_budget.budget_backward}

    @staticmethod
    def forward(ctx, X, parameter, dim, op):
        x_rows, moved_shape = _to_rows(X, dim)
        parameter = _alpha_rows(parameter, X, dim)
        (forward, backward), _ = dispatch.select(op, dispatch.Request(X.device, X.dtype, {}))
        out = _from_rows(forward(x_rows, parameter), moved_shape, dim)
        ctx.save_for_backward(out)
        ctx.backward_impl, ctx.parameter, ctx.dim, ctx.op = backward, parameter, dim, op
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (out,) = ctx.saved_tensors
        p_rows, moved_shape = _to_rows(out, ctx.dim)
        g_rows, _ = _to_rows(grad_output, ctx.dim)
        backward = _RowwiseFunction._REFERENCE_BACKWARD[ctx.op] if torch.is_grad_enabled() else ctx.backward_impl
        dx_rows = backward(p_rows, g_rows, ctx.parameter)
        return _from_rows(dx_rows, moved_shape, ctx.dim), None, None, None


def normmax_bisect(X, alpha=2, dim=-1, n_iter=50):
    """α-normmax: ``argmax_{p ∈ Δ} pᵀX − ‖p‖_α`` along ``dim``.

    ``alpha``: a number > 1, or a tensor of them broadcastable to X with size 1 along ``dim``
    (one α per row, per head), as ``entmax.normmax_bisect`` takes it. α is not differentiated
    (``entmax`` passes it no gradient either): a tensor that requires grad is refused. The
    threshold is found to a tolerance; ``n_iter`` is kept for compatibility.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.normmax_bisect(torch.tensor([[1.0, 0.8, 0.1, -1.0]]), alpha=2)
        tensor([[0.5714, 0.4286, 0.0000, 0.0000]])
    """
    check_floating("X", X)
    dim = check_dim("X", X, dim)
    alpha = row_parameter("alpha", alpha, X, dim, "normmax_bisect", minimum=1.0, inclusive=False)
    if X.numel() == 0:
        return X.clone()
    return _RowwiseFunction.apply(X, alpha, dim, "normmax")


def budget_bisect(X, budget=2, dim=-1, n_iter=50):
    """budget-sparsemax: ``argmax_{0 ≤ p ≤ 1, Σp = budget} pᵀX − ½‖p‖²`` along ``dim``.

    ``budget``: a number in [0, n] (n the size of ``dim``), or a tensor of them broadcastable
    to X with size 1 along ``dim`` (one budget per row), as ``entmax.budget_bisect`` takes
    it. Not differentiated (``entmax`` passes it no gradient either): a tensor that requires
    grad is refused. Budget 0 leaves p = 0 the only feasible point: that row is all zeros,
    with zero gradient (``entmax`` 1.3 returns the same up to its bisection's last step);
    budget n gives all ones. ``n_iter`` is kept for compatibility (the threshold is exact on
    the final active set).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.budget_bisect(torch.tensor([[1.0, 0.8, 0.1, -1.0]]), budget=2)
        tensor([[1.0000, 0.8500, 0.1500, 0.0000]])
    """
    check_floating("X", X)
    dim = check_dim("X", X, dim)
    # A row of length 0 has no budget to meet; its output is empty whatever the budget.
    budget = row_parameter("budget", budget, X, dim, "budget_bisect", minimum=0.0, inclusive=True,
                            maximum=X.shape[dim] if X.numel() else None, maximum_name=f"the size of dim {dim}")
    if X.numel() == 0:
        return X.clone()
    return _RowwiseFunction.apply(X, budget, dim, "budget")
