"""Host side of decoding against a key/value cache: the Triton backend of the op
``attention_kvcache`` (kernels and design: triton_kernels/kvcache_decode.py).

Three launches, none of which waits on the host: the scores of every (row, key) split over
the keys, the exact row-wise solver over them (triton_kernels/rowwise.py, the sink one more
entry of the row), and p·v split over the keys again, whose per-split partial outputs are
summed on the device. Every buffer's size follows from the shapes (the cache's capacity),
not from the lengths in ``seqlens_k``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..._validation import ScoreOptions
from ...common import SCORE_ALIBI, SCORE_SOFTCAP
from ...triton_kernels.kvcache_decode import NUM_WARPS, kvcache_output_kernel, kvcache_scores_kernel, tiles
from . import interpreting
from .rowwise import entmax_forward

__all__ = ["attention_kvcache_forward"]

# Programs per streaming multiprocessor the splits aim at: two keep a multiprocessor busy
# while the other waits on memory. The interpreter runs programs one by one; four programs'
# worth of splits there exercises the split path on small tests.
PROGRAMS_PER_SM = 2
INTERPRETER_PROGRAMS = 4


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return PROGRAMS_PER_SM * _multiprocessors(torch.cuda.current_device() if device.index is None else device.index)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_length(n_keys: int, row_programs: int, unit: int, target: int, splits=None) -> int:
    """Keys per split, a multiple of ``unit``: enough splits that row_programs · splits reach
    ``target`` programs (or ``splits`` of them, when given), never more than one per tile."""
    tiles_total = _cdiv(n_keys, unit)
    if splits is None:
        splits = _cdiv(target, row_programs)
    splits = max(1, min(int(splits), tiles_total))
    return _cdiv(tiles_total, splits) * unit


def _alpha_rows(alpha, batch, heads, lq):
    """α of each (b, h, i) row: a float as it is, an (H,) tensor repeated over B and Lq."""
    if not isinstance(alpha, torch.Tensor):
        return alpha
    return alpha.to(torch.float32).view(1, heads, 1).expand(batch, heads, lq).reshape(-1)


# The decoding kernels' OPTIONS: the score options compiled in (kvcache_decode.DECODE_OPTION_SETS); the
# window's left bound and the sink are run-time arguments there, and the right bound is the causal one.
DECODE_SCORE_BITS = SCORE_SOFTCAP | SCORE_ALIBI


def attention_kvcache_forward(query, k_cache, v_cache, seqlens_k, block_table, alpha, *, scale,
                              score_options=ScoreOptions()):
    alpha_heads, alpha_value = (alpha, 0.0) if isinstance(alpha, torch.Tensor) else (None, float(alpha))
    window_left, _, softcap, alibi_slopes, sinks = score_options.flat()
    return _decode_op(query, k_cache, v_cache, seqlens_k, block_table, alpha_heads, alpha_value, float(scale),
                      window_left, softcap, alibi_slopes, sinks)


# torch.library registration: opaque to torch.compile, which would otherwise trace the launchers
@torch.library.custom_op("entmax_fast::triton_attention_kvcache_fwd", mutates_args=())
def _decode_op(query: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens_k: Tensor, block_table: Optional[Tensor],
               alpha_heads: Optional[Tensor], alpha_value: float, scale: float, window_left: int, softcap: float,
               alibi_slopes: Optional[Tensor], sinks: Optional[Tensor]) -> Tensor:
    return decode(query, k_cache, v_cache, seqlens_k, block_table, alpha_value if alpha_heads is None else alpha_heads,
                  scale=scale, score_options=ScoreOptions.from_flat(window_left, -1, softcap, alibi_slopes, sinks))


@_decode_op.register_fake
def _(query, k_cache, v_cache, seqlens_k, block_table, alpha_heads, alpha_value, scale, window_left, softcap,
      alibi_slopes, sinks):
    return query.new_empty(*query.shape[:3], v_cache.shape[3])


def decode(query, k_cache, v_cache, seqlens_k, block_table, alpha, *, scale, score_options=ScoreOptions(),
           splits=None):
    """`attention_kvcache_forward` with the number of key splits chosen (``splits``: at most
    one per key tile) rather than from the device's multiprocessors (tests)."""
    batch, heads, lq, head_e = query.shape
    kv_heads, head_ev = k_cache.shape[1], v_cache.shape[3]
    group = heads // kv_heads
    paged = block_table is not None
    block_size = k_cache.shape[2] if paged else 1
    n_keys = block_table.shape[1] * block_size if paged else k_cache.shape[2]
    n_rows = batch * heads * lq
    device = query.device
    scores_tiles, output_tiles = tiles(group * lq, head_e, head_ev, k_cache.element_size(), interpreting())
    n_row_blocks = _cdiv(group * lq, scores_tiles["BLOCK_M"])
    row_programs = batch * kv_heads * n_row_blocks
    split_len = _split_length(n_keys, row_programs, max(scores_tiles["BLOCK_N"], output_tiles["BLOCK_N"]),
                              _target_programs(device), splits)
    n_splits = _cdiv(n_keys, split_len)
    grid = (row_programs, n_splits)

    window_left, _, softcap, alibi_slopes, sinks = score_options.flat()
    has_sink = sinks is not None
    scores = torch.empty((n_rows, n_keys + has_sink), dtype=torch.float32, device=device)
    # Pointers a launch without the option never reads: any tensor of the right dtype.
    table = block_table if paged else seqlens_k
    alibi = alibi_slopes.to(torch.float32) if alibi_slopes is not None else scores
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        stride_alibi_b, stride_alibi_h = 0, (alibi.stride(0) if alibi_slopes is not None else 0)
    else:
        stride_alibi_b, stride_alibi_h = alibi.stride(0), alibi.stride(1)
    sink_logits = sinks.to(torch.float32) if has_sink else scores
    options = score_options.kernel_bits & DECODE_SCORE_BITS
    kvcache_scores_kernel[grid](
        query, k_cache, seqlens_k, table, alibi, sink_logits, scores,
        kv_heads, group, lq, head_e, n_keys, split_len, block_size, n_row_blocks,
        *query.stride(), *k_cache.stride(), table.stride(0), stride_alibi_b, stride_alibi_h, scores.stride(0),
        float(scale), softcap, window_left, int(has_sink),
        PAGED=paged, OPTIONS=options, num_warps=NUM_WARPS, num_stages=1, **scores_tiles)

    weights = entmax_forward(scores, _alpha_rows(alpha, batch, heads, lq))

    partial = torch.empty((n_splits, n_rows, head_ev), dtype=torch.float32, device=device)
    kvcache_output_kernel[grid](
        weights, v_cache, seqlens_k, table, partial,
        kv_heads, group, lq, head_ev, n_keys, split_len, block_size, n_row_blocks, n_rows,
        *v_cache.stride(), table.stride(0), weights.stride(0),
        PAGED=paged, num_warps=NUM_WARPS, num_stages=1, **output_tiles)
    return partial.sum(0).view(batch, heads, lq, head_ev).to(query.dtype)
