"""Reading the attention: :func:`attention_weights`, the dense weights an
:func:`entmax_fast.entmax_attention` call uses, and :func:`support_size`, how many keys each
query row gives a nonzero weight, without an (Lq, Lk) tensor per head.

Both take ``entmax_attention``'s arguments (value aside) and options, checked by the same
rules, and form the scores in the same order (docs/attention.md, "Score options").
"""
from __future__ import annotations

import math

import torch

from .attention import NO_WINDOW, checked_arguments
from .common import compute_dtype
from .mappings import entmax_bisect
from .reference.attention import CHUNK_ELEMENTS, _as_4d_mask, expand_heads, masked_scores, with_sink

__all__ = ["attention_weights", "support_size"]


def _prepared(query, key, attn_mask, is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes,
              sinks):
    """The checked arguments as the score function wants them: (query and key with H heads in
    the compute dtype, mask, is_causal, scale, alpha, score options). E = 0 becomes one zero
    feature, as in entmax_attention (every key scores 0)."""
    attn_mask, is_causal, lower_right, alpha, window_size, softcap = checked_arguments(
        query, key, key, attn_mask, 0.0, is_causal, scale, enable_gqa, alpha, window_size, softcap, alibi_slopes,
        sinks)
    if lower_right:
        window_size = (window_size[0], 0)
    if query.shape[-1] == 0:
        query, key = torch.nn.functional.pad(query, (0, 1)), torch.nn.functional.pad(key, (0, 1))
        scale = 1.0
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    options = {"query_length": query.shape[2], "window_size": window_size, "softcap": softcap,
               "alibi_slopes": alibi_slopes}
    compute = compute_dtype(query.dtype)
    return (query.to(compute), expand_heads(key, query.shape[1]).to(compute), _as_4d_mask(attn_mask),
            bool(is_causal), float(scale), alpha, options)


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
    gives a nonzero weight (the sink not counted), with the same arguments. Computed over
    chunks of query rows, each at most ``CHUNK_ELEMENTS`` scores, so memory does not grow as
    Lq·Lk; no gradient."""
    with torch.no_grad():
        q, k, mask, is_causal, scale, alpha, options = _prepared(query, key, attn_mask, is_causal, scale,
                                                                 enable_gqa, alpha, window_size, softcap,
                                                                 alibi_slopes, sinks)
        batch, heads, lq, _ = query.shape
        lk = key.shape[2]
        counts = torch.zeros(batch, heads, lq, dtype=torch.int64, device=query.device)
        if lk == 0 or batch * heads * lq == 0:
            return counts
        rows = max(1, CHUNK_ELEMENTS // max(1, batch * heads * (lk + 1)))
        for start in range(0, lq, rows):
            stop = min(lq, start + rows)
            scores = masked_scores(q[..., start:stop, :], k, scale, mask, start, stop, is_causal, **options)
            counts[..., start:stop] = (_row_weights(scores, alpha, sinks) > 0).sum(-1)
        return counts
