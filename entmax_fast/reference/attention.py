"""Plain-torch reference of scaled-dot-product entmax attention (the tests' ground truth).

Same semantics as ``torch.nn.functional.scaled_dot_product_attention`` with the softmax
replaced by α-entmax (docs/attention.md). Memory-bounded: queries are processed in chunks whose
score block holds at most ``CHUNK_ELEMENTS`` entries, and the backward recomputes each
chunk's weights, so peak extra memory does not grow as B·H·Lq·Lk.
"""
from __future__ import annotations

import math

import torch

from .._validation import once_differentiable_grads
from .mappings import compute_dtype, entmax_backward, entmax_forward

__all__ = ["entmax_attention", "entmax_attention_varlen", "masked_scores", "zero_attention", "is_empty_attention",
           "CHUNK_ELEMENTS"]

# Scores per chunk: 4M entries, 16 MB in float32.
CHUNK_ELEMENTS = 1 << 22


def _as_4d_mask(attn_mask):
    if attn_mask is None:
        return None
    return attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _chunk_bounds(batch_heads: int, lq: int, lk: int, chunk_elements: int):
    rows = max(1, chunk_elements // max(1, batch_heads * lk))
    return [(start, min(start + rows, lq)) for start in range(0, lq, rows)]


def masked_scores(q_chunk, key, scale, mask, start, stop, is_causal):
    """Scores of queries [start, stop) with ``mask`` (bool: True = attend; float: added;
    broadcastable, size 1 or Lq along dim −2) and the top-left causal mask: (..., c, Lk)."""
    lk = key.shape[-2]
    scores = (q_chunk @ key.transpose(-1, -2)) * scale
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
    return scores


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
    def forward(ctx, query, key, value, alpha):
        ctx.save_for_backward(query, key, value, alpha)
        return query.new_zeros(query.shape[:-1] + value.shape[-1:])

    @staticmethod
    def backward(ctx, grad_out):
        return tuple(None if t is None else torch.zeros_like(t) for t in ctx.saved_tensors)


def zero_attention(query, key, value, alpha=None):
    """The output of an empty attention call (:func:`is_empty_attention`): zeros of shape
    (..., Lq, Ev) in query's dtype, whose gradients are zero for every input."""
    return _ZeroAttentionFunction.apply(query, key, value, alpha if isinstance(alpha, torch.Tensor) else None)


class _EntmaxAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, alpha, scale, is_causal, dropout_p, seed, chunk_elements):
        cdt = compute_dtype(query.dtype)
        q, k, v = query.to(cdt), key.to(cdt), value.to(cdt)
        alpha_rows = alpha.to(cdt).view(1, -1, 1, 1) if isinstance(alpha, torch.Tensor) else alpha
        batch, heads, lq, _ = q.shape
        lk = k.shape[-2]
        out = torch.empty(batch, heads, lq, v.shape[-1], dtype=cdt, device=q.device)
        chunks = _chunk_bounds(batch * heads, lq, lk, chunk_elements)
        for index, (start, stop) in enumerate(chunks):
            scores = masked_scores(q[..., start:stop, :], k, scale, mask, start, stop, is_causal)
            weights = entmax_forward(scores, alpha_rows, dim=-1)
            if dropout_p > 0:
                keep = _dropout_keep(weights.shape, dropout_p, seed, index, weights.device)
                weights = weights * keep / (1 - dropout_p)
            out[..., start:stop, :] = weights @ v
        ctx.save_for_backward(query, key, value, mask, alpha if isinstance(alpha, torch.Tensor) else None)
        ctx.alpha_float = None if isinstance(alpha, torch.Tensor) else alpha
        ctx.options = (scale, is_causal, dropout_p, seed, chunks)
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask, alpha_tensor = ctx.saved_tensors
        scale, is_causal, dropout_p, seed, chunks = ctx.options
        cdt = compute_dtype(query.dtype)
        q, k, v = query.to(cdt), key.to(cdt), value.to(cdt)
        d_out = grad_out.to(cdt)
        alpha = ctx.alpha_float if alpha_tensor is None else alpha_tensor.to(cdt).view(1, -1, 1, 1)
        need_alpha_grad = alpha_tensor is not None and ctx.needs_input_grad[4]
        need_mask_grad = mask is not None and ctx.needs_input_grad[3]
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        dalpha = torch.zeros(q.shape[1], dtype=cdt, device=q.device) if need_alpha_grad else None
        dmask = torch.zeros(mask.shape, dtype=cdt, device=q.device) if need_mask_grad else None
        for index, (start, stop) in enumerate(chunks):
            q_chunk = q[..., start:stop, :]
            do_chunk = d_out[..., start:stop, :]
            weights = entmax_forward(masked_scores(q_chunk, k, scale, mask, start, stop, is_causal), alpha, dim=-1)
            d_weights = do_chunk @ v.transpose(-1, -2)
            if dropout_p > 0:
                keep = _dropout_keep(weights.shape, dropout_p, seed, index, weights.device) / (1 - dropout_p)
                dv += (weights * keep).transpose(-1, -2) @ do_chunk
                d_weights = d_weights * keep
            else:
                dv += weights.transpose(-1, -2) @ do_chunk
            d_scores, dalpha_rows = entmax_backward(weights, d_weights, alpha, dim=-1,
                                                    need_alpha_grad=need_alpha_grad)
            dq[..., start:stop, :] = (d_scores @ k) * scale
            dk += (d_scores.transpose(-1, -2) @ q_chunk) * scale
            if need_alpha_grad:
                dalpha += dalpha_rows.sum(dim=(0, 2, 3))
            if need_mask_grad:
                if mask.shape[-2] == 1:
                    dmask += d_scores.sum_to_size(mask.shape)
                else:
                    dmask[..., start:stop, :] += d_scores.sum_to_size(mask[..., start:stop, :].shape)
        grads = once_differentiable_grads(
            "entmax attention (reference backend)",
            (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
             dmask.to(mask.dtype) if need_mask_grad else None,
             dalpha.to(alpha_tensor.dtype) if need_alpha_grad else None),
            (query, key, value, mask, alpha_tensor, grad_out))
        return (*grads, None, None, None, None, None)


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
    heads = query.shape[-3]
    if enable_gqa and key.shape[-3] != heads:
        group = heads // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.reshape(-1).expand(heads) if alpha.numel() == 1 else alpha
    seed = 0
    if dropout_p > 0:
        # Drawn from the global CPU generator so that torch.manual_seed reproduces it.
        seed = int(torch.randint(0, 2**62, (1,)).item())
    return _EntmaxAttentionFunction.apply(query, key, value, _as_4d_mask(attn_mask), alpha, float(scale),
                                          bool(is_causal), float(dropout_p), seed, chunk_elements)


def entmax_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                            is_causal=False, scale=None, alpha=1.5):
    """Reference of the packed variable-length form: one :func:`entmax_attention` call per
    sequence (reads the offsets on the host: a reference, not a fast path).

    q (total_q, H, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev) -> (total_q, H, Ev).
    """
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    gqa = q.shape[1] != k.shape[1]
    outputs = []
    for b in range(len(starts_q) - 1):
        q_b = q[starts_q[b]:starts_q[b + 1]].transpose(0, 1).unsqueeze(0)
        k_b = k[starts_k[b]:starts_k[b + 1]].transpose(0, 1).unsqueeze(0)
        v_b = v[starts_k[b]:starts_k[b + 1]].transpose(0, 1).unsqueeze(0)
        out = entmax_attention(q_b, k_b, v_b, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                               enable_gqa=gqa, alpha=alpha)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)
