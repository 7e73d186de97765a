"""C++ CPU backend: row-wise α-entmax and entmax attention (``torch.ops.entmax_fast``).

The kernels live in ``csrc/cpu/`` and are registered as torch ops by importing
``entmax_fast._C``. This module adds their fake (meta) kernels and autograd formulas and
exposes the backend entry points that ``entmax_fast.dispatch`` routes CPU tensors to:

- ``entmax_rowwise_forward(x, alpha)`` / ``entmax_rowwise_backward(p, grad, alpha, need_alpha_grad)``
- ``entmax_attention_cpp(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, alpha)``
- ``is_available() -> (bool, reason)``

Arithmetic is float64 for float64 tensors and float32 otherwise (fp16/bf16 are computed in
float32); results come back in the input dtype.
"""
from __future__ import annotations

import math

import torch

from . import _ext
from ._validation import once_differentiable_grads
from .reference import attention as _reference_attention
from .reference import mappings as _reference_mappings

__all__ = [
    "is_available",
    "entmax_rowwise_forward",
    "entmax_rowwise_backward",
    "entmax_attention_cpp",
]

_OP_NAMES = ("entmax_rowwise_fwd", "entmax_rowwise_bwd", "entmax_attention_fwd", "entmax_attention_bwd")
_python_side_registered = False


def _ops_loaded() -> bool:
    namespace = torch.ops.entmax_fast
    return all(hasattr(namespace, name) for name in _OP_NAMES)


def is_available() -> tuple[bool, str]:
    """(available, reason) for the C++ CPU ops."""
    loaded, reason = _ext.status()
    if not _ops_loaded():
        if loaded:
            return False, "entmax_fast._C is loaded but has no CPU entmax ops (built without csrc/cpu/)"
        return False, reason
    _register_python_side()
    return True, "C++ CPU ops (csrc/cpu) loaded"


def _require_ops() -> None:
    available, reason = is_available()
    if not available:
        raise RuntimeError(f"entmax_fast C++ CPU backend unavailable: {reason}")


# ---------------------------------------------------------------- fake kernels, autograd

def _rowwise_fwd_fake(x, alpha):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rowwise_bwd_fake(p, grad, alpha, need_alpha_grad):
    dalpha = p.new_empty((p.shape[0],), dtype=alpha.dtype) if need_alpha_grad else p.new_empty((0,))
    return torch.empty_like(p, memory_format=torch.contiguous_format), dalpha


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _attention_fwd_fake(query, key, value, attn_mask, alpha, scale, is_causal):
    B, H, Lq, _ = query.shape
    out = query.new_empty((B, H, Lq, value.shape[-1]))
    stats = query.new_empty((B, H, Lq, 2), dtype=torch.float64)
    return out, stats


def _attention_bwd_fake(grad_out, query, key, value, attn_mask, stats, alpha, scale, is_causal, need_alpha_grad):
    dalpha_len = query.shape[1] if need_alpha_grad else 0
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format),
            query.new_empty((dalpha_len,), dtype=torch.float64))


def _rowwise_setup_context(ctx, inputs, output):
    _, alpha = inputs
    ctx.save_for_backward(output, alpha)


def _rowwise_backward(ctx, grad):
    p, alpha = ctx.saved_tensors
    need_alpha_grad = ctx.needs_input_grad[1]
    if torch.is_grad_enabled():
        # create_graph=True: the reference's closed form in p, in torch ops, so that autograd
        # can differentiate the backward (the C++ kernel cannot be).
        dx, dalpha = _reference_mappings.entmax_rowwise_backward(p, grad, alpha, need_alpha_grad)
        return dx, (dalpha.to(alpha.dtype) if need_alpha_grad else None)
    dx, dalpha = torch.ops.entmax_fast.entmax_rowwise_bwd(p, grad, alpha, need_alpha_grad)
    return dx, (dalpha if need_alpha_grad else None)


