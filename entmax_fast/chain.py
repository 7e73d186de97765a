"""Structured attention over a chain of keys: CRF marginals and SparseMAP.

Each key j of a row carries a binary selection variable z_j; neighbouring keys interact
through a 2×2 transition matrix T[previous, current]:

    θ(z) = Σ_j s_j z_j + Σ_{j≥1} T[z_{j−1}, z_j]

- :func:`crf_marginals`: μ_j = P(z_j = 1) under p(z) ∝ exp θ(z) (a linear-chain CRF,
  "structured attention networks"); dense, smooth. With T = 0 it is sigmoid(s).
- :func:`sparsemap_marginals`: the unary marginals of the SparseMAP problem
  argmax_{μ ∈ M} s·μ + Σ T·(pair marginals) − ½ Σ_j μ_j² over the chain's marginal polytope
  M; sparse: many μ_j are exactly 0 or 1, and a positive T[0,0] + T[1,1] − T[0,1] − T[1,0]
  makes selected keys come in contiguous spans. With T = 0 it is clip(s, 0, 1).

The weights are marginals, not a distribution: they are not renormalised to sum to 1. The
attention forms (:func:`crf_attention`, :func:`sparsemap_attention`) take SDPA's layout;
per query row the chain runs over the keys that row may attend, in key order (masked keys
are removed from the chain, so a causal row is a chain over keys 0..i).

Layers: public function (validates) → :class:`ChainFunction` (autograd; rows in the compute
dtype) → the backend ``dispatch`` picks for op "crf" / "sparsemap": the C++ operators of
``entmax_fast._C`` (CPU; CUDA where the extension was built with CUDA) or the plain-torch
reference (``entmax_fast.reference.chain``). docs/maths.md, "Chain marginals: CRF and
SparseMAP", has the algorithms and the backward.
"""
from __future__ import annotations

import torch

from . import dispatch
from ._validation import _assert_values, check_floating
from .backends.reference import ops as _reference_backend
from .common import compute_dtype
from .reference import structured as _structured_reference
from .structured import check_attention_args

__all__ = ["crf_marginals", "sparsemap_marginals", "crf_attention", "sparsemap_attention", "chain_attention",
           "chain_backend", "ChainFunction"]

OPS = ("crf", "sparsemap")


def chain_backend(X: torch.Tensor, op: str = "crf") -> tuple[str, str]:
    """The backend ("cpp" or "reference") that ``op`` ("crf" or "sparsemap") uses for
    ``X``, and why (the choice is the dispatch registry's)."""
    _, choice = dispatch.select(op, dispatch.Request(X.device, X.dtype, {}))
    return choice.backend, choice.reason


class ChainFunction(torch.autograd.Function):
    """CRF / SparseMAP marginals of rows (R, n) with transitions (R, 2, 2), gradients for
    both, on the dispatched backend. Twice differentiable: under ``create_graph=True`` the
    backward is the reference's (autograd through the reference map), which autograd
    differentiates again, whatever backend ran the forward."""

    @staticmethod
    def forward(ctx, rows, transitions, op):
        (forward, backward), _ = dispatch.select(op, dispatch.Request(rows.device, rows.dtype, {}))
        mu, saved = forward(rows, transitions)
        ctx.save_for_backward(rows, transitions, mu, saved)
        ctx.backward_impl, ctx.op = backward, op
        return mu

    @staticmethod
    def backward(ctx, grad_mu):
        rows, transitions, mu, saved = ctx.saved_tensors
        backward = _REFERENCE_BACKWARD[ctx.op] if torch.is_grad_enabled() else ctx.backward_impl
        grad_rows, grad_transitions = backward(grad_mu.contiguous(), rows, transitions, mu, saved)
        return grad_rows, grad_transitions, None


_REFERENCE_BACKWARD = {"crf": _reference_backend.crf_backward, "sparsemap": _reference_backend.sparsemap_backward}


# ---------------------------------------------------------------------------------------
# Public mappings.

def _check_transitions(name: str, transitions, batch: tuple, scores: torch.Tensor) -> None:
    """transitions: a floating tensor on the scores' device, (..., 2, 2) with leading dims
    broadcastable to ``batch`` (without growing it), finite."""
    check_floating(f"{name}: transitions", transitions)
    if transitions.device != scores.device:
        raise ValueError(f"{name}: transitions must be on the scores' device {scores.device}, got {transitions.device}")
    shape = tuple(transitions.shape)
    fits = len(shape) >= 2 and shape[-2:] == (2, 2) and len(shape) - 2 <= len(batch)
    if fits:
        try:
            fits = torch.broadcast_shapes(shape[:-2], batch) == batch
        except RuntimeError:
            fits = False
    if not fits:
        raise ValueError(f"{name}: transitions must have shape (2, 2) or one broadcastable to the rows' batch shape "
                         f"+ (2, 2) = {batch + (2, 2)}, got {shape}")
    _assert_values(torch.isfinite(transitions), f"{name}: transitions must be finite",
                   got=lambda: f"{transitions.detach().flatten().tolist()[:8]}")


