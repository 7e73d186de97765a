"""Reading the attention: :func:`attention_weights`, the dense weights an
:func:`entmax_fast.entmax_attention` call uses, and :func:`support_size`, how many keys each
query row gives a nonzero weight, without an (Lq, Lk) tensor per head.

Both take ``entmax_attention``'s arguments (value aside) and options, checked by the same
rules, and form the scores in the same order (docs/attention.md, "Score options").
"""
from __future__ import annotations

import math

import torch

from . import dispatch
from ._validation import check_backend_dtype
from .attention import attention_request, checked_arguments
from .common import NO_WINDOW, compute_dtype, per_head_alpha
from .mappings import entmax_bisect
from .reference.attention import as_4d_mask, expand_heads, masked_scores, with_sink

__all__ = ["attention_weights", "support_size"]


def _checked(query, key, attn_mask, is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes, sinks):
    """The arguments checked by entmax_attention's rules and completed as it completes them:
    (query, key, attn_mask, is_causal, alpha, ScoreOptions, scale), E = 0 as one zero feature
    (every key scores 0), the default scale 1/sqrt(E)."""
    attn_mask, is_causal, alpha, score_options = checked_arguments(
        query, key, key, attn_mask, 0.0, is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes,
        sinks)
    if query.shape[-1] == 0:
        query, key = torch.nn.functional.pad(query, (0, 1)), torch.nn.functional.pad(key, (0, 1))
        scale = 1.0
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    return query, key, attn_mask, bool(is_causal), alpha, score_options, float(scale)


def _prepared(query, key, attn_mask, is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes,
              sinks):
    """The checked arguments as the score function wants them: (query and key with H heads in
    the compute dtype, mask, is_causal, scale, alpha, score options)."""
    query, key, attn_mask, is_causal, alpha, score_options, scale = _checked(
        query, key, attn_mask, is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes, sinks)
    options = {"query_length": query.shape[2], "window_size": score_options.window_bounds,
               "softcap": score_options.softcap, "alibi_slopes": score_options.alibi_slopes}
    compute = compute_dtype(query.dtype)
    return (query.to(compute), expand_heads(key, query.shape[1]).to(compute), as_4d_mask(attn_mask),
            is_causal, scale, alpha, options)


def _row_weights(scores, alpha, sinks):
    """Entmax of each row (the sink appended as a last key), without the sink's entry."""
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(scores.dtype).expand(scores.shape[1]).view(1, -1, 1, 1)
    if sinks is None:
        return entmax_bisect(scores, alpha=alpha, dim=-1)
    return entmax_bisect(with_sink(scores, sinks), alpha=alpha, dim=-1)[..., :-1]


def attention_weights(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, alpha=1.5,
                      window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """The (B, H, Lq, Lk) weights of :func:`entmax_fast.entmax_attention` with the same
    arguments (no value, no dropout): each row sums to one over its keys (less with a sink,
    whose own weight is left out), exact zeros outside its support, zeros for a row whose
    keys are all masked. Differentiable (query, key, a float mask, α tensor, sinks).

    Dense, for inspection (as ``"eager"`` attention gives): it holds B·H·Lq·Lk entries.
    In query's dtype, computed in float32 (float64 for float64 inputs).

    ``is_causal`` must be a bool, as in SDPA. Unlike flash-attn's ``causal=True``
    (bottom-right since flash-attn 2.1), ``is_causal`` is aligned top-left when Lq ≠ Lk, as
    in SDPA; flash-attn's ``causal=True`` is ``window_size=(-1, 0)`` here.

    Examples:
        >>> import torch, entmax_fast
        >>> q = torch.tensor([[[[1.0, 0.0]]]])
        >>> k = torch.tensor([[[[2.0, 0.0], [1.6, 0.0], [0.0, 0.0]]]])
        >>> entmax_fast.attention_weights(q, k, scale=1.0, alpha=1.5)
        tensor([[[[0.6400, 0.3600, 0.0000]]]])
    """
    q, k, mask, is_causal, scale, alpha, options = _prepared(query, key, attn_mask, is_causal, scale, enable_gqa,
                                                             alpha, window_size, softcap, alibi_slopes, sinks)
    batch, heads, lq, _ = query.shape
    if key.shape[2] == 0 or batch * heads * lq == 0:
        return query.new_zeros(batch, heads, lq, key.shape[2])
    scores = masked_scores(q, k, scale, mask, 0, lq, is_causal, **options)
    return _row_weights(scores, alpha, sinks).to(query.dtype)


def support_size(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, alpha=1.5,
                 window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """(B, H, Lq) int64: how many keys each query row of :func:`entmax_fast.entmax_attention`
    gives a nonzero weight (the sink not counted; a NaN row counts none), with the same
    arguments. No gradient, and no (Lq, Lk) tensor per head: the dispatched backend (op
    ``"attention_support"``, ``entmax_fast.backend_info()`` says which and why) counts from
    the row thresholds of its own attention forward, or, on the reference backend, over
    chunks of at most ``CHUNK_ELEMENTS`` scores.

    ``is_causal`` must be a bool, as in SDPA. Unlike flash-attn's ``causal=True``
    (bottom-right since flash-attn 2.1), ``is_causal`` is aligned top-left when Lq ≠ Lk, as
    in SDPA; flash-attn's ``causal=True`` is ``window_size=(-1, 0)`` here.

    Examples:
        >>> import torch, entmax_fast
        >>> q = torch.tensor([[[[1.0, 0.0]]]])
        >>> k = torch.tensor([[[[2.0, 0.0], [1.6, 0.0], [0.0, 0.0]]]])
        >>> entmax_fast.support_size(q, k, scale=1.0, alpha=1.5)           # 2 of the 3 keys
        tensor([[[2]]])
        >>> entmax_fast.support_size(q, k, scale=1.0, alpha=1.0)           # softmax: every key
        tensor([[[3]]])
    """
    query, key, attn_mask, is_causal, alpha, score_options, scale = _checked(
        query, key, attn_mask, is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes, sinks)
    batch, heads, lq, _ = query.shape
    if key.shape[2] == 0 or batch * heads * lq == 0:
        return torch.zeros(batch, heads, lq, dtype=torch.int64, device=query.device)
    request_options = attention_request(query, key, attn_mask, alpha, 0.0, is_causal, score_options)
    (forward, _), choice = dispatch.select("attention_support",
                                           dispatch.Request(query.device, query.dtype, request_options))
    check_backend_dtype(choice, query)
    with torch.no_grad():
        return forward(query, key, attn_mask, per_head_alpha(alpha, heads), scale=scale, is_causal=is_causal,
                       enable_gqa=bool(enable_gqa), score_options=score_options)
