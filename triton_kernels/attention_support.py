"""Support size of the fused entmax attention: how many keys each query row gives a nonzero
weight, counted from the row statistics the forward stores (the shift m, the threshold tau
and the weight sum l; attention_common.STAT_*), without an (Lq, Lk) block per head.

`entmax_attn_support_kernel`, one program per query block, recomputes the scores tile by
tile as the dQ kernel does (attention_bwd.py) over the key tiles the block can see (the
causal end, the window's tiles), and forms the weights with the dQ kernel's `_row_weights`,
so that a key counts exactly when the backward gives it a weight. The sink is no key and
is never counted (its share is in the stored sum l); a row whose stored shift is NaN (its
forward is NaN) counts none, a row whose keys are all masked none (its scores are -inf).
A head at alpha 1 of a per-head alpha counts its softmax weights that do not underflow, a
head above 2 the keys above its stored shift and threshold (`_row_weights`' forms of
those heads; attention_common, "A per-head alpha").
"""
import triton
import triton.language as tl

from .attention_bwd import _row_weights
from .attention_common import (ALPHA_KINDS, BLOCK_ES, FLOAT_PARAMETERS, MASK_KINDS,
                               HEADS_ALL_C, HEADS_IN_RANGE_C, HEADS_OUTSIDE_C, NEAR_ONE_INV_AM1,
                               POINTER_TYPES, head_launches, head_suffix, SCORE_OPTION_SETS,
                               SCORE_OPTION_TOKENS, SCORE_SINK, SCORE_WINDOW_C, STAT_MAX_C,
                               STAT_SUM_C, STAT_TAU_C, block_sizes, chunk_width, held_cols,
                               held_rows, launch_config, mask_pointer_type, mask_specialisation,
                               program_sequence, query_block, query_block_key_tiles,
                               shifted_scores)
from .kinds import ALPHA_ABOVE_TWO, ALPHA_GENERAL, ALPHA_SOFTMAX
from .signature import DTYPE_KEYS, kernel_signature


def launch(block_e, dtype_key):
    """(num_warps, num_stages, BLOCK_EC) of the kernel: the dQ kernel's warps and stages
    (the same score tiles, without its dO and dQ blocks) and the forward's head-dim chunk
    (its threshold passes hold what this kernel holds: one score tile and a few row
    values). Not timed on a GPU."""
    num_warps, num_stages = launch_config("dq", block_e, dtype_key)
    return num_warps, num_stages, chunk_width("fwd", block_e, dtype_key)


def kernel_options(options):
    """The kernel's OPTIONS from the attention's: the sink changes no key's weight beyond
    the stored threshold and sum, so it is not compiled in (one compile serves both)."""
    return options & ~SCORE_SINK


@triton.jit
def _count_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, start_n,
                q_len, k_len, head_e, scale, am1, inv_am1, b_mz, b_tau, b_l, is_causal,
                pos_shift, win_left, win_right, softcap, slope, b_count,
                BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                ALPHA_KIND: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr,
                BOUNDARY: tl.constexpr, NEAR_ONE: tl.constexpr):
    """b_count [BM] plus the keys of one tile with a positive weight in each row."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    b_kt = held_cols(p_k, stride_kl, o_n, k_len, head_e, BLOCK_E, BLOCK_EC, BOUNDARY)  # [BE, BN]
    b_u, _ = shifted_scores(b_q, b_kt, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                            stride_mk, o_m, start_n, q_len, k_len, head_e, scale, b_mz,
                            is_causal, pos_shift, win_left, win_right, softcap, slope, BLOCK_N,
                            BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    _, b_p, _ = _row_weights(b_u, b_tau, b_l, am1, inv_am1, ALPHA_KIND, NEAR_ONE)  # [BM, BN]
    return b_count + tl.sum((b_p > 0).to(tl.int32), 1)


@triton.jit
def _count_pass(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, kv_begin,
                full_begin, n_full, kv_end, o_m, q_len, k_len, head_e, scale, am1, inv_am1,
                b_mz, b_tau, b_l, is_causal, pos_shift, win_left, win_right, softcap, slope,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr, MASK_KIND: tl.constexpr,
                OPTIONS: tl.constexpr, NEAR_ONE: tl.constexpr):
    """The counts [BM] over the visible key tiles: those inside every mask without the
    masks' per-score work, those that cross an edge (the key end, the causal diagonal, the
    window's edges) with it."""
    b_count = tl.zeros([BLOCK_M], dtype=tl.int32)
    for start_n in range(full_begin, n_full, BLOCK_N):
        b_count = _count_tile(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, start_n,
            q_len, k_len, head_e, scale, am1, inv_am1, b_mz, b_tau, b_l, is_causal, pos_shift,
            win_left, win_right, softcap, slope, b_count, BLOCK_N, BLOCK_E, BLOCK_EC,
            ALPHA_KIND, MASK_KIND, OPTIONS, False, NEAR_ONE)
    for start_n in range(n_full, kv_end, BLOCK_N):
        b_count = _count_tile(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, start_n,
            q_len, k_len, head_e, scale, am1, inv_am1, b_mz, b_tau, b_l, is_causal, pos_shift,
            win_left, win_right, softcap, slope, b_count, BLOCK_N, BLOCK_E, BLOCK_EC,
            ALPHA_KIND, MASK_KIND, OPTIONS, True, NEAR_ONE)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        # the tiles that cross the window's leading edge
        for start_n in range(kv_begin, full_begin, BLOCK_N):
            b_count = _count_tile(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, start_n,
                q_len, k_len, head_e, scale, am1, inv_am1, b_mz, b_tau, b_l, is_causal,
                pos_shift, win_left, win_right, softcap, slope, b_count, BLOCK_N, BLOCK_E,
                BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, True, NEAR_ONE)
    return b_count


