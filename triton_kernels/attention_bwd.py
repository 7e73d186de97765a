"""Fused entmax attention, backward kernels (deterministic: no atomics).

From q, k, v, dO, the row statistics of the forward (the shift m = max of the scores z,
the threshold tau and the weight sum l; attention_fwd.py) and the D-vector
``D = sum_j s_j v_j / sum_j s_j`` (docs/attention.md, "Backward"), one row's weights are
``p_j = [z_j - m - tau]_+^(1/(alpha-1)) / l`` (tau in z units for alpha 2 and 1.5; the
general kind keeps its threshold in (alpha-1) z units, `attention_common.gap`, and l takes
up the constant factor) and, with ``g_j = dO . v_j`` (times the dropout factor) and
``delta = dO . D``:

    dV_j += p_j dO,   dz_j = s_j (g_j - delta),   dQ = scale sum_j dz_j k_j,
    dK_j += scale dz_j q,   s_j = p_j^(2 - alpha).

Two kernels, each writing its outputs exactly once:
- `entmax_attn_bwd_dq_kernel`, one program per query block: dQ, delta per row, and the
  per-row terms of d(alpha) (Correia et al. 2019; docs/attention.md, "Gradient of alpha")
  and of d(sink), -s_sink delta (a sink is one more entry of the row with a zero value,
  whose weight the statistics and the D-vector include);
- `entmax_attn_bwd_dkdv_kernel`, one program per key block of one key/value head: dK and
  dV, summing over the query heads of its group (GQA) in a fixed order.
Both visit only the tiles the forward flagged as holding non-zero weight, the full ones
through a list of them (`listed_tiles`, so that the loops are pipelined), and spend the
causal, key-end and query-end masks only on the tiles that cross them.
"""
import itertools

import triton
import triton.language as tl

from .. import common
from .attention_common import (DQ_KERNEL, DQ_KERNEL_C, DQ_MAX_POLLS_C, DQ_MODES, DQ_ORDERED_C,
                               HEADS_ALL_C, HEADS_IN_RANGE_C, HEADS_OUTSIDE_C, head_launches,
                               head_suffix,
                               NEAR_ONE_INV_AM1, SCORE_ALIBI_C, SCORE_SINK_C, SCORE_SOFTCAP_C,
                               SCORE_WINDOW_C,
                               STAT_ENTROPY_C, STAT_MAX_C, STAT_SUM_C, STAT_TAU_C, arch_chunks,
                               attention_signature, backward_launch, block_sizes, chunk_width,
                               config_space, config_suffix, dot, dot_rows, dropout_scale,
                               gap, held_cols, held_rows, listed_tiles, load_rows, log2_base,
                               mask_specialisation, program_sequence, query_block,
                               query_block_key_tiles, score_option_values, shifted_scores,
                               sink_logit, window_query_tiles)
from .kinds import ALPHA_ABOVE_TWO, ALPHA_ENTMAX15, ALPHA_GENERAL, ALPHA_SOFTMAX, ALPHA_SPARSEMAX

# rows of the backward's per-row buffer: delta, the row's d(alpha) term and its d(sink)
# term, which the launcher sums per head
ROW_DELTA, ROW_DALPHA, ROW_DSINK = 0, 1, 2
NUM_ROWS = 3
ROW_DELTA_C = tl.constexpr(ROW_DELTA)
ROW_DALPHA_C = tl.constexpr(ROW_DALPHA)
ROW_DSINK_C = tl.constexpr(ROW_DSINK)


