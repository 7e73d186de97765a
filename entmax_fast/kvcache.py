"""Decoding with a key/value cache: :func:`entmax_attention_with_kvcache`, FlashAttention's
``flash_attn_with_kvcache`` for entmax attention, in this package's (B, H, L, E) layout.

The new keys and values are written into the cache in place (contiguous, or paged through a
block table), then the new queries attend the cache, lower-right causal. Forward only: a
serving op, for ``torch.no_grad`` / ``torch.inference_mode``.
"""
from __future__ import annotations

import math

import torch

from . import dispatch
from ._validation import (_assert_values, check_backend_dtype, check_dropout_scale_alpha, check_floating, check_like,
                          check_score_options)
from .common import NO_WINDOW, per_head_alpha

__all__ = ["entmax_attention_with_kvcache"]

# A paged cache's block size must be a multiple of this: the sizes serving engines allocate
# (vLLM's blocks are multiples of 16; flash-attn 2 asks for multiples of 256), kept so that a
# kernel may read a block as whole 16-key tiles. Today's decoding kernels (C++, Triton) look
# up each key's block on its own and do not rely on it.
PAGE_MULTIPLE = 16


def _check_cache(name, cache, paged, batch, width_name, width=None):
    """A cache's shape: (B, Hkv, Lmax, width) contiguous, (num_blocks, Hkv, block_size, width)
    paged; returns it."""
    check_floating(name, cache)
    layout = "(num_blocks, Hkv, block_size, E)" if paged else "(B, Hkv, Lmax, E)"
    if cache.dim() != 4:
        raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(cache.shape)}")
    if not paged and cache.shape[0] != batch:
        raise ValueError(f"{name} must have q's batch size {batch} along dim 0 {layout}, got shape "
                         f"{tuple(cache.shape)}")
    if width is not None and cache.shape[3] != width:
        raise ValueError(f"{name} must have {width_name} {width} along its last dim, got shape "
                         f"{tuple(cache.shape)}")
    return cache


def _check_int32(name, tensor, shape_text, dims, like):
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tensor.dim() != dims:
        got = f"{tensor.dtype} of shape {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else \
            type(tensor).__name__
        raise ValueError(f"{name} must be an int32 tensor of shape {shape_text}, got {got}")
    if tensor.device != like.device:
        raise ValueError(f"{name} must be on q's device {like.device}, got {tensor.device}")


def _check_new_tokens(k, v, q, k_cache, v_cache):
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new tokens to append) or both be None")
    if k is None:
        return
    batch, _, lq, _ = q.shape
    for name, tensor, cache in (("k", k, k_cache), ("v", v, v_cache)):
        check_floating(name, tensor)
        expected = (batch, cache.shape[1], lq, cache.shape[3])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape (B, Hkv, Lq, {'E' if name == 'k' else 'Ev'}) = {expected}, "
                             f"got {tuple(tensor.shape)}")
    check_like(("k", "v"), (k, v), "q", q)


def _check_lengths(cache_seqlens, block_table, lq, appending, capacity, n_blocks, block_size):
    """Values of cache_seqlens and block_table, without a host sync on GPUs."""
    seqlens = cache_seqlens.long()
    after = seqlens + lq if appending else seqlens
    fits = (seqlens >= 0) & (after <= capacity)
    if appending:
        message = f"cache_seqlens must be >= 0 with cache_seqlens + Lq <= the cache's capacity {capacity} (Lq = {lq})"
    else:
        message = (f"cache_seqlens must hold the new tokens: Lq <= cache_seqlens <= the cache's capacity {capacity} "
                   f"(Lq = {lq}; without k and v the cache already holds them)")
        fits = fits & (seqlens >= lq)
    _assert_values(fits, message, got=lambda: cache_seqlens.tolist())
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=block_table.device) * block_size < after.view(-1, 1)
        in_range = (block_table >= 0) & (block_table < n_blocks)
        _assert_values(in_range | ~used, f"block_table's entries for the blocks a sequence uses must be in "
                                         f"[0, num_blocks = {n_blocks})", got=lambda: block_table[used].tolist())
    return after.to(torch.int32)