def _chain(name: str, scores, transitions, dim: int) -> torch.Tensor:
    check_floating(f"{name}: scores", scores)
    if scores.dim() == 0:
        raise ValueError(f"{name}: scores must have at least 1 dimension, got a 0-d tensor")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__}")
    if not -scores.dim() <= dim < scores.dim():
        raise IndexError(f"{name}: dim must be in [{-scores.dim()}, {scores.dim() - 1}] for scores of shape "
                         f"{tuple(scores.shape)}, got {dim}")
    moved = scores.movedim(dim, -1)
    batch = tuple(moved.shape[:-1])
    _check_transitions(name, transitions, batch, scores)
    # NaN or +inf scores are not an error on any backend: their rows get NaN weights
    # (torch.softmax's rule); −inf removes a key from the chain.
    compute = compute_dtype(scores.dtype)
    n = moved.shape[-1]
    count = 1
    for size in batch:
        count *= size
    rows = moved.reshape(count, n).to(compute).contiguous()
    per_row = transitions.to(compute).expand(*batch, 2, 2).reshape(count, 2, 2).contiguous()
    mu = ChainFunction.apply(rows, per_row, name.split("_")[0])
    return mu.reshape(moved.shape).to(scores.dtype).movedim(-1, dim)


def crf_marginals(scores: torch.Tensor, transitions: torch.Tensor, dim: int = -1) -> torch.Tensor:
    r"""Linear-chain CRF marginals along ``dim``: μ_j = P(z_j = 1) under

        p(z) ∝ exp( Σ_j s_j z_j + Σ_{j≥1} T[z_{j−1}, z_j] ),   z ∈ {0, 1}^L

    computed by forward–backward. Differentiable in ``scores`` and ``transitions``.

    Args:
        scores: (..., L, ...) any floating dtype (fp16/bf16 computed in fp32). A score of
            −inf removes its position from the chain (weight 0; its valid neighbours are
            linked). As with ``torch.softmax``, a slice holding NaN or +inf at a valid
            position gets NaN weights and a NaN gradient.
        transitions: (2, 2), indexed [previous, current], or (..., 2, 2) with leading dims
            broadcastable to the shape of ``scores`` without ``dim`` (one matrix per
            slice); floating, finite (ValueError otherwise), on the scores' device.
        dim: the chain's dimension.

    Returns: marginals in [0, 1] of the shape and dtype of ``scores`` (not normalised to
    sum to 1; T = 0 gives sigmoid(scores)).

    Examples:
        >>> import torch
        >>> from entmax_fast import crf_marginals
        >>> scores = torch.tensor([[2.0, -1.0, 0.5]])
        >>> torch.allclose(crf_marginals(scores, torch.zeros(2, 2)), torch.sigmoid(scores))
        True
        >>> sticky = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # neighbours like to agree
        >>> crf_marginals(scores, sticky).shape
        torch.Size([1, 3])
    """
    return _chain("crf_marginals", scores, transitions, dim)


def sparsemap_marginals(scores: torch.Tensor, transitions: torch.Tensor, dim: int = -1) -> torch.Tensor:
    r"""SparseMAP unary marginals along ``dim``:

        μ = argmax_{μ ∈ M} Σ_j s_j μ_j + Σ_{j≥1} Σ_{a,b} T[a, b] μ_{j−1,j}(a, b) − ½ Σ_j μ_j²

    over the marginal polytope M of the binary chain (μ_{j−1,j} its pair marginals); the
    solution is a sparse mixture of a few configurations, and many μ_j are exactly 0 or 1.
    With T = 0 it is clip(scores, 0, 1); w = T[0,0] + T[1,1] − T[0,1] − T[1,0] > 0 fuses
    neighbours into runs of equal weight (contiguous spans). Differentiable in ``scores``
    and ``transitions`` (almost everywhere, as sparsemax).

    Args, masking and NaN rule as :func:`crf_marginals`.

    Returns: marginals in [0, 1] of the shape and dtype of ``scores``.

    Examples:
        >>> import torch
        >>> from entmax_fast import sparsemap_marginals
        >>> scores = torch.tensor([[1.2, 0.3, -0.4, 0.9, 0.5, -1.0]])
        >>> sparsemap_marginals(scores, torch.zeros(2, 2))  # clip(scores, 0, 1)
        tensor([[1.0000, 0.3000, 0.0000, 0.9000, 0.5000, 0.0000]])
        >>> sticky = torch.tensor([[0.0, -0.3], [-0.3, 0.3]])  # w = 0.9 > 0: a span
        >>> sparsemap_marginals(scores, sticky)
        tensor([[0.9000, 0.6250, 0.6250, 0.6250, 0.6250, 0.0000]])
    """
    return _chain("sparsemap_marginals", scores, transitions, dim)


