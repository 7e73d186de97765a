"""Plain-torch reference of scaled-dot-product entmax attention (the tests' ground truth).

Same semantics as ``torch.nn.functional.scaled_dot_product_attention`` with the softmax
replaced by α-entmax (docs/attention.md), and FlashAttention's options: a sliding window,
softcapping, ALiBi and attention sinks, in the order docs/attention.md ("Score options")
writes down. Memory-bounded: queries are processed in chunks whose
score block holds at most ``CHUNK_ELEMENTS`` entries, and the backward recomputes each
chunk's weights, so peak extra memory does not grow as B·H·Lq·Lk.
"""
from __future__ import annotations

import math

import torch

from .._validation import once_differentiable_grads
from ..common import NO_WINDOW, compute_dtype
from .mappings import entmax_backward, entmax_forward

__all__ = ["entmax_attention", "entmax_attention_varlen", "masked_scores", "with_score_options", "with_sink",
           "expand_heads", "zero_attention",
           "is_empty_attention", "CHUNK_ELEMENTS", "NO_WINDOW"]

# Scores per chunk: 4M entries, 16 MB in float32.
CHUNK_ELEMENTS = 1 << 22


def as_4d_mask(attn_mask):
    """A mask of up to 4 dims viewed as 4-D (leading dims of size 1), or None."""
    if attn_mask is None:
        return None
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _chunk_bounds(batch_heads: int, lq: int, lk: int, chunk_elements: int):
    rows = max(1, chunk_elements // max(1, batch_heads * lk))
    return [(start, min(start + rows, lq)) for start in range(0, lq, rows)]


def capped_scores(q_chunk, key, scale, softcap):
    """``scale·q kᵀ``, then ``softcap·tanh(s/softcap)`` when softcap > 0 (Gemma 2's capping)."""
    scores = (q_chunk @ key.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def softcap_slope(q_chunk, key, scale, softcap):
    """d(capped score)/d(scaled score) = 1/cosh²(s/softcap): recomputed from the product,
    since the capped scores are gone once ALiBi and the masks are added. 1/cosh² rather
    than 1 − tanh², which loses every digit where tanh rounds to ±1."""
    return torch.cosh((q_chunk @ key.transpose(-1, -2)) * (scale / softcap)).pow(-2)


def _positions(start, stop, lq, lk, device):
    """(query positions among the keys, key indices): query i sits at key position
    i + Lk − Lq (bottom-right, as FlashAttention), as a (c, 1) and a (1, Lk) tensor."""
    rows = torch.arange(start + lk - lq, stop + lk - lq, device=device).view(-1, 1)
    return rows, torch.arange(lk, device=device).view(1, -1)


def _alibi_rows(alibi_slopes, dtype):
    """Slopes (H,) or (B, H) shaped to broadcast over (B, H, c, Lk) score blocks."""
    slopes = alibi_slopes.to(dtype)
    return slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(*slopes.shape, 1, 1)


def masked_scores(q_chunk, key, scale, mask, start, stop, is_causal, *, query_length, window_size=NO_WINDOW,
                  softcap=0.0, alibi_slopes=None):
    """Scores of queries [start, stop) of ``query_length``, the options in the order of
    docs/attention.md ("Score options"): ALiBi ``−slope·|pos − j|``, ``mask`` (bool: True =
    attend; float: added; broadcastable, size 1 or Lq along dim −2), the top-left causal
    mask, the window ``pos − left ≤ j ≤ pos + right`` (−1: unbounded), pos = i + Lk − Lq.
    Returns (..., c, Lk); the sink is appended later, to the masked row."""
    return with_score_options(capped_scores(q_chunk, key, scale, softcap), mask, start, stop, is_causal,
                              query_length=query_length, window_size=window_size, alibi_slopes=alibi_slopes)


def with_score_options(scores, mask, start, stop, is_causal, *, query_length, window_size=NO_WINDOW,
                       alibi_slopes=None):
    """:func:`masked_scores` after the (capped) scores (..., c, Lk) are formed: ALiBi, the
    masks and the window."""
    lk = scores.shape[-1]
    needs_positions = alibi_slopes is not None or window_size != NO_WINDOW
    if needs_positions:
        positions, keys = _positions(start, stop, query_length, lk, scores.device)
    if alibi_slopes is not None:
        scores = scores - _alibi_rows(alibi_slopes, scores.dtype) * (positions - keys).abs().to(scores.dtype)
    if mask is not None:
        mask_rows = mask if mask.shape[-2] == 1 else mask[..., start:stop, :]
        if mask_rows.dtype == torch.bool:
            scores = scores.masked_fill(~mask_rows, float("-inf"))
        else:
            scores = scores + mask_rows.to(scores.dtype)
    if is_causal:
        rows = torch.arange(start, stop, device=scores.device).view(-1, 1)
        cols = torch.arange(lk, device=scores.device).view(1, -1)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    left, right = window_size
    if left >= 0:
        scores = scores.masked_fill(keys < positions - left, float("-inf"))
    if right >= 0:
        scores = scores.masked_fill(keys > positions + right, float("-inf"))
    return scores


def with_sink(scores, sinks):
    """The row with each head's sink logit appended as a last, virtual key: (..., c, Lk + 1)."""
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1)


def _weights(scores, alpha_rows, sinks):
    """(weights over the real keys, weights of the whole row): entmax of the row with the
    sink appended, the sink's own entry left out of the first (it has a zero value)."""
    if sinks is None:
        weights = entmax_forward(scores, alpha_rows, dim=-1)
        return weights, weights
    full = entmax_forward(with_sink(scores, sinks), alpha_rows, dim=-1)
    return full[..., :-1], full


def _dropout_keep(shape, dropout_p, seed, chunk_index, device):
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + chunk_index)
    return torch.rand(shape, generator=generator, device=device) >= dropout_p


