"""Fused entmax attention, forward kernel (never materialises Lq x Lk).

One program handles one block of BLOCK_M query rows of one (batch, query head). With z the
scaled, masked scores and u = (alpha - 1)(z - max z), the threshold tau lies in [-1, 0)
(docs/attention.md, "Threshold"):

1. a dense pass for the row maximum of z (NaN-propagating), which also flags the key tiles
   with a score within 1/(alpha - 1) of its row's running maximum: tau lies above the
   final maximum minus that, so the other tiles hold no weight (`_row_max`);
2. a threshold pass that captures every row's scores above a lower bound of tau, which it
   raises from the scores it captured so far (a subset's threshold is at most the row's:
   `_running_capture_pass`, `_compact`); where every row of the block fits its CANDIDATES
   slots, tau is found over those alone (`_candidate_pass`) and the forward makes three
   passes over K (docs/attention.md, "A rising lower bound"). The other blocks, and those
   that do not capture (heads near alpha = 1; general-alpha blocks whose rows are unlikely
   to fit, `_capture_fits`), go on with threshold passes over the tiles (`_passes_over_tiles`),
   each a few operations per score, like a softmax pass: the sums of `_moments` at one
   trial threshold t (two in the first pass: the bracket's lower end and its middle).
   From them `_update_threshold` gives a Newton step (a lower bound of tau, f being convex
   and decreasing for alpha in (1, 2]) and, for alpha = 2 and 1.5, the closed-form root on
   the support at t, which *is* tau when no score lies between t and that root (checked
   against the smallest positive d: an exact certificate). Passes
   repeat until every row of the block is exact or its Newton step is below TAU_STEP_TOL
   (at most MAX_TAU_PASSES); from the third on, alpha 1.5's rows are evaluated just below
   their closed-form upper bound (`_trial_point`); tools/attention_passes.py counts
   them. The second of those also captures every row's scores above lo, and when they fit
   their slots the later passes run over those alone (docs/attention.md, "Captured
   scores");
3. the threshold passes visit only the flagged tiles, so on local attention every pass
   after the maximum touches only the tiles near each query. The capturing first pass
   rewrites each tile's flag at the lower bound it holds when it visits the tile, and the
   second pass over the tiles at the lower bound the first found (tau only rises, so no
   later pass needs the others; alpha 2 and 1.5 evaluate that pass there, general alpha
   at its trial point); the other passes leave them (a flag costs a cross-warp reduction
   per tile). The passes loop over a list
   of the flagged tiles (`listed_tiles`, in tiles_ptr's scratch), not over flags tested
   inside the loop, so that Triton pipelines their loads;
4. the output pass visits the flagged tiles, divides by the row sum of the weights (every
   output row is an exact convex combination whatever tau's residual error) and, when
   gradients are needed, rewrites the flags to "holds a non-zero weight" for the backward.

PHASE splits the passes between two launches (`forward_phases`): 1-3 (PHASE_THRESHOLD,
which leaves the raw row maximum and tau in the statistics) and 4 (PHASE_OUTPUT), so that
the threshold passes do not run at the output pass's register count (docs/attention.md,
"Two launches").

The tiles work in z units shifted by the row maximum (`shifted_scores`), so only score
differences enter, whatever the offset; the bracket lives in u units (`_sums_in_u`).
Masks cost per-score work only on the tiles that cross the key end or the causal
diagonal (`full_tiles_end`). Row statistics (max z, tau and the weight sum, in z units,
and the entropy) are stored for the backward, and, when gradients are needed, the
D-vector ``sum_j s_j v_j / sum_j s_j`` with ``s_j = p_j^(2 - alpha)`` (docs/attention.md,
"Backward").

Tile tables, the statistics layout and the helpers the backward shares live in
attention_common.py; the launcher in ``entmax_fast/backends/triton/attention.py``.
"""
import triton
import triton.language as tl

from .. import common
from .attention_common import (CANDIDATE_CHUNK_C, CAPTURE_MAX_COLUMN_SHARE_C, COMPACT_FILL_C,
                               HEADS_ALL_C, HEADS_IN_RANGE_C, HEADS_OUTSIDE_C, head_launches,
                               head_suffix,
                               COMPACT_MIN_C, COMPACT_SEGMENT_C, COMPACT_STEPS, COMPACT_TILES_C,
                               MAX_TAU_PASSES_C, NEAR_ONE_INV_AM1, PHASE_OUTPUT_C,
                               PHASE_THRESHOLD_C, SCORE_SINK_C, SCORE_WINDOW_C, STAT_ENTROPY_C,
                               STAT_MAX_C,
                               STAT_SUM_C, STAT_TAU_C, SUBSET_STEPS_C, TAU_STEP_TOL_C, arch_chunks,
                               attention_signature, block_sizes, candidate_slots, chunk_width,
                               config_space, config_suffix, dot, dropout_scale, forward_launches,
                               full_tiles_end, gap, held_cols, held_rows, launch_options,
                               listed_tiles, log2_base, mask_specialisation, program_sequence,
                               query_block, score_option_values, sensitivity, shifted_scores,
                               sink_logit, weights, weights_and_sensitivity, window_key_tiles)
from .kinds import (ALPHA_ABOVE_TWO, ALPHA_ENTMAX15, ALPHA_GENERAL, ALPHA_SOFTMAX, ALPHA_SPARSEMAX,
                    GRAD_ALPHA, GRAD_INPUTS)
from .support import count_and_smallest, positive_f16, store_above, support_bits


@triton.jit
def _threshold_in_z(b_c, inv_am1, ALPHA_KIND: tl.constexpr):
    """The row threshold the tiles take (`gap`) from c = tau + 1 (u units, where the
    bracket lives): tau_z = (c - 1)/(alpha - 1) for alpha 2 and 1.5, c itself for general."""
    if ALPHA_KIND == ALPHA_GENERAL:
        b_thr = b_c
    else:
        b_thr = (b_c - 1.0) * inv_am1
    return b_thr


