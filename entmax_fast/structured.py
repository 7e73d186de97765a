"""fusedmax and oscarmax (Niculae & Blondel, NIPS 2017): structured sparse attention.

    fusedmax(z; lam)  = argmax_{p ∈ Δ} pᵀz − ½‖p‖² − lam Σ_i |p_{i+1} − p_i|
                      = sparsemax(prox_TV(z; lam))
    oscarmax(z; beta) = argmax_{p ∈ Δ} pᵀz − ½‖p‖² − beta Σ_{i<j} max(|p_i|, |p_j|)
                      = sparsemax(prox_OWL(z; w)),  w_i = beta (n − i)

fusedmax fuses neighbouring positions into groups of equal weight; oscarmax groups equal
weights anywhere. lam = 0 / beta = 0 give sparsemax; a large lam gives the uniform
distribution over the valid positions. docs/maths.md, "fusedmax and oscarmax", has the algorithms
and the backward.

Layers: public function (validates) → :class:`StructuredFunction` (autograd; rows in the
compute dtype) → the backend ``dispatch`` picks for op "fusedmax" / "oscarmax": the C++
operators of ``entmax_fast._C`` (CPU; CUDA where the extension was built with CUDA) or the
plain-torch reference. :func:`structured_backend` says which one a tensor gets and why;
:func:`last_backend` says which one the last call of an op used.
"""
from __future__ import annotations

import math

import torch

from . import dispatch
from ._validation import (_assert_values, check_dropout, check_floating, check_gqa_heads, check_is_causal,
                          check_like, check_scale)
from .backends.reference import ops as _reference_backend
from .common import compute_dtype
from .reference import structured as _reference

__all__ = [
    "fusedmax",
    "oscarmax",
    "fusedmax_attention",
    "oscarmax_attention",
    "Fusedmax",
    "Oscarmax",
    "structured_backend",
    "last_backend",
    "StructuredFunction",
]


def structured_backend(X: torch.Tensor, op: str = "fusedmax") -> tuple[str, str]:
    """The backend ("cpp" or "reference") that ``op`` ("fusedmax"/"oscarmax") uses for
    ``X``, and why (the choice is the dispatch registry's)."""
    _, choice = dispatch.select(op, dispatch.Request(X.device, X.dtype, {}))
    return choice.backend, choice.reason


def last_backend(op: str = "fusedmax") -> tuple[str, str] | None:
    """(backend, reason) of the last call of ``op`` ("fusedmax" or "oscarmax"), or None."""
    choice = dispatch.last_choice(op)
    return None if choice is None else (choice.backend, choice.reason)


class StructuredFunction(torch.autograd.Function):
    """fusedmax / oscarmax of rows (R, n) with gradients for the rows, on the dispatched
    backend. Twice differentiable: under ``create_graph=True`` the backward is the
    reference's (autograd through the reference map), which autograd differentiates again,
    whatever backend ran the forward."""

    @staticmethod
    def forward(ctx, rows, reg, lengths, op):
        (forward, backward), _ = dispatch.select(op, dispatch.Request(rows.device, rows.dtype, {}))
        p, saved = forward(rows, reg, lengths)
        ctx.save_for_backward(rows, lengths, p, saved)
        ctx.backward_impl, ctx.reg, ctx.op = backward, reg, op
        return p

    @staticmethod
    def backward(ctx, grad_p):
        rows, lengths, p, saved = ctx.saved_tensors
        backward = _REFERENCE_BACKWARD[ctx.op] if torch.is_grad_enabled() else ctx.backward_impl
        return backward(grad_p, rows, lengths, p, saved, ctx.reg), None, None, None


_REFERENCE_BACKWARD = {"fusedmax": _reference_backend.fusedmax_backward,
                       "oscarmax": _reference_backend.oscarmax_backward}


# ---------------------------------------------------------------------------------------
# Public mappings.