def is_empty_attention(query, key, value) -> bool:
    """True when the output is all zeros by the zero-size rule: no batch, head, query or
    value feature (an empty output), or no key (every query fully masked)."""
    return math.prod(query.shape[:-1]) == 0 or value.shape[-1] == 0 or key.shape[-2] == 0


class _ZeroAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, alpha, sinks):
        ctx.save_for_backward(query, key, value, alpha, sinks)
        return query.new_zeros(query.shape[:-1] + value.shape[-1:])

    @staticmethod
    def backward(ctx, grad_out):
        return tuple(None if t is None else torch.zeros_like(t) for t in ctx.saved_tensors)


def zero_attention(query, key, value, alpha=None, sinks=None):
    """The output of an empty attention call (:func:`is_empty_attention`): zeros of shape
    (..., Lq, Ev) in query's dtype, whose gradients are zero for every input (a sink with no
    real key takes the whole row, and its value is zero)."""
    return _ZeroAttentionFunction.apply(query, key, value, alpha if isinstance(alpha, torch.Tensor) else None, sinks)


def expand_heads(tensor, heads):
    """key/value with Hkv heads repeated to the query's H (grouped-query attention)."""
    return tensor if tensor.shape[-3] == heads else tensor.repeat_interleave(heads // tensor.shape[-3], dim=-3)


def _draw_seed(dropout_p):
    # Drawn from the global CPU generator (no device sync) so that torch.manual_seed
    # reproduces the dropout.
    return torch.randint(0, 2**62, (1,), dtype=torch.int64) if dropout_p > 0 else torch.zeros(1, dtype=torch.int64)


def attention_forward(query, key, value, attn_mask, alpha, *, scale, is_causal, dropout_p, enable_gqa=False,
                      need_grad=None, window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None,
                      chunk_elements=CHUNK_ELEMENTS):
    """Entmax attention of valid, non-empty (B, H, L, E) inputs (the backend contract,
    entmax_fast/backends/__init__.py); returns (out, saved) with saved = (dropout seed,)."""
    cdt = compute_dtype(query.dtype)
    heads = query.shape[-3]
    q = query.to(cdt)
    k, v = expand_heads(key, heads).to(cdt), expand_heads(value, heads).to(cdt)
    mask = as_4d_mask(attn_mask)
    alpha_rows = alpha.to(cdt).view(1, -1, 1, 1) if isinstance(alpha, torch.Tensor) else alpha
    seed = _draw_seed(dropout_p)
    batch, _, lq, _ = q.shape
    lk = k.shape[-2]
    score_options = {"query_length": lq, "window_size": window_size, "softcap": softcap,
                     "alibi_slopes": alibi_slopes}
    out = torch.empty(batch, heads, lq, v.shape[-1], dtype=cdt, device=q.device)
    for index, (start, stop) in enumerate(_chunk_bounds(batch * heads, lq, lk + (sinks is not None), chunk_elements)):
        scores = masked_scores(q[..., start:stop, :], k, scale, mask, start, stop, is_causal, **score_options)
        weights, _ = _weights(scores, alpha_rows, sinks)
        if dropout_p > 0:
            keep = _dropout_keep(weights.shape, dropout_p, int(seed), index, weights.device)
            weights = weights * keep / (1 - dropout_p)
        out[..., start:stop, :] = weights @ v
    return out.to(query.dtype), (seed,)


def attention_support_forward(query, key, attn_mask, alpha, *, scale, is_causal, enable_gqa=False,
                              window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None,
                              chunk_elements=CHUNK_ELEMENTS):
    """(B, H, Lq) int64: how many keys each query row of :func:`attention_forward` with the
    same arguments gives a nonzero weight (the sink not counted; a NaN row counts none),
    over chunks of rows of at most ``chunk_elements`` scores (the backend contract)."""
    cdt = compute_dtype(query.dtype)
    heads = query.shape[-3]
    q, k = query.to(cdt), expand_heads(key, heads).to(cdt)
    mask = as_4d_mask(attn_mask)
    alpha_rows = alpha.to(cdt).view(1, -1, 1, 1) if isinstance(alpha, torch.Tensor) else alpha
    batch, _, lq, _ = q.shape
    lk = k.shape[-2]
    score_options = {"query_length": lq, "window_size": window_size, "softcap": softcap,
                     "alibi_slopes": alibi_slopes}
    counts = torch.empty(batch, heads, lq, dtype=torch.int64, device=q.device)
    for start, stop in _chunk_bounds(batch * heads, lq, lk + (sinks is not None), chunk_elements):
        scores = masked_scores(q[..., start:stop, :], k, scale, mask, start, stop, is_causal, **score_options)
        weights, _ = _weights(scores, alpha_rows, sinks)
        counts[..., start:stop] = (weights > 0).sum(-1)
    return counts


def attention_backward(grad_out, query, key, value, attn_mask, alpha, out, saved, *, scale, is_causal, dropout_p,
                       enable_gqa=False, need_mask_grad=False, need_alpha_grad=False, window_size=NO_WINDOW,
                       softcap=0.0, alibi_slopes=None, sinks=None, need_sinks_grad=False,
                       chunk_elements=CHUNK_ELEMENTS):
    """Gradients of :func:`attention_forward`: (dq, dk, dv, dmask | None, dalpha | None,
    dsinks | None), each chunk's weights recomputed. ALiBi slopes get no gradient."""
    (seed,) = saved
    cdt = compute_dtype(query.dtype)
    heads, kv_heads = query.shape[-3], key.shape[-3]
    q = query.to(cdt)
    k, v = expand_heads(key, heads).to(cdt), expand_heads(value, heads).to(cdt)
    mask = as_4d_mask(attn_mask)
    d_out = grad_out.to(cdt)
    alpha_rows = alpha.to(cdt).view(1, -1, 1, 1) if isinstance(alpha, torch.Tensor) else alpha
    need_alpha_grad = need_alpha_grad and isinstance(alpha, torch.Tensor)
    need_mask_grad = need_mask_grad and mask is not None
    need_sinks_grad = need_sinks_grad and sinks is not None
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dalpha = torch.zeros(heads, dtype=cdt, device=q.device) if need_alpha_grad else None
    dmask = torch.zeros(mask.shape, dtype=cdt, device=q.device) if need_mask_grad else None
    dsinks = torch.zeros(heads, dtype=cdt, device=q.device) if need_sinks_grad else None
    batch, _, lq, _ = q.shape
    lk = k.shape[-2]
    score_options = {"query_length": lq, "window_size": window_size, "softcap": softcap,
                     "alibi_slopes": alibi_slopes}
    for index, (start, stop) in enumerate(_chunk_bounds(batch * heads, lq, lk + (sinks is not None), chunk_elements)):
        q_chunk = q[..., start:stop, :]
        do_chunk = d_out[..., start:stop, :]
        weights, row_weights = _weights(masked_scores(q_chunk, k, scale, mask, start, stop, is_causal,
                                                      **score_options), alpha_rows, sinks)
        d_weights = do_chunk @ v.transpose(-1, -2)
        if dropout_p > 0:
            keep = _dropout_keep(weights.shape, dropout_p, int(seed), index, weights.device) / (1 - dropout_p)
            dv += (weights * keep).transpose(-1, -2) @ do_chunk
            d_weights = d_weights * keep
        else:
            dv += weights.transpose(-1, -2) @ do_chunk
        if sinks is not None:
            # The sink's value is zero: its weight reaches the output through nothing.
            d_weights = torch.nn.functional.pad(d_weights, (0, 1))
        d_scores, dalpha_rows = entmax_backward(row_weights, d_weights, alpha_rows, dim=-1,
                                                need_alpha_grad=need_alpha_grad)
        if sinks is not None:
            if need_sinks_grad:
                dsinks += d_scores[..., -1].sum(dim=(0, 2))
            d_scores = d_scores[..., :-1]
        if need_alpha_grad:
            dalpha += dalpha_rows.sum(dim=(0, 2, 3))
        if need_mask_grad:
            if mask.shape[-2] == 1:
                dmask += d_scores.sum_to_size(mask.shape)
            else:
                dmask[..., start:stop, :] += d_scores.sum_to_size(mask[..., start:stop, :].shape)
        if softcap > 0:
            d_scores = d_scores * softcap_slope(q_chunk, k, scale, softcap)
        dq[..., start:stop, :] = (d_scores @ k) * scale
        dk += (d_scores.transpose(-1, -2) @ q_chunk) * scale
    if kv_heads != heads:
        dk = dk.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)
        dv = dv.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)
    return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
            dmask.to(attn_mask.dtype).reshape(attn_mask.shape) if need_mask_grad else None,
            dalpha.to(alpha.dtype) if need_alpha_grad else None,
            dsinks.to(sinks.dtype) if need_sinks_grad else None)