def _append(cache, new, cache_seqlens, block_table):
    """Writes ``new`` (B, Hkv, Lq, E) into ``cache`` at positions cache_seqlens[b] + i, in place."""
    batch, _, lq, _ = new.shape
    positions = cache_seqlens.long().view(-1, 1) + torch.arange(lq, device=new.device)
    # Indices on dims 0 and 2 around a slice: the indexed shape is (B, Lq, Hkv, E).
    if block_table is None:
        rows = torch.arange(batch, device=new.device).view(-1, 1).expand(batch, lq)
        cache[rows, :, positions] = new.transpose(1, 2).to(cache.dtype)
    else:
        block_size = cache.shape[2]
        blocks = block_table.long().gather(1, positions // block_size)
        cache[blocks, :, positions % block_size] = new.transpose(1, 2).to(cache.dtype)


def entmax_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None,
                                  scale=None, alpha=1.5, window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                                  sinks=None):
    r"""Entmax attention of new query tokens against a key/value cache, appending the new
    keys and values to the cache in place (``flash_attn_with_kvcache``'s semantics, heads
    before length as in SDPA). For decoding (Lq = 1), speculative decoding and chunked
    prefill (Lq > 1).

    Args:
        q: (B, H, Lq, E) new queries.
        k_cache, v_cache: (B, Hkv, Lmax, E) and (B, Hkv, Lmax, Ev) contiguous caches, or, with
            ``block_table``, paged caches (num_blocks, Hkv, block_size, E | Ev), block_size a
            multiple of 16. Hkv divides H (grouped-query attention).
        k, v: (B, Hkv, Lq, E | Ev) new keys and values, or None. Given, they are written into
            the caches at positions ``cache_seqlens[b] … cache_seqlens[b] + Lq − 1`` and
            query i sits at position ``cache_seqlens[b] + i``. Without them the caches
            already hold the new tokens and query i sits at ``cache_seqlens[b] − Lq + i``.
        cache_seqlens: (B,) int32 tokens in each sequence's cache before the call (0 allowed).
        block_table: (B, max_blocks) int32 cache block of each sequence's block of
            positions; entries past the blocks a sequence uses are not read.
        scale, alpha, window_size, softcap, alibi_slopes, sinks: as
            :func:`entmax_fast.entmax_attention` (α float >= 1 or (H,) tensor). Attention is
            causal: query at position p sees keys 0 … p (within the window, if any).

    Returns:
        (B, H, Lq, Ev) in q's dtype.

    Bad lengths (beyond the cache's capacity) or block table entries out of range raise a
    ValueError on CPU; on CUDA they are checked on the device without a host sync.

    Examples:
        >>> import torch, entmax_fast
        >>> k_cache, v_cache = torch.zeros(1, 2, 64, 16), torch.zeros(1, 2, 64, 16)    # room for 64 tokens
        >>> cache_seqlens = torch.tensor([0], dtype=torch.int32)
        >>> q, k, v = torch.randn(1, 4, 10, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
        >>> prefill = entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k, v,
        ...                                                     cache_seqlens=cache_seqlens)
        >>> torch.equal(k_cache[:, :, :10], k)                                     # appended in place
        True
        >>> q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
        >>> step = entmax_fast.entmax_attention_with_kvcache(q, k_cache, v_cache, k, v,
        ...                                                  cache_seqlens=cache_seqlens + 10)
        >>> step.shape
        torch.Size([1, 4, 1, 16])
    """
    paged = block_table is not None
    batch, heads, lq, head_e = _check_query_and_caches(q, k_cache, v_cache, paged)
    _check_new_tokens(k, v, q, k_cache, v_cache)
    block_size, capacity = _check_cache_index(q, k_cache, cache_seqlens, block_table)
    alpha = check_dropout_scale_alpha(0.0, scale, alpha, heads, q)
    score_options = check_score_options(window_size, softcap, alibi_slopes, sinks, batch, heads, "q", q)
    _check_forward_only(q, k_cache, v_cache, k, v, sinks, alpha)
    seqlens_k = _check_lengths(cache_seqlens, block_table, lq, k is not None, capacity, k_cache.shape[0],
                               block_size)
    if k is not None:
        _append(k_cache, k, cache_seqlens, block_table)
        _append(v_cache, v, cache_seqlens, block_table)
    if batch * heads * lq == 0 or v_cache.shape[-1] == 0 or capacity == 0:
        return q.new_zeros(batch, heads, lq, v_cache.shape[-1])
    return _decode(q, k_cache, v_cache, seqlens_k, block_table, alpha, scale, score_options)