def _attention_setup_context(ctx, inputs, output):
    query, key, value, attn_mask, alpha, scale, is_causal = inputs
    _, stats = output
    ctx.save_for_backward(query, key, value, attn_mask, stats, alpha)
    ctx.scale = scale
    ctx.is_causal = is_causal


def _attention_backward(ctx, grad_out, grad_stats):
    # stats (row max, mu) is an internal by-product: no gradient flows through it.
    query, key, value, attn_mask, stats, alpha = ctx.saved_tensors
    need_alpha_grad = ctx.needs_input_grad[4]
    dq, dk, dv, dalpha = torch.ops.entmax_fast.entmax_attention_bwd(
        grad_out, query, key, value, attn_mask, stats, alpha, ctx.scale, ctx.is_causal, need_alpha_grad)
    grads = (dq, dk, dv, (dalpha.to(alpha.dtype) if need_alpha_grad else None))
    dq, dk, dv, dalpha = once_differentiable_grads("entmax attention (cpp backend)", grads,
                                                   (query, key, value, alpha, grad_out))
    return dq, dk, dv, None, dalpha, None, None


def _register_python_side() -> None:
    global _python_side_registered
    if _python_side_registered:
        return
    torch.library.register_fake("entmax_fast::entmax_rowwise_fwd")(_rowwise_fwd_fake)
    torch.library.register_fake("entmax_fast::entmax_rowwise_bwd")(_rowwise_bwd_fake)
    torch.library.register_fake("entmax_fast::entmax_attention_fwd")(_attention_fwd_fake)
    torch.library.register_fake("entmax_fast::entmax_attention_bwd")(_attention_bwd_fake)
    torch.library.register_autograd("entmax_fast::entmax_rowwise_fwd", _rowwise_backward,
                                    setup_context=_rowwise_setup_context)
    torch.library.register_autograd("entmax_fast::entmax_attention_fwd", _attention_backward,
                                    setup_context=_attention_setup_context)
    _python_side_registered = True


# ---------------------------------------------------------------- row-wise entry points

