"""Forward and backward of the C++ operators (contract: ``entmax_fast/backends``).

Arithmetic is float64 for float64 tensors and float32 otherwise; results come back in the
input dtype. α reaches the kernels as one value per row (row-wise) or per head (attention).
The attention kernels take the score options (docs/attention.md, "Score options") themselves,
flat (`_flat_options`): a lower-right causal mask arrives as the window's right bound 0.
"""
from __future__ import annotations

import torch

from ..._validation import ScoreOptions
from ...common import ALPHA_ENTMAX15, ALPHA_SPARSEMAX, GRAD_NONE, alpha_kind, alpha_vector, compute_dtype
from .. import refuse_score_options
from . import SCORE_OPTIONS_IMPLEMENTED

__all__ = ["entmax_forward", "entmax_backward", "attention_forward", "attention_backward",
           "attention_kvcache_forward", "attention_support_forward", "attention_sparse_tiles", "fusedmax_forward",
           "fusedmax_backward", "oscarmax_forward", "oscarmax_backward", "crf_forward", "crf_backward",
           "sparsemap_forward", "sparsemap_backward", "kept_support_capacity"]

# The forward keeps each sparsemax and 1.5-entmax tile's supports for the backward in at most
# this share of the output's bytes (kept_support_capacity), which lets the backward skip the
# tile's score GEMM: fwd+bwd at B 2, H 8, E 64, float32, 2 threads took 0.47x SDPA's time at
# L 1024 and 0.35x at L 2048 (0.63x and 0.51x without), peak memory below SDPA's (aaecdec,
# 2-core x86-64; docs/performance.md, "CPU attention"). At E 64 in float32 that is 32 entries
# per row, pooled over the tile's 64 rows, where N(0,1) rows of 1.5-entmax hold 19 at L 1024;
# with the whole output row (42 entries) the peak at L 256 reached SDPA's (5.18 against 5.15
# MiB in one run, the same machine, 41abd83's code with a share of 1).
KEPT_SUPPORT_SHARE = 0.75
# Fewer entries per row than this (head dims under 16 in float32) are fewer than the rows'
# supports (the trained recall model of bench_attention.py --sparsity, E 8: 4 entries for
# supports of 11 on average): nothing is kept.
MIN_KEPT_SUPPORT = 8


def _alphas(alpha, count: int, device) -> torch.Tensor:
    # A python float stays exact in float64; a tensor keeps its dtype, which dα comes back in.
    dtype = alpha.dtype if isinstance(alpha, torch.Tensor) else torch.float64
    return alpha_vector(alpha, count, device, dtype)


def entmax_forward(x: torch.Tensor, alpha) -> torch.Tensor:
    return torch.ops.entmax_fast.entmax_rowwise_fwd(x, _alphas(alpha, x.shape[0], x.device))


def entmax_backward(p: torch.Tensor, grad: torch.Tensor, alpha, need_alpha_grad: bool):
    dx, dalpha = torch.ops.entmax_fast.entmax_rowwise_bwd(p, grad, _alphas(alpha, p.shape[0], p.device),
                                                         bool(need_alpha_grad))
    if not need_alpha_grad:
        return dx, None
    return dx, dalpha if isinstance(alpha, torch.Tensor) else dalpha.to(compute_dtype(p.dtype))


def _flat_options(what: str, score_options: ScoreOptions):
    """The operators' score arguments: ([window_left, window_right], softcap, alibi_slopes,
    sinks), after refusing an option the kernels lack."""
    refuse_score_options(what, score_options, implemented=SCORE_OPTIONS_IMPLEMENTED)
    left, right, softcap, alibi_slopes, sinks = score_options.flat()
    return [left, right], softcap, alibi_slopes, sinks


def kept_support_capacity(value: torch.Tensor, alpha, softcap: float) -> int:
    """Entries per query row of the supports the forward keeps for the backward (pooled over a
    tile of rows; a tile that overflows its pool recomputes its scores in the backward): as
    many as fit in KEPT_SUPPORT_SHARE of an output row's bytes, an entry being an int16 column
    and a score in the compute dtype; 0 below MIN_KEPT_SUPPORT, and where no row can be kept:
    α a float other than 1.5 and 2 (an α tensor's values are the kernel's to read), or capped
    scores."""
    if (not isinstance(alpha, torch.Tensor) and alpha_kind(alpha) not in (ALPHA_ENTMAX15, ALPHA_SPARSEMAX)) \
            or softcap > 0:
        return 0
    entry_bytes = 2 + compute_dtype(value.dtype).itemsize
    capacity = int(KEPT_SUPPORT_SHARE * value.shape[-1] * value.element_size()) // entry_bytes
    return capacity if capacity >= MIN_KEPT_SUPPORT else 0