def _check_lengths_range(name: str, X, dim: int, lengths) -> None:
    """lengths in [0, n], checked here once for every backend: a ValueError on CPU, a
    device-side assertion without a host sync on CUDA (whose operators would otherwise clamp
    lengths to [0, n], while the C++ CPU ones raise a RuntimeError)."""
    if lengths is None or lengths.numel() == 0:
        return
    n = X.shape[dim]
    _assert_values((lengths >= 0) & (lengths <= n), f"{name}: lengths must lie in [0, {n}] (the size of dim {dim})",
                   got=lambda: f"values in [{int(lengths.min())}, {int(lengths.max())}]")


def _structured(name: str, X, reg, reg_name: str, dim: int, lengths):
    # NaN or +inf scores are not an error on any backend: their rows get NaN weights
    # (torch.softmax's rule).
    _reference.check_mapping_args(name, X, reg, reg_name, dim, lengths, check_values=False)
    _check_lengths_range(name, X, dim, lengths)
    if X.dim() == 2 and dim % 2 == 1 and X.dtype == compute_dtype(X.dtype):
        # Rows already: each view below would be one more autograd node, and on a GPU a
        # small call's time is the host's (fusedmax 1024x512 fp32 on an H100, commit
        # 4a08cac: 0.088 ms forward, 0.255 ms forward+backward, against ~65 and ~200 us
        # of Python layers on a CPU; skipping the views takes those to ~35 and ~138 us).
        return StructuredFunction.apply(X.contiguous(), float(reg), lengths, name)
    moved = X.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1]).to(compute_dtype(X.dtype)).contiguous()
    row_lengths = None if lengths is None else lengths.reshape(-1)
    p = StructuredFunction.apply(rows, float(reg), row_lengths, name)
    return p.reshape(moved.shape).to(X.dtype).movedim(-1, dim)