def _alpha_vector(alpha, count: int, device, what: str) -> torch.Tensor:
    """alpha as a tensor of shape (count,) (one per ``what``); a python float is kept exact
    in float64."""
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() == 1:
            return alpha.reshape(1).expand(count)
        if alpha.shape != (count,):
            raise ValueError(f"alpha must be a float or a tensor of shape ({count},) (one per {what}), "
                             f"got shape {tuple(alpha.shape)}")
        if alpha.device != device:
            raise ValueError(f"alpha must be on {device}, got {alpha.device}")
        return alpha
    alpha = float(alpha)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    return torch.full((count,), alpha, dtype=torch.float64, device=device)


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (R, n), got shape {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor for the C++ CPU backend, got device {x.device}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {x.dtype}")


def entmax_rowwise_forward(x: torch.Tensor, alpha) -> torch.Tensor:
    """α-entmax of each row of ``x`` (R, n); ``alpha`` a float or a tensor (R,).

    α = 1 is softmax, α = 2 sparsemax, α = 1.5 exact 1.5-entmax, any other α > 0 by
    safeguarded Newton on the threshold then exact normalisation (α < 1 gives dense
    outputs). −inf entries get 0; rows without a finite entry give zeros. Output in x's
    dtype. Differentiable in x and in a tensor alpha.
    """
    _require_ops()
    _check_rows(x, "x")
    return torch.ops.entmax_fast.entmax_rowwise_fwd(x, _alpha_vector(alpha, x.shape[0], x.device, "row"))


def entmax_rowwise_backward(p: torch.Tensor, grad: torch.Tensor, alpha, need_alpha_grad: bool):
    """Vector–Jacobian product of row-wise α-entmax from its output ``p`` (docs/maths.md,
    "Backward").

    Returns ``(dx (R, n), dalpha (R,) or None)``; dalpha is in alpha's dtype (p's compute
    dtype for a python float). At α = 1 it is the exact limit −½(p log²p − p Σ_j p_j log² p_j).
    """
    _require_ops()
    _check_rows(p, "p")
    if grad.shape != p.shape:
        raise ValueError(f"grad must have p's shape {tuple(p.shape)}, got {tuple(grad.shape)}")
    alpha_t = _alpha_vector(alpha, p.shape[0], p.device, "row")
    dx, dalpha = torch.ops.entmax_fast.entmax_rowwise_bwd(p, grad, alpha_t, bool(need_alpha_grad))
    if not need_alpha_grad:
        return dx, None
    if not isinstance(alpha, torch.Tensor):
        dalpha = dalpha.to(_compute_dtype(p.dtype))
    return dx, dalpha


# ---------------------------------------------------------------- attention entry point

def entmax_attention_cpp(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False, alpha=1.5):
    """Entmax attention on CPU: ``softmax`` of SDPA replaced by row-wise α-entmax.

    Shapes as ``scaled_dot_product_attention``: query (B, H, Lq, E), key (B, Hk, Lk, E),
    value (B, Hk, Lk, Ev) (or 3-D without the batch dim) -> (B, H, Lq, Ev). Hk = H unless
    ``enable_gqa`` (then H % Hk == 0, query head h uses key/value head h // (H // Hk)).
    ``attn_mask``: bool (True = attend) or float (added to the scores), broadcastable to
    (B, H, Lq, Lk); not differentiated. ``is_causal``: top-left aligned, query i sees keys
    j <= i (combined with ``attn_mask`` when both are given), e.g. Lq = 3, Lk = 5::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0

    ``alpha``: float or tensor (H,) (one per query head, differentiable). A query whose keys
    are all masked gets a zero output and zero gradients. ``dropout_p`` > 0 is not
    supported here (NotImplementedError; the reference backend implements it).
    Zero-size dims and bad values follow :func:`entmax_fast.entmax_attention`. Once
    differentiable: double backward raises.
    """
    _require_ops()
    if dropout_p != 0.0:
        raise NotImplementedError(f"entmax_attention_cpp: dropout_p > 0 is not supported by the C++ CPU backend "
                                  f"(got dropout_p={dropout_p}); use the reference backend")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() not in (3, 4):
            raise ValueError(f"{name} must be 3-D or 4-D (B, H, L, E), got shape {tuple(t.shape)}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor for the C++ CPU backend, got device {t.device}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key, value must have the same number of dims, got {query.dim()}, "
                         f"{key.dim()}, {value.dim()}")
    squeeze = query.dim() == 3
    if squeeze:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    B, H, Lq, E = query.shape
    Hk, Lk = key.shape[1], key.shape[2]
    if not query.is_floating_point() or key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key, value must share one floating dtype, got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    if Hk != H and not enable_gqa:
        raise ValueError(f"query has {H} heads but key/value have {Hk}; pass enable_gqa=True for grouped-query "
                         "attention")
    if enable_gqa and H % Hk != 0:
        raise ValueError(f"enable_gqa: query heads ({H}) must be a multiple of key/value heads ({Hk})")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
        try:
            target = torch.broadcast_shapes(attn_mask.shape, (B, H, Lq, Lk))
        except RuntimeError:
            target = None
        if target != (B, H, Lq, Lk):
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(B, H, Lq, Lk) = {(B, H, Lq, Lk)}")
    alpha_t = _alpha_vector(alpha, H, query.device, "query head")
    if _reference_attention.is_empty_attention(query, key, value):
        out = _reference_attention.zero_attention(query, key, value, alpha if isinstance(alpha, torch.Tensor) else None)
        return out.squeeze(0) if squeeze else out
    if E == 0:
        # Every score is the empty dot product 0 (the scale multiplies zeros): a zero feature
        # gives the same scores to the kernels, which need E >= 1.
        query, key = torch.nn.functional.pad(query, (0, 1)), torch.nn.functional.pad(key, (0, 1))
        scale = 1.0
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    out, _ = torch.ops.entmax_fast.entmax_attention_fwd(query, key, value, attn_mask, alpha_t, float(scale),
                                                        bool(is_causal))
    return out.squeeze(0) if squeeze else out
