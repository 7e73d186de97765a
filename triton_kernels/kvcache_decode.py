"""Entmax attention against a key/value cache (decoding), split over the keys.

Decoding is bound by reading the cache: one step of a sequence reads Lk·(E + Ev) values of
each key/value head for a handful of query rows, so the work must be spread over the keys,
not only over the (batch, head) pairs, for a small batch to fill a GPU. Softmax's split-K
(FlashDecoding) merges per-split partial outputs with their log-sum-exps; entmax cannot:
its threshold τ is a root over the whole row, and a split's output depends on it. So the
row's scores are formed first and τ is found exactly over all of them:

1. `kvcache_scores_kernel`, grid (B·Hkv·row blocks, splits): a program takes the query rows
   of one key/value head (the G = H/Hkv query heads of its group times Lq queries, so that
   the group reads each key once) and the keys of one split, read through the block table
   or from the contiguous cache; it writes the scores after the score options and masks
   (scale, softcap, ALiBi, lower-right causal and window: docs/attention.md, "Score
   options") to an fp32 buffer (rows, Lk + sink), masked entries −inf, and the head's sink
   logit in the row's last column. Each write or read of the buffer (and of the weights)
   costs 4·G bytes per key of a kv head against the 4·E of its fp16 key and value: a small
   share of the traffic where G is well below E.
2. The row-wise solver (triton_kernels/rowwise.py, exact, any α) maps each buffer row to
   its weights p, which sum to one; the sink is one more entry of the row and its weight
   reaches no value. The weights are stored rather than τ: the output launch then needs no
   per-α power, and its rows are convex combinations as the solver normalised them.
3. `kvcache_output_kernel`, same grid: each split accumulates p·v over its keys into a
   per-split fp32 partial output, skipping the value tiles where the row block has no
   weight (entmax's zeros: their values are never read); the launcher sums the splits on
   the device.

Every buffer's size follows from the shapes alone (the cache's capacity, not the lengths
in cache_seqlens), so nothing waits on the host and a CUDA graph can capture the call; keys
past a sequence's length are never loaded (their block-table entries may be garbage) and
score −inf. q·k is a tensor-core product in the cache's dtype with fp32 accumulation (fp32:
three TF32 products, `attention_common.dot`); in p·v the fp32 weights meet fp16/bf16 values
as two parts in the values' dtype (hi + lo), so that they keep 22 (fp16) or 16 (bf16) bits
where one part would keep 11 or 8, and the values are used as stored.

The launchers (`entmax_fast/backends/triton/kvcache.py`) choose the tiles and the number of
splits; this module holds what they launch and what the AOT check compiles.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import SCORE_ALIBI, SCORE_ALIBI_C, SCORE_SOFTCAP, SCORE_SOFTCAP_C, dot, softcap_tanh
from .signature import DTYPE_KEYS, TENSOR, kernel_signature

__all__ = ["kvcache_scores_kernel", "kvcache_output_kernel", "tiles", "aot_configs", "HEAD_BLOCKS", "ROW_BLOCKS",
           "DECODE_OPTION_SETS", "NUM_WARPS"]

# Row blocks: a decoding step's group (G·1 rows, G ≤ 16 in common models) in one block of
# 16, the tensor cores' smallest; speculative or chunked steps in blocks of 64.
ROW_BLOCKS = (16, 64)
# Head dims a tile covers (E and Ev up to 256, the public layer's limit for these kernels).
HEAD_BLOCKS = (16, 32, 64, 128, 256)
# The score options with per-score work, compiled in only where used; the window is a
# comparison every score makes anyway (an unbounded left side lies past every key).
DECODE_OPTION_SETS = (0, SCORE_SOFTCAP, SCORE_ALIBI, SCORE_SOFTCAP | SCORE_ALIBI)
# Elements of a [BLOCK_N, BLOCK_E] key or value tile in two-byte elements: 64 keys up to
# E 128 in fp16/bf16, 32 at E 256; fp32 tiles half as many keys (three TF32 products hold
# more of them: AOT, sm_90, 64 rows by 256 of fp32 at 32 keys took 192 KiB of shared memory).
_TILE_HALFS = 8192
_MAX_KEY_BLOCK = 64
_MIN_KEY_BLOCK = 16
NUM_WARPS = 4


def _head_block(dim: int) -> int:
    # plain integer arithmetic: triton.next_power_of_2 is a ConstexprFunction, microseconds
    # per call on the host
    return max(HEAD_BLOCKS[0], 1 << max(0, dim - 1).bit_length())


def _key_block(block_e: int, element_bytes: int) -> int:
    return max(_MIN_KEY_BLOCK, min(_MAX_KEY_BLOCK, _TILE_HALFS * 2 // (block_e * element_bytes)))


def tiles(n_rows: int, head_e: int, head_ev: int, element_bytes: int, interpreting: bool = False) -> tuple:
    """(scores kernel's constexprs, output kernel's) of a call with ``n_rows`` rows per
    key/value head and a cache of ``element_bytes`` per element: BLOCK_M rows per program,
    BLOCK_N keys per tile, BLOCK_E / BLOCK_EV the head dim padded to a power of two. The
    interpreter takes 16-key tiles, so that small tests cross several tiles and splits."""
    block_m = ROW_BLOCKS[0] if n_rows <= ROW_BLOCKS[0] else ROW_BLOCKS[1]
    block_e, block_ev = _head_block(head_e), _head_block(head_ev)
    key_block, value_block = ((_MIN_KEY_BLOCK, _MIN_KEY_BLOCK) if interpreting else
                              (_key_block(block_e, element_bytes), _key_block(block_ev, element_bytes)))
    return ({"BLOCK_M": block_m, "BLOCK_N": key_block, "BLOCK_E": block_e},
            {"BLOCK_M": block_m, "BLOCK_N": value_block, "BLOCK_EV": block_ev})


@triton.jit
def _program_rows(pid_rows, n_row_blocks, kv_heads, group, q_len, BLOCK_M: tl.constexpr):
    """(i_b, i_kvh, o_r, m_r, o_row, o_qh, o_qi) of a program: its sequence and key/value
    head, its rows r = g·Lq + i of the group (mask m_r), their rows of the (B·H·Lq) buffers,
    and their query heads and query indices."""
    i_blk = pid_rows % n_row_blocks
    i_bh = pid_rows // n_row_blocks
    i_kvh = i_bh % kv_heads
    i_b = i_bh // kv_heads
    o_r = i_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    n_group_rows = group * q_len
    m_r = o_r < n_group_rows
    o_row = i_bh.to(tl.int64) * n_group_rows + o_r
    o_qh = i_kvh * group + o_r // q_len
    o_qi = o_r % q_len
    return i_b, i_kvh, o_r, m_r, o_row, o_qh, o_qi


@triton.jit
def _split_keys(pid_split, split_len, n_keys):
    return pid_split * split_len, tl.minimum((pid_split + 1) * split_len, n_keys)


@triton.jit
def _key_rows(p_table_row, i_b, i_kvh, o_n, m_n, stride_cb, stride_ch, stride_cl, block_size,
              PAGED: tl.constexpr):
    """Offsets of keys o_n (mask m_n: the table is read only there) of sequence i_b's head
    i_kvh in a cache: (B, Hkv, Lmax, ·) contiguous, or (num_blocks, Hkv, block_size, ·)
    through the sequence's block table row."""
    if PAGED:
        o_block = tl.load(p_table_row + o_n // block_size, mask=m_n, other=0).to(tl.int64)
        return o_block * stride_cb + i_kvh * stride_ch + (o_n % block_size) * stride_cl
    return i_b.to(tl.int64) * stride_cb + i_kvh * stride_ch + o_n.to(tl.int64) * stride_cl


@triton.jit
def kvcache_scores_kernel(
        q_ptr, k_ptr, seqlens_ptr, table_ptr, alibi_ptr, sinks_ptr, scores_ptr,
        kv_heads, group, q_len, head_e, n_keys, split_len, block_size, n_row_blocks,
        stride_qb, stride_qh, stride_ql, stride_qe,
        stride_kb, stride_kh, stride_kl, stride_ke,
        stride_tb, stride_alibi_b, stride_alibi_h, stride_scores,
        scale, softcap, window_left, has_sink,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, PAGED: tl.constexpr,
        OPTIONS: tl.constexpr):
    """Scores of one split's keys for one row block, to scores_ptr (rows, n_keys [+ 1]):
    the (capped, ALiBi-biased) scaled scores where query i at position seqlen − Lq + i
    sees key j (j ≤ position, j ≥ position − window_left when window_left ≥ 0), −inf
    elsewhere; the split-0 program also writes each row's sink logit after the keys."""
    pid_rows = tl.program_id(0)
    pid_split = tl.program_id(1)
    i_b, i_kvh, o_r, m_r, o_row, o_qh, o_qi = _program_rows(pid_rows, n_row_blocks, kv_heads, group, q_len,
                                                             BLOCK_M)
    seqlen = tl.load(seqlens_ptr + i_b)
    o_pos = seqlen - q_len + o_qi
    # Keys any row of the block may see: those of no row are neither read nor scored.
    first_key = 0
    if window_left >= 0:
        first_key = tl.maximum(seqlen - q_len - window_left, 0)
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < head_e
    p_q = (q_ptr + i_b.to(tl.int64) * stride_qb + o_qh[:, None] * stride_qh + o_qi[:, None] * stride_ql
           + o_e[None, :] * stride_qe)
    b_q = tl.load(p_q, mask=m_r[:, None] & m_e[None, :], other=0.0)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if (SCORE_ALIBI_C & OPTIONS) != 0:
        slope = tl.load(alibi_ptr + i_b * stride_alibi_b + o_qh * stride_alibi_h, mask=m_r, other=0.0)
    p_table_row = table_ptr + i_b.to(tl.int64) * stride_tb
    p_scores = scores_ptr + o_row[:, None] * stride_scores
    split_begin, split_end = _split_keys(pid_split, split_len, n_keys)
    for start_n in range(split_begin, split_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = (o_n < seqlen) & (o_n >= first_key)
        o_k = _key_rows(p_table_row, i_b, i_kvh, o_n, m_n, stride_kb, stride_kh, stride_kl, block_size, PAGED)
        b_kt = tl.load(k_ptr + o_k[None, :] + o_e[:, None] * stride_ke, mask=m_n[None, :] & m_e[:, None],
                       other=0.0)
        b_s = dot(b_q, b_kt) * scale
        if (SCORE_SOFTCAP_C & OPTIONS) != 0:
            b_tanh, _ = softcap_tanh(b_s * (1.0 / softcap))
            b_s = softcap * b_tanh
        if (SCORE_ALIBI_C & OPTIONS) != 0:
            b_s = b_s - slope[:, None] * tl.abs(o_pos[:, None] - o_n[None, :]).to(tl.float32)
        m_visible = m_n[None, :] & (o_n[None, :] <= o_pos[:, None])
        if window_left >= 0:
            m_visible = m_visible & (o_n[None, :] >= (o_pos - window_left)[:, None])
        b_s = tl.where(m_visible, b_s, float("-inf"))
        tl.store(p_scores + o_n[None, :], b_s, mask=m_r[:, None] & (o_n[None, :] < split_end))
    if has_sink != 0:
        if pid_split == 0:
            b_sink = tl.load(sinks_ptr + o_qh, mask=m_r, other=0.0)
            tl.store(scores_ptr + o_row * stride_scores + n_keys, b_sink, mask=m_r)


@triton.jit
def kvcache_output_kernel(
        p_ptr, v_ptr, seqlens_ptr, table_ptr, partial_ptr,
        kv_heads, group, q_len, head_ev, n_keys, split_len, block_size, n_row_blocks, n_rows,
        stride_vb, stride_vh, stride_vl, stride_ve, stride_tb, stride_p,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_EV: tl.constexpr, PAGED: tl.constexpr):
    """Σ_j p_j v_j over one split's keys for one row block, to partial_ptr
    (splits, rows, Ev) fp32. Value tiles where no row of the block has weight are not read."""
    pid_rows = tl.program_id(0)
    pid_split = tl.program_id(1)
    i_b, i_kvh, o_r, m_r, o_row, o_qh, o_qi = _program_rows(pid_rows, n_row_blocks, kv_heads, group, q_len,
                                                             BLOCK_M)
    seqlen = tl.load(seqlens_ptr + i_b)
    o_e = tl.arange(0, BLOCK_EV)
    m_e = o_e < head_ev
    p_table_row = table_ptr + i_b.to(tl.int64) * stride_tb
    p_weights = p_ptr + o_row[:, None] * stride_p
    b_acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    split_begin, split_end = _split_keys(pid_split, split_len, n_keys)
    for start_n in range(split_begin, split_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < tl.minimum(seqlen, split_end)
        b_p = tl.load(p_weights + o_n[None, :], mask=m_r[:, None] & m_n[None, :], other=0.0)
        if tl.max(tl.max(b_p, axis=1), axis=0) > 0:
            o_v = _key_rows(p_table_row, i_b, i_kvh, o_n, m_n, stride_vb, stride_vh, stride_vl, block_size,
                            PAGED)
            b_v = tl.load(v_ptr + o_v[:, None] + o_e[None, :] * stride_ve, mask=m_n[:, None] & m_e[None, :],
                          other=0.0)
            if b_v.dtype == tl.float32:
                b_acc += dot(b_p, b_v)
            else:
                # the weights as two parts in the values' dtype, hi + lo (22 bits of fp16,
                # 16 of bf16), each a tensor-core product with the values as they are stored
                b_p_hi = b_p.to(b_v.dtype)
                b_p_lo = (b_p - b_p_hi.to(tl.float32)).to(b_v.dtype)
                b_acc = tl.dot(b_p_hi, b_v, b_acc)
                b_acc = tl.dot(b_p_lo, b_v, b_acc)
    p_out = partial_ptr + (pid_split * n_rows + o_row[:, None]) * head_ev + o_e[None, :]
    tl.store(p_out, b_acc, mask=m_r[:, None] & m_e[None, :])


SCORES_POINTERS = {"q_ptr": TENSOR, "k_ptr": TENSOR, "seqlens_ptr": "*i32", "table_ptr": "*i32",
                   "alibi_ptr": "*fp32", "sinks_ptr": "*fp32", "scores_ptr": "*fp32"}
OUTPUT_POINTERS = {"p_ptr": "*fp32", "v_ptr": TENSOR, "seqlens_ptr": "*i32", "table_ptr": "*i32",
                   "partial_ptr": "*fp32"}


def aot_configs() -> list[dict]:
    """Every configuration the launcher can choose (`tiles` on a GPU), for triton_kernels/aot.py."""
    configs = []
    for dtype, dtype_key in DTYPE_KEYS.items():
        for block_m in ROW_BLOCKS:
            for block_e in HEAD_BLOCKS:
                block_n = _key_block(block_e, dtype.itemsize)
                for paged in (False, True):
                    tag = f"{dtype_key}_m{block_m}_e{block_e}_{'paged' if paged else 'contiguous'}"
                    for options in DECODE_OPTION_SETS:
                        configs.append({
                            "name": f"kvcache_scores_{tag}_o{options}",
                            "fn": kvcache_scores_kernel,
                            "signature": kernel_signature(kvcache_scores_kernel, dtype_key, SCORES_POINTERS,
                                                          floats=("scale", "softcap")),
                            "constexprs": {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_E": block_e,
                                           "PAGED": paged, "OPTIONS": options},
                            "num_warps": NUM_WARPS, "num_stages": 1,
                        })
                    configs.append({
                        "name": f"kvcache_output_{tag}",
                        "fn": kvcache_output_kernel,
                        "signature": kernel_signature(kvcache_output_kernel, dtype_key, OUTPUT_POINTERS),
                        "constexprs": {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_EV": block_e,
                                       "PAGED": paged},
                        "num_warps": NUM_WARPS, "num_stages": 1,
                    })
    return configs