def fusedmax(X: torch.Tensor, lam: float = 1.0, dim: int = -1, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """fusedmax along ``dim``: p = sparsemax(prox_TV(z; lam)), i.e.

        p = argmax_{p ∈ Δ} pᵀz − ½‖p‖² − lam Σ_i |p_{i+1} − p_i|

    over the valid positions of each slice. Differentiable in X (not in lam).

    Args:
        X: scores, any floating dtype (fp16/bf16 are computed in fp32); −inf marks masked
            positions, which get weight 0 and are skipped by the fused chain (the valid
            neighbours on either side are linked). As with ``torch.softmax``, a slice
            holding NaN or +inf at a valid position gets NaN weights and a NaN gradient.
        lam: fusion strength, a Python float >= 0. 0 gives sparsemax.
        dim: the dimension to map.
        lengths: optional integer tensor of X's shape without ``dim``: only the first
            ``lengths[...]`` positions of each slice are valid.

    Returns: weights of X's shape and dtype, summing to 1 over each slice with a valid
    position (0 where no position is valid, NaN where a valid position holds NaN or +inf).

    Examples:
        >>> import torch, entmax_fast
        >>> x = torch.tensor([[1.0, 0.3, 0.9, 0.5, 0.95]])
        >>> entmax_fast.fusedmax(x, lam=0.1)                  # the neighbours 0.9 and 0.5 tied
        tensor([[0.3625, 0.0000, 0.1625, 0.1625, 0.3125]])
        >>> entmax_fast.fusedmax(x, lam=0.1, lengths=torch.tensor([2]))   # only 2 valid positions
        tensor([[0.7500, 0.2500, 0.0000, 0.0000, 0.0000]])
    """
    return _structured("fusedmax", X, lam, "lam", dim, lengths)


def oscarmax(X: torch.Tensor, beta: float = 1.0, dim: int = -1, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """oscarmax along ``dim``: p = sparsemax(prox_OWL(z; w)), w_i = beta (n − i), i.e.

        p = argmax_{p ∈ Δ} pᵀz − ½‖p‖² − beta Σ_{i<j} max(|p_i|, |p_j|)

    over the n valid positions of each slice; groups equal weights regardless of position.
    Differentiable in X (not in beta). Arguments as :func:`fusedmax`, with ``beta`` >= 0
    (0 gives sparsemax).

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.oscarmax(torch.tensor([[1.0, 0.3, 0.9, 0.5, 0.95]]), beta=0.05)   # one group of three
        tensor([[0.3333, 0.0000, 0.3333, 0.0000, 0.3333]])
    """
    return _structured("oscarmax", X, beta, "beta", dim, lengths)


# ---------------------------------------------------------------------------------------
# Attention.

def fusedmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, *, lam: float = 1.0):
    """Scaled-dot-product attention with fusedmax(·; lam) over the keys instead of softmax.

    Same arguments as ``torch.nn.functional.scaled_dot_product_attention``:
    query (B, H, Lq, E), key (B, Hkv, Lk, E), value (B, Hkv, Lk, Ev) -> (B, H, Lq, Ev)
    (any leading dims, broadcast as in SDPA; one key/value head serves every query head).
    query, key and value share one dtype. Hkv ≠ H (other than 1) needs ``enable_gqa=True``
    and H divisible by Hkv. ``attn_mask``: bool (True = attend) or float (added to the
    scores), broadcastable to (B, H, Lq, Lk); masked keys are skipped by the fused chain.
    ``is_causal`` (a bool, as in SDPA) is top-left aligned, for Lq != Lk too — query i sees
    keys j <= i (drawn in ``entmax_fast.attention``'s docstring); with ``attn_mask`` too, a
    key must pass both. Unlike flash-attn's ``causal=True`` (bottom-right since flash-attn
    2.1), ``is_causal`` is aligned top-left when Lq ≠ Lk, as in SDPA; for flash-attn's
    alignment pass the bottom-right mask ``torch.ones(Lq, Lk, dtype=torch.bool).tril(Lk − Lq)``.
    ``scale``: default 1/sqrt(E); any finite number, as in SDPA (0 scores every key alike,
    which gives uniform weights over the unmasked keys). A query row with every key masked
    gets zero weights and a zero output.

    Memory: the scores are materialised one query chunk at a time (at most 4M entries per
    chunk), not fused into a flash-style kernel; autograd keeps every chunk's weights, so
    training memory is O(B·H·Lq·Lk).

    Examples:
        >>> import torch, entmax_fast
        >>> q = torch.tensor([[[[1.0, 0.0]]]])
        >>> k = torch.tensor([[[[2.0, 0.0], [1.9, 0.0], [1.8, 0.0], [0.0, 0.0]]]])
        >>> entmax_fast.fusedmax_attention(q, k, torch.eye(4)[None, None], scale=1.0, lam=0.5)
        tensor([[[[0.3333, 0.3333, 0.3333, 0.0000]]]])
    """
    _check_reg("fusedmax_attention", lam, "lam")
    check_attention_args("fusedmax_attention", query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa)
    return _reference.structured_attention(lambda scores: fusedmax(scores, lam, dim=-1), query, key, value,
                                           attn_mask, dropout_p, is_causal, scale, enable_gqa)


def oscarmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False, *, beta: float = 1.0):
    """Scaled-dot-product attention with oscarmax(·; beta) over the keys instead of softmax.

    Arguments, masking, causal alignment and memory as :func:`fusedmax_attention` (scores
    materialised one query chunk at a time). Unlike flash-attn's ``causal=True``
    (bottom-right since flash-attn 2.1), ``is_causal`` is aligned top-left when Lq ≠ Lk, as
    in SDPA.

    Examples:
        >>> import torch, entmax_fast
        >>> q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
        >>> entmax_fast.oscarmax_attention(q, k, v, is_causal=True, beta=0.1).shape
        torch.Size([2, 4, 16, 8])
    """
    _check_reg("oscarmax_attention", beta, "beta")
    check_attention_args("oscarmax_attention", query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa)
    return _reference.structured_attention(lambda scores: oscarmax(scores, beta, dim=-1), query, key, value,
                                           attn_mask, dropout_p, is_causal, scale, enable_gqa)