@triton.jit
def entmax_attn_support_kernel(
    q_ptr, k_ptr, stats_ptr, mask_ptr, alpha_ptr, counts_ptr,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_sb, stride_sh, stride_stat,
    n_heads, kv_group, seqlen_q, seqlen_k, n_qblocks, head_e,
    scale, is_causal, window_left, window_right, softcap,
    alibi_ptr, stride_alibi_b, stride_alibi_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr, MASK_KIND: tl.constexpr,
    OPTIONS: tl.constexpr, HEADS: tl.constexpr = HEADS_ALL_C,
):
    """The support size of each row of one query block, into counts (B, H, Lq) int32
    (contiguous), from the statistics of the forward that ran on q and k with the same
    arguments."""
    pid_bh = tl.program_id(0)
    pid_m = query_block(tl.program_id(1), n_qblocks)
    # padded sequences only: no cu_seqlens, the pointers in their place are not read
    i_b, i_h, i_hk, _, q_len, _, k_len = program_sequence(
        pid_bh, n_heads, kv_group, counts_ptr, counts_ptr, seqlen_q, seqlen_k, False, False)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    o_m = start_m + tl.arange(0, BLOCK_M)
    m_m = o_m < q_len

    p_q = q_ptr + i_b * stride_qb + i_h * stride_qh
    p_k = k_ptr + i_b * stride_kb + i_hk * stride_kh
    p_mask = mask_ptr + i_b * stride_mb + i_h * stride_mh
    p_stats = stats_ptr + i_b * stride_sb + i_h * stride_sh + o_m

    b_q = held_rows(p_q, stride_ql, o_m, q_len, head_e, BLOCK_E, BLOCK_EC, True)  # [BM, BE]
    b_mz = tl.load(p_stats + STAT_MAX_C * stride_stat, mask=m_m, other=0.0)
    b_tau = tl.load(p_stats + STAT_TAU_C * stride_stat, mask=m_m, other=0.0)
    b_l = tl.load(p_stats + STAT_SUM_C * stride_stat, mask=m_m, other=0.0)
    # a row with every key masked stores l = 0: its scores are -inf, its weights 0
    b_l = tl.where(b_l > 0, b_l, 1.0)
    alpha = tl.load(alpha_ptr + i_h).to(tl.float32)
    am1 = alpha - 1.0
    inv_am1 = 1.0 / am1
    if HEADS == HEADS_IN_RANGE_C:
        if (am1 == 0.0) | (am1 > 1.0):
            return
    if HEADS == HEADS_OUTSIDE_C:
        if (am1 != 0.0) & (am1 <= 1.0):
            return

    kv_begin, full_begin, n_full, kv_end, pos_shift, win_left, win_right, slope = query_block_key_tiles(
        i_b, i_h, start_m, q_len, k_len, is_causal, window_left, window_right, alibi_ptr,
        stride_alibi_b, stride_alibi_h, BLOCK_M, BLOCK_N, OPTIONS)
    # general alpha near 1 takes `log2_base`'s log1p form, as in the forward and dQ
    # (and a head at alpha 1, softmax, or above 2: attention_common, "A per-head alpha")
    near_one = False
    softmax = False
    if ALPHA_KIND == ALPHA_GENERAL:
        if HEADS == HEADS_OUTSIDE_C:
            softmax = am1 == 0.0
        else:
            near_one = inv_am1 > NEAR_ONE_INV_AM1
    if HEADS == HEADS_OUTSIDE_C:
        if softmax:
            b_count = _count_pass(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, kv_begin,
                full_begin, n_full, kv_end, o_m, q_len, k_len, head_e, scale, am1,
                inv_am1, b_mz, b_tau, b_l, is_causal, pos_shift, win_left, win_right, softcap,
                slope, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, ALPHA_SOFTMAX, MASK_KIND, OPTIONS,
                False)
        else:
            b_count = _count_pass(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, kv_begin,
                full_begin, n_full, kv_end, o_m, q_len, k_len, head_e, scale, am1,
                inv_am1, b_mz, b_tau, b_l, is_causal, pos_shift, win_left, win_right, softcap,
                slope, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, ALPHA_ABOVE_TWO, MASK_KIND, OPTIONS,
                False)
    elif near_one:
        b_count = _count_pass(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, kv_begin,
            full_begin, n_full, kv_end, o_m, q_len, k_len, head_e, scale, am1,
            inv_am1, b_mz, b_tau, b_l, is_causal, pos_shift, win_left, win_right, softcap,
            slope, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, True)
    else:
        b_count = _count_pass(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, kv_begin,
            full_begin, n_full, kv_end, o_m, q_len, k_len, head_e, scale, am1,
            inv_am1, b_mz, b_tau, b_l, is_causal, pos_shift, win_left, win_right, softcap,
            slope, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, False)
    # a row whose forward was NaN (a NaN or +inf score) stores a NaN shift and counts none
    b_count = tl.where(b_mz != b_mz, 0, b_count)
    tl.store(counts_ptr + pid_bh.to(tl.int64) * seqlen_q + o_m, b_count, mask=m_m)