class _EntmaxAttentionFunction(torch.autograd.Function):
    """The oracle's own autograd over attention_forward/attention_backward (the package's
    public layer has its own, over whichever backend dispatch picks)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, alpha, options):
        out, saved = attention_forward(query, key, value, mask, alpha, **options)
        ctx.save_for_backward(query, key, value, mask, alpha if isinstance(alpha, torch.Tensor) else None, *saved)
        ctx.alpha_float = None if isinstance(alpha, torch.Tensor) else alpha
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask, alpha_tensor, *saved = ctx.saved_tensors
        alpha = ctx.alpha_float if alpha_tensor is None else alpha_tensor
        *grads, _ = attention_backward(grad_out, query, key, value, mask, alpha, None, tuple(saved), **ctx.options,
                                       need_mask_grad=ctx.needs_input_grad[3],
                                       need_alpha_grad=ctx.needs_input_grad[4])
        grads = once_differentiable_grads("entmax attention (reference backend)", tuple(grads),
                                          (query, key, value, mask, alpha_tensor, grad_out))
        return (*grads, None)


def entmax_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False, *, alpha=1.5, chunk_elements=CHUNK_ELEMENTS):
    """Reference entmax attention; arguments as ``scaled_dot_product_attention``.

    query (B, H, Lq, E), key (B, Hkv, Lk, E), value (B, Hkv, Lk, Ev); ``attn_mask`` bool
    (True = attend) or float (added), broadcastable to (B, H, Lq, Lk); ``is_causal``
    top-left aligned (query i sees keys j ≤ i); ``alpha`` float ≥ 1 or tensor (H,).
    Arguments are assumed valid (the public ``entmax_fast.entmax_attention`` checks them).
    Zero-size dims: no key gives zeros, as a fully masked row does; an empty query, head or
    batch gives an empty output; E = 0 gives all scores 0 (the default scale is then 1).
    Once differentiable: double backward raises.
    """
    if is_empty_attention(query, key, value):
        return zero_attention(query, key, value, alpha)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] > 0 else 1.0
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.reshape(-1).expand(query.shape[-3]) if alpha.numel() == 1 else alpha
    options = {"scale": float(scale), "is_causal": bool(is_causal), "dropout_p": float(dropout_p),
               "chunk_elements": chunk_elements}
    return _EntmaxAttentionFunction.apply(query, key, value, attn_mask, alpha, options)


def entmax_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                            is_causal=False, scale=None, alpha=1.5):
    """Reference of the packed variable-length form: one :func:`entmax_attention` call per
    sequence (reads the offsets on the host: a reference, not a fast path).

    q (total_q, H, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev) -> (total_q, H, Ev).
    """
    gqa = q.shape[1] != k.shape[1]
    outputs = []
    for rows_q, rows_k in _sequences(cu_seqlens_q, cu_seqlens_k):
        out = entmax_attention(_as_batch(q, rows_q), _as_batch(k, rows_k), _as_batch(v, rows_k), dropout_p=dropout_p,
                               is_causal=is_causal, scale=scale, enable_gqa=gqa, alpha=alpha)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """(query slice, key slice) of every packed sequence (reads the offsets on the host: a
    reference, not a fast path)."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1]))
            for b in range(len(starts_q) - 1)]