def check_attention_args(name: str, query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa) -> None:
    """The structured attention's arguments, with the argument named (instead of a broadcast
    error from deep inside the scores); the rules and messages of ``entmax_attention``,
    widened to its leading dims broadcast as in SDPA."""
    prefix = f"{name}: "
    for arg, tensor in (("query", query), ("key", key), ("value", value)):
        check_floating(f"{name}: {arg}", tensor)
        if tensor.dim() < 2:
            raise ValueError(f"{name}: {arg} must have at least 2 dims (..., L, E), got shape {tuple(tensor.shape)}")
    check_like(("key", "value"), (key, value), "query", query, prefix)
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"{name}: key's last dim (E) must equal query's {query.shape[-1]}, got {key.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"{name}: value's length (dim -2) must equal key's {key.shape[-2]}, got {value.shape[-2]}")
    check_dropout(dropout_p, prefix)
    check_is_causal(is_causal, prefix)
    check_scale(scale, prefix)
    leading = [tuple(query.shape[:-2])]
    for tensor in (key, value):
        shape = list(tensor.shape[:-2])
        if query.dim() >= 3 and tensor.dim() >= 3 and shape[-1] != 1:
            check_gqa_heads(query.shape[-3], shape[-1], enable_gqa, prefix)
            shape[-1] = query.shape[-3]  # after the grouped heads are repeated
        leading.append(tuple(shape))
    try:
        leading = torch.broadcast_shapes(*leading)
    except RuntimeError:
        raise ValueError(f"{name}: query, key and value must have broadcastable leading dims (..., H), got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}") from None
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{name}: attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"{name}: attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask.device != query.device:
        raise ValueError(f"{name}: attn_mask must be on query's device {query.device}, got {attn_mask.device}")
    target = (*leading, query.shape[-2], key.shape[-2])
    try:
        fits = torch.broadcast_shapes(attn_mask.shape, target) == target
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name}: attn_mask must be broadcastable to the scores' shape (..., Lq, Lk) = {target}, "
                         f"got shape {tuple(attn_mask.shape)}")


def _check_reg(name: str, reg, reg_name: str) -> None:
    if isinstance(reg, bool) or not isinstance(reg, (int, float)):
        raise TypeError(f"{name}: {reg_name} must be a Python float >= 0, got {type(reg).__name__}")
    if not math.isfinite(reg) or reg < 0:
        raise ValueError(f"{name}: {reg_name} must be finite and >= 0, got {reg}")


# ---------------------------------------------------------------------------------------
# Modules.

class Fusedmax(torch.nn.Module):
    """Module form of :func:`fusedmax`: ``Fusedmax(lam, dim)(X, lengths=None)``.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.Fusedmax(lam=0.1)(torch.tensor([[1.0, 0.3, 0.9, 0.5, 0.95]]))
        tensor([[0.3625, 0.0000, 0.1625, 0.1625, 0.3125]])
    """

    def __init__(self, lam: float = 1.0, dim: int = -1):
        super().__init__()
        _check_reg("Fusedmax", lam, "lam")
        self.lam = float(lam)
        self.dim = dim

    def forward(self, X: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return fusedmax(X, self.lam, dim=self.dim, lengths=lengths)

    def extra_repr(self) -> str:
        return f"lam={self.lam}, dim={self.dim}"


class Oscarmax(torch.nn.Module):
    """Module form of :func:`oscarmax`: ``Oscarmax(beta, dim)(X, lengths=None)``.

    Examples:
        >>> import torch, entmax_fast
        >>> entmax_fast.Oscarmax(beta=0.05)(torch.tensor([[1.0, 0.3, 0.9, 0.5, 0.95]]))
        tensor([[0.3333, 0.0000, 0.3333, 0.0000, 0.3333]])
    """

    def __init__(self, beta: float = 1.0, dim: int = -1):
        super().__init__()
        _check_reg("Oscarmax", beta, "beta")
        self.beta = float(beta)
        self.dim = dim

    def forward(self, X: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return oscarmax(X, self.beta, dim=self.dim, lengths=lengths)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, dim={self.dim}"