def attention_forward(query, key, value, attn_mask, alpha, *, scale, is_causal, dropout_p, enable_gqa, need_grad,
                      score_options=ScoreOptions()):
    window, softcap, alibi_slopes, sinks = _flat_options("the C++ attention", score_options)
    capacity = kept_support_capacity(value, alpha, softcap) if need_grad != GRAD_NONE else 0
    out, *saved = torch.ops.entmax_fast.entmax_attention_fwd(
        query, key, value, attn_mask, _alphas(alpha, query.shape[1], query.device), float(scale), bool(is_causal),
        window, softcap, alibi_slopes, sinks, capacity)
    return out, tuple(saved)


def attention_backward(grad_out, query, key, value, attn_mask, alpha, out, saved, *, scale, is_causal, dropout_p,
                       enable_gqa, need_mask_grad, need_alpha_grad, score_options=ScoreOptions(),
                       need_sinks_grad=False):
    flat = _flat_options("the C++ attention", score_options)
    stats, *kept_support = saved
    sinks = score_options.sinks
    need_alpha_grad = bool(need_alpha_grad) and isinstance(alpha, torch.Tensor)
    need_sinks_grad = bool(need_sinks_grad) and sinks is not None
    dq, dk, dv, dalpha, dsinks = torch.ops.entmax_fast.entmax_attention_bwd(
        grad_out, query, key, value, attn_mask, stats, _alphas(alpha, query.shape[1], query.device), float(scale),
        bool(is_causal), need_alpha_grad, *flat, need_sinks_grad, *kept_support)
    return (dq, dk, dv, None, (dalpha.to(alpha.dtype) if need_alpha_grad else None),
            (dsinks.to(sinks.dtype) if need_sinks_grad else None))


def attention_kvcache_forward(query, k_cache, v_cache, seqlens_k, block_table, alpha, *, scale,
                              score_options=ScoreOptions()):
    return torch.ops.entmax_fast.entmax_attention_kvcache_fwd(
        query, k_cache, v_cache, seqlens_k, block_table, _alphas(alpha, query.shape[1], query.device), float(scale),
        *_flat_options("the C++ decoding attention", score_options))


def attention_support_forward(query, key, attn_mask, alpha, *, scale, is_causal, enable_gqa,
                              score_options=ScoreOptions()):
    """Counts from the forward's own row statistics (max, mu): the forward runs on a value of
    one zero feature, which leaves its P.V negligible, then the count recomputes the scores
    tile by tile."""
    flat = _flat_options("the C++ attention", score_options)
    batch, kv_heads, key_length, _ = key.shape
    value = query.new_zeros((batch, kv_heads, key_length, 1))
    alphas = _alphas(alpha, query.shape[1], query.device)
    _, stats, *_ = torch.ops.entmax_fast.entmax_attention_fwd(query, key, value, attn_mask, alphas, float(scale),
                                                              bool(is_causal), *flat)
    return torch.ops.entmax_fast.entmax_attention_support(query, key, attn_mask, stats, alphas, float(scale),
                                                          bool(is_causal), *flat)


def attention_sparse_tiles(counts, key_length, *, is_causal, window_size=(-1, -1)):
    """(B, H, query tiles) bool: which tiles of a call with these shapes run P.V and the
    backward as sparse products over their support rather than dense GEMMs, from the
    supported keys of each query row (``attention_support_forward``'s counts). Tiles of α = 1
    and tiles holding a NaN row are dense whatever this says."""
    return torch.ops.entmax_fast.entmax_attention_sparse_tiles(counts, int(key_length), bool(is_causal),
                                                               [int(bound) for bound in window_size])


def fusedmax_forward(x, reg, lengths):
    return torch.ops.entmax_fast.fusedmax_forward(x, float(reg), lengths)


def fusedmax_backward(grad, x, lengths, p, y, reg):
    return torch.ops.entmax_fast.fusedmax_backward(grad.contiguous(), p, y, float(reg))


def oscarmax_forward(x, reg, lengths):
    return torch.ops.entmax_fast.oscarmax_forward(x, float(reg), lengths)


def oscarmax_backward(grad, x, lengths, p, y, reg):
    return torch.ops.entmax_fast.oscarmax_backward(grad.contiguous(), p, y, float(reg))


def crf_forward(x, transitions):
    return torch.ops.entmax_fast.crf_forward(x, transitions)


def crf_backward(grad, x, transitions, mu, saved):
    return torch.ops.entmax_fast.crf_backward(grad, x, transitions, mu, saved)


def sparsemap_forward(x, transitions):
    return torch.ops.entmax_fast.sparsemap_forward(x, transitions)


def sparsemap_backward(grad, x, transitions, mu, saved):
    return torch.ops.entmax_fast.sparsemap_backward(grad, x, transitions, mu, saved)
