"""Fused entmax attention, forward kernel (never materialises Lq x Lk).

One program handles one block of BLOCK_M query rows of one (batch, query head) and makes
three dense passes over the keys, then one sparse pass:

1. row max ``m`` of the scores and the number ``n`` of finite (unmasked) scores;
2. in shifted coordinates ``u = (alpha - 1)(z - m)`` the threshold lies in
   ``[-1, -n^(1-alpha)]`` (MATH.md section 1). Each of two passes evaluates
   ``f(tau) = sum [u - tau]_+^(1/(alpha-1)) - 1`` and its first two derivatives at
   NUM_CANDIDATES points of the current bracket at once. f is convex and decreasing for
   alpha in (1, 2], so Newton steps from the candidates either side of the sign change
   are lower bounds of the root and the secant through them an upper bound: the bracket
   shrinks by NUM_CANDIDATES and then quadratically. After the second pass a Halley step
   from the last candidate with f >= 0 gives tau (bench/bench_attention_passes.py
   measures the error this leaves: <= 5e-7 for alpha in [1.1, 2], n up to 8k). Tiles
   whose scores all lie below the bracket contribute nothing and skip the evaluation;
3. the second candidate pass also records, per (query block, key block) tile, whether any
   score lies above the bracket's lower end (a lower bound of tau): only those tiles can
   hold non-zero weight;
4. the output pass visits only flagged tiles and divides by the row sum of the weights,
   so every output row is an exact convex combination whatever tau's residual error.

Row statistics (score max, tau, weight sum, entropy) are stored for the backward, and,
when gradients are needed, the D-vector ``sum_j s_j v_j / sum_j s_j`` with
``s_j = p_j^(2 - alpha)`` (MATH.md section 3).
"""
import itertools

import triton
import triton.language as tl

# ALPHA_KIND: specialisations of the power p = d^(1/(alpha-1)).
ALPHA_GENERAL = 0
ALPHA_15 = 1
ALPHA_2 = 2
# MASK_KIND: how attn_mask enters the scores.
MASK_NONE = 0
MASK_BOOL = 1
MASK_ADDITIVE = 2

NUM_CANDIDATES = 16
# Row statistics stored per query row, stacked along the first dimension of `stats`.
STAT_MAX, STAT_TAU, STAT_SUM, STAT_ENTROPY = 0, 1, 2, 3
NUM_STATS = 4
STAT_MAX_C = tl.constexpr(STAT_MAX)
STAT_TAU_C = tl.constexpr(STAT_TAU)
STAT_SUM_C = tl.constexpr(STAT_SUM)
STAT_ENTROPY_C = tl.constexpr(STAT_ENTROPY)


# Register limit handed to ptxas (Triton's maxnreg, PTX .maxnreg) by the launchers and the
# AOT check. Without it ptxas caps some 8-warp configurations at 128 registers (room for two
# CTAs per SM) and spills the rest to the stack even though 255 fit (KERNELS.md section 2).
MAX_REGISTERS = 255