def _check_query_and_caches(q, k_cache, v_cache, paged):
    """q (B, H, Lq, E) and the caches' shapes, dtypes and devices; returns (B, H, Lq, E)."""
    check_floating("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, H, Lq, E), got shape {tuple(q.shape)}")
    batch, heads, lq, head_e = q.shape
    _check_cache("k_cache", k_cache, paged, batch, "q's head dim E", head_e)
    _check_cache("v_cache", v_cache, paged, batch, "")
    check_like(("k_cache", "v_cache"), (k_cache, v_cache), "q", q)
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache in all but the last dim, got {tuple(v_cache.shape)} and "
                         f"{tuple(k_cache.shape)}")
    kv_heads = k_cache.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the caches' heads ({kv_heads})")
    return batch, heads, lq, head_e


def _check_cache_index(q, k_cache, cache_seqlens, block_table):
    """cache_seqlens and block_table as tensors (their values: :func:`_check_lengths`);
    returns (block_size, capacity): 0 and Lmax for a contiguous cache."""
    batch = q.shape[0]
    _check_int32("cache_seqlens", cache_seqlens, f"(B,) = ({batch},)", 1, q)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens must have shape (B,) = ({batch},), got {tuple(cache_seqlens.shape)}")
    if block_table is None:
        return 0, k_cache.shape[2]
    _check_int32("block_table", block_table, "(B, max_blocks)", 2, q)
    if block_table.shape[0] != batch:
        raise ValueError(f"block_table must have q's batch size {batch} along dim 0, got shape "
                         f"{tuple(block_table.shape)}")
    block_size = k_cache.shape[2]
    if block_size == 0 or block_size % PAGE_MULTIPLE != 0:
        raise ValueError(f"a paged cache's block_size (k_cache.shape[2]) must be a positive multiple of "
                         f"{PAGE_MULTIPLE}, got {block_size}")
    return block_size, block_table.shape[1] * block_size


def _check_forward_only(q, k_cache, v_cache, k, v, sinks, alpha):
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k_cache, v_cache, k, v, sinks, alpha)
                                       if isinstance(t, torch.Tensor)):
        raise ValueError("entmax_attention_with_kvcache is forward-only (inference): call it under torch.no_grad() "
                         "or torch.inference_mode(), or pass tensors that do not require grad")


def _decode(q, k_cache, v_cache, seqlens_k, block_table, alpha, scale, score_options):
    """The dispatched decoding forward over the first ``seqlens_k[b]`` keys of each cache."""
    head_e = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(head_e) if head_e else 1.0
    request_options = {"alpha": alpha if isinstance(alpha, float) else "tensor", "paged": block_table is not None,
                       "head_dim": max(head_e, v_cache.shape[-1]), **score_options.request_flags()}
    (forward, _), choice = dispatch.select("attention_kvcache", dispatch.Request(q.device, q.dtype, request_options))
    check_backend_dtype(choice, q)
    return forward(q, k_cache, v_cache, seqlens_k, block_table, per_head_alpha(alpha, q.shape[1]), scale=float(scale),
                   score_options=score_options)