@triton.jit
def _max_nan(b_a, b_b):
    """max that keeps NaN (tl.maximum's default returns the other operand), so that a NaN
    score reaches the row maximum and marks its row."""
    return tl.maximum(b_a, b_b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _score_tile(b_q, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base, stride_mq,
                stride_mk, o_m, start_n, q_len, k_len, head_e, scale, b_shift,
                is_causal, pos_shift, win_left, win_right, softcap, slope, BLOCK_N: tl.constexpr,
                BLOCK_E: tl.constexpr,
                BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr,
                BOUNDARY: tl.constexpr):
    """`shifted_scores` of the key tile at start_n, loading the key block."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    b_kt = held_cols(p_k_base, stride_kl, o_n, k_len, head_e, BLOCK_E, BLOCK_EC, BOUNDARY)
    b_z, _ = shifted_scores(b_q, b_kt, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base,
                          stride_mq, stride_mk, o_m, start_n, q_len, k_len, head_e, scale,
                          b_shift, is_causal, pos_shift, win_left, win_right, softcap, slope,
                          BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    return b_z


@triton.jit
def _max_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, m_m,
              start_n, q_len, k_len, head_e, scale, is_causal, pos_shift, win_left, win_right,
              softcap, slope, b_m, b_ycol, p_flags, inv_am1,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr,
              BOUNDARY: tl.constexpr):
    """Adds one key tile to the running row maximum b_m and to the running maximum of each
    column b_ycol [BM, BN] (`_subset_bound`), and flags the tile when a row's tile maximum
    comes within 1/(alpha - 1) of the running maximum."""
    b_y = _score_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                      start_n, q_len, k_len, head_e, scale, tl.zeros([BLOCK_M], dtype=tl.float32),
                      is_causal, pos_shift, win_left, win_right, softcap, slope, BLOCK_N, BLOCK_E,
                      BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    b_ycol = tl.maximum(b_ycol, b_y)
    b_tile_max = tl.reduce(b_y, 1, _max_nan)
    b_m = _max_nan(b_m, b_tile_max)
    # The window has a margin, so that the flag does not depend on rounding at its edge:
    # 0.1 % of its width, and two fp32 units of |max|, since the later passes see z - max
    # rounded once (`shifted_scores`) where here z was rounded first (at offsets where an
    # ulp of max exceeds the window every tile stays flagged). NaN, -inf (masked) and +inf
    # rows compare false: they have no threshold to find.
    b_window = inv_am1 * 1.001 + tl.abs(b_m) * 2.4e-7
    m_near = m_m & (b_tile_max - b_m > -b_window)
    tl.store(p_flags + start_n // BLOCK_N, tl.max(m_near.to(tl.int8), 0))
    return b_m, b_ycol


@triton.jit
def _row_max(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, m_m,
             start_m, q_len, k_len, kv_begin, full_begin, window_full_end, kv_end, head_e, scale,
             is_causal, pos_shift, win_left, win_right, softcap, slope, sink, p_flags, inv_am1,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
             BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr):
    """Pass 1: the row maximum of the scores and the sink logit when OPTIONS has one (NaN if
    any is NaN, -inf if every score is masked and there is no sink), [BM], and the first
    tile flags. tau lies at or above max - 1/(alpha - 1) in z
    units (the bracket's lower end), so a tile none of whose scores come within 1/(alpha - 1)
    of their row's maximum holds no weight and no threshold pass needs it. The running
    maximum is at most the final one, so flagging against it keeps every tile that matters;
    the tiles nearest the diagonal go first (causal, the tiles crossing it, then the full ones
    leftwards from the diagonal, wrapping round; without is_causal the ragged last tile
    comes last), so that on local attention the running maximum is the final one almost at
    once and the far tiles go unflagged. Also returns each column's largest score over the
    tiles, [BM, BN] (`_subset_bound`). Under a window, the tiles crossing its edges and
    then the full ones (`window_key_tiles`: from kv_begin, full_begin and window_full_end
    to kv_end) leftwards from the tile of the block's first key position, wrapping round."""
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if (SCORE_SINK_C & OPTIONS) != 0:
        # the sink is an entry of every row: from the start, the running maximum is at
        # least the sink logit, and the tiles far below it go unflagged
        b_m = _max_nan(b_m, tl.zeros([BLOCK_M], dtype=tl.float32) + sink)
    b_ycol = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        b_m, b_ycol = _max_boundary_tiles(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, m_m,
            window_full_end, q_len, k_len, kv_end, head_e, scale, is_causal, pos_shift,
            win_left, win_right, softcap, slope, b_m, b_ycol, p_flags, inv_am1, BLOCK_M,
            BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS)
        b_m, b_ycol = _max_boundary_tiles(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, m_m,
            kv_begin, q_len, k_len, full_begin, head_e, scale, is_causal, pos_shift, win_left,
            win_right, softcap, slope, b_m, b_ycol, p_flags, inv_am1, BLOCK_M, BLOCK_N,
            BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS)
        first = full_begin // BLOCK_N
        n_inside = window_full_end // BLOCK_N - first
        diagonal = tl.minimum(tl.maximum(start_m + pos_shift, 0) // BLOCK_N - first, n_inside - 1)
        for i in range(n_inside):
            tile = tl.maximum(diagonal, 0) - i
            start_n = (tl.where(tile < 0, tile + n_inside, tile) + first) * BLOCK_N
            b_m, b_ycol = _max_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                                    stride_mk, o_m, m_m, start_n, q_len, k_len, head_e, scale,
                                    is_causal, pos_shift, win_left, win_right, softcap, slope,
                                    b_m, b_ycol, p_flags, inv_am1, BLOCK_M, BLOCK_N, BLOCK_E,
                                    BLOCK_EC, MASK_KIND, OPTIONS, False)
        return b_m, b_ycol
    full_end = full_tiles_end(start_m, k_len, is_causal, BLOCK_N)
    if is_causal != 0:
        b_m, b_ycol = _max_boundary_tiles(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, m_m,
            full_end, q_len, k_len, kv_end, head_e, scale, is_causal, pos_shift, win_left,
            win_right, softcap, slope, b_m, b_ycol, p_flags,
            inv_am1, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS)
    n_full = full_end // BLOCK_N
    diagonal = tl.minimum(start_m // BLOCK_N, n_full - 1)
    for i in range(n_full):
        # diagonal - i wraps round once at most: a select, not an integer division per tile
        # (about 25 instructions of the loop's 218: sm_90, bf16, E 64)
        tile = diagonal - i
        start_n = tl.where(tile < 0, tile + n_full, tile) * BLOCK_N
        b_m, b_ycol = _max_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                                stride_mk, o_m, m_m, start_n, q_len, k_len, head_e, scale,
                                is_causal, pos_shift, win_left, win_right, softcap, slope, b_m,
                                b_ycol, p_flags, inv_am1, BLOCK_M, BLOCK_N,
                                BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, False)
    if is_causal == 0:
        b_m, b_ycol = _max_boundary_tiles(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, m_m,
            full_end, q_len, k_len, kv_end, head_e, scale, is_causal, pos_shift, win_left,
            win_right, softcap, slope, b_m, b_ycol, p_flags,
            inv_am1, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS)
    return b_m, b_ycol


@triton.jit
def _max_boundary_tiles(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                        m_m, full_end, q_len, k_len, kv_end, head_e, scale, is_causal, pos_shift,
                        win_left, win_right, softcap, slope, b_m,
                        b_ycol, p_flags, inv_am1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr,
                        OPTIONS: tl.constexpr):
    """`_max_tile` of the tiles past the full ones: the causal diagonal's, or the ragged
    end of the keys'."""
    for start_n in range(full_end, kv_end, BLOCK_N):
        b_m, b_ycol = _max_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                                stride_mk, o_m, m_m, start_n, q_len, k_len, head_e, scale,
                                is_causal, pos_shift, win_left, win_right, softcap, slope, b_m,
                                b_ycol, p_flags, inv_am1, BLOCK_M, BLOCK_N,
                                BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, True)
    return b_m, b_ycol


@triton.jit
def _moment_terms(b_g, inv_am1, ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr):
    """Per score of a `gap`, the terms whose row sums `_sum_moments` turns into `_moments`:
    (ta, tb, the zero count and smallest-d key of `support.support_bits`); alpha 2:
    (d, unused, ...), alpha 1.5: (d^2, d, ...), general: (base^(e-1) w, base^(e-1), unused,
    unused). Summed over several chunks entry by entry before one reduction
    (`_candidate_pass`)."""
    if ALPHA_KIND == ALPHA_ABOVE_TWO:
        b_tb = sensitivity(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
        b_ta = b_tb * (b_g * (1.0 / inv_am1))
        b_neg = tl.zeros(b_g.shape, dtype=tl.int32)
        b_low = tl.zeros(b_g.shape, dtype=tl.uint32)
    elif ALPHA_KIND == ALPHA_GENERAL:
        b_pw = sensitivity(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
        b_ta = b_pw * tl.where(b_g > -1.0, b_g, 0.0)
        b_tb = b_pw
        b_neg = tl.zeros(b_g.shape, dtype=tl.int32)
        b_low = tl.zeros(b_g.shape, dtype=tl.uint32)
    else:
        b_neg, b_low = support_bits(b_g)
        if ALPHA_KIND == ALPHA_SPARSEMAX:
            b_ta = b_g
            b_tb = tl.zeros_like(b_g)
        else:
            b_ta = b_g * b_g
            b_tb = b_g
    return b_ta, b_tb, b_neg, b_low


@triton.jit
def _sum_moments(b_ta, b_tb, b_neg, b_low, n, ALPHA_KIND: tl.constexpr):
    """`_moments` from the `_moment_terms` of n entries per row, summed entry by entry."""
    if ALPHA_KIND == ALPHA_ABOVE_TWO:
        b_a = tl.sum(b_ta, 1)
        b_b = tl.sum(b_tb, 1)
        b_c = b_b
        b_dmin = b_b
    elif ALPHA_KIND == ALPHA_GENERAL:
        b_b = tl.sum(b_tb, 1)
        b_a = b_b + tl.sum(b_ta, 1)
        b_c = b_b
        b_dmin = b_b
    else:
        b_count, b_dmin = count_and_smallest(tl.sum(b_neg, 1), tl.min(b_low, 1), n)
        b_a = tl.sum(b_ta, 1)
        if ALPHA_KIND == ALPHA_SPARSEMAX:
            b_b = b_count
        else:
            b_b = tl.sum(b_tb, 1)
        b_c = b_count
    return b_a, b_b, b_c, b_dmin


@triton.jit
def _moments(b_g, inv_am1, ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr):
    """Per-row sums over one tile of a `gap` that fix the threshold update
    (docs/attention.md, "Threshold"): (a, b, c, dmin) with

        alpha = 2:    a = sum d      b = #{d > 0}     c = b        (d in z units)
        alpha = 1.5:  a = sum d^2    b = sum d        c = #{d > 0}
        general:      a = sum base^e  b = sum base^(e-1)  c = b    (base = 1 + w, u units)
        above 2:      a = sum base^e  b = sum base^(e-1)  c = b    (base = (alpha-1) d)

    and dmin the smallest positive d (the exactness certificate of alpha 2 and 1.5; general
    alpha returns b there, unused). f(t) = a - 1 in u units (`_sums_in_u`)."""
    b_ta, b_tb, b_neg, b_low = _moment_terms(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
    return _sum_moments(b_ta, b_tb, b_neg, b_low, b_g.shape[1], ALPHA_KIND)


@triton.jit
def _capture(p_cand, b_u, b_key, b_ncand, CANDIDATES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stores the scores b_u whose b_key > 0 (`_capture_key`) to their row's next slots of p_cand
    (CANDIDATES per row) in key order: each row's b_ncand[row] + its rank among them in
    the tile. Returns (b_ncand counting them all, each row's count in the tile)."""
    # The rank, an inclusive prefix count, as a product with a triangular matrix of ones:
    # exact, on the tensor cores, in the scores' own layout; its row maximum is the row's
    # count. Accumulated in fp16 (counts below 2^11 are exact), half the registers of fp32
    # (sm_90, bf16, E 64, alpha 1.5: the loop's spills 39 -> 6 per tile); tf32 products
    # would take the comparison's 1.0 as it is, but move it between layouts by shuffles.
    o_n = tl.arange(0, BLOCK_N)
    b_upto = tl.where(o_n[:, None] <= o_n[None, :], 1.0, 0.0).to(tl.float16)
    b_rank = tl.dot(positive_f16(b_key), b_upto, out_dtype=tl.float16).to(tl.float32)
    b_count = tl.max(b_rank, 1)
    # The slot is formed in fp32 (exact below 2^23) as 2^23 + slot (`store_above`); the
    # scores of a row past its last slot are counted, not stored (its block takes the
    # passes over the tiles).
    o_slot = tl.arange(0, b_u.shape[0]) * CANDIDATES
    b_first = (o_slot + b_ncand).to(tl.float32) + (8388608.0 - 1.0)
    b_last = (o_slot + (CANDIDATES - 1)).to(tl.float32) + 8388608.0
    store_above(p_cand, b_rank + b_first[:, None], b_last[:, None], b_u, b_key, 0.0)
    return b_ncand + b_count.to(tl.int32), b_count


@triton.jit
def _threshold_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    start_n, q_len, k_len, head_e, scale, b_shift, is_causal, pos_shift, win_left,
                    win_right, softcap, slope,
                    b_t0, b_t1, b_flag_thr, m_rows, p_flags, inv_am1,
                    b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, p_cand, b_ncand,
                    TWO: tl.constexpr, REFLAG: tl.constexpr, CANDIDATES: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                    MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr,
                    BOUNDARY: tl.constexpr,
                    NEAR_ONE: tl.constexpr):
    """Adds one key tile to the sums at threshold t0 (and t1 when TWO) and, when REFLAG,
    rewrites its flag: does any row have a score above b_flag_thr (lo, a lower bound of tau
    that only rises, so a tile with none has none above any later pass's threshold either)?
    Alpha 2 and 1.5 reflag at t0 = lo and read the answer off its sums; general alpha's t0
    is its trial point, and the flag takes the row maxima of the tile (monotone rounding:
    the gap of the maximum is the maximum of the gaps). REFLAG with CANDIDATES > 0 also
    captures the scores above b_flag_thr (`_capture`; lo only rises, so a score at or
    below it adds nothing at any later trial point: the later passes' sums over the
    captured scores are theirs over all, `_candidate_pass`)."""
    b_u = _score_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                      start_n, q_len, k_len, head_e, scale, b_shift, is_causal, pos_shift,
                      win_left, win_right, softcap, slope,
                      BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    if REFLAG:
        if CANDIDATES > 0:
            if ALPHA_KIND == ALPHA_GENERAL:
                # before the sums: general alpha's evaluation at its trial point holds many
                # values per score, through which the key, rank and store need not live
                # (the key as `_capture_key`'s: 1 + gap, exact where it is near 0)
                b_key = gap(b_u, b_flag_thr, inv_am1, ALPHA_KIND) + 1.0
                b_ncand, _ = _capture(p_cand, b_u, b_key, b_ncand, CANDIDATES, BLOCK_N)
    b_a, b_b, b_c, b_n = _moments(gap(b_u, b_t0, inv_am1, ALPHA_KIND), inv_am1, ALPHA_KIND,
                                  NEAR_ONE)
    b_a0 += b_a
    b_b0 += b_b
    b_c0 += b_c
    b_n0 = tl.minimum(b_n0, b_n)
    if REFLAG:
        # rows without a threshold (masked, NaN, past the end) must not keep tiles alive
        if ALPHA_KIND == ALPHA_GENERAL:
            b_top = tl.max(gap(tl.expand_dims(tl.max(b_u, 1), 1), b_flag_thr, inv_am1,
                               ALPHA_KIND), 1)
            b_alive = tl.max(tl.where(m_rows & (b_top > -1.0), 1.0, 0.0), 0)
        else:
            b_alive = tl.max(tl.where(m_rows, b_b, 0.0), 0)
        tl.store(p_flags + start_n // BLOCK_N, (b_alive > 0).to(tl.int8))
        if CANDIDATES > 0:
            if ALPHA_KIND != ALPHA_GENERAL:
                b_ncand, _ = _capture(p_cand, b_u, b_u - b_flag_thr[:, None], b_ncand,
                                      CANDIDATES, BLOCK_N)
    if TWO:
        b_a, b_b, b_c, b_n = _moments(gap(b_u, b_t1, inv_am1, ALPHA_KIND), inv_am1, ALPHA_KIND,
                                      NEAR_ONE)
        b_a1 += b_a
        b_b1 += b_b
        b_c1 += b_c
        b_n1 = tl.minimum(b_n1, b_n)
    return b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, b_ncand


@triton.jit
def _threshold_pass(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_shift,
                    is_causal, pos_shift, win_left, win_right, softcap, slope,
                    b_t0, b_t1, b_flag_thr, m_rows, p_flags, p_tiles, n_listed, inv_am1,
                    p_cand, TWO: tl.constexpr, REFLAG: tl.constexpr, CANDIDATES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr,
                    ALPHA_KIND: tl.constexpr,
                    NEAR_ONE: tl.constexpr):
    """One pass over the flagged tiles: the `_moments` sums at t0 (and t1). The full tiles
    (those before n_full, `full_tiles_end`) through their list (p_tiles[0:n_listed],
    `listed_tiles`: a pipelined loop), the few that cross a mask's edge through their
    flags. REFLAG: rewrite the flags at b_flag_thr and, with CANDIDATES > 0, capture the
    scores above it; the last value returned is each row's count of them."""
    b_zero = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_inf = tl.full([BLOCK_M], float("inf"), dtype=tl.float32)
    b_a0, b_b0, b_c0, b_n0 = b_zero, b_zero, b_zero, b_inf
    b_a1, b_b1, b_c1, b_n1 = b_zero, b_zero, b_zero, b_inf
    b_ncand = tl.zeros([BLOCK_M], dtype=tl.int32)
    for i in range(n_listed):
        start_n = tl.load(p_tiles + i) * BLOCK_N
        b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, b_ncand = _threshold_tile(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, start_n,
            q_len, k_len, head_e, scale, b_shift, is_causal, pos_shift, win_left, win_right,
            softcap, slope, b_t0, b_t1, b_flag_thr, m_rows,
            p_flags, inv_am1, b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, p_cand, b_ncand,
            TWO, REFLAG, CANDIDATES, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND,
            False,
            NEAR_ONE)
    for start_n in range(n_full, kv_end, BLOCK_N):
        if tl.load(p_flags + start_n // BLOCK_N) != 0:
            b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, b_ncand = _threshold_tile(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                start_n, q_len, k_len, head_e, scale, b_shift, is_causal, pos_shift, win_left,
                win_right, softcap, slope, b_t0, b_t1, b_flag_thr,
                m_rows, p_flags, inv_am1, b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1,
                p_cand, b_ncand, TWO, REFLAG, CANDIDATES, BLOCK_N, BLOCK_E, BLOCK_EC,
                MASK_KIND, OPTIONS, ALPHA_KIND, True, NEAR_ONE)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        # the tiles that cross the window's leading edge
        for start_n in range(kv_begin, full_begin, BLOCK_N):
            if tl.load(p_flags + start_n // BLOCK_N) != 0:
                b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, b_ncand = _threshold_tile(
                    b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    start_n, q_len, k_len, head_e, scale, b_shift, is_causal, pos_shift, win_left,
                    win_right, softcap, slope, b_t0, b_t1, b_flag_thr,
                    m_rows, p_flags, inv_am1, b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1,
                    p_cand, b_ncand, TWO, REFLAG, CANDIDATES, BLOCK_N, BLOCK_E, BLOCK_EC,
                    MASK_KIND, OPTIONS, ALPHA_KIND, True, NEAR_ONE)
    return b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, b_ncand


@triton.jit
def _sums_in_u(b_a, b_b, b_c, b_dmin, am1, inv_am1, ALPHA_KIND: tl.constexpr):
    """`_moments` sums taken on d in z units (scores minus their max), in u = (alpha-1) z
    units: alpha 1.5: a (alpha-1)^2, b (alpha-1); general: a (alpha-1) (its powers are in u
    units already); dmin (alpha-1)."""
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        b_a_u, b_b_u = b_a, b_b
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        b_a_u, b_b_u = b_a * (am1 * am1), b_b * am1
    else:
        b_a_u, b_b_u = b_a, b_b
    return b_a_u, b_b_u, b_c, b_dmin * am1


@triton.jit
def _update_threshold(b_t, b_a, b_b, b_c, b_dmin, b_lo, b_hi, b_tau, m_done, m_tight, am1,
                      ALPHA_KIND: tl.constexpr):
    """Tighter bracket [lo, hi] of tau from the `_moments` sums at t, and tau where it is
    now known. f(tau) = sum [u - tau]_+^e - 1 is convex and decreasing, so a Newton step
    from either side lands left of the root. The root of the closed form on the support
    at t (alpha 2: linear, alpha 1.5: quadratic) is tau itself when no score lies between
    t and it (all positive d above the step); otherwise it bounds tau from below (alpha 2,
    or t right of the root) or from above (alpha 1.5, t left of the root). Rows in m_done
    keep their tau. Returns (lo, hi, tau, done, tight): tight where hi is the closed-form root
    of a point left of tau (alpha 1.5), an upper bound that lies close above tau: set by
    this update, or kept from m_tight while hi does not move."""
    b_f = b_a - 1.0
    m_left = b_f >= 0
    b_bs = tl.where(b_b > 0, b_b, 1.0)
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        b_step = b_f / b_bs
        b_root = b_t + b_step
        m_exact = m_left & (b_step <= b_dmin)
        b_new_lo = b_root
        b_new_hi = tl.where(m_left, b_hi, b_t)
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        b_disc = b_b * b_b - b_c * b_f
        m_real = b_disc >= 0
        b_root = b_t + (b_b - tl.sqrt(tl.maximum(b_disc, 0.0))) / tl.where(b_c > 0, b_c, 1.0)
        b_step = b_f / (2.0 * b_bs)
        # The root is tau when no score of the support at t lies below it. Scores there lie
        # within gap of it, so they lower f at the root by at most c gap^2, and f falls at
        # least 2 (b - c (root - t)) per unit left of the root: the root is exact to that
        # ratio (docs/attention.md, "Certificates"), which gap = 0 makes 0.
        b_gap = tl.maximum(b_root - b_t - b_dmin, 0.0)
        m_exact = m_left & m_real & (
            b_c * b_gap * b_gap <= (b_b - b_c * (b_root - b_t)) * (2.0 * TAU_STEP_TOL_C))
        b_new_lo = tl.where(m_left, b_t + b_step, tl.maximum(b_root, b_t + b_step))
        b_new_hi = tl.where(m_left, tl.where(m_real, b_root, b_hi), b_t)
    else:
        b_step = b_f * am1 / b_bs
        b_root = b_t + b_step
        m_exact = m_left & (b_step <= TAU_STEP_TOL_C)
        # for alpha near 1, d^(e-1) underflows right of the root: no slope, no bound
        b_new_lo = tl.where(b_b > 0, b_root, b_lo)
        b_new_hi = tl.where(m_left, b_hi, b_t)
    # a Newton step this small leaves an error of its square: done for every kind
    m_small = m_left & (b_step <= TAU_STEP_TOL_C)
    b_root = tl.where(m_exact, b_root, b_t + b_step)
    m_exact = m_exact | m_small
    b_hi_next = tl.minimum(b_hi, b_new_hi)
    b_lo_next = tl.minimum(tl.maximum(b_lo, b_new_lo), b_hi_next)
    # a bracket this narrow is done too: f rounds to just below 0 at a t on the root,
    # which then never counts as left of it
    m_narrow = (b_hi_next - b_lo_next) <= TAU_STEP_TOL_C
    b_root = tl.where(m_exact, b_root, b_lo_next)
    m_exact = m_exact | m_narrow
    m_new = m_exact & ~m_done
    b_tau = tl.where(m_new, b_root, b_tau)
    # a row that is done is evaluated at its tau from now on: tight tile flags
    b_lo_next = tl.where(m_new, b_root, tl.where(m_done, b_lo, b_lo_next))
    b_hi_out = tl.where(m_done, b_hi, b_hi_next)
    if ALPHA_KIND == ALPHA_ENTMAX15:
        m_tight = (m_left & m_real & (b_hi_next < b_hi)) | (m_tight & (b_hi_out == b_hi))
    else:
        m_tight = tl.zeros_like(m_left)
    return b_lo_next, b_hi_out, b_tau, m_done | m_exact, m_tight


@triton.jit
def _model_root(b_t, b_a, b_b, am1, ALPHA_KIND: tl.constexpr):
    """General alpha: the root of the model C (m - s)^e - 1 of f(t + s), fitted to the
    `_moments` sums at t (f = a - 1, f' = -e b: m = a / b, C = a / m^e), i.e.
    t + m (1 - a^(-1/e)). Far from tau it steps much further than Newton's tangent, which
    ignores the curvature of d^e; it is a guess, not a bound (`_trial_point` clips it into
    the bracket). Other kinds: t."""
    if ALPHA_KIND == ALPHA_GENERAL:
        m_fit = (b_b > 0) & (b_a > 0)
        b_a_safe = tl.where(m_fit, b_a, 1.0)
        b_shrink = 1.0 - tl.exp2(-am1 * tl.log2(b_a_safe))
        b_guess = tl.where(m_fit, b_t + b_a_safe / tl.where(m_fit, b_b, 1.0) * b_shrink, b_t)
    else:
        b_guess = b_t
    return b_guess


@triton.jit
def _trial_point(b_lo, b_hi, m_done, m_tight, b_guess, ALPHA_KIND: tl.constexpr):
    """Where a later pass evaluates each row: inside the bracket, near hi where hi is tight
    (`_update_threshold`), at lo otherwise. Newton's lower bounds reach tau from the left
    and certify only once no score lies between them and tau, while alpha 1.5's closed-form
    upper bound is typically 20-30x nearer tau than lo: a trial point 0.3 of the bracket
    below it lands left of tau and past those scores more often, and one right of tau still
    lowers hi to it and raises lo to its closed-form root. The float32 emulation of the
    passes (tools/attention_passes.py) counts 4.25 -> 3.75 passes per block of 64 rows
    at L 4096 on random scores, 3.62 -> 3.12 on local ones. General alpha has no such
    bound: its rows go to the `_model_root` of the last pass, clipped into [lo, hi] (left of
    tau Newton's next lower bound starts nearer it, right of tau it is a tight upper bound):
    8 -> 6 passes at alpha 1.25, 10 -> 5 at 1.1, 6.2 -> 6.0 at 1.5 in the emulation. Rows
    that are done stay at tau."""
    if ALPHA_KIND == ALPHA_GENERAL:
        b_trial = tl.where(m_done, b_lo, tl.minimum(tl.maximum(b_guess, b_lo), b_hi))
    else:
        m_move = m_tight & ~m_done
        b_trial = tl.where(m_move, tl.maximum(b_lo, b_hi - 0.3 * (b_hi - b_lo)), b_lo)
    return b_trial


@triton.jit
def _with_sink(b_t, b_a, b_b, b_c, b_dmin, b_sink, inv_am1, OPTIONS: tl.constexpr,
               ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr):
    """`_moments` sums (a, b, c, dmin) at the trial point t (c units) of a row's scores,
    with its sink's entry added when OPTIONS has one: b_sink [BM], the sink logit less the
    row's maximum (z units). Every evaluation of the threshold adds it, whether its sums
    come from the tiles, the captured scores or a subset of them (a subset with the sink
    is still a subset of the row with it), so that tau is the threshold of the row with
    the sink: one entry per row, nothing per score."""
    if (SCORE_SINK_C & OPTIONS) != 0:
        b_sa, b_sb, b_sc, b_sn = _moments(
            gap(b_sink[:, None], _threshold_in_z(b_t, inv_am1, ALPHA_KIND), inv_am1, ALPHA_KIND),
            inv_am1, ALPHA_KIND, NEAR_ONE)
        b_a += b_sa
        b_b += b_sb
        b_c += b_sc
        b_dmin = tl.minimum(b_dmin, b_sn)
    return b_a, b_b, b_c, b_dmin


@triton.jit
def _update_from_sums(b_t, b_a, b_b, b_c, b_dmin, b_lo, b_hi, b_tau, m_done, m_tight, am1,
                      inv_am1, b_sink, OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr,
                      NEAR_ONE: tl.constexpr):
    """`_update_threshold` from a pass's `_moments` sums at t (z units), with the sink's
    entry (`_with_sink`), and the `_model_root` of those sums: (lo, hi, tau, done, tight,
    guess)."""
    b_a, b_b, b_c, b_dmin = _with_sink(b_t, b_a, b_b, b_c, b_dmin, b_sink, inv_am1, OPTIONS,
                                       ALPHA_KIND, NEAR_ONE)
    b_a, b_b, b_c, b_dmin = _sums_in_u(b_a, b_b, b_c, b_dmin, am1, inv_am1, ALPHA_KIND)
    b_lo, b_hi, b_tau, m_done, m_tight = _update_threshold(
        b_t, b_a, b_b, b_c, b_dmin, b_lo, b_hi, b_tau, m_done, m_tight, am1, ALPHA_KIND)
    return b_lo, b_hi, b_tau, m_done, m_tight, _model_root(b_t, b_a, b_b, am1, ALPHA_KIND)


@triton.jit
def _one_point_pass(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz, b_sink,
                    is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows,
                    p_flags, p_tiles, n_listed, am1, inv_am1, b_t, b_lo, b_hi, b_tau, m_done,
                    m_tight, p_cand, REFLAG: tl.constexpr, CANDIDATES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr,
                    ALPHA_KIND: tl.constexpr,
                    NEAR_ONE: tl.constexpr):
    """A threshold pass at every row's trial point t in [lo, hi] and the bracket's update
    from it: (lo, hi, tau, done, tight, guess), as `_update_from_sums`, and each row's count
    of captured scores. REFLAG rewrites the tile flags at lo, a lower bound of tau (alpha 2
    and 1.5 need t = lo for it), and with CANDIDATES > 0 captures the scores above lo."""
    b_t0 = _threshold_in_z(b_t, inv_am1, ALPHA_KIND)
    b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, b_ncand = _threshold_pass(
        b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
        full_begin, n_full, q_len,
        k_len, kv_end, head_e, scale, b_mz, is_causal, pos_shift, win_left, win_right, softcap,
        slope, b_t0, b_t0,
        _threshold_in_z(b_lo, inv_am1, ALPHA_KIND), m_rows, p_flags, p_tiles, n_listed,
        inv_am1, p_cand, False, REFLAG, CANDIDATES, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC,
        MASK_KIND, OPTIONS, ALPHA_KIND, NEAR_ONE)
    b_lo, b_hi, b_tau, m_done, m_tight, b_guess = _update_from_sums(
        b_t, b_a0, b_b0, b_c0, b_n0, b_lo, b_hi, b_tau, m_done, m_tight, am1, inv_am1, b_sink,
        OPTIONS, ALPHA_KIND, NEAR_ONE)
    return b_lo, b_hi, b_tau, m_done, m_tight, b_guess, b_ncand


@triton.jit
def _candidate_pass(p_cand, b_ncand, n_cand, am1, inv_am1, b_sink, b_t, b_lo, b_hi, b_tau, m_done,
                    m_tight, BLOCK_M: tl.constexpr, CANDIDATES: tl.constexpr,
                    CHUNK: tl.constexpr, OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr,
                    NEAR_ONE: tl.constexpr):
    """`_one_point_pass` over the captured scores alone (b_ncand[row] of them in
    p_cand[row], at most n_cand in any row): the same sums, without a score product. The
    chunks' terms are summed entry by entry and reduced across threads once (a compaction,
    two of these and a rewrite, took 4000 instructions with a reduction per chunk and 3000
    this way: sm_90, bf16, E 64, alpha 1.5)."""
    b_t0 = _threshold_in_z(b_t, inv_am1, ALPHA_KIND)
    b_ta = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
    b_tb = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
    b_neg = tl.zeros([BLOCK_M, CHUNK], dtype=tl.int32)
    b_low = tl.full([BLOCK_M, CHUNK], 0xFFFFFFFF, dtype=tl.uint32)
    for start in range(0, n_cand, CHUNK):
        o_c = start + tl.arange(0, CHUNK)
        # the whole chunk loaded (each row's slots lie inside its CANDIDATES), then the
        # entries past its count set to -inf: vector loads instead of one masked load per
        # entry (sm_90, bf16, E 64, alpha 1.5: the chunk loop 204 -> 187 instructions, a
        # compaction about 2800 -> 2150)
        b_u = tl.load(p_cand + tl.arange(0, BLOCK_M)[:, None] * CANDIDATES + o_c[None, :])
        b_u = tl.where(o_c[None, :] < b_ncand[:, None], b_u, float("-inf"))
        c_ta, c_tb, c_neg, c_low = _moment_terms(gap(b_u, b_t0, inv_am1, ALPHA_KIND), inv_am1,
                                                 ALPHA_KIND, NEAR_ONE)
        b_ta += c_ta
        b_tb += c_tb
        b_neg += c_neg
        b_low = tl.minimum(b_low, c_low)
    b_a, b_b, b_c, b_dmin = _sum_moments(b_ta, b_tb, b_neg, b_low,
                                         tl.cdiv(n_cand, CHUNK) * CHUNK, ALPHA_KIND)
    return _update_from_sums(b_t, b_a, b_b, b_c, b_dmin, b_lo, b_hi, b_tau, m_done, m_tight,
                             am1, inv_am1, b_sink, OPTIONS, ALPHA_KIND, NEAR_ONE)


@triton.jit
def _passes_over_captured(p_cand, b_ncand, n_cand, am1, inv_am1, b_sink, b_lo, b_hi, b_tau, m_done,
                          m_tight, b_guess, n_pass, BLOCK_M: tl.constexpr,
                          CANDIDATES: tl.constexpr, OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr,
                          NEAR_ONE: tl.constexpr):
    """Threshold passes over the captured scores alone (`_candidate_pass`) until every row
    of the block is done or MAX_TAU_PASSES passes were made in all: (lo, hi, tau, done,
    tight, guess, passes)."""
    while (tl.max(tl.where(m_done, 0, 1), 0) > 0) & (MAX_TAU_PASSES_C > n_pass):
        b_t = _trial_point(b_lo, b_hi, m_done, m_tight, b_guess, ALPHA_KIND)
        b_lo, b_hi, b_tau, m_done, m_tight, b_guess = _candidate_pass(
            p_cand, b_ncand, n_cand, am1, inv_am1, b_sink, b_t, b_lo, b_hi, b_tau, m_done, m_tight,
            BLOCK_M, CANDIDATES, CANDIDATE_CHUNK_C, OPTIONS, ALPHA_KIND, NEAR_ONE)
        n_pass += 1
    return b_lo, b_hi, b_tau, m_done, m_tight, b_guess, n_pass


@triton.jit
def _capture_key(b_u, b_lo, inv_am1, ALPHA_KIND: tl.constexpr):
    """Per score of b_u (z units), positive exactly where it lies above its row's lower
    bound lo of tau (c units): the scores a capture keeps. General alpha compares its
    `gap` with -1 (1 + gap is exact there, Sterbenz)."""
    b_thr = _threshold_in_z(b_lo, inv_am1, ALPHA_KIND)
    if ALPHA_KIND == ALPHA_GENERAL:
        b_key = gap(b_u, b_thr, inv_am1, ALPHA_KIND) + 1.0
    else:
        b_key = b_u - b_thr[:, None]
    return b_key


@triton.jit
def _compact(p_cand, b_stored, b_keep, am1, inv_am1, b_sink, b_lo, b_hi, m_done,
             BLOCK_M: tl.constexpr, CANDIDATES: tl.constexpr, CHUNK: tl.constexpr,
             OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr):
    """Raises each open row's lower bound of tau from the scores in its first b_stored slots
    and keeps, of its first b_keep, those above the new bound: (lo, count kept). The slots
    hold scores of the row above its bound at the time, a subset of the row: their f is at
    most the row's, so their threshold, and every lower bound of it that
    `_update_threshold` finds, is at most the row's tau. COMPACT_STEPS evaluations (a
    Newton step, and alpha 1.5's and 2's closed forms: the float32 emulation needed as few
    compactions with two as with the subset's exact threshold); the bracket's upper end and
    the roots belong to the subset and are dropped. Each chunk is read whole before any
    thread writes it (a kept score only moves down)."""
    tl.debug_barrier()
    # a row past its slots stored only its first CANDIDATES (the chunks reach past them)
    b_stored = tl.minimum(b_stored, CANDIDATES)
    b_lo_s, b_hi_s, b_tau_s, m_done_s = b_lo, b_hi, b_lo, m_done
    m_tight_s = tl.zeros_like(m_done)
    b_guess = b_lo
    o_rows = tl.arange(0, BLOCK_M)[:, None] * CANDIDATES
    n_stored = tl.max(b_stored, 0)
    for _ in tl.static_range(COMPACT_STEPS):
        b_t = _trial_point(b_lo_s, b_hi_s, m_done_s, m_tight_s, b_guess, ALPHA_KIND)
        b_lo_s, b_hi_s, b_tau_s, m_done_s, m_tight_s, b_guess = _candidate_pass(
            p_cand, b_stored, n_stored, am1, inv_am1, b_sink, b_t, b_lo_s, b_hi_s, b_tau_s,
            m_done_s, m_tight_s, BLOCK_M, CANDIDATES, CHUNK, OPTIONS, ALPHA_KIND, NEAR_ONE)
    b_lo = tl.where(m_done, b_lo, tl.maximum(b_lo, b_lo_s))
    b_kept = tl.zeros([BLOCK_M], dtype=tl.int32)
    for start in tl.static_range(0, CANDIDATES, CHUNK):
        o_c = start + tl.arange(0, CHUNK)
        b_u = tl.where(o_c[None, :] < b_keep[:, None], tl.load(p_cand + o_rows + o_c[None, :]),
                       float("-inf"))
        tl.debug_barrier()
        b_key = _capture_key(b_u, b_lo, inv_am1, ALPHA_KIND)
        b_kept, _ = _capture(p_cand, b_u, b_key, b_kept, CANDIDATES, CHUNK)
    tl.debug_barrier()
    return b_lo, b_kept


@triton.jit
def _running_capture_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk,
                          o_m, start_n, q_len, k_len, head_e, scale, b_shift, is_causal,
                          pos_shift, win_left, win_right, softcap, slope,
                          m_rows, p_flags, inv_am1, b_lo, p_cand, b_ncand,
                          BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr,
                          ALPHA_KIND: tl.constexpr, BOUNDARY: tl.constexpr,
                          CANDIDATES: tl.constexpr):
    """One key tile of `_running_capture_pass`: captures its scores above each row's lower
    bound and rewrites its flag at that bound (lo only rises, so a tile without a score
    above it has none above tau). Returns the rows' counts, those past the slots too."""
    b_u = _score_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                      start_n, q_len, k_len, head_e, scale, b_shift, is_causal, pos_shift,
                      win_left, win_right, softcap, slope,
                      BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    b_ncand, b_count = _capture(p_cand, b_u, _capture_key(b_u, b_lo, inv_am1, ALPHA_KIND),
                                b_ncand, CANDIDATES, BLOCK_N)
    b_alive = tl.max(tl.where(m_rows, b_count, 0.0), 0)
    tl.store(p_flags + start_n // BLOCK_N, (b_alive > 0).to(tl.int8))
    return b_ncand


@triton.jit
def _running_capture_pass(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk,
                          o_m, kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale,
                          b_mz, b_sink, is_causal, pos_shift, win_left, win_right, softcap, slope,
                          m_rows, p_flags, p_tiles, n_listed, am1, inv_am1, b_lo, b_hi,
                          m_done, p_cand, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                          MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr,
                          CANDIDATES: tl.constexpr, NEAR_ONE: tl.constexpr):
    """The first threshold pass: captures every score above a lower bound of tau that
    rises as the pass goes (`_compact`), so that at its end each row's slots hold every
    score above its bound and the threshold is found on chip (`_candidate_pass`), with no
    sums over the tiles: a score product and the capture per score, against the two-point
    pass and the capturing pass it replaces where the rows fit (docs/attention.md, "A
    rising lower bound").

    The listed tiles go in segments of COMPACT_SEGMENT: a loop that holds the compaction
    (its barriers) is not software-pipelined, so the tile loop holds the capture alone and
    the compaction runs between segments, when a row holds more than COMPACT_FILL of its
    slots. A segment that overflows a row's slots is captured again after a compaction
    (raised from every score it stored; only the scores from before the segment are kept).
    After COMPACT_MIN + (listed tiles) / COMPACT_TILES compactions the pass stops where it
    is.
    Returns (lo, each row's count of captured scores, past CANDIDATES where a row did not
    fit: its block takes the passes over the tiles)."""
    b_ncand = tl.zeros([BLOCK_M], dtype=tl.int32)
    # the tiles that cross a mask's edge first: at most BLOCK_M + BLOCK_N keys, within the
    # slots of an empty row (a window's two edges, below, can give a row twice that)
    for start_n in range(n_full, kv_end, BLOCK_N):
        if tl.load(p_flags + start_n // BLOCK_N) != 0:
            b_ncand = _running_capture_tile(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                start_n, q_len, k_len, head_e, scale, b_mz, is_causal, pos_shift, win_left,
                win_right, softcap, slope, m_rows, p_flags,
                inv_am1, b_lo, p_cand, b_ncand, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS,
                ALPHA_KIND, True, CANDIDATES)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        # the tiles that cross the window's leading edge
        for start_n in range(kv_begin, full_begin, BLOCK_N):
            if tl.load(p_flags + start_n // BLOCK_N) != 0:
                b_ncand = _running_capture_tile(
                    b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    start_n, q_len, k_len, head_e, scale, b_mz, is_causal, pos_shift, win_left,
                    win_right, softcap, slope, m_rows, p_flags,
                    inv_am1, b_lo, p_cand, b_ncand, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS,
                    ALPHA_KIND, True, CANDIDATES)
    n_compact = n_listed * 0
    max_compactions = COMPACT_MIN_C + n_listed // COMPACT_TILES_C
    start = n_listed * 0
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        # A row past its slots after the window's edge tiles lost scores that a compaction,
        # which keeps only stored ones, would not count: the block keeps its count past
        # CANDIDATES, skips the listed tiles (their flags stay the max pass's) and takes the
        # passes over the tiles from lo.
        if tl.max(tl.where(m_done, 0, b_ncand), 0) > CANDIDATES:
            start = n_listed
    while start < n_listed:
        end = tl.minimum(start + COMPACT_SEGMENT_C, n_listed)
        b_next = b_ncand
        for i in range(start, end):
            b_next = _running_capture_tile(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                tl.load(p_tiles + i) * BLOCK_N, q_len, k_len, head_e, scale, b_mz, is_causal,
                pos_shift, win_left, win_right, softcap, slope,
                m_rows, p_flags, inv_am1, b_lo, p_cand, b_next, BLOCK_N, BLOCK_E, BLOCK_EC,
                MASK_KIND, OPTIONS, ALPHA_KIND, False, CANDIDATES)
        n_most = tl.max(tl.where(m_done, 0, b_next), 0)
        if n_most > CANDIDATES:
            if n_compact < max_compactions:
                b_lo, b_ncand = _compact(p_cand, b_next, b_ncand, am1, inv_am1, b_sink, b_lo, b_hi,
                                         m_done, BLOCK_M, CANDIDATES, CANDIDATE_CHUNK_C,
                                         OPTIONS, ALPHA_KIND, NEAR_ONE)
                n_compact += 1
            else:
                b_ncand = b_next
                start = n_listed
        else:
            b_ncand = b_next
            start = end
            if (n_most > CANDIDATES * COMPACT_FILL_C) & (n_compact < max_compactions):
                b_lo, b_ncand = _compact(p_cand, b_ncand, b_ncand, am1, inv_am1, b_sink, b_lo, b_hi,
                                         m_done, BLOCK_M, CANDIDATES, CANDIDATE_CHUNK_C,
                                         OPTIONS, ALPHA_KIND, NEAR_ONE)
                n_compact += 1
    return b_lo, b_ncand


@triton.jit
def _passes_over_tiles(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                       kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz,
                       b_sink,
                       is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows,
                       p_flags, p_tiles, p_cand, am1, inv_am1, b_lo, b_hi, b_tau, m_done,
                       n_listed, n_pass, capture, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr,
                       OPTIONS: tl.constexpr,
                       ALPHA_KIND: tl.constexpr, CANDIDATES: tl.constexpr,
                       NEAR_ONE: tl.constexpr):
    """The threshold passes over the tiles, for blocks the first pass's capture did not
    settle, from the bracket [lo, hi] it left: two points (lo and the middle), then one
    that rewrites the flags at the new lower bound and captures the scores above it (their
    threshold found on chip when they fit; for general alpha only where `capture`, the
    block's `_capture_fits`), then one point per pass. Returns (lo, hi, tau, done, tight,
    guess, listed tiles, passes so far)."""
    b_mid = 0.5 * (b_lo + b_hi)
    b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, b_ncand = _threshold_pass(
        b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
        full_begin, n_full, q_len,
        k_len, kv_end, head_e, scale, b_mz, is_causal, pos_shift, win_left, win_right, softcap,
        slope, _threshold_in_z(b_lo, inv_am1, ALPHA_KIND),
        _threshold_in_z(b_mid, inv_am1, ALPHA_KIND), _threshold_in_z(b_lo, inv_am1, ALPHA_KIND),
        m_rows, p_flags, p_tiles, n_listed, inv_am1, p_cand, True, False, CANDIDATES,
        BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND, NEAR_ONE)
    b_a0, b_b0, b_c0, b_n0 = _with_sink(b_lo, b_a0, b_b0, b_c0, b_n0, b_sink, inv_am1, OPTIONS,
                                        ALPHA_KIND, NEAR_ONE)
    b_a1, b_b1, b_c1, b_n1 = _with_sink(b_mid, b_a1, b_b1, b_c1, b_n1, b_sink, inv_am1, OPTIONS,
                                        ALPHA_KIND, NEAR_ONE)
    b_a0, b_b0, b_c0, b_n0 = _sums_in_u(b_a0, b_b0, b_c0, b_n0, am1, inv_am1, ALPHA_KIND)
    b_a1, b_b1, b_c1, b_n1 = _sums_in_u(b_a1, b_b1, b_c1, b_n1, am1, inv_am1, ALPHA_KIND)
    b_first = b_lo
    b_lo, b_hi, b_tau, m_done, m_tight = _update_threshold(
        b_first, b_a0, b_b0, b_c0, b_n0, b_lo, b_hi, b_tau, m_done, tl.zeros_like(m_done), am1,
        ALPHA_KIND)
    b_lo, b_hi, b_tau, m_done, m_tight = _update_threshold(
        b_mid, b_a1, b_b1, b_c1, b_n1, b_lo, b_hi, b_tau, m_done, m_tight, am1, ALPHA_KIND)
    # general alpha's model, fitted at the nearer of the first pass's two points left of tau
    b_guess = tl.where(b_a1 >= 1.0, _model_root(b_mid, b_a1, b_b1, am1, ALPHA_KIND),
                       _model_root(b_first, b_a0, b_b0, am1, ALPHA_KIND))
    n_pass += 1
    # the most scores any open row captured; past CANDIDATES when nothing was captured
    n_cand = n_full * 0 + (CANDIDATES + 1)
    if tl.max(tl.where(m_done, 0, 1), 0) > 0:
        # The second pass alone rewrites the flags, at the lower bound the first one found:
        # a cross-warp reduction per tile (14 % of the forward with every pass rewriting
        # them, on an H100), and the later passes' higher bounds drop few more tiles. In its
        # own compile of the pass (REFLAG), so that the later passes' loop carries none of
        # it (sm_90, bf16, E 64, alpha 1.5: 13.4 -> 12.5 instructions per score).
        # General alpha evaluates this pass at its trial point already, and flags from the
        # tiles' row maxima (`_threshold_tile`): a pass fewer per block in the float32
        # emulation (6 -> 5 at alpha 1.25, L 4096). Alpha 2 and 1.5 gain none there and
        # keep reading the flags off the sums at lo.
        if ALPHA_KIND == ALPHA_GENERAL:
            b_t2 = _trial_point(b_lo, b_hi, m_done, m_tight, b_guess, ALPHA_KIND)
            if capture:
                b_lo, b_hi, b_tau, m_done, m_tight, b_guess, b_ncand = _one_point_pass(
                    b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz, b_sink,
                    is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows,
                    p_flags, p_tiles, n_listed, am1, inv_am1, b_t2, b_lo, b_hi, b_tau, m_done,
                    m_tight, p_cand, True, CANDIDATES, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC,
                    MASK_KIND, OPTIONS, ALPHA_KIND, NEAR_ONE)
                n_cand = tl.max(tl.where(m_done, 0, b_ncand), 0)
            else:
                b_lo, b_hi, b_tau, m_done, m_tight, b_guess, b_ncand = _one_point_pass(
                    b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz, b_sink,
                    is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows,
                    p_flags, p_tiles, n_listed, am1, inv_am1, b_t2, b_lo, b_hi, b_tau, m_done,
                    m_tight, p_cand, True, 0, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND,
                    OPTIONS,
                    ALPHA_KIND, NEAR_ONE)
        else:
            b_lo, b_hi, b_tau, m_done, m_tight, b_guess, b_ncand = _one_point_pass(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
                full_begin, n_full,
                q_len, k_len, kv_end, head_e, scale, b_mz, b_sink, is_causal, pos_shift, win_left,
                win_right, softcap, slope, m_rows, p_flags, p_tiles,
                n_listed, am1, inv_am1, b_lo, b_lo, b_hi, b_tau, m_done, m_tight, p_cand, True,
                CANDIDATES, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND,
                NEAR_ONE)
            n_cand = tl.max(tl.where(m_done, 0, b_ncand), 0)
        # (the barrier also orders the captured scores' stores before their loads)
        tl.debug_barrier()
        n_listed = listed_tiles(p_flags, 1, full_begin // BLOCK_N, n_full // BLOCK_N, p_tiles)
        tl.debug_barrier()
        n_pass += 1
    if (CANDIDATES > 0) & (not NEAR_ONE):
        # Every score a later pass can count was captured: the passes run on chip, a few
        # operations per captured score (tens per row after the first pass on random
        # scores, `tools/attention_passes.py`) instead of a score product and those
        # operations per score of the row. A row that captured more than CANDIDATES sends
        # its block through the passes over the tiles below.
        if n_cand <= CANDIDATES:
            b_lo, b_hi, b_tau, m_done, m_tight, b_guess, n_pass = _passes_over_captured(
                p_cand, b_ncand, n_cand, am1, inv_am1, b_sink, b_lo, b_hi, b_tau, m_done, m_tight,
                b_guess, n_pass, BLOCK_M, CANDIDATES, OPTIONS, ALPHA_KIND, NEAR_ONE)
    while (tl.max(tl.where(m_done, 0, 1), 0) > 0) & (n_pass < MAX_TAU_PASSES_C):
        b_lo, b_hi, b_tau, m_done, m_tight, b_guess, b_ncand = _one_point_pass(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
            full_begin, n_full,
            q_len, k_len, kv_end, head_e, scale, b_mz, b_sink, is_causal, pos_shift, win_left,
            win_right,
            softcap, slope, m_rows, p_flags, p_tiles,
            n_listed, am1, inv_am1, _trial_point(b_lo, b_hi, m_done, m_tight, b_guess, ALPHA_KIND),
            b_lo, b_hi, b_tau, m_done, m_tight, p_cand, False, CANDIDATES, BLOCK_M, BLOCK_N,
            BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND, NEAR_ONE)
        n_pass += 1
    return b_lo, b_hi, b_tau, m_done, m_tight, b_guess, n_listed, n_pass


@triton.jit
def _subset_bound(b_u, am1, inv_am1, b_sink, b_lo, b_hi, m_done, OPTIONS: tl.constexpr,
                  ALPHA_KIND: tl.constexpr,
                  NEAR_ONE: tl.constexpr):
    """Each open row's lower bound of tau from a subset of its scores: b_u [BM, BN], the
    largest shifted score of each column over the tiles the max pass visited (masked
    columns -inf). A subset's f is at most the row's, so its threshold and every lower bound
    of it that `_update_from_sums` finds lies at or below the row's tau (as a compaction's,
    `_compact`); SUBSET_STEPS evaluations over the subset, in registers. The float32
    emulation (64-row blocks, N(0, 1) scores, L 4096, alpha 1.5): the first threshold
    pass's compactions 2.2 -> 0 per block, 46.2 -> 41.0 units per score (docs/attention.md,
    "A lower bound from the max pass")."""
    b_lo_s, b_hi_s, b_tau_s, m_done_s = b_lo, b_hi, b_lo, m_done
    m_tight_s = tl.zeros_like(m_done)
    b_guess = b_lo
    for _ in tl.static_range(SUBSET_STEPS_C):
        b_t = _trial_point(b_lo_s, b_hi_s, m_done_s, m_tight_s, b_guess, ALPHA_KIND)
        b_a, b_b, b_c, b_dmin = _moments(gap(b_u, _threshold_in_z(b_t, inv_am1, ALPHA_KIND),
                                             inv_am1, ALPHA_KIND), inv_am1, ALPHA_KIND, NEAR_ONE)
        b_lo_s, b_hi_s, b_tau_s, m_done_s, m_tight_s, b_guess = _update_from_sums(
            b_t, b_a, b_b, b_c, b_dmin, b_lo_s, b_hi_s, b_tau_s, m_done_s, m_tight_s, am1,
            inv_am1, b_sink, OPTIONS, ALPHA_KIND, NEAR_ONE)
    return tl.where(m_done, b_lo, tl.maximum(b_lo, b_lo_s))


@triton.jit
def _capture_fits(b_u, b_lo, inv_am1, m_done, BLOCK_N: tl.constexpr, ALPHA_KIND: tl.constexpr):
    """Whether the block's open rows are likely to fit their capture slots: none has more
    than CAPTURE_MAX_COLUMN_SHARE of its BLOCK_N column maxima b_u (`_subset_bound`'s
    subset) above its lower bound lo. Rows whose scores above lo outnumber the slots spread
    over nearly every column (attention_common.CAPTURE_MAX_COLUMN_SHARE has the emulation's
    counts); one pass over the [BM, BN] maxima in registers, per block."""
    b_above = tl.sum((_capture_key(b_u, b_lo, inv_am1, ALPHA_KIND) > 0).to(tl.int32), 1)
    return tl.max(tl.where(m_done, 0, b_above), 0) <= BLOCK_N * CAPTURE_MAX_COLUMN_SHARE_C


@triton.jit
def _find_threshold(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz, b_sink,
                    b_ycol, is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows,
                    p_flags, p_tiles, p_cand, am1, inv_am1, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                    MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr,
                    CANDIDATES: tl.constexpr, NEAR_ONE: tl.constexpr):
    """Passes 2 and on: the tiles' threshold (`_threshold_in_z`) of every row, [BM], and the
    number of listed tiles (p_tiles) the output pass visits, from the flags the max pass
    left (which the first threshold pass rewrites). With CANDIDATES > 0 (and, for general
    alpha, a block whose rows are likely to fit, `_capture_fits`) the first threshold pass
    captures every row's scores above a rising lower bound of tau (`_running_capture_pass`),
    and when every open row's fit its CANDIDATES slots the threshold is found over those alone
    (`_candidate_pass`): a max pass, one threshold pass and the output pass. Blocks whose
    rows do not fit take the passes over the tiles from the bound it reached: two points
    in the first, a capture above the new lower bound in the second (its scores again
    searched on chip when they fit), one point in each later one."""
    # threshold passes; the bracket holds c = tau + 1 in [0, 1), u = (alpha-1)(z - max z)
    # units: near alpha = 1 the threshold sits close to -1 and c keeps its digits
    b_lo = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_hi = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    m_done = ~m_rows
    m_tight = tl.zeros_like(m_done)
    b_ysub = b_ycol - b_mz[:, None]
    b_lo = _subset_bound(b_ysub, am1, inv_am1, b_sink, b_lo, b_hi, m_done, OPTIONS, ALPHA_KIND,
                         NEAR_ONE)
    b_tau = b_lo
    b_guess = b_lo
    # the list of the tiles the max pass flagged (from other threads' flags)
    tl.debug_barrier()
    n_listed = listed_tiles(p_flags, 1, full_begin // BLOCK_N, n_full // BLOCK_N, p_tiles)
    tl.debug_barrier()
    n_pass = 0
    # the most scores any open row captured; past CANDIDATES when nothing was captured
    n_cand = n_full * 0 + (CANDIDATES + 1)
    b_ncand = tl.zeros([BLOCK_M], dtype=tl.int32)
    # heads near alpha = 1 (NEAR_ONE: alpha < 1.25) never capture; the general kind's blocks
    # only where their rows are likely to fit the slots (`_capture_fits`), since a block
    # that does not fit pays the capture on top of the passes over the tiles
    capture = False
    if (CANDIDATES > 0) & (not NEAR_ONE):
        capture = True
        if ALPHA_KIND == ALPHA_GENERAL:
            capture = _capture_fits(b_ysub, b_lo, inv_am1, m_done, BLOCK_N, ALPHA_KIND)
    if capture:
        b_lo, b_ncand = _running_capture_pass(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
            full_begin, n_full,
            q_len, k_len, kv_end, head_e, scale, b_mz, b_sink, is_causal, pos_shift, win_left,
            win_right,
            softcap, slope, m_rows, p_flags, p_tiles,
            n_listed, am1, inv_am1, b_lo, b_hi, m_done, p_cand, BLOCK_M, BLOCK_N, BLOCK_E,
            BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND, CANDIDATES, NEAR_ONE)
        n_cand = tl.max(tl.where(m_done, 0, b_ncand), 0)
        # (the barrier also orders the captured scores' stores before their loads)
        tl.debug_barrier()
        n_listed = listed_tiles(p_flags, 1, full_begin // BLOCK_N, n_full // BLOCK_N, p_tiles)
        tl.debug_barrier()
        n_pass = 1
        if n_cand <= CANDIDATES:
            b_lo, b_hi, b_tau, m_done, m_tight, b_guess, n_pass = _passes_over_captured(
                p_cand, b_ncand, n_cand, am1, inv_am1, b_sink, b_lo, b_hi, b_tau, m_done, m_tight,
                b_guess, n_pass, BLOCK_M, CANDIDATES, OPTIONS, ALPHA_KIND, NEAR_ONE)
    if (tl.max(tl.where(m_done, 0, 1), 0) > 0) & (n_pass < MAX_TAU_PASSES_C):
        b_lo, b_hi, b_tau, m_done, m_tight, b_guess, n_listed, n_pass = _passes_over_tiles(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
            full_begin, n_full,
            q_len, k_len, kv_end, head_e, scale, b_mz, b_sink, is_causal, pos_shift, win_left,
            win_right,
            softcap, slope, m_rows, p_flags, p_tiles,
            p_cand, am1, inv_am1, b_lo, b_hi, b_tau, m_done, n_listed, n_pass, capture,
            BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND, CANDIDATES,
            NEAR_ONE)
    # rows still open after MAX_TAU_PASSES: the last lower bound (a Newton step). From here
    # on the tiles' threshold (`_threshold_in_z`), which the statistics store too.
    b_tau = _threshold_in_z(tl.where(m_done, b_tau, b_lo), inv_am1, ALPHA_KIND)
    return b_tau, n_listed


@triton.jit
def _bracket_search(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_shift,
                    b_sink, is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows,
                    p_flags, p_tiles, n_listed, p_cand, am1, inv_am1, b_lo, b_hi, m_done,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr):
    """The threshold of a head above alpha 2 in z units relative to b_shift, inside the
    bracket [lo, hi] (f(lo) >= 0 > f(hi)): (tau, lo, hi). There e = 1/(alpha - 1) < 1 and
    f(t) = sum (am1 [u - t]_+)^e - 1 is concave between the points where a score enters the
    support, where its slope is infinite: a Newton step bounds tau from neither side (the
    capture and the subset bound of `_find_threshold` rest on such bounds). Each pass over
    the flagged tiles evaluates f at two points, the root of the model C (m - s)^e - 1
    fitted at the last pass's point nearer its root (`_model_root`), clipped into the
    bracket, and the bracket's middle; only the signs of f move the ends, which halves the
    bracket at least once per pass. A row is done at a point where |f| <= TAU_STEP_TOL
    (every term of f moves the same way with t, so no weight is off by more than |f|) or
    when its bracket is down to neighbouring floats; MAX_TAU_PASSES bounds the rest, at
    lo."""
    b_tau = b_lo
    b_guess = b_lo
    n_pass = 0
    while (tl.max(tl.where(m_done, 0, 1), 0) > 0) & (n_pass < MAX_TAU_PASSES_C):
        b_t0 = tl.where(m_done, b_tau, tl.minimum(tl.maximum(b_guess, b_lo), b_hi))
        b_t1 = tl.where(m_done, b_tau, 0.5 * (b_lo + b_hi))
        b_a0, b_b0, b_c0, b_n0, b_a1, b_b1, b_c1, b_n1, _ = _threshold_pass(
            b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
            full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_shift, is_causal,
            pos_shift, win_left, win_right, softcap, slope, b_t0, b_t1, b_lo, m_rows, p_flags,
            p_tiles, n_listed, inv_am1, p_cand, True, False, 0, BLOCK_M, BLOCK_N, BLOCK_E,
            BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_ABOVE_TWO, False)
        if (SCORE_SINK_C & OPTIONS) != 0:
            b_sa, b_sb, _, _ = _moments(gap(b_sink[:, None], b_t0, inv_am1, ALPHA_ABOVE_TWO),
                                        inv_am1, ALPHA_ABOVE_TWO, False)
            b_a0 += b_sa
            b_b0 += b_sb
            b_sa, b_sb, _, _ = _moments(gap(b_sink[:, None], b_t1, inv_am1, ALPHA_ABOVE_TWO),
                                        inv_am1, ALPHA_ABOVE_TWO, False)
            b_a1 += b_sa
            b_b1 += b_sb
        b_f0 = b_a0 - 1.0
        b_f1 = b_a1 - 1.0
        b_lo = tl.maximum(b_lo, tl.maximum(tl.where(b_f0 >= 0, b_t0, b_lo),
                                           tl.where(b_f1 >= 0, b_t1, b_lo)))
        b_hi = tl.minimum(b_hi, tl.minimum(tl.where(b_f0 < 0, b_t0, b_hi),
                                           tl.where(b_f1 < 0, b_t1, b_hi)))
        m_at0 = tl.abs(b_f0) <= TAU_STEP_TOL_C
        m_at1 = tl.abs(b_f1) <= TAU_STEP_TOL_C
        b_mid = 0.5 * (b_lo + b_hi)
        m_new = (m_at0 | m_at1 | (b_mid <= b_lo) | (b_mid >= b_hi)) & ~m_done
        b_tau = tl.where(m_new, tl.where(m_at0, b_t0, tl.where(m_at1, b_t1, b_lo)), b_tau)
        m_done = m_done | m_new
        # the model's step (`_model_root`, u units) in z units
        m_near0 = tl.abs(b_f0) <= tl.abs(b_f1)
        b_t = tl.where(m_near0, b_t0, b_t1)
        b_a = tl.where(m_near0, b_a0, b_a1)
        b_b = tl.where(m_near0, b_b0, b_b1)
        b_guess = b_t + (_model_root(b_t, b_a, b_b, am1, ALPHA_GENERAL) - b_t) * inv_am1
        n_pass += 1
    return tl.where(m_done, b_tau, b_lo), b_lo, b_hi


@triton.jit
def _above_two_threshold(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                         kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz,
                         sink, is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows,
                         p_flags, p_tiles, p_cand, am1, inv_am1, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                         MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr):
    """`_find_threshold` for a head with alpha > 2: (shift, tau, listed tiles), the weights
    p = (am1 [z - shift - tau]_+)^e. The first search (`_bracket_search`) finds tau in z
    units relative to the row maximum, [max - 1/(alpha - 1), max) (the max pass's flags
    hold for every alpha > 1), to about an ulp of the scores; the second searches again
    relative to the shift m + tau (rounded), where the scores next to the threshold are
    differences near 0 that the kernels form exactly (`shifted_scores`' fused
    multiply-add), so that a weight (am1 d)^e whose d is far below an ulp of the scores is
    still right (attention_common, "A per-head alpha")."""
    tl.debug_barrier()
    n_listed = listed_tiles(p_flags, 1, full_begin // BLOCK_N, n_full // BLOCK_N, p_tiles)
    tl.debug_barrier()
    m_done = ~m_rows
    b_tau, b_lo, b_hi = _bracket_search(
        b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
        full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz, sink - b_mz, is_causal,
        pos_shift, win_left, win_right, softcap, slope, m_rows, p_flags, p_tiles, n_listed,
        p_cand, am1, inv_am1, tl.zeros([BLOCK_M], dtype=tl.float32) - inv_am1,
        tl.zeros([BLOCK_M], dtype=tl.float32), m_done, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC,
        MASK_KIND, OPTIONS)
    b_shift = tl.where(m_rows, b_mz + b_tau, b_mz)
    # the bracket relative to the new shift, widened by the rounding of the shift and of
    # the offset (a few ulps of the larger of max and tau)
    b_off = b_shift - b_mz
    b_slack = (tl.abs(b_mz) + tl.abs(b_tau)) * 4.8e-7
    b_tau, _, _ = _bracket_search(
        b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
        full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_shift, sink - b_shift,
        is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows, p_flags, p_tiles,
        n_listed, p_cand, am1, inv_am1, b_lo - b_off - b_slack, b_hi - b_off + b_slack, m_done,
        BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS)
    return b_shift, tl.where(m_rows, b_tau, 0.0), n_listed


@triton.jit
def _output_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq,
                 stride_mk, o_m, start_n, q_len, k_len, head_e, head_ev, scale, inv_am1,
                 b_mz, b_tau, m_rows, is_causal, pos_shift, win_left, win_right, softcap, slope,
                 p_flags, seed, pid_bh, seqlen_q, seqlen_k,
                 dropout_p, b_sum, b_ssum, b_plogp, b_acc, b_dacc,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, MASK_KIND: tl.constexpr,
                 OPTIONS: tl.constexpr,
                 ALPHA_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 NEED_GRAD: tl.constexpr, BOUNDARY: tl.constexpr, NEAR_ONE: tl.constexpr):
    """Adds one key tile to the output sums and, when gradients are needed, rewrites its
    flag to "holds a non-zero weight". The tiles the last threshold pass kept hold weight
    almost always: the products run unconditionally, which keeps the loop pipelined."""
    b_u = _score_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                      start_n, q_len, k_len, head_e, scale, b_mz, is_causal, pos_shift, win_left,
                      win_right, softcap, slope,
                      BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, OPTIONS, BOUNDARY)
    b_g = gap(b_u, b_tau, inv_am1, ALPHA_KIND)  # [BM, BN]
    if NEED_GRAD >= GRAD_INPUTS:
        b_p, b_s = weights_and_sensitivity(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
    else:
        b_p = weights(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
    b_prow = tl.sum(b_p, 1)
    b_sum += b_prow
    if NEED_GRAD >= GRAD_INPUTS:
        # for the backward alone; a forward without gradients leaves the threshold passes'
        # flags, which also cover every tile with weight (the reduction over the block's
        # warps is 3.5 % of that forward: H100, bf16, L 4096, commit 7035a19)
        b_alive = tl.max(tl.where(m_rows, b_prow, 0.0), 0) > 0
        tl.store(p_flags + start_n // BLOCK_N, b_alive.to(tl.int8))
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_ev = tl.arange(0, BLOCK_EV)
    m_v = o_ev[None, :] < head_ev
    if BOUNDARY:
        m_v = m_v & (o_n[:, None] < k_len)
    b_v = tl.load(p_v + o_n[:, None] * stride_vl + o_ev[None, :], mask=m_v, other=0.0)  # [BN, BEV]
    b_drop = dropout_scale(seed, pid_bh, o_m, o_n, seqlen_q, seqlen_k, dropout_p,
                           BLOCK_M, BLOCK_N, HAS_DROPOUT)
    if HAS_DROPOUT:
        b_acc += dot((b_p * b_drop).to(b_v.dtype), b_v)
    else:
        b_acc += dot(b_p.to(b_v.dtype), b_v)
    if NEED_GRAD >= GRAD_INPUTS:
        b_ssum += tl.sum(b_s, 1)
        if HAS_DROPOUT:
            b_dacc += dot((b_s * b_drop).to(b_v.dtype), b_v)
        else:
            b_dacc += dot(b_s.to(b_v.dtype), b_v)
    if NEED_GRAD >= GRAD_ALPHA:
        b_plogp += _row_plogp(b_g, b_p, inv_am1, ALPHA_KIND, NEAR_ONE)
    return b_sum, b_ssum, b_plogp, b_acc, b_dacc


@triton.jit
def _row_plogp(b_g, b_p, inv_am1, ALPHA_KIND: tl.constexpr, NEAR_ONE: tl.constexpr):
    """Row sums of p log p (unnormalised weights b_p of the `gap` b_g), for the entropy:
    p log p = p * log(base) / (alpha - 1); softmax: p * g (g = log p, 0 where p is)."""
    if ALPHA_KIND == ALPHA_SOFTMAX:
        b_plogp = tl.sum(tl.where(b_p > 0, b_p * b_g, 0.0), 1)
    else:
        b_log2 = log2_base(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
        if ALPHA_KIND == ALPHA_GENERAL:
            b_log2 = tl.where(b_g > -1.0, b_log2, 0.0)
        b_plogp = tl.sum(b_p * b_log2, 1) * (inv_am1 * 0.6931471805599453)
    return b_plogp


@triton.jit
def _sink_sums(b_sink, b_tau, inv_am1, b_sum, b_ssum, b_plogp, OPTIONS: tl.constexpr,
               ALPHA_KIND: tl.constexpr, NEED_GRAD: tl.constexpr, NEAR_ONE: tl.constexpr):
    """The output sums (sum p, sum s, sum p log p) with the sink's entry added when OPTIONS
    has one (b_sink: its logit less the row's maximum, z units): its weight takes part in
    the row's normalisation, its sensitivity in the D-vector's (its value is zero, so it
    adds nothing to p V or s V), its p log p in the entropy."""
    if (SCORE_SINK_C & OPTIONS) != 0:
        b_g = gap(b_sink[:, None], b_tau, inv_am1, ALPHA_KIND)
        if NEED_GRAD >= GRAD_INPUTS:
            b_p, b_s = weights_and_sensitivity(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
            b_ssum += tl.sum(b_s, 1)
        else:
            b_p = weights(b_g, inv_am1, ALPHA_KIND, NEAR_ONE)
        b_sum += tl.sum(b_p, 1)
        if NEED_GRAD >= GRAD_ALPHA:
            b_plogp += _row_plogp(b_g, b_p, inv_am1, ALPHA_KIND, NEAR_ONE)
    return b_sum, b_ssum, b_plogp


@triton.jit
def _output_pass(b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq,
                 stride_mk, o_m, kv_begin, full_begin, n_full, kv_end, n_listed, p_tiles, q_len,
                 k_len, head_e,
                 head_ev, scale, inv_am1, b_mz, b_sink, b_tau, m_rows, is_causal, pos_shift,
                 win_left,
                 win_right, softcap, slope, p_flags, seed, pid_bh,
                 seqlen_q, seqlen_k, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr,
                 MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, ALPHA_KIND: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr,
                 NEED_GRAD: tl.constexpr, NEAR_ONE: tl.constexpr):
    """The output pass (sparse): `_output_tile` over the listed full tiles (p_tiles) and the
    flagged ones that cross a mask's edge, and the sink's entry (`_sink_sums`); (sum p,
    sum s, sum p log p, p V, s V)."""
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_plogp = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_ssum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    b_dacc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    for i in range(n_listed):
        start_n = tl.load(p_tiles + i) * BLOCK_N
        b_sum, b_ssum, b_plogp, b_acc, b_dacc = _output_tile(
            b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq, stride_mk,
            o_m, start_n, q_len, k_len, head_e, head_ev, scale, inv_am1, b_mz, b_tau,
            m_rows, is_causal, pos_shift, win_left, win_right, softcap, slope, p_flags, seed,
            pid_bh, seqlen_q, seqlen_k, dropout_p,
            b_sum, b_ssum, b_plogp, b_acc, b_dacc, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
            BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND, HAS_DROPOUT, NEED_GRAD, False, NEAR_ONE)
    for start_n in range(n_full, kv_end, BLOCK_N):
        if tl.load(p_flags + start_n // BLOCK_N) != 0:
            b_sum, b_ssum, b_plogp, b_acc, b_dacc = _output_tile(
                b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq,
                stride_mk, o_m, start_n, q_len, k_len, head_e, head_ev, scale, inv_am1, b_mz,
                b_tau, m_rows, is_causal, pos_shift, win_left, win_right, softcap, slope, p_flags,
                seed, pid_bh, seqlen_q, seqlen_k, dropout_p,
                b_sum, b_ssum, b_plogp, b_acc, b_dacc, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
                BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND, HAS_DROPOUT, NEED_GRAD, True, NEAR_ONE)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        # the tiles that cross the window's leading edge
        for start_n in range(kv_begin, full_begin, BLOCK_N):
            if tl.load(p_flags + start_n // BLOCK_N) != 0:
                b_sum, b_ssum, b_plogp, b_acc, b_dacc = _output_tile(
                    b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq,
                    stride_mk, o_m, start_n, q_len, k_len, head_e, head_ev, scale, inv_am1, b_mz,
                    b_tau, m_rows, is_causal, pos_shift, win_left, win_right, softcap, slope,
                    p_flags, seed, pid_bh, seqlen_q, seqlen_k, dropout_p,
                    b_sum, b_ssum, b_plogp, b_acc, b_dacc, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV,
                    BLOCK_EC, MASK_KIND, OPTIONS, ALPHA_KIND, HAS_DROPOUT, NEED_GRAD, True,
                    NEAR_ONE)
    b_sum, b_ssum, b_plogp = _sink_sums(b_sink, b_tau, inv_am1, b_sum, b_ssum, b_plogp, OPTIONS,
                                        ALPHA_KIND, NEED_GRAD, NEAR_ONE)
    return b_sum, b_ssum, b_plogp, b_acc, b_dacc


@triton.jit
def entmax_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, dvec_ptr, stats_ptr, flags_ptr, tiles_ptr, cand_ptr, mask_ptr,
    alpha_ptr, seed_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_ol,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_sb, stride_sh, stride_stat,
    n_heads, kv_group, seqlen_q, seqlen_k, n_qblocks, n_kblocks, head_e, head_ev,
    scale, dropout_p, is_causal, window_left, window_right, softcap,
    alibi_ptr, stride_alibi_b, stride_alibi_h, sinks_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
    MASK_KIND: tl.constexpr, OPTIONS: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    NEED_GRAD: tl.constexpr, PHASE: tl.constexpr, CANDIDATES: tl.constexpr,
    HEADS: tl.constexpr = HEADS_ALL_C,
):
    pid_bh = tl.program_id(0)
    pid_m = query_block(tl.program_id(1), n_qblocks)
    i_b, i_h, i_hk, q_start, q_len, k_start, k_len = program_sequence(
        pid_bh, n_heads, kv_group, cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, IS_VARLEN, False)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_ev = tl.arange(0, BLOCK_EV)
    m_m = o_m < q_len

    p_q = q_ptr + i_b * stride_qb + i_h * stride_qh + q_start * stride_ql
    p_k = k_ptr + i_b * stride_kb + i_hk * stride_kh + k_start * stride_kl
    p_v = v_ptr + i_b * stride_vb + i_hk * stride_vh + k_start * stride_vl
    p_mask = mask_ptr + i_b * stride_mb + i_h * stride_mh
    p_flags = flags_ptr + (pid_bh.to(tl.int64) * n_qblocks + pid_m) * n_kblocks
    p_tiles = tiles_ptr + (pid_bh.to(tl.int64) * n_qblocks + pid_m) * n_kblocks
    p_stats = stats_ptr + i_b * stride_sb + i_h * stride_sh + q_start + o_m
    # each row's slots for the scores the threshold passes capture
    p_cand = cand_ptr + (pid_bh.to(tl.int64) * n_qblocks + pid_m) * BLOCK_M * CANDIDATES

    b_q = held_rows(p_q, stride_ql, o_m, q_len, head_e, BLOCK_E, BLOCK_EC, True)  # [BM, BE]
    alpha = tl.load(alpha_ptr + i_h).to(tl.float32)
    am1 = alpha - 1.0
    inv_am1 = 1.0 / am1
    if HEADS == HEADS_IN_RANGE_C:
        if (am1 == 0.0) | (am1 > 1.0):
            return
    if HEADS == HEADS_OUTSIDE_C:
        if (am1 != 0.0) & (am1 <= 1.0):
            return

    kv_end = k_len
    if is_causal != 0:
        kv_end = tl.minimum(k_len, start_m + BLOCK_M)
    pos_shift, win_left, win_right, slope = score_option_values(
        i_b, i_h, q_len, k_len, window_left, window_right, alibi_ptr, stride_alibi_b,
        stride_alibi_h, OPTIONS)
    sink = sink_logit(sinks_ptr, i_h, OPTIONS)
    # the key tiles every pass visits: [kv_begin, kv_end), those in [full_begin, n_full)
    # without masks (`window_key_tiles`; without a window all before kv_end, the full ones
    # first)
    kv_begin = 0
    full_begin = 0
    window_full_end = 0
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        kv_begin, full_begin, window_full_end, kv_end = window_key_tiles(
            start_m, kv_end, full_tiles_end(start_m, k_len, is_causal, BLOCK_N), pos_shift,
            win_left, win_right, BLOCK_M, BLOCK_N)

    if PHASE == PHASE_OUTPUT_C:
        b_m = tl.load(p_stats + STAT_MAX_C * stride_stat, mask=m_m, other=float("-inf"))
    else:
        # pass 1: row max and the tiles the threshold passes need
        b_m, b_ycol = _row_max(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                               stride_mk, o_m, m_m, start_m, q_len, k_len, kv_begin,
                               full_begin, window_full_end, kv_end, head_e,
                               scale, is_causal, pos_shift, win_left, win_right, softcap, slope,
                               sink,
                               p_flags, inv_am1, BLOCK_M, BLOCK_N, BLOCK_E,
                               BLOCK_EC, MASK_KIND, OPTIONS)
    # torch.softmax's rule: a NaN or +inf score makes its row NaN; a row with every key
    # masked gets zeros (with a sink, its row is the sink alone, whose value is zero).
    # Neither has a threshold to find.
    m_bad = (b_m != b_m) | (b_m == float("inf"))
    m_rows = m_m & (b_m > float("-inf")) & (b_m < float("inf"))
    b_mz = tl.where(m_rows, b_m, 0.0)
    # the sink's entry in z units shifted by the row maximum, as the tiles' scores
    b_sink = sink - b_mz

    n_full = full_tiles_end(start_m, k_len, is_causal, BLOCK_N)
    if (SCORE_WINDOW_C & OPTIONS) != 0:
        n_full = window_full_end
    # A head's alpha is one value: the threshold search and the output pass are compiled
    # for heads near alpha = 1 and for the others (`log2_base`), so that the passes' loops
    # of the usual heads hold no near-one log (sm_90, bf16, E 64, alpha >= 1.25: the
    # threshold launch's stack 448 -> 168 bytes, a later pass 14.1 instructions per score).
    # The launch for the heads at alpha 1 or above 2 (HEADS_OUTSIDE, attention_common "A
    # per-head alpha"): softmax has no threshold (0, its weights exp(u)), above 2 the
    # bracketing search.
    near_one = False
    softmax = False
    if ALPHA_KIND == ALPHA_GENERAL:
        if HEADS == HEADS_OUTSIDE_C:
            softmax = am1 == 0.0
        else:
            near_one = inv_am1 > NEAR_ONE_INV_AM1
    if PHASE == PHASE_OUTPUT_C:
        b_tau = tl.load(p_stats + STAT_TAU_C * stride_stat, mask=m_m, other=0.0)
        n_listed = listed_tiles(p_flags, 1, full_begin // BLOCK_N, n_full // BLOCK_N, p_tiles)
    else:
        if HEADS == HEADS_OUTSIDE_C:
            if softmax:
                tl.debug_barrier()
                n_listed = listed_tiles(p_flags, 1, full_begin // BLOCK_N, n_full // BLOCK_N,
                                        p_tiles)
                b_tau = tl.zeros([BLOCK_M], dtype=tl.float32)
            else:
                b_mz, b_tau, n_listed = _above_two_threshold(
                    b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m,
                    kv_begin, full_begin, n_full, q_len, k_len, kv_end, head_e, scale, b_mz, sink,
                    is_causal, pos_shift, win_left, win_right, softcap, slope, m_rows, p_flags,
                    p_tiles, p_cand, am1, inv_am1, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC,
                    MASK_KIND, OPTIONS)
                # its shift is the rounded m + tau: kept where the threshold launch leaves
                # the row maximum, for the output launch
                b_m = tl.where(m_rows, b_mz, b_m)
                b_sink = sink - b_mz
        elif near_one:
            b_tau, n_listed = _find_threshold(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
                full_begin, n_full,
                q_len, k_len, kv_end, head_e, scale, b_mz, b_sink, b_ycol, is_causal, pos_shift,
                win_left,
                win_right, softcap, slope, m_rows, p_flags,
                p_tiles, p_cand, am1, inv_am1, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND,
                OPTIONS,
                ALPHA_KIND, CANDIDATES, True)
        else:
            b_tau, n_listed = _find_threshold(
                b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, kv_begin,
                full_begin, n_full,
                q_len, k_len, kv_end, head_e, scale, b_mz, b_sink, b_ycol, is_causal, pos_shift,
                win_left,
                win_right, softcap, slope, m_rows, p_flags,
                p_tiles, p_cand, am1, inv_am1, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND,
                OPTIONS,
                ALPHA_KIND, CANDIDATES, False)
        if PHASE == PHASE_THRESHOLD_C:
            tl.store(p_stats + STAT_MAX_C * stride_stat, b_m, mask=m_m)
            tl.store(p_stats + STAT_TAU_C * stride_stat, b_tau, mask=m_m)
            return
    tl.debug_barrier()

    # output pass (sparse): the listed tiles; it flags exactly the tiles holding non-zero
    # weight, for the backward
    seed = tl.load(seed_ptr)
    if HEADS == HEADS_OUTSIDE_C:
        if softmax:
            b_sum, b_ssum, b_plogp, b_acc, b_dacc = _output_pass(
                b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq,
                stride_mk, o_m, kv_begin, full_begin, n_full, kv_end, n_listed, p_tiles, q_len,
                k_len, head_e, head_ev, scale, inv_am1, b_mz, b_sink, b_tau, m_rows, is_causal,
                pos_shift, win_left, win_right, softcap, slope, p_flags, seed, pid_bh, seqlen_q,
                seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, MASK_KIND,
                OPTIONS, ALPHA_SOFTMAX, HAS_DROPOUT, NEED_GRAD, False)
        else:
            b_sum, b_ssum, b_plogp, b_acc, b_dacc = _output_pass(
                b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq,
                stride_mk, o_m, kv_begin, full_begin, n_full, kv_end, n_listed, p_tiles, q_len,
                k_len, head_e, head_ev, scale, inv_am1, b_mz, b_sink, b_tau, m_rows, is_causal,
                pos_shift, win_left, win_right, softcap, slope, p_flags, seed, pid_bh, seqlen_q,
                seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, MASK_KIND,
                OPTIONS, ALPHA_ABOVE_TWO, HAS_DROPOUT, NEED_GRAD, False)
    elif near_one:
        b_sum, b_ssum, b_plogp, b_acc, b_dacc = _output_pass(
            b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq, stride_mk,
            o_m, kv_begin, full_begin, n_full, kv_end, n_listed, p_tiles, q_len, k_len, head_e,
            head_ev, scale,
            inv_am1, b_mz, b_sink, b_tau, m_rows, is_causal, pos_shift, win_left, win_right,
            softcap,
            slope, p_flags, seed, pid_bh, seqlen_q,
            seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, MASK_KIND, OPTIONS,
            ALPHA_KIND, HAS_DROPOUT, NEED_GRAD, True)
    else:
        b_sum, b_ssum, b_plogp, b_acc, b_dacc = _output_pass(
            b_q, p_q, stride_ql, p_k, stride_kl, p_v, stride_vl, p_mask, stride_mq, stride_mk,
            o_m, kv_begin, full_begin, n_full, kv_end, n_listed, p_tiles, q_len, k_len, head_e,
            head_ev, scale,
            inv_am1, b_mz, b_sink, b_tau, m_rows, is_causal, pos_shift, win_left, win_right,
            softcap,
            slope, p_flags, seed, pid_bh, seqlen_q,
            seqlen_k, dropout_p, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EV, BLOCK_EC, MASK_KIND, OPTIONS,
            ALPHA_KIND, HAS_DROPOUT, NEED_GRAD, False)

    m_pos = b_sum > 0
    b_sum_safe = tl.where(m_pos, b_sum, 1.0)
    b_out = b_acc / b_sum_safe[:, None]
    b_out = tl.where(m_bad[:, None], float("nan"), b_out)
    p_o = o_ptr + i_b * stride_ob + i_h * stride_oh + q_start * stride_ol
    m_o = m_m[:, None] & (o_ev[None, :] < head_ev)
    tl.store(p_o + o_m[:, None] * stride_ol + o_ev[None, :], b_out.to(o_ptr.dtype.element_ty),
             mask=m_o)

    # the backward recomputes u from the stored shift: NaN on NaN rows keeps them NaN there
    tl.store(p_stats + STAT_MAX_C * stride_stat, tl.where(m_bad, float("nan"), b_mz), mask=m_m)
    tl.store(p_stats + STAT_TAU_C * stride_stat, b_tau, mask=m_m)
    tl.store(p_stats + STAT_SUM_C * stride_stat, b_sum, mask=m_m)
    if NEED_GRAD >= GRAD_ALPHA:
        # entropy of the normalised row: -sum (p/l) log(p/l) = log l - (sum p log p) / l
        b_entropy = tl.where(m_pos, tl.log(b_sum_safe) - b_plogp / b_sum_safe, 0.0)
        tl.store(p_stats + STAT_ENTROPY_C * stride_stat, b_entropy, mask=m_m)
    if NEED_GRAD >= GRAD_INPUTS:
        b_dvec = b_dacc / tl.where(b_ssum > 0, b_ssum, 1.0)[:, None]
        p_dv = dvec_ptr + i_b * stride_ob + i_h * stride_oh + q_start * stride_ol
        tl.store(p_dv + o_m[:, None] * stride_ol + o_ev[None, :], b_dvec, mask=m_o)


def aot_configs():
    """Every forward configuration the launcher can choose."""
    configs = []
    for (dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout,
         options) in config_space():
        block_m, block_n = block_sizes(block_e, dtype_key, dropout)
        # a differentiable alpha is a tensor: the general kind
        grads = (common.GRAD_NONE, common.GRAD_INPUTS) + (
            (common.GRAD_ALPHA,) if alpha_kind == common.ALPHA_GENERAL else ())
        # every call's launches; a launch several calls share (the threshold one) once
        launches = dict.fromkeys(launch for need_grad in grads
                                 for launch in forward_launches(block_e, dtype_key, mask_kind,
                                                                need_grad))
        for launch in launches:
            constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_E": block_e,
                          "BLOCK_EV": block_e, "BLOCK_EC": chunk_width("fwd", block_e, dtype_key),
                          "ALPHA_KIND": alpha_kind, "MASK_KIND": mask_kind, "OPTIONS": options,
                          "IS_VARLEN": int(varlen), "HAS_DROPOUT": int(dropout),
                          "NEED_GRAD": launch.need_grad, "PHASE": launch.phase,
                          "CANDIDATES": candidate_slots(alpha_kind),
                          **mask_specialisation(mask_kind)}
            suffix = config_suffix(dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout,
                               options)
            for heads in head_launches(alpha_kind):
                configs.append({
                    "name": (f"entmax_attn_{launch.kernel}_{suffix}_g{launch.need_grad}"
                             + head_suffix(heads)),
                    "options": launch_options(launch.maxnreg),
                    "fn": entmax_attn_fwd_kernel,
                    "signature": attention_signature(entmax_attn_fwd_kernel, dtype_key,
                                                     mask_kind),
                    "constexprs": dict(constexprs, HEADS=heads),
                    "arch_constexprs": arch_chunks("fwd", block_e, dtype_key),
                    "num_warps": launch.num_warps,
                    "num_stages": launch.num_stages,
                })
    return configs