def block_sizes(block_e, dtype_key, dropout=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a padded head dimension and dtype.

    Shared by forward and backward: the tile flags written by the forward are read by the
    backward, so both must tile the same way. Chosen by compiling for sm_80/sm_90 and
    reading the stack frame (cuobjdump): fp32 operands go through three TF32 products and
    need smaller tiles than fp16/bf16, dropout's Philox state halves BLOCK_M, and at
    E = 256 the [BLOCK_M, E] operands leave room only for BLOCK_N = 16. Where even these
    tiles spill, the products run over head-dim chunks (`chunk_width`).
    """
    if dtype_key == "fp32":
        block_m, block_n = (32, 16) if block_e <= 32 else (16, 16)
    elif block_e <= 32:
        block_m, block_n = 64, 32
    elif block_e <= 128:
        block_m, block_n = 32, 32
    else:
        block_m, block_n = 16, 16
    if dropout:
        block_m = max(16, block_m // 2)
    # the pipelined key loads of a second stage cost the fp32 E = 128 forward its last
    # registers
    num_stages = 2 if block_e <= 64 or (block_e == 128 and dtype_key != "fp32") else 1
    return block_m, block_n, 8, num_stages


# Head-dim chunk (BLOCK_EC) of the q.k and dO.v products, per (kernel, dtype) and padded
# head dim; head dims not listed are not chunked. Chosen by compiling every configuration
# for sm_80/sm_90 (triton_kernels/aot.py): chunk only where the whole head dim leaves a
# stack frame, and no finer than needed, since each chunk reloads its operands from cache.
_CHUNKS = {
    ("fwd", "fp32"): {256: 32},
    ("dq", "fp32"): {32: 16, 64: 32, 128: 32, 256: 32},
    ("dq", "fp16"): {128: 64, 256: 64},
    ("dq", "bf16"): {128: 64, 256: 64},
    ("dkdv", "fp32"): {64: 32, 128: 32, 256: 32},
}


def chunk_width(kernel, block_e, dtype_key):
    """BLOCK_EC of `kernel` ("fwd", "dq" or "dkdv"): block_e itself when not chunked."""
    return _CHUNKS.get((kernel, dtype_key), {}).get(block_e, block_e)


@triton.jit
def _sequence_bounds(cu_q_ptr, cu_k_ptr, i_b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q_start, q_len, k_start, k_len) of batch entry i_b: from the varlen offsets, or the
    whole padded sequence."""
    if IS_VARLEN:
        q_start = tl.load(cu_q_ptr + i_b).to(tl.int64)
        q_len = tl.load(cu_q_ptr + i_b + 1).to(tl.int32) - q_start.to(tl.int32)
        k_start = tl.load(cu_k_ptr + i_b).to(tl.int64)
        k_len = tl.load(cu_k_ptr + i_b + 1).to(tl.int32) - k_start.to(tl.int32)
    else:
        q_start = i_b * 0
        q_len = seqlen_q
        k_start = i_b * 0
        k_len = seqlen_k
    return q_start, q_len, k_start, k_len


@triton.jit
def _load_rows(p_base, stride, o_rows, n_rows, width, BLOCK_E: tl.constexpr):
    """Rows o_rows (< n_rows) of a row-major [*, width] matrix, zero-padded to [., BLOCK_E]."""
    o_e = tl.arange(0, BLOCK_E)
    return tl.load(p_base + o_rows[:, None] * stride + o_e[None, :],
                   mask=(o_rows[:, None] < n_rows) & (o_e[None, :] < width), other=0.0)


@triton.jit
def _held_rows(p_base, stride, o_rows, n_rows, width, BLOCK_E: tl.constexpr,
               BLOCK_EC: tl.constexpr):
    """`_load_rows` for an operand of `_dot_rows`; nothing (0) when the head dim is
    processed in chunks (BLOCK_EC < BLOCK_E), where `_dot_rows` reloads it chunk by chunk."""
    if BLOCK_EC >= BLOCK_E:
        b_rows = _load_rows(p_base, stride, o_rows, n_rows, width, BLOCK_E)
    else:
        b_rows = 0.0
    return b_rows


@triton.jit
def _held_cols(p_base, stride, o_rows, n_rows, width, BLOCK_E: tl.constexpr,
               BLOCK_EC: tl.constexpr):
    """The transpose [BLOCK_E, len(o_rows)] of `_held_rows`, loaded as such: the right-hand
    operand of `_dot_rows` (a transpose in registers would cost a layout conversion)."""
    if BLOCK_EC >= BLOCK_E:
        o_e = tl.arange(0, BLOCK_E)
        b_cols = tl.load(p_base + o_rows[None, :] * stride + o_e[:, None],
                         mask=(o_rows[None, :] < n_rows) & (o_e[:, None] < width), other=0.0)
    else:
        b_cols = 0.0
    return b_cols


@triton.jit
def _dot_rows(b_a, b_bt, p_a, stride_a, o_a, n_a, p_b, stride_b, o_b, n_b, width,
              BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr):
    """a_i . b_j over the first `width` columns, for rows o_a of A and rows o_b of B (both
    row-major with unit column stride): [len(o_a), len(o_b)] fp32.

    Whole head dim (BLOCK_EC >= BLOCK_E): from the held blocks b_a [., BE] (`_held_rows`)
    and b_bt [BE, .] (`_held_cols`). Chunked: both operands are reloaded BLOCK_EC columns at
    a time (from cache). A tensor-core operand A is replicated across the warps that share its rows, so a
    [16, 256] fp32 block alone fills 128 registers per thread (more with tf32x3's split):
    chunks keep the wide-head kernels within 255 registers without spilling.
    """
    if BLOCK_EC >= BLOCK_E:
        b_c = _dot(b_a, b_bt)
    else:
        b_c = tl.zeros([o_a.shape[0], o_b.shape[0]], dtype=tl.float32)
        for e0 in tl.range(0, width, BLOCK_EC, loop_unroll_factor=1):
            o_e = e0 + tl.arange(0, BLOCK_EC)
            m_e = o_e < width
            b_ac = tl.load(p_a + o_a[:, None] * stride_a + o_e[None, :],
                           mask=(o_a[:, None] < n_a) & m_e[None, :], other=0.0)
            b_bc = tl.load(p_b + o_b[None, :] * stride_b + o_e[:, None],
                           mask=(o_b[None, :] < n_b) & m_e[:, None], other=0.0)
            b_c += _dot(b_ac, b_bc)
    return b_c


@triton.jit
def _score_tile(b_q, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base, stride_mq,
                stride_mk, o_m, start_n, q_len, k_len, head_e, scale, is_causal,
                BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                MASK_KIND: tl.constexpr):
    """Scores z = scale * q k^T (+ mask) of one tile, -inf where masked. [BM, BN] fp32.
    b_q: the held query block (`_held_rows`)."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    b_kt = _held_cols(p_k_base, stride_kl, o_n, k_len, head_e, BLOCK_E, BLOCK_EC)
    return _scores(b_q, b_kt, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base, stride_mq,
                   stride_mk, o_m, start_n, q_len, k_len, head_e, scale, is_causal, BLOCK_N,
                   BLOCK_E, BLOCK_EC, MASK_KIND)


@triton.jit
def _scores(b_q, b_kt, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base, stride_mq,
            stride_mk, o_m, start_n, q_len, k_len, head_e, scale, is_causal,
            BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
            MASK_KIND: tl.constexpr):
    """`_score_tile` from the held blocks b_q (`_held_rows`) and b_kt (`_held_cols`), or from
    chunks reloaded by `_dot_rows`; -inf outside the sequences and where masked."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    b_z = _dot_rows(b_q, b_kt, p_q_base, stride_ql, o_m, q_len, p_k_base, stride_kl, o_n,
                    k_len, head_e, BLOCK_E, BLOCK_EC) * scale
    m_valid = (o_n[None, :] < k_len) & (o_m[:, None] < q_len)
    # top-left aligned causal mask: query i sees keys j <= i
    # (without is_causal the limit lies past every key; integer arithmetic because the
    # interpreter cannot load under a mask built from a scalar boolean)
    m_valid = m_valid & (o_n[None, :] <= (o_m + (1 - is_causal) * k_len)[:, None])
    if MASK_KIND == 1:
        b_keep = tl.load(p_mask_base + o_m[:, None] * stride_mq + o_n[None, :] * stride_mk,
                         mask=m_valid, other=0)
        m_valid = m_valid & (b_keep != 0)
    if MASK_KIND == 2:
        b_add = tl.load(p_mask_base + o_m[:, None] * stride_mq + o_n[None, :] * stride_mk,
                        mask=m_valid, other=0.0).to(tl.float32)
        b_z = b_z + b_add
    return tl.where(m_valid, b_z, float("-inf"))