def _as_batch(packed, rows):
    """Tokens ``rows`` of a packed (total, H, E) tensor as (1, H, L, E)."""
    return packed[rows].transpose(0, 1).unsqueeze(0)


def _sequence_slopes(alibi_slopes, index):
    """The ALiBi slopes of packed sequence ``index``: (H,) slopes serve every sequence,
    (B, H) ones have a row per sequence."""
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[index]


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alpha, *, scale,
                             is_causal, dropout_p, need_grad=None, window_size=NO_WINDOW, softcap=0.0,
                             alibi_slopes=None, sinks=None):
    """The packed form (backend contract): :func:`attention_forward` per sequence (windows
    and ALiBi positions bottom-right within each); saved holds one dropout seed per sequence."""
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
    seeds = []
    for index, (rows_q, rows_k) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        seed = torch.zeros(1, dtype=torch.int64)
        if rows_q.stop > rows_q.start and rows_k.stop > rows_k.start:
            out_b, (seed,) = attention_forward(_as_batch(q, rows_q), _as_batch(k, rows_k), _as_batch(v, rows_k),
                                               None, alpha, scale=scale, is_causal=is_causal, dropout_p=dropout_p,
                                               window_size=window_size, softcap=softcap,
                                               alibi_slopes=_sequence_slopes(alibi_slopes, index), sinks=sinks)
            out[rows_q] = out_b.squeeze(0).transpose(0, 1)
        seeds.append(seed)
    return out, (torch.cat(seeds),)