# ---------------------------------------------------------------------------------------
# Attention.

def chain_attention(kind: str, query, key, value, transitions, attn_mask=None, is_causal=False, scale=None,
                    enable_gqa=False, dropout_p: float = 0.0):
    """:func:`crf_attention` (``kind="crf"``) or :func:`sparsemap_attention`
    (``kind="sparsemap"``), with dropout on the weights (``dropout_p``, as
    ``MultiheadEntmaxAttention`` in training mode applies it); the one implementation of both."""
    if kind not in OPS:
        raise ValueError(f"kind must be one of {OPS}, got {kind!r}")
    name = f"{kind}_attention"
    mapping = crf_marginals if kind == "crf" else sparsemap_marginals
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"{name}: enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    check_attention_args(name, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    check_floating(f"{name}: transitions", transitions)
    allowed = ((2, 2), (query.shape[-3], 2, 2)) if query.dim() >= 3 else ((2, 2),)
    if tuple(transitions.shape) not in allowed:
        raise ValueError(f"{name}: transitions must have shape (2, 2) or (H, 2, 2) with H = query's heads, "
                         f"allowed here: {', '.join(str(shape) for shape in allowed)}; got {tuple(transitions.shape)}")
    if transitions.device != query.device:
        raise ValueError(f"{name}: transitions must be on query's device {query.device}, got {transitions.device}")
    # (H, 2, 2) as (H, 1, 2, 2): one matrix per head, broadcast over the query rows.
    per_head = transitions if transitions.dim() == 2 else transitions.unsqueeze(-3)
    return _structured_reference.structured_attention(lambda scores: mapping(scores, per_head, dim=-1), query, key,
                                                      value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def crf_attention(query, key, value, transitions, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    r"""Scaled-dot-product attention whose weights are the CRF marginals of each query row's
    scores over its keys (:func:`crf_marginals`); ``out = weights @ value``, the weights
    not renormalised.

    Same layout and arguments as ``torch.nn.functional.scaled_dot_product_attention``
    (no dropout): query (B, H, Lq, E), key (B, Hkv, Lk, E), value (B, Hkv, Lk, Ev) →
    (B, H, Lq, Ev), any leading dims broadcast as in SDPA; Hkv ≠ H (other than 1) needs
    ``enable_gqa=True``. ``attn_mask``: bool (True = attend) or float (added to the
    scores), broadcastable to (B, H, Lq, Lk). ``is_causal`` (a bool): top-left aligned,
    query i sees keys j ≤ i. Masked keys are removed from the chain: the chain of a causal
    row runs over keys 0..i, and the keys on either side of a masked key are neighbours.
    A row with every key masked gets zero weights and a zero output. ``scale``: default
    1/sqrt(E).

    Args:
        transitions: (2, 2) for every head or (H, 2, 2) one per query head, indexed
            [previous, current]; floating, finite, learnable (gradients flow to it).

    Memory: the scores are materialised one query chunk at a time; autograd keeps every
    chunk's weights, so training memory is O(B·H·Lq·Lk).

    Examples:
        >>> import torch
        >>> from entmax_fast import crf_attention
        >>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
        >>> transitions = torch.zeros(2, 2, 2, requires_grad=True)
        >>> out = crf_attention(q, k, v, transitions, is_causal=True)
        >>> out.shape
        torch.Size([1, 2, 5, 8])
        >>> out.sum().backward(); transitions.grad.shape
        torch.Size([2, 2, 2])
    """
    return chain_attention("crf", query, key, value, transitions, attn_mask, is_causal, scale, enable_gqa)


def sparsemap_attention(query, key, value, transitions, attn_mask=None, is_causal=False, scale=None,
                        enable_gqa=False):
    r"""Scaled-dot-product attention whose weights are the SparseMAP marginals of each query
    row's scores over its keys (:func:`sparsemap_marginals`): exact zeros and ones, spans of
    keys for a positive T[0,0] + T[1,1] − T[0,1] − T[1,0]; ``out = weights @ value``.

    Arguments, masking (masked keys leave the chain), causal alignment and memory as
    :func:`crf_attention`.

    Examples:
        >>> import torch
        >>> from entmax_fast import sparsemap_attention
        >>> q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
        >>> out = sparsemap_attention(q, k, v, torch.zeros(2, 2))
        >>> out.shape
        torch.Size([1, 2, 5, 8])
    """
    return chain_attention("sparsemap", query, key, value, transitions, attn_mask, is_causal, scale, enable_gqa)