@triton.jit
def _dot(b_a, b_b):
    """Tensor-core matmul with fp32 accumulation; fp32 operands use three TF32 products
    (about fp32 accuracy) instead of the register-hungry FMA path of "ieee"."""
    if b_a.dtype == tl.float32:
        b_c = tl.dot(b_a, b_b, input_precision="tf32x3")
    else:
        b_c = tl.dot(b_a, b_b)
    return b_c


@triton.jit
def _safe_log2(b_d):
    """log2 of d > 0; entries d <= 0 are discarded by the caller, log2(1) keeps them finite."""
    return tl.log2(tl.where(b_d > 0, b_d, 1.0))


@triton.jit
def _weights(b_d, inv_am1, ALPHA_KIND: tl.constexpr):
    """p = d^(1/(alpha-1)) for d >= 0."""
    if ALPHA_KIND == 2:
        b_p = b_d
    elif ALPHA_KIND == 1:
        b_p = b_d * b_d
    else:
        b_p = tl.where(b_d > 0, tl.exp2(inv_am1 * _safe_log2(b_d)), 0.0)
    return b_p


@triton.jit
def _sensitivity(b_d, inv_am1, ALPHA_KIND: tl.constexpr):
    """dp/dz = d^(1/(alpha-1) - 1), i.e. p^(2-alpha) before row normalisation."""
    if ALPHA_KIND == 2:
        b_s = tl.where(b_d > 0, 1.0, 0.0)
    elif ALPHA_KIND == 1:
        b_s = b_d
    else:
        b_s = tl.where(b_d > 0, tl.exp2((inv_am1 - 1.0) * _safe_log2(b_d)), 0.0)
    return b_s