def attention_varlen_backward(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alpha, out,
                              saved, *, scale, is_causal, dropout_p, need_alpha_grad=False, window_size=NO_WINDOW,
                              softcap=0.0, alibi_slopes=None, sinks=None, need_sinks_grad=False):
    """Gradients of :func:`attention_varlen_forward`: (dq, dk, dv, dalpha | None, dsinks | None)."""
    (seeds,) = saved
    need_alpha_grad = need_alpha_grad and isinstance(alpha, torch.Tensor)
    need_sinks_grad = need_sinks_grad and sinks is not None
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dalpha = torch.zeros_like(alpha) if need_alpha_grad else None
    dsinks = torch.zeros_like(sinks) if need_sinks_grad else None
    for index, (rows_q, rows_k) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        dq_b, dk_b, dv_b, _, dalpha_b, dsinks_b = attention_backward(
            _as_batch(grad_out, rows_q), _as_batch(q, rows_q), _as_batch(k, rows_k), _as_batch(v, rows_k), None,
            alpha, None, (seeds[index:index + 1],), scale=scale, is_causal=is_causal, dropout_p=dropout_p,
            need_alpha_grad=need_alpha_grad, window_size=window_size, softcap=softcap,
            alibi_slopes=_sequence_slopes(alibi_slopes, index), sinks=sinks, need_sinks_grad=need_sinks_grad)
        dq[rows_q] = dq_b.squeeze(0).transpose(0, 1)
        dk[rows_k] = dk_b.squeeze(0).transpose(0, 1)
        dv[rows_k] = dv_b.squeeze(0).transpose(0, 1)
        if need_alpha_grad:
            dalpha += dalpha_b
        if need_sinks_grad:
            dsinks += dsinks_b
    return dq, dk, dv, dalpha, dsinks