@triton.jit
def _row_weights(b_u, b_thr, b_l, am1, inv_am1, ALPHA_KIND: tl.constexpr,
                 NEAR_ONE: tl.constexpr = None):
    """The `gap` g of the shifted scores u to the stored threshold, the normalised weights
    p and the sensitivities s = p^(2-alpha). [BM, BN]

    The row's weight sum l comes in through a factor per row, not per score: alpha 1.5
    scales the gap by l^(-1/2), so that p = (g l^(-1/2))^2 and s = g l^(-1/2); alpha 2's
    s = [g > 0] needs no l; general alpha adds (alpha - 2) log2 l to the exponent of
    s = base^(e-1) l^(alpha-2) and takes p = base^e / l = s base l^(1-alpha), a factor per
    row (`weights_and_sensitivity`). That spares a multiply per score and weight, and
    libdevice's log2 and a division per row, which the dK/dV loop paid on every tile (its
    rows change with the tile). The g returned (alpha 1.5's scaled) is read only for
    d(alpha). Softmax (a head at alpha 1 of the general kind): g = u - thr, p = exp(g) / l
    and s = p. A head above 2: g = d, p = (am1 d)^e / l, s = (am1 d)^(e-1) l^(alpha-2)."""
    if ALPHA_KIND == ALPHA_SOFTMAX:
        b_g = gap(b_u, b_thr, inv_am1, ALPHA_KIND)
        b_p = tl.exp2(b_g * 1.4426950408889634 - tl.log2(b_l)[:, None])
        b_s = b_p
    elif ALPHA_KIND == ALPHA_ABOVE_TWO:
        b_g = gap(b_u, b_thr, inv_am1, ALPHA_KIND)
        b_log2l = tl.log2(b_l)
        b_lb = log2_base(b_g, inv_am1, ALPHA_KIND)
        b_s = tl.where(b_g > 0,
                       tl.exp2((inv_am1 - 1.0) * b_lb + ((am1 - 1.0) * b_log2l)[:, None]), 0.0)
        b_p = tl.where(b_g > 0, tl.exp2(inv_am1 * b_lb - b_log2l[:, None]), 0.0)
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        b_c = tl.math.rsqrt(b_l)
        b_g = tl.maximum(tl.fma(b_u, b_c[:, None], -(b_thr * b_c)[:, None]), 0.0)
        b_p = b_g * b_g
        b_s = b_g
    elif ALPHA_KIND == ALPHA_SPARSEMAX:
        b_g = gap(b_u, b_thr, inv_am1, ALPHA_KIND)
        b_p = b_g * (1.0 / b_l)[:, None]
        b_s = tl.where(b_g > 0, 1.0, 0.0)
    else:
        b_g = gap(b_u, b_thr, inv_am1, ALPHA_KIND)
        b_log2l = tl.log2(b_l)
        b_lb = log2_base(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
        b_s = tl.where(b_g > -1.0,
                       tl.exp2((inv_am1 - 1.0) * b_lb + ((am1 - 1.0) * b_log2l)[:, None]), 0.0)
        # p = base^e / l = s base l^(1 - alpha) (`weights_and_sensitivity`)
        b_p = b_s * tl.maximum(1.0 + b_g, 0.0) * tl.exp2(-am1 * b_log2l)[:, None]
    return b_g, b_p, b_s


@triton.jit
def _dq_tile(b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
             p_mask, stride_mq, stride_mk, o_m, start_n, q_len, k_len, head_e, head_ev,
             scale, am1, inv_am1, b_mz, b_tau, b_l, b_delta, is_causal, pos_shift, win_left,
             win_right, softcap, slope, seed, pid_bh,
             seqlen_q, seqlen_k, dropout_p, b_dq, b_gh,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
             BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
             MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             NEED_DALPHA: tl.constexpr,
             BOUNDARY: tl.constexpr, NEAR_ONE: tl.constexpr):
    """Adds one key tile to dQ and to sum_j g_j h_j."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    b_k = held_rows(p_k, stride_kl, o_n, k_len, head_e, BLOCK_E, BLOCK_EC, BOUNDARY)  # [BN, BE]
    if BLOCK_EC >= BLOCK_E:
        b_kt = tl.trans(b_k)  # one load of k for the scores and for dQ
    else:
        b_kt = 0.0
    b_u, b_cap_slope = shifted_scores(b_q, b_kt, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                         stride_mk, o_m, start_n, q_len, k_len, head_e, scale, b_mz,
                         is_causal, pos_shift, win_left, win_right, softcap, slope, BLOCK_N,
                         BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    b_gap, b_p, b_s = _row_weights(b_u, b_tau, b_l, am1, inv_am1, ALPHA_KIND, NEAR_ONE)
    b_vt = held_cols(p_v, stride_vl, o_n, k_len, head_ev, BLOCK_EV, BLOCK_EC, BOUNDARY)
    b_g = dot_rows(b_do, b_vt, p_do, stride_ol, o_m, q_len, p_v, stride_vl, o_n, k_len,
                   head_ev, BLOCK_EV, BLOCK_EC)  # dL/dp [BM, BN]
    if HAS_DROPOUT:
        b_g = b_g * dropout_scale(seed, pid_bh, o_m, o_n, seqlen_q, seqlen_k, dropout_p,
                                  BLOCK_M, BLOCK_N, HAS_DROPOUT)
    b_dz = b_s * (b_g - b_delta[:, None])
    if (SCORE_SOFTCAP_C & OPTIONS) != 0:
        # through the cap: d(softcap tanh(s / softcap))/ds = 1 / cosh^2(s / softcap)
        b_dz = b_dz * b_cap_slope
    if BLOCK_EC < BLOCK_E:
        # loaded only now, so that it is not live during the chunked products
        b_k = load_rows(p_k, stride_kl, o_n, k_len, head_e, BLOCK_E, BOUNDARY)
    b_dq += dot(b_dz.to(b_k.dtype), b_k)
    if NEED_DALPHA:
        if ALPHA_KIND == ALPHA_SOFTMAX:
            # at alpha = 1, dp_j/dalpha = -(p_j log^2 p_j - p_j sum_k p_k log^2 p_k) / 2, so
            # that the row's d(alpha) is -sum_j p_j log^2 p_j (g_j - delta) / 2 (delta =
            # sum_j g_j p_j: the D-vector is the output)
            b_logp = tl.where(b_p > 0, b_gap - tl.log(b_l)[:, None], 0.0)
            b_gh -= 0.5 * tl.sum(b_p * b_logp * b_logp * (b_g - b_delta[:, None]), 1)
        else:
            # h = -p log p with log p = log(d) / (alpha - 1) - log l
            # (off the support p = 0 and the log of the base is 0)
            b_log2 = log2_base(b_gap, inv_am1, ALPHA_KIND, NEAR_ONE)
            if ALPHA_KIND == ALPHA_GENERAL:
                b_log2 = tl.where(b_gap > -1.0, b_log2, 0.0)
            b_logp = (b_log2 * inv_am1 - tl.log2(b_l)[:, None]) * 0.6931471805599453
            b_gh -= tl.sum(b_p * b_logp * b_g, 1)
    return b_dq, b_gh


@triton.jit
def _dq_pass(b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol, p_mask,
             stride_mq, stride_mk, p_flags, p_tiles, n_listed, kv_begin, full_begin, n_full,
             kv_end, o_m, q_len, k_len,
             head_e, head_ev, scale, am1, inv_am1, b_mz, b_tau, b_l, b_delta, is_causal,
             pos_shift, win_left, win_right, softcap, slope, seed,
             pid_bh, seqlen_q, seqlen_k, dropout_p,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
             BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
             MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             NEED_DALPHA: tl.constexpr,
             NEAR_ONE: tl.constexpr):
    """(dQ, sum_j g_j h_j) over the listed full key tiles (a pipelined loop) and the flagged
    ones that cross a mask's edge."""
    b_dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    b_gh = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum_j g_j h_j for d(alpha)
    for i in range(n_listed):
        start_n = tl.load(p_tiles + i) * BLOCK_N
        b_dq, b_gh = _dq_tile(
            b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol, p_mask,
            stride_mq, stride_mk, o_m, start_n, q_len, k_len, head_e, head_ev, scale,
            am1, inv_am1, b_mz, b_tau, b_l, b_delta, is_causal, pos_shift, win_left, win_right,
            softcap, slope, seed, pid_bh, seqlen_q, seqlen_k,
            dropout_p, b_dq, b_gh, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
            BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, HAS_DROPOUT, NEED_DALPHA, False, NEAR_ONE)
    for start_n in range(n_full, kv_end, BLOCK_N):
        if tl.load(p_flags + start_n // BLOCK_N) != 0:
            b_dq, b_gh = _dq_tile(
                b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                p_mask, stride_mq, stride_mk, o_m, start_n, q_len, k_len, head_e, head_ev,
                scale, am1, inv_am1, b_mz, b_tau, b_l, b_delta, is_causal, pos_shift, win_left,
                win_right, softcap, slope, seed, pid_bh,
                seqlen_q, seqlen_k, dropout_p, b_dq, b_gh, BLOCK_M, BLOCK_N,
                BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, HAS_DROPOUT,
                NEED_DALPHA,
                True, NEAR_ONE)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        # the tiles that cross the window's leading edge
        for start_n in range(kv_begin, full_begin, BLOCK_N):
            if tl.load(p_flags + start_n // BLOCK_N) != 0:
                b_dq, b_gh = _dq_tile(
                    b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                    p_mask, stride_mq, stride_mk, o_m, start_n, q_len, k_len, head_e, head_ev,
                    scale, am1, inv_am1, b_mz, b_tau, b_l, b_delta, is_causal, pos_shift,
                    win_left, win_right, softcap, slope, seed, pid_bh,
                    seqlen_q, seqlen_k, dropout_p, b_dq, b_gh, BLOCK_M, BLOCK_N,
                    BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, HAS_DROPOUT,
                    NEED_DALPHA,
                    True, NEAR_ONE)
    return b_dq, b_gh


@triton.jit
def entmax_attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, dq_ptr, dvec_ptr, stats_ptr, rows_ptr, flags_ptr,
    tiles_ptr, mask_ptr, alpha_ptr, seed_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_ol,
    stride_dqb, stride_dqh, stride_dql,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_sb, stride_sh, stride_stat, stride_row,
    n_heads, kv_group, seqlen_q, seqlen_k, n_qblocks, n_kblocks, head_e, head_ev,
    scale, dropout_p, is_causal, window_left, window_right, softcap,
    alibi_ptr, stride_alibi_b, stride_alibi_h, sinks_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
    MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    NEED_DALPHA: tl.constexpr,
    HEADS: tl.constexpr = HEADS_ALL_C,
):
    """dQ for one query block; o, do and dvec share strides. dq has its own: q may be a
    view a fresh tensor cannot copy the strides of (a slice of a fused projection).
    NEED_DALPHA, the per-row d(alpha) terms, is a compile-time switch: as a run-time flag
    its terms (a log per score) held 250 registers in every dQ launch on sm_90 (bf16,
    E 64, alpha 1.5), against 162 without them."""
    pid_bh = tl.program_id(0)
    pid_m = query_block(tl.program_id(1), n_qblocks)
    i_b, i_h, i_hk, q_start, q_len, k_start, k_len = program_sequence(
        pid_bh, n_heads, kv_group, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, IS_VARLEN, False)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_e = tl.arange(0, BLOCK_E)
    o_ev = tl.arange(0, BLOCK_EV)
    m_m = o_m < q_len
    m_qe = m_m[:, None] & (o_e[None, :] < head_e)
    m_qev = m_m[:, None] & (o_ev[None, :] < head_ev)

    q_off = i_b * stride_qb + i_h * stride_qh + q_start * stride_ql
    o_off = i_b * stride_ob + i_h * stride_oh + q_start * stride_ol
    p_k = k_ptr + i_b * stride_kb + i_hk * stride_kh + k_start * stride_kl
    p_v = v_ptr + i_b * stride_vb + i_hk * stride_vh + k_start * stride_vl
    p_mask = mask_ptr + i_b * stride_mb + i_h * stride_mh
    p_flags = flags_ptr + (pid_bh.to(tl.int64) * n_qblocks + pid_m) * n_kblocks
    p_tiles = tiles_ptr + (pid_bh.to(tl.int64) * n_qblocks + pid_m) * n_kblocks
    p_stats = stats_ptr + i_b * stride_sb + i_h * stride_sh + q_start + o_m
    p_rows = rows_ptr + i_b * stride_sb + i_h * stride_sh + q_start + o_m

    p_q = q_ptr + q_off
    p_do = do_ptr + o_off
    b_do = tl.load(p_do + o_m[:, None] * stride_ol + o_ev[None, :], mask=m_qev,
                   other=0.0)  # [BM, BEV]
    b_dvec = tl.load(dvec_ptr + o_off + o_m[:, None] * stride_ol + o_ev[None, :], mask=m_qev,
                     other=0.0)
    b_delta = tl.sum(b_do.to(tl.float32) * b_dvec, 1)  # [BM]
    b_gp = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NEED_DALPHA:
        b_o = tl.load(o_ptr + o_off + o_m[:, None] * stride_ol + o_ev[None, :], mask=m_qev,
                      other=0.0)
        b_gp = tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)  # sum_j g_j p_j = dO . o
    if BLOCK_EC < BLOCK_EV:
        # chunked products reload dO: the full block need not stay live through the loop
        b_do = 0.0
    b_q = held_rows(p_q, stride_ql, o_m, q_len, head_e, BLOCK_E, BLOCK_EC, True)
    b_mz = tl.load(p_stats + STAT_MAX_C * stride_stat, mask=m_m, other=0.0)
    b_tau = tl.load(p_stats + STAT_TAU_C * stride_stat, mask=m_m, other=0.0)
    b_l = tl.load(p_stats + STAT_SUM_C * stride_stat, mask=m_m, other=0.0)
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
    seed = tl.load(seed_ptr)

    kv_begin, full_begin, n_full, kv_end, pos_shift, win_left, win_right, slope = query_block_key_tiles(
        i_b, i_h, start_m, q_len, k_len, is_causal, window_left, window_right, alibi_ptr,
        stride_alibi_b, stride_alibi_h, BLOCK_M, BLOCK_N, OPTIONS)
    # the full tiles the forward flagged through their list: a pipelined loop
    n_listed = listed_tiles(p_flags, 1, full_begin // BLOCK_N, n_full // BLOCK_N, p_tiles)
    tl.debug_barrier()
    # compiled for heads near alpha = 1 and for the others (`log2_base`): without the
    # near-one log the loop holds fewer registers (sm_90, bf16, E 64, general alpha without
    # d(alpha): 255 registers and 48 bytes of stack -> 212 and none)
    # and for a head at alpha 1 (softmax) or above 2 (attention_common, "A per-head alpha")
    near_one = False
    softmax = False
    if ALPHA_KIND == ALPHA_GENERAL:
        if HEADS == HEADS_OUTSIDE_C:
            softmax = am1 == 0.0
        else:
            near_one = inv_am1 > NEAR_ONE_INV_AM1
    if HEADS == HEADS_OUTSIDE_C:
        if softmax:
            b_dq, b_gh = _dq_pass(
                b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                p_mask, stride_mq, stride_mk, p_flags, p_tiles, n_listed, kv_begin, full_begin,
                n_full, kv_end, o_m, q_len, k_len, head_e, head_ev, scale, am1, inv_am1, b_mz,
                b_tau, b_l, b_delta, is_causal, pos_shift, win_left, win_right, softcap, slope,
                seed, pid_bh, seqlen_q, seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
                BLOCK_EC, ALPHA_SOFTMAX, MASK_KIND, OPTIONS, HAS_DROPOUT, NEED_DALPHA, False)
        else:
            b_dq, b_gh = _dq_pass(
                b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                p_mask, stride_mq, stride_mk, p_flags, p_tiles, n_listed, kv_begin, full_begin,
                n_full, kv_end, o_m, q_len, k_len, head_e, head_ev, scale, am1, inv_am1, b_mz,
                b_tau, b_l, b_delta, is_causal, pos_shift, win_left, win_right, softcap, slope,
                seed, pid_bh, seqlen_q, seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
                BLOCK_EC, ALPHA_ABOVE_TWO, MASK_KIND, OPTIONS, HAS_DROPOUT, NEED_DALPHA, False)
    elif near_one:
        b_dq, b_gh = _dq_pass(
            b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol, p_mask,
            stride_mq, stride_mk, p_flags, p_tiles, n_listed, kv_begin, full_begin, n_full,
            kv_end, o_m, q_len, k_len,
            head_e, head_ev, scale, am1, inv_am1, b_mz, b_tau, b_l, b_delta, is_causal, pos_shift,
            win_left, win_right, softcap, slope, seed,
            pid_bh, seqlen_q, seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
            BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, HAS_DROPOUT, NEED_DALPHA, True)
    else:
        b_dq, b_gh = _dq_pass(
            b_q, b_do, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol, p_mask,
            stride_mq, stride_mk, p_flags, p_tiles, n_listed, kv_begin, full_begin, n_full,
            kv_end, o_m, q_len, k_len,
            head_e, head_ev, scale, am1, inv_am1, b_mz, b_tau, b_l, b_delta, is_causal, pos_shift,
            win_left, win_right, softcap, slope, seed,
            pid_bh, seqlen_q, seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
            BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, HAS_DROPOUT, NEED_DALPHA, False)
    # a row whose forward was NaN (a NaN or +inf score, stored shift NaN) gets NaN gradients
    b_dq = tl.where((b_mz != b_mz)[:, None], float("nan"), b_dq * scale)
    dq_off = i_b * stride_dqb + i_h * stride_dqh + q_start * stride_dql
    tl.store(dq_ptr + dq_off + o_m[:, None] * stride_dql + o_e[None, :],
             b_dq.to(dq_ptr.dtype.element_ty), mask=m_qe)
    tl.store(p_rows + ROW_DELTA_C * stride_row, b_delta, mask=m_m)
    if (SCORE_SINK_C & OPTIONS) != 0:
        # The sink is one more entry of the row, with a zero value: delta and the sums of
        # the forward's statistics include it, so the keys' gradients need nothing more.
        # Its own dz, s_sink (0 - delta), is the row's term of d(sink); NaN on NaN rows.
        b_sink = sink_logit(sinks_ptr, i_h, OPTIONS) - b_mz
        if HEADS == HEADS_OUTSIDE_C:
            if softmax:
                b_gap_sink, b_p_sink, b_s_sink = _row_weights(b_sink[:, None], b_tau, b_l, am1,
                                                              inv_am1, ALPHA_SOFTMAX)
                if NEED_DALPHA:
                    # the sink's term of softmax's d(alpha) (`_dq_tile`), its g being 0
                    b_logp_sink = tl.where(b_p_sink > 0, b_gap_sink - tl.log(b_l)[:, None],
                                           0.0)
                    b_gh += 0.5 * tl.sum(b_p_sink * b_logp_sink * b_logp_sink, 1) * b_delta
            else:
                _, _, b_s_sink = _row_weights(b_sink[:, None], b_tau, b_l, am1, inv_am1,
                                              ALPHA_ABOVE_TWO)
        else:
            _, _, b_s_sink = _row_weights(b_sink[:, None], b_tau, b_l, am1, inv_am1, ALPHA_KIND)
        b_dsink = tl.where(b_mz != b_mz, float("nan"), -tl.sum(b_s_sink, 1) * b_delta)
        tl.store(p_rows + ROW_DSINK_C * stride_row, b_dsink, mask=m_m)
    if NEED_DALPHA:
        # dalpha = sum_i g_i dp_i/dalpha with sum g p = dO.o, sum g p~ = delta
        # (docs/attention.md, "Gradient of alpha"); softmax's is the sum itself
        b_entropy = tl.load(p_stats + STAT_ENTROPY_C * stride_stat, mask=m_m, other=0.0)
        b_dalpha = (b_gp - b_delta) * inv_am1 * inv_am1 + (b_gh - b_delta * b_entropy) * inv_am1
        if HEADS == HEADS_OUTSIDE_C:
            if softmax:
                b_dalpha = b_gh
        tl.store(p_rows + ROW_DALPHA_C * stride_row, b_dalpha, mask=m_m)


@triton.jit
def _row_values(p_row, o_m, q_len, MASK_ROWS: tl.constexpr):
    """One value per query row o_m (a statistic), 0 past q_len when MASK_ROWS."""
    if MASK_ROWS:
        b_values = tl.load(p_row + o_m, mask=o_m < q_len, other=0.0)
    else:
        b_values = tl.load(p_row + o_m)
    return b_values


@triton.jit
def _add_to_dq(p_dqacc, stride_al, o_m, q_len, head_e, b_dq, p_lock, p_turn,
               BLOCK_E: tl.constexpr, BOUNDARY: tl.constexpr, DQ_MODE: tl.constexpr):
    """Adds a key tile's share of dQ (dz k, unscaled) to the query tile's fp32 sum.
    DQ_ORDERED: first waits until the sum's counter reaches this tile's turn (the number
    of flagged key tiles after it in the query tile's row, which add before it), and
    advances the counter after its adds. The adds are atomic either way, so a key block that
    stops waiting (DQ_MAX_POLLS_C) leaves the sum right, in another order."""
    o_e = tl.arange(0, BLOCK_E)
    m_tile = o_e[None, :] < head_e
    if BOUNDARY:
        m_tile = m_tile & (o_m[:, None] < q_len)
    if DQ_MODE == DQ_ORDERED_C:
        turn = tl.load(p_turn)
        polls = 0
        while (tl.atomic_add(p_lock, 0, sem="acquire") < turn) & (polls < DQ_MAX_POLLS_C):
            polls += 1
    tl.atomic_add(p_dqacc + o_m[:, None] * stride_al + o_e[None, :], b_dq, mask=m_tile,
                  sem="relaxed")
    if DQ_MODE == DQ_ORDERED_C:
        # every thread's adds are issued before the counter moves; the release orders them
        tl.debug_barrier()
        tl.atomic_add(p_lock, 1, sem="release")


@triton.jit
def _dkdv_tile(b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
               p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row,
               o_n, start_n, start_m, q_len, k_len, head_e, head_ev, scale, am1,
               inv_am1, is_causal, pos_shift, win_left, win_right, softcap, slope, seed, pid_bh,
               seqlen_q, seqlen_k, dropout_p, b_dk, b_dv,
               b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
               MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               BOUNDARY: tl.constexpr,
               DQ_MODE: tl.constexpr):
    """Adds one query tile to dK and dV, and (DQ_MODE other than DQ_KERNEL) its share to
    the query tile's dQ (`_add_to_dq`). BOUNDARY: the tile crosses the causal diagonal,
    the end of the keys or the end of the queries; rows past q_len load as zeros (q, dO,
    the statistics), so their weights and gradients are zero. Other tiles load without
    masks (a comparison and a select per loaded vector)."""
    o_m = start_m + tl.arange(0, BLOCK_M)
    b_q = held_rows(p_q, stride_ql, o_m, q_len, head_e, BLOCK_E, BLOCK_EC, BOUNDARY)
    b_do = held_rows(p_do, stride_ol, o_m, q_len, head_ev, BLOCK_EV, BLOCK_EC, BOUNDARY)
    b_mz = _row_values(p_stats + STAT_MAX_C * stride_stat, o_m, q_len, BOUNDARY)
    b_tau = _row_values(p_stats + STAT_TAU_C * stride_stat, o_m, q_len, BOUNDARY)
    b_l = _row_values(p_stats + STAT_SUM_C * stride_stat, o_m, q_len, BOUNDARY)
    b_l = tl.where(b_l > 0, b_l, 1.0)
    b_delta = _row_values(p_rows + ROW_DELTA_C * stride_row, o_m, q_len, BOUNDARY)
    b_u, b_cap_slope = shifted_scores(b_q, b_kt, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                         stride_mk, o_m, start_n, q_len, k_len, head_e, scale, b_mz,
                         is_causal, pos_shift, win_left, win_right, softcap, slope, BLOCK_N,
                         BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    b_gap, b_p, b_s = _row_weights(b_u, b_tau, b_l, am1, inv_am1, ALPHA_KIND)
    b_g = dot_rows(b_do, b_vt, p_do, stride_ol, o_m, q_len, p_v, stride_vl, o_n, k_len,
                   head_ev, BLOCK_EV, BLOCK_EC)  # [BM, BN]
    if HAS_DROPOUT:
        b_drop = dropout_scale(seed, pid_bh, o_m, o_n, seqlen_q, seqlen_k, dropout_p,
                               BLOCK_M, BLOCK_N, HAS_DROPOUT)
        b_g = b_g * b_drop
        b_p = b_p * b_drop
    b_dz = b_s * (b_g - b_delta[:, None])
    if (SCORE_SOFTCAP_C & OPTIONS) != 0:
        # through the cap: d(softcap tanh(s / softcap))/ds = 1 / cosh^2(s / softcap)
        b_dz = b_dz * b_cap_slope
    if BLOCK_EC < BLOCK_E:
        # loaded only now, so that they are not live during the chunked products
        b_q = load_rows(p_q, stride_ql, o_m, q_len, head_e, BLOCK_E, BOUNDARY)
    if BLOCK_EC < BLOCK_EV:
        b_do = load_rows(p_do, stride_ol, o_m, q_len, head_ev, BLOCK_EV, BOUNDARY)
    b_dv += dot(tl.trans(b_p.to(b_do.dtype)), b_do)
    b_dk += dot(tl.trans(b_dz.to(b_q.dtype)), b_q)
    if DQ_MODE != DQ_KERNEL_C:
        i_m = start_m // BLOCK_M
        _add_to_dq(p_dqacc, stride_al, o_m, q_len, head_e, dot(b_dz.to(b_k.dtype), b_k),
                   p_locks + i_m, p_turns + i_m * n_kblocks, BLOCK_E, BOUNDARY, DQ_MODE)
    return b_dk, b_dv


@triton.jit
def _dkdv_last_tile(b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                    p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row,
                    p_flags, o_n, start_n, m_full, q_full, q_len, k_len, head_e, head_ev, scale,
                    am1, inv_am1, is_causal, pos_shift, win_left, win_right, softcap, slope, seed,
                    pid_bh, seqlen_q, seqlen_k, dropout_p, b_dk,
                    b_dv, b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
                    MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    DQ_MODE: tl.constexpr):
    """`_dkdv_tile` of the query tile at q_full that the end of the queries cuts, if it
    lies past m_full (the masked tiles') and the forward flagged it."""
    if (q_full < q_len) & (q_full >= m_full):
        if tl.load(p_flags + (q_full // BLOCK_M) * n_kblocks) != 0:
            b_dk, b_dv = _dkdv_tile(
                b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row,
                o_n, start_n, q_full, q_len, k_len, head_e, head_ev, scale, am1, inv_am1,
                is_causal, pos_shift, win_left, win_right, softcap, slope, seed, pid_bh, seqlen_q,
                seqlen_k, dropout_p, b_dk, b_dv,
                b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
                BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS,
                HAS_DROPOUT, True, DQ_MODE)
    return b_dk, b_dv


@triton.jit
def _dkdv_head(b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
               p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row, p_flags,
               p_tiles, o_n, start_n, m_begin, m_masked_end, m_full, m_full_end, m_end, q_len,
               k_len, head_e, head_ev, scale, am1, inv_am1, is_causal, pos_shift, win_left,
               win_right, softcap, slope, seed, pid_bh, seqlen_q, seqlen_k, dropout_p, b_dk, b_dv,
               b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
               MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               DQ_MODE: tl.constexpr):
    """One query head's share of a key block's dK and dV: its masked query tiles, the
    listed full ones (a pipelined loop) and those past them (`_dkdv_tile`)."""
    for start_m in range(m_begin, m_masked_end, BLOCK_M):
        if tl.load(p_flags + (start_m // BLOCK_M) * n_kblocks) != 0:
            b_dk, b_dv = _dkdv_tile(
                b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row,
                o_n, start_n, start_m, q_len, k_len, head_e, head_ev, scale, am1, inv_am1,
                is_causal, pos_shift, win_left, win_right, softcap, slope, seed, pid_bh,
                seqlen_q, seqlen_k, dropout_p, b_dk, b_dv,
                b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
                BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS,
                HAS_DROPOUT, True, DQ_MODE)
    q_full = (q_len // BLOCK_M) * BLOCK_M
    # the full query tiles the forward flagged through their list: a pipelined loop
    # (the list of the previous head of the group is read to the end first)
    listed_end = q_full
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        listed_end = m_full_end
    tl.debug_barrier()
    n_listed = listed_tiles(p_flags, n_kblocks, tl.cdiv(m_full, BLOCK_M),
                            listed_end // BLOCK_M, p_tiles)
    tl.debug_barrier()
    for i in range(n_listed):
        start_m = tl.load(p_tiles + i) * BLOCK_M
        b_dk, b_dv = _dkdv_tile(
            b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
            p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row,
            o_n, start_n, start_m, q_len, k_len, head_e, head_ev, scale, am1, inv_am1,
            is_causal, pos_shift, win_left, win_right, softcap, slope, seed, pid_bh, seqlen_q,
            seqlen_k, dropout_p, b_dk, b_dv,
            b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
            BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS,
            HAS_DROPOUT, False, DQ_MODE)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        # the tiles that cross the window's trailing edge, the last query tile among
        # them
        for start_m in range(m_full_end, m_end, BLOCK_M):
            if tl.load(p_flags + (start_m // BLOCK_M) * n_kblocks) != 0:
                b_dk, b_dv = _dkdv_tile(
                    b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do,
                    stride_ol, p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows,
                    stride_row, o_n, start_n, start_m, q_len, k_len, head_e, head_ev, scale,
                    am1, inv_am1, is_causal, pos_shift, win_left, win_right, softcap, slope,
                    seed, pid_bh, seqlen_q, seqlen_k, dropout_p, b_dk, b_dv, b_k, p_dqacc,
                    stride_al, p_locks, p_turns, n_kblocks, BLOCK_M, BLOCK_N, BLOCK_E,
                    BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, HAS_DROPOUT, True,
                    DQ_MODE)
    else:
        # a last query tile past m_full that the end of the queries cuts, after the listed
        # ones (DQ_ORDERED visits a program's query tiles in ascending order)
        b_dk, b_dv = _dkdv_last_tile(
            b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
            p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row, p_flags,
            o_n, start_n, m_full, q_full, q_len, k_len, head_e, head_ev, scale, am1,
            inv_am1, is_causal, pos_shift, win_left, win_right, softcap, slope, seed, pid_bh,
            seqlen_q, seqlen_k, dropout_p, b_dk, b_dv,
            b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
            BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS,
            HAS_DROPOUT, DQ_MODE)
    return b_dk, b_dv


@triton.jit
def entmax_attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, stats_ptr, rows_ptr, flags_ptr, tiles_ptr,
    mask_ptr, alpha_ptr, seed_ptr, cu_q_ptr, cu_k_ptr, dqacc_ptr, locks_ptr, turns_ptr,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_ol,
    stride_dkb, stride_dkh, stride_dkl,
    stride_dvb, stride_dvh, stride_dvl,
    stride_ab, stride_ah, stride_al,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_sb, stride_sh, stride_stat, stride_row,
    n_heads, n_kv_heads, kv_group, seqlen_q, seqlen_k, n_qblocks, n_kblocks, head_e, head_ev,
    scale, dropout_p, is_causal, window_left, window_right, softcap,
    alibi_ptr, stride_alibi_b, stride_alibi_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
    MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DQ_MODE: tl.constexpr = DQ_KERNEL_C,
    HEADS: tl.constexpr = HEADS_ALL_C,
):
    """dK, dV for one key block of one key/value head; dk and dv have their own strides.
    With DQ_MODE other than DQ_KERNEL also dQ's shares (dz k, unscaled) in the fp32 sum
    dqacc, laid out like q (strides stride_a*), from the delta per row in rows_ptr.

    DQ_ORDERED: the key blocks of a query tile add in descending order: each program
    visits its query tiles in ascending order, so that on a causal pattern a later key
    block, whose first tile is further down, reaches each tile first, and the programs
    are numbered from the last key block, so that a program only waits on programs
    launched before it (locks_ptr: a counter per query tile of each head; turns_ptr: each
    flagged tile's turn, laid out like flags_ptr)."""
    pid_bhk = tl.program_id(0)
    if DQ_MODE == DQ_ORDERED_C:
        pid_n = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        pid_n = tl.program_id(1)
    i_b, _, i_hk, q_start, q_len, k_start, k_len = program_sequence(
        pid_bhk, n_kv_heads, kv_group, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, IS_VARLEN, True)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        return
    if HEADS == HEADS_OUTSIDE_C:
        # a group with a head at alpha 1 or above 2 is run again, all its heads, by this
        # launch (the launch for (1, 2] ran it too, compiled as it was: its dK, dV are
        # replaced here, its shares of dQ dropped by the launcher)
        n_outside = 0
        for i_g in range(0, kv_group):
            am1_g = tl.load(alpha_ptr + i_hk * kv_group + i_g).to(tl.float32) - 1.0
            n_outside += ((am1_g == 0.0) | (am1_g > 1.0)).to(tl.int32)
        if n_outside == 0:
            return
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_e = tl.arange(0, BLOCK_E)
    o_ev = tl.arange(0, BLOCK_EV)
    m_n = o_n < k_len
    k_off = i_b * stride_kb + i_hk * stride_kh + k_start * stride_kl
    v_off = i_b * stride_vb + i_hk * stride_vh + k_start * stride_vl
    p_k = k_ptr + k_off
    p_v = v_ptr + v_off
    b_kt = held_cols(p_k, stride_kl, o_n, k_len, head_e, BLOCK_E, BLOCK_EC, True)  # [BE, BN]
    b_vt = held_cols(p_v, stride_vl, o_n, k_len, head_ev, BLOCK_EV, BLOCK_EC, True)  # [BEV, BN]
    if DQ_MODE == DQ_KERNEL_C:
        b_k = 0.0
    elif BLOCK_EC >= BLOCK_E:
        b_k = tl.trans(b_kt)  # [BN, BE], dQ's operand
    else:
        b_k = load_rows(p_k, stride_kl, o_n, k_len, head_e, BLOCK_E, True)
    seed = tl.load(seed_ptr)

    m_begin = 0
    # query blocks from m_full on need no mask: causal, their first query sees the whole
    # key block; a key block past the end of the keys masks every tile (it reads the mask
    # and scores only in bounds then)
    m_full = 0
    if is_causal != 0:
        # query i sees key j only when j <= i: earlier query blocks are all masked
        m_begin = (start_n // BLOCK_M) * BLOCK_M
        m_full = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    if start_n + BLOCK_N > k_len:
        m_full = q_len
    m_full = tl.minimum(m_full, q_len)
    pos_shift, win_left, win_right, slope = score_option_values(
        i_b, i_hk * kv_group, q_len, k_len, window_left, window_right, alibi_ptr,
        stride_alibi_b, stride_alibi_h, OPTIONS)
    # the masked query tiles [m_begin, m_masked_end), the full ones from m_full (to
    # m_full_end under a window, whose tiles in [m_full_end, m_end) are masked again)
    m_masked_end = m_full
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        m_begin, m_full, m_full_end, m_end = window_query_tiles(
            start_n, q_len, m_begin, m_full, pos_shift, win_left, win_right, BLOCK_M, BLOCK_N)
        m_masked_end = tl.minimum(m_full, m_end)
    p_tiles = tiles_ptr + (pid_bhk.to(tl.int64) * n_kblocks + pid_n) * n_qblocks
    b_dk = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_EV], dtype=tl.float32)
    for i_g in range(0, kv_group):
        i_h = i_hk * kv_group + i_g
        pid_bh = i_b * n_heads + i_h
        alpha = tl.load(alpha_ptr + i_h).to(tl.float32)
        am1 = alpha - 1.0
        inv_am1 = 1.0 / am1
        if (SCORE_ALIBI_C & OPTIONS) != 0:
            # each query head of the group has its own slope (`score_option_values`)
            slope = tl.load(alibi_ptr + i_b * stride_alibi_b + i_h * stride_alibi_h).to(tl.float32)
        p_q = q_ptr + i_b * stride_qb + i_h * stride_qh + q_start * stride_ql
        p_do = do_ptr + i_b * stride_ob + i_h * stride_oh + q_start * stride_ol
        p_mask = mask_ptr + i_b * stride_mb + i_h * stride_mh
        p_flags = flags_ptr + pid_bh * n_qblocks * n_kblocks + pid_n
        p_stats = stats_ptr + i_b * stride_sb + i_h * stride_sh + q_start
        p_rows = rows_ptr + i_b * stride_sb + i_h * stride_sh + q_start
        p_dqacc = dqacc_ptr + i_b * stride_ab + i_h * stride_ah + q_start * stride_al
        p_locks = locks_ptr + pid_bh * n_qblocks
        p_turns = turns_ptr + pid_bh * n_qblocks * n_kblocks + pid_n
        if HEADS == HEADS_OUTSIDE_C:
            # a head at alpha 1 is softmax, one above 2 has passes of its own, the others
            # of the group run as in the launch for (1, 2] (attention_common, "A per-head
            # alpha")
            full_end = m_full
            end = q_len
            if (SCORE_WINDOW_C & OPTIONS) != 0:
                full_end = m_full_end
                end = m_end
            if am1 > 1.0:
                b_dk, b_dv = _dkdv_head(
                    b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do,
                    stride_ol, p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows,
                    stride_row, p_flags, p_tiles, o_n, start_n, m_begin, m_masked_end, m_full,
                    full_end, end, q_len, k_len, head_e, head_ev, scale, am1, inv_am1, is_causal,
                    pos_shift, win_left, win_right, softcap, slope, seed, pid_bh, seqlen_q,
                    seqlen_k, dropout_p, b_dk, b_dv, b_k, p_dqacc, stride_al, p_locks, p_turns,
                    n_kblocks, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_ABOVE_TWO,
                    MASK_KIND, OPTIONS, HAS_DROPOUT, DQ_MODE)
            elif am1 == 0.0:
                b_dk, b_dv = _dkdv_head(
                    b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do,
                    stride_ol, p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows,
                    stride_row, p_flags, p_tiles, o_n, start_n, m_begin, m_masked_end, m_full,
                    full_end, end, q_len, k_len, head_e, head_ev, scale, am1, inv_am1, is_causal,
                    pos_shift, win_left, win_right, softcap, slope, seed, pid_bh, seqlen_q,
                    seqlen_k, dropout_p, b_dk, b_dv, b_k, p_dqacc, stride_al, p_locks, p_turns,
                    n_kblocks, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_SOFTMAX,
                    MASK_KIND, OPTIONS, HAS_DROPOUT, DQ_MODE)
            else:
                b_dk, b_dv = _dkdv_head(
                    b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do,
                    stride_ol, p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows,
                    stride_row, p_flags, p_tiles, o_n, start_n, m_begin, m_masked_end, m_full,
                    full_end, end, q_len, k_len, head_e, head_ev, scale, am1, inv_am1, is_causal,
                    pos_shift, win_left, win_right, softcap, slope, seed, pid_bh, seqlen_q,
                    seqlen_k, dropout_p, b_dk, b_dv, b_k, p_dqacc, stride_al, p_locks, p_turns,
                    n_kblocks, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND,
                    MASK_KIND, OPTIONS, HAS_DROPOUT, DQ_MODE)
        else:
            for start_m in range(m_begin, m_masked_end, BLOCK_M):
                if tl.load(p_flags + (start_m // BLOCK_M) * n_kblocks) != 0:
                    b_dk, b_dv = _dkdv_tile(
                        b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                        p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row,
                        o_n, start_n, start_m, q_len, k_len, head_e, head_ev, scale, am1, inv_am1,
                        is_causal, pos_shift, win_left, win_right, softcap, slope, seed, pid_bh,
                        seqlen_q, seqlen_k, dropout_p, b_dk, b_dv,
                        b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
                        BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND,
                        OPTIONS,
                        HAS_DROPOUT, True, DQ_MODE)
            q_full = (q_len // BLOCK_M) * BLOCK_M
            # the full query tiles the forward flagged through their list: a pipelined loop
            # (the list of the previous head of the group is read to the end first)
            listed_end = q_full
            if (SCORE_WINDOW_C & OPTIONS) != 0:
                listed_end = m_full_end
            tl.debug_barrier()
            n_listed = listed_tiles(p_flags, n_kblocks, tl.cdiv(m_full, BLOCK_M),
                                    listed_end // BLOCK_M, p_tiles)
            tl.debug_barrier()
            for i in range(n_listed):
                start_m = tl.load(p_tiles + i) * BLOCK_M
                b_dk, b_dv = _dkdv_tile(
                    b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                    p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row,
                    o_n, start_n, start_m, q_len, k_len, head_e, head_ev, scale, am1, inv_am1,
                    is_causal, pos_shift, win_left, win_right, softcap, slope, seed, pid_bh,
                    seqlen_q,
                    seqlen_k, dropout_p, b_dk, b_dv,
                    b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
                    BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS,
                    HAS_DROPOUT, False, DQ_MODE)
            if (SCORE_WINDOW_C & OPTIONS) != 0:
                # the tiles that cross the window's trailing edge, the last query tile among
                # them
                for start_m in range(m_full_end, m_end, BLOCK_M):
                    if tl.load(p_flags + (start_m // BLOCK_M) * n_kblocks) != 0:
                        b_dk, b_dv = _dkdv_tile(
                            b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do,
                            stride_ol, p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows,
                            stride_row, o_n, start_n, start_m, q_len, k_len, head_e, head_ev, scale,
                            am1, inv_am1, is_causal, pos_shift, win_left, win_right, softcap, slope,
                            seed, pid_bh, seqlen_q, seqlen_k, dropout_p, b_dk, b_dv, b_k, p_dqacc,
                            stride_al, p_locks, p_turns, n_kblocks, BLOCK_M, BLOCK_N, BLOCK_E,
                            BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS, HAS_DROPOUT, True,
                            DQ_MODE)
            else:
                # a last query tile past m_full that the end of the queries cuts, after the listed
                # ones (DQ_ORDERED visits a program's query tiles in ascending order)
                b_dk, b_dv = _dkdv_last_tile(
                    b_kt, b_vt, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_do, stride_ol,
                    p_mask, stride_mq, stride_mk, p_stats, stride_stat, p_rows, stride_row, p_flags,
                    o_n, start_n, m_full, q_full, q_len, k_len, head_e, head_ev, scale, am1,
                    inv_am1, is_causal, pos_shift, win_left, win_right, softcap, slope, seed,
                    pid_bh,
                    seqlen_q, seqlen_k, dropout_p, b_dk, b_dv,
                    b_k, p_dqacc, stride_al, p_locks, p_turns, n_kblocks,
                    BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, ALPHA_KIND, MASK_KIND, OPTIONS,
                    HAS_DROPOUT, DQ_MODE)
    dk_off = i_b * stride_dkb + i_hk * stride_dkh + k_start * stride_dkl
    dv_off = i_b * stride_dvb + i_hk * stride_dvh + k_start * stride_dvl
    tl.store(dk_ptr + dk_off + o_n[:, None] * stride_dkl + o_e[None, :],
             (b_dk * scale).to(dk_ptr.dtype.element_ty),
             mask=m_n[:, None] & (o_e[None, :] < head_e))
    tl.store(dv_ptr + dv_off + o_n[:, None] * stride_dvl + o_ev[None, :],
             b_dv.to(dv_ptr.dtype.element_ty), mask=m_n[:, None] & (o_ev[None, :] < head_ev))


def aot_configs():
    """Every backward configuration the launcher can choose."""
    configs = []
    for (dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout,
         options) in config_space():
        block_m, block_n = block_sizes(block_e, dtype_key, dropout)
        constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_E": block_e,
                      "BLOCK_EV": block_e, "ALPHA_KIND": alpha_kind, "MASK_KIND": mask_kind,
                      "OPTIONS": options,
                      "IS_VARLEN": int(varlen), "HAS_DROPOUT": int(dropout),
                      **mask_specialisation(mask_kind)}
        suffix = config_suffix(dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout,
                               options)
        # dQ with and without the d(alpha) terms; a differentiable alpha is a tensor: the
        # general kind
        dalphas = (False, True) if alpha_kind == common.ALPHA_GENERAL else (False,)
        kernels = [("dq", entmax_attn_bwd_dq_kernel, {"NEED_DALPHA": need}, f"_da{int(need)}")
                   for need in dalphas]
        # dK/dV alone, and with dQ's shares (attention_common.backward_dq)
        kernels += [("dkdv", entmax_attn_bwd_dkdv_kernel, {"DQ_MODE": mode},
                     "" if mode == DQ_KERNEL else f"_dq{name}") for name, mode in DQ_MODES.items()]
        for (name, fn, switches, tag), heads in itertools.product(kernels,
                                                                  head_launches(alpha_kind)):
            keywords = backward_launch(name, block_e, dtype_key)
            configs.append({"name": f"entmax_attn_bwd_{name}_{suffix}{tag}{head_suffix(heads)}",
                            "fn": fn, "signature": attention_signature(fn, dtype_key, mask_kind),
                            "constexprs": dict(constexprs, **switches, HEADS=heads,
                                               BLOCK_EC=chunk_width(name, block_e, dtype_key)),
                            "arch_constexprs": arch_chunks(name, block_e, dtype_key),
                            "num_warps": keywords.pop("num_warps"),
                            "num_stages": keywords.pop("num_stages"), "options": keywords})
    return configs
