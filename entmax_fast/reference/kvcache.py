"""Entmax attention of new query tokens against a key/value cache, in plain torch: exact,
the tests' ground truth and the fallback of every device (the backend contract's
``attention_kvcache``, entmax_fast/backends/__init__.py).

The cache is read as a (B, Hkv, capacity, E) tensor (a paged cache gathered through its
block table) and each sequence's positions become one additive mask: query i of sequence b
sits at key position ``seqlens_k[b] − Lq + i`` and sees keys ``j ≤`` that position (the
window's left bound and ALiBi's distance measured from it). The rest is
:func:`entmax_fast.reference.attention.attention_forward`, with the softcap and the sinks.
"""
from __future__ import annotations

import torch

from ..common import NO_WINDOW, compute_dtype
from .attention import attention_forward

__all__ = ["cache_view", "attention_kvcache_forward"]


def cache_view(cache, block_table, seqlens_k=None):
    """A cache as (B, Hkv, capacity, E): a contiguous (B, Hkv, Lmax, E) cache as it is; a paged
    (num_blocks, Hkv, block_size, E) one gathered through ``block_table`` (B, max_blocks).
    With ``seqlens_k``, table entries past the blocks a sequence uses are not read (they may
    hold anything, as in FlashAttention's paged cache)."""
    if block_table is None:
        return cache
    table = block_table.long()
    block_size = cache.shape[2]
    if seqlens_k is not None:
        used = torch.arange(table.shape[1], device=table.device) * block_size < seqlens_k.long().view(-1, 1)
        table = torch.where(used, table, 0)
    blocks = cache[table]  # (B, max_blocks, Hkv, block_size, E)
    batch, n_blocks, kv_heads, _, width = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, n_blocks * block_size, width)


def _position_mask(seqlens_k, lq, capacity, heads, window_size, alibi_slopes, dtype):
    """The additive (B, 1 or H, Lq, capacity) mask of the cache's positions: 0 (or ALiBi's
    −slope·(pos − j)) where query i may see key j, −inf elsewhere."""
    device = seqlens_k.device
    positions = (seqlens_k.long().view(-1, 1) - lq + torch.arange(lq, device=device)).unsqueeze(-1)
    keys = torch.arange(capacity, device=device).view(1, 1, -1)
    allowed = keys <= positions
    left = window_size[0]
    if left >= 0:
        allowed = allowed & (keys >= positions - left)
    bias = torch.zeros((), dtype=dtype, device=device)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype).view(-1 if alibi_slopes.dim() == 1 else seqlens_k.shape[0], heads)
        distance = (positions - keys).to(dtype).unsqueeze(1)
        bias = -slopes.view(slopes.shape[0], heads, 1, 1) * distance
    return torch.where(allowed.unsqueeze(1), bias, float("-inf"))


def attention_kvcache_forward(query, k_cache, v_cache, seqlens_k, block_table, alpha, *, scale,
                              window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None):
    """Entmax attention of ``query`` (B, H, Lq, E) against the first ``seqlens_k[b]`` keys of
    each sequence's cache, lower-right causal; returns (B, H, Lq, Ev) in query's dtype."""
    keys = cache_view(k_cache, block_table, seqlens_k)
    values = cache_view(v_cache, block_table, seqlens_k)
    mask = _position_mask(seqlens_k, query.shape[2], keys.shape[2], query.shape[1], window_size, alibi_slopes,
                          compute_dtype(query.dtype))
    out, _ = attention_forward(query, keys, values, mask, alpha, scale=scale, is_causal=False, dropout_p=0.0,
                               enable_gqa=True, softcap=softcap, sinks=sinks)
    return out