# ------------------------------------------------------------------------------ AOT

POINTERS = dict(POINTER_TYPES, counts_ptr="*i32")


def aot_configs():
    """Every configuration the launcher can choose: dtype, head dim, alpha kind, mask kind
    and the score options other than the sink (`kernel_options`)."""
    configs = []
    for dtype_key in DTYPE_KEYS.values():
        for block_e in BLOCK_ES:
            block_m, block_n = block_sizes(block_e, dtype_key)
            num_warps, num_stages, block_ec = launch(block_e, dtype_key)
            # a token of its own, so that the covering sample compiles the chunked products
            chunked = f"_ec{block_ec}" if block_ec < block_e else ""
            for mask_kind in MASK_KINDS:
                signature = kernel_signature(
                    entmax_attn_support_kernel, dtype_key,
                    dict(POINTERS, mask_ptr=mask_pointer_type(dtype_key, mask_kind)),
                    floats=FLOAT_PARAMETERS)
                signature.update(dict.fromkeys(mask_specialisation(mask_kind), "constexpr"))
                for alpha_kind, heads in ((a, h) for a in ALPHA_KINDS for h in head_launches(a)):
                    for options in sorted({kernel_options(o) for o in SCORE_OPTION_SETS}):
                        name = (f"entmax_attn_support_{dtype_key}_e{block_e}{chunked}"
                                f"_a{alpha_kind}_m{mask_kind}"
                                + "".join(f"_{token}" for bit, token in SCORE_OPTION_TOKENS
                                          if options & bit) + head_suffix(heads))
                        configs.append({
                            "name": name, "fn": entmax_attn_support_kernel,
                            "signature": signature,
                            "constexprs": {"BLOCK_M": block_m, "BLOCK_N": block_n,
                                           "BLOCK_E": block_e, "BLOCK_EC": block_ec,
                                           "ALPHA_KIND": alpha_kind, "MASK_KIND": mask_kind,
                                           "OPTIONS": options, "HEADS": heads,
                                           **mask_specialisation(mask_kind)},
                            "num_warps": num_warps, "num_stages": num_stages,
                        })
    return configs