@triton.jit
def _dropout_scale(seed, pid_bh, o_m, o_n, seqlen_q, seqlen_k, dropout_p,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """Per-weight factor 0 (dropped) or 1/(1-p) (kept); 1 without dropout. [BM, BN]

    The Philox offset is the weight's global index, so the backward regenerates the mask.
    A compile-time switch: Philox's state costs registers that kernels without dropout
    should not pay for.
    """
    b_drop = tl.full([BLOCK_M, BLOCK_N], 1.0, dtype=tl.float32)
    if HAS_DROPOUT:
        o_rand = (pid_bh.to(tl.int64) * seqlen_q + o_m[:, None]) * seqlen_k + o_n[None, :]
        b_drop = tl.where(tl.rand(seed, o_rand) >= dropout_p, 1.0 / (1.0 - dropout_p), 0.0)
    return b_drop


@triton.jit
def _candidate_pass(b_q, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base, stride_mq,
                    stride_mk, o_m, q_len, k_len, kv_end, head_e, scale, is_causal,
                    b_m, am1, inv_am1, b_lo, b_hi, b_fhi, b_fphi, b_has_fhi,
                    p_flags, record_flags, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EC: tl.constexpr,
                    MASK_KIND: tl.constexpr, ALPHA_KIND: tl.constexpr, NUM_CAND: tl.constexpr):
    """One dense pass evaluating f, f', f'' at NUM_CAND points of [lo, hi) per row.

    Returns the new bracket (lo, hi, f(hi), f'(hi), whether they are known) and the
    Halley estimate of tau. With record_flags, writes one int8 per key block: does any score of
    the tile lie above lo (a lower bound of tau)?
    """
    o_c = tl.arange(0, NUM_CAND)
    b_step = (b_hi - b_lo) / NUM_CAND  # [BM]
    b_f0 = tl.zeros([BLOCK_M, NUM_CAND], dtype=tl.float32)   # sum d^e
    b_f1 = tl.zeros([BLOCK_M, NUM_CAND], dtype=tl.float32)   # sum d^(e-1)
    b_f2 = tl.zeros([BLOCK_M, NUM_CAND], dtype=tl.float32)   # sum d^(e-2)
    for start_n in range(0, kv_end, BLOCK_N):
        b_z = _score_tile(b_q, p_q_base, stride_ql, p_k_base, stride_kl, p_mask_base,
                          stride_mq, stride_mk, o_m, start_n, q_len, k_len, head_e, scale,
                          is_causal, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND)
        b_u = am1 * (b_z - b_m[:, None])  # [BM, BN], -inf where masked
        b_above = tl.max(tl.max(b_u - b_lo[:, None], 1), 0)
        if record_flags != 0:
            tl.store(p_flags + start_n // BLOCK_N, (b_above > 0).to(tl.int8))
        # tiles with every score below lo contribute nothing to f at any candidate
        if b_above > 0:
            # not unrolled: unrolled candidates get interleaved by the scheduler and spill
            for c in tl.range(0, NUM_CAND, loop_unroll_factor=1):
                b_t = b_lo + c * b_step
                b_d = tl.maximum(b_u - b_t[:, None], 0.0)
                if ALPHA_KIND == 2:
                    b_p0 = b_d
                    b_p1 = tl.where(b_d > 0, 1.0, 0.0)
                    b_p2 = tl.zeros_like(b_d)
                elif ALPHA_KIND == 1:
                    b_p0 = b_d * b_d
                    b_p1 = b_d
                    b_p2 = tl.where(b_d > 0, 1.0, 0.0)
                else:
                    b_p2 = tl.where(b_d > 0, tl.exp2((inv_am1 - 2.0) * _safe_log2(b_d)), 0.0)
                    b_p1 = b_p2 * b_d
                    b_p0 = b_p1 * b_d
                m_c = o_c[None, :] == c
                b_f0 += tl.where(m_c, tl.sum(b_p0, 1)[:, None], 0.0)
                b_f1 += tl.where(m_c, tl.sum(b_p1, 1)[:, None], 0.0)
                b_f2 += tl.where(m_c, tl.sum(b_p2, 1)[:, None], 0.0)
    b_f = b_f0 - 1.0
    b_fp = -inv_am1 * b_f1
    b_fpp = inv_am1 * (inv_am1 - 1.0) * b_f2
    # last candidate with f >= 0 (candidate 0 is lo, where f >= 0 up to rounding)
    b_il = tl.max(tl.where(b_f >= 0, o_c[None, :], 0), 1)  # [BM]
    m_l = o_c[None, :] == b_il[:, None]
    m_r = o_c[None, :] == (b_il + 1)[:, None]
    b_left = b_lo + b_il * b_step
    b_fl = tl.sum(tl.where(m_l, b_f, 0.0), 1)
    b_fpl = tl.sum(tl.where(m_l, b_fp, 0.0), 1)
    b_fppl = tl.sum(tl.where(m_l, b_fpp, 0.0), 1)
    m_has_r = (b_il + 1) < NUM_CAND
    b_right = tl.where(m_has_r, b_left + b_step, b_hi)
    b_fr = tl.where(m_has_r, tl.sum(tl.where(m_r, b_f, 0.0), 1), b_fhi)
    b_fpr = tl.where(m_has_r, tl.sum(tl.where(m_r, b_fp, 0.0), 1), b_fphi)
    m_has_fr = m_has_r | (b_has_fhi != 0)
    # convexity: Newton steps from either end land left of the root, the secant right of
    # it; for piecewise-linear f (alpha = 2) one of the two Newton steps is exact when at
    # most one score lies between the ends
    m_newton = b_fpl < 0
    b_newton = tl.where(m_newton, b_left - b_fl / tl.where(m_newton, b_fpl, -1.0), b_left)
    m_newton_r = m_has_fr & (b_fpr < 0) & (b_fr <= 0)
    b_newton_r = tl.where(m_newton_r, b_right - b_fr / tl.where(m_newton_r, b_fpr, -1.0),
                          b_left)
    b_new_lo = tl.maximum(b_left, tl.minimum(tl.maximum(b_newton, b_newton_r), b_right))
    m_secant = m_has_fr & (b_fl - b_fr > 0)
    b_secant = tl.where(m_secant, b_left + b_fl * (b_right - b_left) /
                        tl.where(m_secant, b_fl - b_fr, 1.0), b_right)
    m_secant_inside = m_secant & (b_secant < b_right)
    b_new_hi = tl.minimum(b_right, tl.maximum(b_secant, b_new_lo))
    b_new_has_fhi = tl.where(m_secant_inside, 0, m_has_fr.to(tl.int32))
    b_den = 2.0 * b_fpl * b_fpl - b_fl * b_fppl
    m_halley = m_newton & (b_den > 0)
    b_halley = b_left - 2.0 * b_fl * b_fpl / tl.where(m_halley, b_den, 1.0)
    b_tau = tl.where(m_halley & (b_halley == b_halley),
                     tl.minimum(tl.maximum(b_halley, b_new_lo), b_new_hi), b_new_lo)
    return b_new_lo, b_new_hi, b_fr, b_fpr, b_new_has_fhi, b_tau


@triton.jit
def entmax_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, dvec_ptr, stats_ptr, flags_ptr, mask_ptr, alpha_ptr,
    seed_ptr, cu_q_ptr, cu_k_ptr,
    stride_qb, stride_qh, stride_ql,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_ob, stride_oh, stride_ol,
    stride_mb, stride_mh, stride_mq, stride_mk,
    stride_sb, stride_sh, stride_stat,
    n_heads, kv_group, seqlen_q, seqlen_k, n_qblocks, n_kblocks, head_e, head_ev,
    scale, dropout_p, is_causal, need_grad,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_EV: tl.constexpr, BLOCK_EC: tl.constexpr, ALPHA_KIND: tl.constexpr,
    MASK_KIND: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    NUM_CAND: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    i_b = (pid_bh // n_heads).to(tl.int64)
    i_h = (pid_bh % n_heads).to(tl.int64)
    i_hk = i_h // kv_group
    q_start, q_len, k_start, k_len = _sequence_bounds(cu_q_ptr, cu_k_ptr, i_b, seqlen_q, seqlen_k, IS_VARLEN)
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

    b_q = _held_rows(p_q, stride_ql, o_m, q_len, head_e, BLOCK_E, BLOCK_EC)  # [BM, BE]
    alpha = tl.load(alpha_ptr + i_h).to(tl.float32)
    am1 = alpha - 1.0
    inv_am1 = 1.0 / am1

    kv_end = k_len
    if is_causal != 0:
        kv_end = tl.minimum(k_len, start_m + BLOCK_M)

    # pass 1: row max and count of finite scores
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_n = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, kv_end, BLOCK_N):
        b_z = _score_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk,
                          o_m, start_n, q_len, k_len, head_e, scale, is_causal, BLOCK_N,
                          BLOCK_E, BLOCK_EC, MASK_KIND)
        b_m = tl.maximum(b_m, tl.max(b_z, 1))
        b_n += tl.sum(tl.where(b_z > float("-inf"), 1.0, 0.0), 1)
    # a fully masked row keeps every u at -inf, so its weights come out as exact zeros
    b_m = tl.where(b_m > float("-inf"), b_m, 0.0)

    # passes 2 and 3: tau by bracketed multi-point Newton/secant, Halley at the end
    b_lo = tl.full([BLOCK_M], -1.0, dtype=tl.float32)
    b_hi = -tl.exp2((1.0 - alpha) * tl.log2(tl.maximum(b_n, 1.0)))
    b_fhi = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_fphi = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_has_fhi = tl.zeros([BLOCK_M], dtype=tl.int32)
    b_lo, b_hi, b_fhi, b_fphi, b_has_fhi, b_tau = _candidate_pass(
        b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, q_len, k_len,
        kv_end, head_e, scale, is_causal, b_m, am1, inv_am1, b_lo, b_hi, b_fhi, b_fphi,
        b_has_fhi, p_flags, 0, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, ALPHA_KIND,
        NUM_CAND)
    b_lo, b_hi, b_fhi, b_fphi, b_has_fhi, b_tau = _candidate_pass(
        b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq, stride_mk, o_m, q_len, k_len,
        kv_end, head_e, scale, is_causal, b_m, am1, inv_am1, b_lo, b_hi, b_fhi, b_fphi,
        b_has_fhi, p_flags, 1, BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND, ALPHA_KIND,
        NUM_CAND)
    # the flags written above are read back by other threads of this program
    tl.debug_barrier()

    # pass 4 (sparse): output over the flagged tiles only
    seed = tl.load(seed_ptr)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_plogp = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_ssum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    b_dacc = tl.zeros([BLOCK_M, BLOCK_EV], dtype=tl.float32)
    for start_n in range(0, kv_end, BLOCK_N):
        if tl.load(p_flags + start_n // BLOCK_N) != 0:
            b_z = _score_tile(b_q, p_q, stride_ql, p_k, stride_kl, p_mask, stride_mq,
                              stride_mk, o_m, start_n, q_len, k_len, head_e, scale,
                              is_causal, BLOCK_N, BLOCK_E, BLOCK_EC, MASK_KIND)
            b_d = tl.maximum(am1 * (b_z - b_m[:, None]) - b_tau[:, None], 0.0)  # [BM, BN]
            b_p = _weights(b_d, inv_am1, ALPHA_KIND)
            b_sum += tl.sum(b_p, 1)
            o_n = start_n + tl.arange(0, BLOCK_N)
            b_vt = tl.load(p_v + o_n[:, None] * stride_vl + o_ev[None, :],
                           mask=(o_n[:, None] < k_len) & (o_ev[None, :] < head_ev),
                           other=0.0)  # [BN, BEV]
            b_drop = _dropout_scale(seed, pid_bh, o_m, o_n, seqlen_q, seqlen_k, dropout_p,
                                    BLOCK_M, BLOCK_N, HAS_DROPOUT)
            b_acc += _dot((b_p * b_drop).to(b_vt.dtype), b_vt)
            if need_grad != 0:
                b_s = _sensitivity(b_d, inv_am1, ALPHA_KIND)
                b_ssum += tl.sum(b_s, 1)
                b_dacc += _dot((b_s * b_drop).to(b_vt.dtype), b_vt)
                # p log p = p * log(d) / (alpha - 1)
                b_plogp += tl.sum(tl.where(b_d > 0, b_p * _safe_log2(b_d), 0.0), 1) * (
                    inv_am1 * 0.6931471805599453)

    m_pos = b_sum > 0
    b_sum_safe = tl.where(m_pos, b_sum, 1.0)
    b_out = b_acc / b_sum_safe[:, None]
    p_o = o_ptr + i_b * stride_ob + i_h * stride_oh + q_start * stride_ol
    m_o = m_m[:, None] & (o_ev[None, :] < head_ev)
    tl.store(p_o + o_m[:, None] * stride_ol + o_ev[None, :], b_out.to(o_ptr.dtype.element_ty),
             mask=m_o)

    p_stats = stats_ptr + i_b * stride_sb + i_h * stride_sh + q_start + o_m
    tl.store(p_stats + STAT_MAX_C * stride_stat, b_m, mask=m_m)
    tl.store(p_stats + STAT_TAU_C * stride_stat, b_tau, mask=m_m)
    tl.store(p_stats + STAT_SUM_C * stride_stat, b_sum, mask=m_m)
    if need_grad != 0:
        # entropy of the normalised row: -sum (p/l) log(p/l) = log l - (sum p log p) / l
        b_entropy = tl.where(m_pos, tl.log(b_sum_safe) - b_plogp / b_sum_safe, 0.0)
        tl.store(p_stats + STAT_ENTROPY_C * stride_stat, b_entropy, mask=m_m)
        b_dvec = b_dacc / tl.where(b_ssum > 0, b_ssum, 1.0)[:, None]
        p_dv = dvec_ptr + i_b * stride_ob + i_h * stride_oh + q_start * stride_ol
        tl.store(p_dv + o_m[:, None] * stride_ol + o_ev[None, :], b_dvec, mask=m_o)


_DTYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}
_BLOCK_ES = (16, 32, 64, 128, 256)


def _mask_type(dtype_key, mask_kind):
    """Additive masks have the query's dtype (SDPA's rule); boolean ones are read as int8."""
    if mask_kind == MASK_ADDITIVE:
        return _DTYPES[dtype_key]
    return "*i8"


def fwd_signature(dtype_key, mask_kind):
    t = _DTYPES[dtype_key]
    mask_t = _mask_type(dtype_key, mask_kind)
    sig = {"q_ptr": t, "k_ptr": t, "v_ptr": t, "o_ptr": t, "dvec_ptr": "*fp32",
           "stats_ptr": "*fp32", "flags_ptr": "*i8", "mask_ptr": mask_t, "alpha_ptr": "*fp32",
           "seed_ptr": "*i64", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32"}
    for name in ("stride_qb", "stride_qh", "stride_ql", "stride_kb", "stride_kh", "stride_kl",
                 "stride_vb", "stride_vh", "stride_vl", "stride_ob", "stride_oh", "stride_ol",
                 "stride_mb", "stride_mh", "stride_mq", "stride_mk",
                 "stride_sb", "stride_sh", "stride_stat",
                 "n_heads", "kv_group", "seqlen_q", "seqlen_k", "n_qblocks", "n_kblocks",
                 "head_e", "head_ev"):
        sig[name] = "i32"
    sig.update({"scale": "fp32", "dropout_p": "fp32", "is_causal": "i32", "need_grad": "i32"})
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_E", "BLOCK_EV", "BLOCK_EC", "ALPHA_KIND",
                 "MASK_KIND", "IS_VARLEN", "HAS_DROPOUT", "NUM_CAND"):
        sig[name] = "constexpr"
    return sig


def _config_space():
    """(dtype, BLOCK_E, ALPHA_KIND, MASK_KIND, varlen, dropout) the launchers can choose;
    the packed varlen form takes no attn_mask."""
    for dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout in itertools.product(
            _DTYPES, _BLOCK_ES, (ALPHA_GENERAL, ALPHA_15, ALPHA_2),
            (MASK_NONE, MASK_BOOL, MASK_ADDITIVE), (False, True), (False, True)):
        if not (varlen and mask_kind != MASK_NONE):
            yield dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout


def config_suffix(dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout):
    return (f"{dtype_key}_e{block_e}_a{alpha_kind}_m{mask_kind}{'_varlen' if varlen else ''}"
            f"{'_dropout' if dropout else ''}")


def aot_configs():
    """Every forward configuration the launcher in attention.py can choose.

    "options" holds the extra triton.compile options the launcher also passes (maxnreg).
    """
    configs = []
    for dtype_key, block_e, alpha_kind, mask_kind, varlen, dropout in _config_space():
        block_m, block_n, num_warps, num_stages = block_sizes(block_e, dtype_key, dropout)
        constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_E": block_e,
                      "BLOCK_EV": block_e, "BLOCK_EC": chunk_width("fwd", block_e, dtype_key),
                      "ALPHA_KIND": alpha_kind, "MASK_KIND": mask_kind,
                      "IS_VARLEN": int(varlen), "HAS_DROPOUT": int(dropout),
                      "NUM_CAND": NUM_CANDIDATES}
        configs.append({
            "name": "entmax_attn_fwd_" + config_suffix(dtype_key, block_e, alpha_kind, mask_kind,
                                                       varlen, dropout),
            "fn": entmax_attn_fwd_kernel,
            "signature": fwd_signature(dtype_key, mask_kind),
            "constexprs": constexprs,
            "num_warps": num_warps,
            "num_stages": num_stages,
            "options": {"maxnreg": MAX_REGISTERS},
        })
    return configs
