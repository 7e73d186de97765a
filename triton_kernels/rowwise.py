"""Row-wise α-entmax kernels, forward and backward, bound by memory traffic.

Every row of ``x`` (R, n) is mapped to ``p = α-entmax(x_row)``, in the threshold form of
``entmax_fast.reference.mappings`` written with ``c = −τ`` (docs/maths.md, "Threshold of
the row-wise mappings"):

    u = x − max(x),  t = α − 1,  v = t·u  (v = u for α = 1),  e = 1/t
    α ≠ 1:  p_i = [c + v_i]_+ ^ e,      α = 1:  p_i = c · exp(u_i)

``c`` is the support's largest ``[·]_+`` base: for a sparse row a small number that fp32
holds to 1e-7 relative. The root lies in ``c ∈ [min(1, n^{−t}), max(1, n^{−t})]``.

Forward (`entmax_rowwise_fwd_kernel`): a program takes ROWS rows. Rows of at most
RESIDENT_MAX_COLS[α kind] entries (32768 for sparsemax and entmax15, 8192 for the other
kinds) are read from memory once and kept in registers while c is found ("resident");
every iteration is a pass over the on-chip row, a few operations per entry. Longer rows
are swept in chunks of BLOCK (one row per program) and every iteration reads the row again
(mostly from L2), summing the chunks' terms entry by entry and reducing them across the
warps once per iteration (`_pass_terms`, `_sum_terms`); a swept general-kind row whose
support fits its slots stores it once and runs the later iterations over the slots
(`candidate_slots`; docs/maths.md, "Candidates of the general kind"). Iterations, from
c = 1 (the top entry alone), or, where 1.25 ≤ α ≤ 2 and the row is swept or holds 32 or
more entries per thread, from the root over a subset of the row, which lies between c*
and 1 (`_subset_start`, `start_subset`; docs/maths.md, "A start from a subset"):

- α = 2 (sparsemax): Michelot's exact support update ``c ← c − (Σ_S d − 1)/|S|`` with
  d = c + u and S = {d > 0}. From c = 1 it decreases monotonically to c*; it is exact and
  stops when no entry of S leaves at the new c (min_S d > step), which certifies that S is
  the support. Per entry and pass: add, max, 2 adds, and the count and min d taken on
  the bit patterns of d_+ (`support.support_bits`).
- α = 1.5 (entmax15): on S the equation Σ_S (d + δ)² = 1 is a quadratic; its root is
  exact when no entry of S leaves (same certificate). Otherwise c moves by a Newton step
  on φ(c) = (Σ d_+²)^{1/2} − 1, which is convex and increasing, so the step never crosses
  c*; it is exact for rows whose support holds equal entries. Per entry and pass: ~9 ops.
- any other α (float, or one per row, α ≤ 0 excluded): Newton on
  φ(c) = (Σ d_+^e)^{1/e} − 1 (the e-norm of the support's bases). φ is increasing for every
  t ≠ 0, convex for 1 < α ≤ 2 (monotone from c = 1 above c*) and concave for α < 1
  (monotone from c = 1 below c*). For α > 2 φ has kinks where entries enter the support,
  with infinite slope: a step is taken on the support without its smallest entry when that
  entry leaves on the way, steps are kept in a bracket, and the bracket falls back to
  bisection when two steps did not halve it. Where every row of a program has
  1.25 ≤ α ≤ 2 its passes are compiled without the rest ("plain": no softmax or dense
  rows, no log1p, no minimum of d; `entmax_rowwise_fwd_kernel`): per entry and pass
  two adds, a log2, a multiply, an exp2, a select, a multiply and two sums (10.4
  instructions on sm_90 resident, 14.1 swept in chunks, against 27.6 before the split).
  Other rows take the general pass (~12 more near α = 1, see below). A launch whose α
  is a python float in that range (`plain_alpha`) is compiled without the other passes
  (ALL_PLAIN): the same instructions run, but registers are no longer held for passes it
  never takes (sm_90, 1024-entry fp32 rows on 2 warps: 111 -> 48, 9 -> 21 programs per SM).
  c is an unevaluated fp32 pair (hi + lo): for α > 2, p = d^e has an infinite slope at
  d = 0 and a plain fp32 c (steps of 6e-8) moves such an entry's p by ~1e-4. Near α = 1
  (|t| < 1/4) e amplifies the rounding of d ≈ 1 instead (α = 1.0001: 6e-4 relative in p),
  so there log d comes from log1p(w), w = d − 1 = (v + (c_hi − 1)) + c_lo formed without
  rounding at 1 (`_log2_base`), and the Newton numerator P − P^(1−t), which cancels as
  t → 0, from series (`_pow_gap`).
  Stops when |Σp − 1| ≤ tol, when the bracket is below the pair's resolution, or after
  max_passes. α = 1 rows (float α = 1 or in a per-row α) are softmax: one pass.

The output pass writes p(c) / Σp(c) (Σp from the last evaluation, 1 after a certified
exact step; a resident general-kind row sums its own output, since its last Newton step
may have been taken without an evaluation: docs/maths.md, "The last step without its
evaluation"), so the output sums to one to rounding.

NaN/inf rule (as torch.softmax): a row holding NaN or +inf gives an all-NaN row, −inf
entries get weight zero, a row with no finite entry gives zeros. Scores are shifted by
the row max before anything else, so large finite scores (1e30 fp32, fp16/bf16 maxima)
are exact.

Backward (`entmax_rowwise_bwd_kernel`, docs/maths.md, "Backward"): resident rows read p and g
once; dα (when asked, "Gradient of alpha") from the same sums, in a regrouped form that
stays accurate as α → 1.

Configurations (rows per program, block, resident or chunked, warps) come from
`tile_config`, a table keyed on the row length and the α kind: the kind decides how long a
row stays resident, since a pass of the closed forms costs a few operations per entry and
one of the general α a log2 and an exp2 more (see its docstring for the measurements, and
for why a table and not triton.autotune). Forward and backward of one row length and kind
run the same configuration.

The launchers (allocation, grid, the α argument) are host code of the Triton backend,
``entmax_fast/backends/triton/rowwise.py``; this module holds what they launch and what
the AOT check (triton_kernels/aot.py) compiles.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .. import common
from .kinds import ALPHA_ENTMAX15, ALPHA_GENERAL, ALPHA_SOFTMAX, ALPHA_SPARSEMAX
from .signature import DTYPE_KEYS, TENSOR, kernel_signature
from .support import count_and_smallest, log2_approx, support_bits

__all__ = [
    "aot_configs",
    "tile_config",
    "candidate_slots",
    "start_subset",
    "entmax_rowwise_fwd_kernel",
    "entmax_rowwise_bwd_kernel",
    "RESIDENT_MAX_COLS",
    "CHUNK_BLOCK",
    "WIDE_CHUNK_COLS",
    "STATS_COLUMNS",
    "STAT_C_HI",
    "STAT_C_LO",
    "STAT_PASSES",
    "STAT_CAPTURED_AT",
]

_LOG2E = tl.constexpr(1.4426950408889634)
# v of the general kind's zero-weight entries (`_scaled`)
_FAR_BELOW = tl.constexpr(-1e30)
# t = α − 1 of the rows the forward's passes call plain: the kernel's per-program test and
# the launcher's compile for a python-float α (`plain_alpha`) read the same bounds.
_PLAIN_T_MIN = tl.constexpr(0.25)
_PLAIN_T_MAX = tl.constexpr(1.0)
# what `_chunk_sums` does with the support at c besides the sums: nothing, count, store
SUPPORT_NONE = tl.constexpr(0)
SUPPORT_COUNT = tl.constexpr(1)
SUPPORT_STORE = tl.constexpr(2)
# 2!, 3!, …, 8!: Horner coefficients of the series Σ_k y^k / (k+2)! used by the backward
_FACT = tl.constexpr((2.0, 6.0, 24.0, 120.0, 720.0, 5040.0, 40320.0))

# Longest row kept in registers, per α kind (`tile_config` gives the reasons and figures).
# 8192 entries over 16 warps are 16 fp32 per thread; at 16384 (32 per thread, the
# 128-register cap of 16 warps) the general-α forward and the dα backward spill (AOT: 160
# and 472 bytes of stack on sm_90). The closed forms stay resident up to 32768 (64 per
# thread) although they spill there (AOT, fp32, sm_90: 296 bytes of stack in the entmax15
# forward, 64 in sparsemax's, 72 and 88 in their backwards; none at 16384): a spill is
# thread-local memory cached in L1, while a chunked row is read again on every pass.
RESIDENT_MAX_COLS = {
    common.ALPHA_SPARSEMAX: 32768,
    common.ALPHA_ENTMAX15: 32768,
    common.ALPHA_SOFTMAX: 8192,
    common.ALPHA_GENERAL: 8192,
}
# Chunk of the swept rows (16 fp32 per thread by 4 warps, 8 by 8): pass 1 keeps four
# accumulators per entry (max, finite count, NaN/+inf count, softmax sum); 4096 by 8 warps
# took 149 registers (AOT).
CHUNK_BLOCK = 2048
# Chunked rows are swept by 4 warps, and the general kind's longer than WIDE_CHUNK_COLS by
# 8, whose passes cost the most per entry (`tile_config`). By 8 warps its forward compiles
# without a stack frame; its fp32 backward leaves 8 bytes (AOT: sm_90 without dα, sm_80
# with it).
WIDE_CHUNK_COLS = 16384
DEFAULT_TOL = 1e-6
DEFAULT_MAX_PASSES = 40
# The forward's record per row (fp32 words): the threshold c as a pair c_hi + c_lo, the
# passes over the row and the pass from which a general-kind row ran over its captured
# support (0: none), the two counts as int32 bit patterns.
STATS_COLUMNS = tl.constexpr(4)
STAT_C_HI = tl.constexpr(0)
STAT_C_LO = tl.constexpr(1)
STAT_PASSES = tl.constexpr(2)
STAT_CAPTURED_AT = tl.constexpr(3)
# The start from a subset (`_subset_start`, `start_subset`): its iterations at most, and
# the general kind's |Σp − 1| over the subset at which it stops (a start needs no more).
SUBSET_STEPS = tl.constexpr(6)
SUBSET_TOL = tl.constexpr(1e-3)
# Resident rows start from a subset from this many entries per thread on, with 8 subset
# values per thread (each the largest of a group of the thread's own entries).
SUBSET_MIN_PER_THREAD = 32


# ----------------------------------------------------------------------------- device helpers

@triton.jit
def _add_to_pair(a_hi, a_lo, b):
    """(a_hi + a_lo) + b as a normalised pair of fp32 (error-free two-sum)."""
    s = a_hi + b
    b_virtual = s - a_hi
    err = (a_hi - (s - b_virtual)) + (b - b_virtual)
    lo = a_lo + err
    hi = s + lo
    return hi, lo - (hi - s)


@triton.jit
def _log1p_small(w):
    """log(1 + w) for |w| ≤ 1/8, without forming 1 + w: Taylor to degree 8 (truncation
    ≤ 8^−8/9 ≈ 7e−9 relative), Horner in fp32 (a few ulp of log1p(w))."""
    b = -1.0 / 8.0
    b = b * w + 1.0 / 7.0
    b = b * w - 1.0 / 6.0
    b = b * w + 1.0 / 5.0
    b = b * w - 1.0 / 4.0
    b = b * w + 1.0 / 3.0
    b = b * w - 1.0 / 2.0
    b = b * w + 1.0
    return b * w


@triton.jit
def _pow_gap(P, t):
    """P − P^(1−t) (> 0 for P > 0, t ≠ 0, P ≠ 1): the numerator of the Newton step on φ.

    Written as −P·expm1(−t·log P) with log1p / expm1 series near P = 1 and t·log P = 0:
    the direct form loses it to cancellation when t is small (α = 1.0001: P − P^(1−t) is
    1e−4·(P − 1), below fp32's resolution of P once |P − 1| < 1e−3), and Newton stalled
    into bisection (25–40 passes). Far from P = 1 log P is the hardware's approximation
    (`log2_approx`): a step there is one of several and the bracket bounds it.  [ROWS]"""
    p_safe = tl.where(P > 0, P, 1.0)
    f = p_safe - 1.0  # exact for P ∈ [1/2, 2]
    log_p = tl.where(tl.abs(f) < 0.125, _log1p_small(f),
                     log2_approx(p_safe) * 0.6931471805599453)
    y = -t * log_p
    # expm1(y): Taylor to degree 7 for |y| < 1/8 (truncation ≤ 8^−7/8! ≈ 1e−11 relative)
    b = 1.0 / 5040.0
    b = b * y + 1.0 / 720.0
    b = b * y + 1.0 / 120.0
    b = b * y + 1.0 / 24.0
    b = b * y + 1.0 / 6.0
    b = b * y + 1.0 / 2.0
    b = b * y + 1.0
    em1 = tl.where(tl.abs(y) < 0.125, b * y, tl.exp2(y * _LOG2E) - 1.0)
    return tl.where(P > 0, -p_safe * em1, P - 1.0)  # P ≤ 0: as the direct form with P^(1−t) := 1


@triton.jit
def _log2_base(b_v, b_d, c_hi, c_lo, near_one):
    """log2 d, accurate on the support; NaN (d < 0) or −inf (d = 0) outside it, which
    callers drop with their select on d > 0 (one select after the exp2 instead of one
    before the log2 as well).  [ROWS, BLOCK]

    p = d^e amplifies d's relative error by e = 1/t: d ≈ 1 carries fp32's rounding of
    c_hi + v (3e−8 relative), so at α = 1.0001 p was off by ~6e−4 relative. When some row
    of the program has |t| < 1/4 (``near_one``, a uniform branch), entries with
    |d − 1| < 1/8 take log2(1 + w) from w = d − 1 = (v + (c_hi − 1)) + c_lo, formed without
    1 + ·: c_hi − 1 is exact (Sterbenz: c_hi ∈ (7/8, 9/8) there), w keeps its relative
    precision, and e·log d is accurate to a few ulp of itself. The other entries keep
    log2(d) (their p ≤ (1 ± 1/8)^e, where e·3e−8·p stays below 2e−7), as do all rows
    with |t| ≥ 1/4 (e ≤ 4: d's rounding gives ≤ 1.2e−7 relative in p)."""
    b_lg = log2_approx(b_d)
    if near_one:
        b_w = (b_v + (c_hi - 1.0)[:, None]) + c_lo[:, None]
        b_lg = tl.where(tl.abs(b_w) < 0.125, _log1p_small(b_w) * _LOG2E, b_lg)
    return b_lg


@triton.jit
def _pow_pos(y, e):
    """[y]_+ ^ e (e > 0)."""
    return tl.where(y > 0, tl.exp2(e * tl.log2(tl.where(y > 0, y, 1.0))), 0.0)


@triton.jit
def _row_alpha(alpha_ptr, rows, m_row, alpha_stride, ALPHA_KIND: tl.constexpr):
    zero = rows.to(tl.float32) * 0.0
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        alpha = zero + 2.0
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        alpha = zero + 1.5
    elif ALPHA_KIND == ALPHA_SOFTMAX:
        alpha = zero + 1.0
    else:
        alpha = tl.load(alpha_ptr + rows * alpha_stride, mask=m_row, other=2.0).to(tl.float32)
    return alpha


@triton.jit
def _scaled(b_x, shift, t, ALPHA_KIND: tl.constexpr, PLAIN: tl.constexpr):
    """v = t·(x − shift) (u itself on α = 1 rows).  [ROWS, BLOCK]

    General kind: entries of weight zero by the −inf rule (x = −inf, or x − shift
    overflowing to −inf) get v = −1e30 whatever t's sign, so that d = c + v is finite and
    negative there: the passes then test the support with d > 0 alone and p = q·d is 0
    off it without a select (0·∞ would be NaN). No entry with v below −1e30 can be in a
    support (c ≤ max(1, n^−t) < 2^31). With t > 0 on every row (PLAIN) that is a single
    maximum, which chunked rows pay on every pass."""
    b_u = b_x - shift[:, None]
    if PLAIN:
        b_v = tl.maximum(t[:, None] * b_u, _FAR_BELOW)
    else:
        b_v = tl.where(t[:, None] == 0.0, b_u, t[:, None] * b_u)
        if ALPHA_KIND == ALPHA_GENERAL:
            b_v = tl.where(b_u > float("-inf"), tl.maximum(b_v, _FAR_BELOW), _FAR_BELOW)
    return b_v


@triton.jit
def _pass_terms(b_v, c_hi, c_lo, t, e, near_one, ALPHA_KIND: tl.constexpr, PLAIN: tl.constexpr):
    """One evaluation at c per entry: the four terms whose row sums (a minimum for the last)
    `_sum_terms` turns into `_pass_sums`'s.  [ROWS, BLOCK] each

    sparsemax, entmax15: d_+, the zero count and min key of `support.support_bits`, and
    d_+² (entmax15; d_+ again for sparsemax); general: p (exp(u) on α = 1 rows),
    d_+^(e−1), p again, and d on the support (+inf off it; not formed when PLAIN)."""
    if (ALPHA_KIND == ALPHA_SPARSEMAX) | (ALPHA_KIND == ALPHA_ENTMAX15):
        b_a = tl.maximum(c_hi[:, None] + b_v, 0.0)
        b_b, b_low = support_bits(b_a)
        if ALPHA_KIND == ALPHA_ENTMAX15:
            b_q2 = b_a * b_a
        else:
            b_q2 = b_a
    else:
        # d = (c_hi + v) + c_lo: for entries near the support's edge c_hi + v is exact
        # (Sterbenz), so d keeps its relative precision down to d ≈ 0.
        b_d = (c_hi[:, None] + b_v) + c_lo[:, None]
        if PLAIN:
            # d is finite (`_scaled`): q = 0 and p = q·d = 0 off the support
            b_b = tl.where(b_d > 0, tl.exp2((e[:, None] - 1.0) * log2_approx(b_d)), 0.0)
            b_a = b_b * b_d
            b_low = b_a
        else:
            b_lg = _log2_base(b_v, b_d, c_hi, c_lo, near_one)
            is_soft = t[:, None] == 0.0
            b_q = tl.exp2(tl.where(is_soft, b_v * _LOG2E, (e[:, None] - 1.0) * b_lg))
            b_b = tl.where(b_d > 0, b_q, 0.0)
            b_a = tl.where(is_soft, b_q, b_b * b_d)
            b_low = tl.where(b_d > 0, b_d, float("inf"))
        b_q2 = b_a
    return b_a, b_b, b_q2, b_low


@triton.jit
def _no_terms(ROWS: tl.constexpr, BLOCK: tl.constexpr, ALPHA_KIND: tl.constexpr):
    """`_pass_terms` of no entry: the start of a sum over chunks."""
    b_zero = tl.zeros([ROWS, BLOCK], tl.float32)
    if (ALPHA_KIND == ALPHA_SPARSEMAX) | (ALPHA_KIND == ALPHA_ENTMAX15):
        b_b = tl.zeros([ROWS, BLOCK], tl.int32)
        b_low = tl.full([ROWS, BLOCK], 0xFFFFFFFF, tl.uint32)
    else:
        b_b = b_zero
        b_low = tl.full([ROWS, BLOCK], float("inf"), tl.float32)
    return b_zero, b_b, b_zero, b_low


@triton.jit
def _sum_terms(b_a, b_b, b_q2, b_low, n, ALPHA_KIND: tl.constexpr, PLAIN: tl.constexpr):
    """(Σa, Σb, Σq2, min d over the support) per row of `_pass_terms` (summed over chunks
    of n entries in all): sparsemax: a = d_+, b = |S|, q2 unused; entmax15: a = d_+,
    b = |S|, q2 = Σd_+²; general: a = Σp, b = Σd_+^(e−1) (φ's slope), q2 unused, the
    minimum +inf when PLAIN; α = 1 rows a = Σexp(u).  [ROWS] each"""
    s_a = tl.sum(b_a, axis=1)
    if (ALPHA_KIND == ALPHA_SPARSEMAX) | (ALPHA_KIND == ALPHA_ENTMAX15):
        s_b, d_min = count_and_smallest(tl.sum(b_b, axis=1), tl.min(b_low, axis=1), n)
        if ALPHA_KIND == ALPHA_ENTMAX15:
            s_q2 = tl.sum(b_q2, axis=1)
        else:
            s_q2 = s_a
    else:
        s_b = tl.sum(b_b, axis=1)
        s_q2 = s_a
        if PLAIN:
            d_min = tl.full(s_a.shape, float("inf"), tl.float32)
        else:
            d_min = tl.min(b_low, axis=1)
    return s_a, s_b, s_q2, d_min


@triton.jit
def _pass_sums(b_v, c_hi, c_lo, t, e, near_one, ALPHA_KIND: tl.constexpr, PLAIN: tl.constexpr):
    """One evaluation at c per row of a resident block: `_sum_terms` of `_pass_terms`."""
    b_a, b_b, b_q2, b_low = _pass_terms(b_v, c_hi, c_lo, t, e, near_one, ALPHA_KIND, PLAIN)
    return _sum_terms(b_a, b_b, b_q2, b_low, b_v.shape[1], ALPHA_KIND, PLAIN)


@triton.jit
def _chunk_sums(p_x, m_row, o_col, n_cols, shift, c_hi, c_lo, t, e, near_one, p_cand,
                ROWS: tl.constexpr, BLOCK: tl.constexpr, ALPHA_KIND: tl.constexpr,
                PLAIN: tl.constexpr, SUPPORT: tl.constexpr = SUPPORT_NONE,
                CANDIDATES: tl.constexpr = 1):
    """One evaluation at c per row swept in chunks from memory: the chunks' terms summed
    entry by entry, reduced across the row's warps once (each reduction crosses the warps
    through shared memory with barriers). `_sum_terms`'s four sums and the size of the
    support at c: counted with SUPPORT_COUNT, and with SUPPORT_STORE the support stored in
    the row's slots as well (`_capture`); zero with SUPPORT_NONE. The support modes are
    for plain general-kind rows.  [ROWS] each"""
    b_a, b_b, b_q2, b_low = _no_terms(ROWS, BLOCK, ALPHA_KIND)
    b_in = tl.zeros([ROWS, BLOCK], tl.int32)
    n_in = tl.zeros([ROWS], tl.int32)
    for start in range(0, n_cols, BLOCK):
        m_tile = m_row[:, None] & (start + o_col[None, :] < n_cols)
        b_x = tl.load(p_x + start, mask=m_tile, other=float("-inf")).to(tl.float32)
        b_v = _scaled(b_x, shift, t, ALPHA_KIND, PLAIN)
        c_a, c_b, c_q2, c_low = _pass_terms(b_v, c_hi, c_lo, t, e, near_one, ALPHA_KIND, PLAIN)
        b_a += c_a
        b_b += c_b
        b_q2 += c_q2
        if not PLAIN:
            b_low = tl.minimum(b_low, c_low)
        if SUPPORT == SUPPORT_STORE:
            n_in = _capture(b_v, c_hi, c_lo, p_cand, n_in, CANDIDATES)
        elif SUPPORT == SUPPORT_COUNT:
            b_in += (((c_hi[:, None] + b_v) + c_lo[:, None]) > 0).to(tl.int32)
    if SUPPORT == SUPPORT_COUNT:
        n_in = tl.sum(b_in, axis=1)
    s_a, s_b, s_q2, d_min = _sum_terms(b_a, b_b, b_q2, b_low, tl.cdiv(n_cols, BLOCK) * BLOCK,
                                       ALPHA_KIND, PLAIN)
    return s_a, s_b, s_q2, d_min, n_in


@triton.jit
def _capture(b_v, c_hi, c_lo, p_cand, n_in, CANDIDATES: tl.constexpr):
    """Stores the entries of the support at c (d > 0) in the row's candidate slots, after
    the n_in already there; returns the new count, which may exceed the slots (the entries
    past them are not stored).  [ROWS]"""
    m_in = ((c_hi[:, None] + b_v) + c_lo[:, None]) > 0
    o_slot = n_in[:, None] + tl.cumsum(m_in.to(tl.int32), axis=1) - 1
    tl.store(p_cand + o_slot, b_v, mask=m_in & (o_slot < CANDIDATES))
    return n_in + tl.sum(m_in.to(tl.int32), axis=1)


@triton.jit
def _load_candidates(p_cand, n_in, CANDIDATES: tl.constexpr):
    """The captured entries, the empty slots at v = −1e30 (`_scaled`'s value of zero
    weight).  [ROWS, CANDIDATES]"""
    # the slots were written by other threads of the program
    tl.debug_barrier()
    o_slot = tl.arange(0, CANDIDATES)
    return tl.load(p_cand + o_slot[None, :], mask=o_slot[None, :] < n_in[:, None], other=_FAR_BELOW)


@triton.jit
def _p_at(b_v, c_hi, c_lo, t, e, near_one, ALPHA_KIND: tl.constexpr, PLAIN: tl.constexpr):
    """p (not normalised) at the row's threshold.  [ROWS, BLOCK]"""
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        b_p = tl.maximum(c_hi[:, None] + b_v, 0.0)
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        b_d = tl.maximum(c_hi[:, None] + b_v, 0.0)
        b_p = b_d * b_d
    elif ALPHA_KIND == ALPHA_SOFTMAX:
        b_p = tl.exp2(b_v * _LOG2E)
    else:
        b_d = (c_hi[:, None] + b_v) + c_lo[:, None]
        if PLAIN:
            b_p = tl.where(b_d > 0, tl.exp2(e[:, None] * log2_approx(b_d)), 0.0)
        else:
            is_soft = t[:, None] == 0.0
            b_lg = _log2_base(b_v, b_d, c_hi, c_lo, near_one)
            b_p = tl.where(is_soft | (b_d > 0),
                           tl.exp2(tl.where(is_soft, b_v * _LOG2E, e[:, None] * b_lg)), 0.0)
    return b_p


@triton.jit
def _chunk_store(p_x, p_p, m_row, o_col, n_cols, shift, c_hi, c_lo, t, e, near_one, inv_norm,
                 BLOCK: tl.constexpr, ALPHA_KIND: tl.constexpr, PLAIN: tl.constexpr):
    """The output pass of a row swept in chunks: p(c)·inv_norm."""
    for start in range(0, n_cols, BLOCK):
        m_tile = m_row[:, None] & (start + o_col[None, :] < n_cols)
        b_x = tl.load(p_x + start, mask=m_tile, other=float("-inf")).to(tl.float32)
        b_p = _p_at(_scaled(b_x, shift, t, ALPHA_KIND, PLAIN), c_hi, c_lo, t, e, near_one,
                    ALPHA_KIND, PLAIN) * inv_norm[:, None]
        tl.store(p_p + start, b_p.to(p_p.dtype.element_ty), mask=m_tile)


@triton.jit
def _exact_step(s_a, s_b, s_q2, d_min, ALPHA_KIND: tl.constexpr):
    """(step to the exact root on the current support, whether it is certified, whether
    it is the last, the monotone step to take otherwise) for sparsemax / entmax15.  [ROWS]"""
    k = tl.maximum(s_b, 1.0)
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        f = s_a - 1.0
        step = -f / k
        fallback = step
    else:
        f = s_q2 - 1.0
        # Σ_S (d + δ)² = 1, the root nearest 0, in the form without cancellation
        disc = tl.maximum(s_a * s_a - k * f, 0.0)
        step = -f / tl.where(s_a > 0, s_a + tl.sqrt(disc), 1.0)
        norm = tl.sqrt(s_q2)
        fallback = -(s_q2 - norm) / tl.where(s_a > 0, s_a, 1.0)
    # No entry of S leaves at c + step, no entry outside enters (steps are ≤ 0 from above).
    # The step's rounding error is ~1e-7·Σp relative, so only a step from Σp ≤ 2 is final;
    # from a flat row's Σp ≫ 1 it is taken and certified again at the next pass.
    exact = d_min + step > 0
    final = exact & (f <= 1.0)
    return step, exact, final, fallback


@triton.jit
def _subset_start(b_vs, done, t, e, near_one, ALPHA_KIND: tl.constexpr):
    """c to start the row's iteration from: the root over a subset of its entries (b_vs,
    each the largest v of a group of the row's entries), found by the row's own iteration
    from c = 1 over the subset alone (docs/maths.md, "A start from a subset"). Σp over a
    subset is at most Σp over the row at every c, so the subset's root, and every iterate
    of the iteration's from above, lies at or above the row's root c*: the row's iteration
    then starts from above, as from c = 1, but close to c* (float64 replica, N(0, 1) rows
    of 4096–32768 entries: 4–5 evaluations over the row → 1 for sparsemax and entmax15,
    2 for α 1.3 and 1.7). Sparsemax, entmax15 and plain general rows (1.25 ≤ α ≤ 2); done
    rows keep c = 1.  [ROWS]"""
    c = tl.full(done.shape, 1.0, tl.float32)
    settled = done
    steps = 0
    while (steps < SUBSET_STEPS) & (tl.sum((~settled).to(tl.int32), axis=0) > 0):
        s_a, s_b, s_q2, d_min = _pass_sums(b_vs, c, c * 0.0, t, e, near_one, ALPHA_KIND, True)
        if ALPHA_KIND == ALPHA_GENERAL:
            # Newton on the subset's convex φ: from above, its iterates stay above
            near = s_a - 1.0 <= SUBSET_TOL
            step = tl.where(near, 0.0, -_pow_gap(s_a, t) / tl.where(s_b > 0, s_b, 1.0))
        else:
            step, exact, final, fallback = _exact_step(s_a, s_b, s_q2, d_min, ALPHA_KIND)
            near = exact
            step = tl.where(exact, step, fallback)
        c = tl.where(settled, c, c + step)
        settled = settled | near
        steps += 1
    # a few ulps up: the subset's exact root, rounded, stays on the side of c*
    return tl.where(done, 1.0, c * (1.0 + 2.0 ** -20))


# ----------------------------------------------------------------------------- forward

@triton.jit
def entmax_rowwise_fwd_kernel(
    x_ptr, p_ptr, stats_ptr, alpha_ptr, cand_ptr,
    n_rows, n_cols, stride_x_row, stride_p_row, alpha_stride, tol, max_passes,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ALPHA_KIND: tl.constexpr, RESIDENT: tl.constexpr,
    CANDIDATES: tl.constexpr = 0, SUBSET: tl.constexpr = 0, ALL_PLAIN: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_row = rows < n_rows
    o_col = tl.arange(0, BLOCK)
    p_x = x_ptr + rows[:, None] * stride_x_row + o_col[None, :]
    p_p = p_ptr + rows[:, None] * stride_p_row + o_col[None, :]
    alpha = _row_alpha(alpha_ptr, rows, m_row, alpha_stride, ALPHA_KIND)
    t = alpha - 1.0
    e = 1.0 / tl.where(t == 0.0, 1.0, t)  # unused on α = 1 rows
    # Uniform flags of the general kind's passes: a row of the program near α = 1 takes the
    # accurate log of d (`_log2_base`), one above α = 2 the minimum of d over the support
    # (the step on the support without its smallest entry). Where every row has
    # 1.25 ≤ α ≤ 2 (``plain``) the passes run without either, and without the selects
    # of softmax rows (α = 1) and dense ones (α < 1): a compile of their own
    # (PLAIN), since a branch inside a pass keeps each entry's predicates across it.
    # ALL_PLAIN: every row of the launch is (one python-float α, `plain_alpha`), and the
    # kernel is compiled without the other passes, whose registers it no longer holds
    # (sm_90, fp32, 1024-entry rows on 2 warps: 111 -> 48; the same instructions run).
    if ALL_PLAIN:
        near_one = False
        need_low = False
        plain = True
    else:
        near_one = tl.min(tl.abs(t), axis=0) < _PLAIN_T_MIN
        need_low = tl.max(t, axis=0) > _PLAIN_T_MAX
        if ALPHA_KIND == ALPHA_GENERAL:
            plain = (tl.min(t, axis=0) >= _PLAIN_T_MIN) & ~need_low
        else:
            plain = False

    # pass 1: max, finite count, NaN/+inf; softmax: the online sum of exp as well.
    if RESIDENT:
        m_tile = m_row[:, None] & (o_col[None, :] < n_cols)
        b_x = tl.load(p_x, mask=m_tile, other=float("-inf")).to(tl.float32)
        x_max = tl.max(b_x, axis=1)
        n_fin = tl.sum((b_x > float("-inf")).to(tl.int32), axis=1)
        n_bad = tl.sum(((b_x != b_x) | (b_x == float("inf"))).to(tl.int32), axis=1)
    else:
        b_max = tl.full([ROWS, BLOCK], float("-inf"), tl.float32)
        b_fin = tl.zeros([ROWS, BLOCK], tl.int32)
        b_bad = tl.zeros([ROWS, BLOCK], tl.int32)
        b_sum = tl.zeros([ROWS, BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            m_tile = m_row[:, None] & (start + o_col[None, :] < n_cols)
            b_x = tl.load(p_x + start, mask=m_tile, other=float("-inf")).to(tl.float32)
            b_new = tl.maximum(b_max, b_x)
            if ALPHA_KIND == ALPHA_SOFTMAX:
                # a lane that has seen only −inf keeps sum 0 (avoids −inf − (−inf)).
                b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
                b_sum = b_sum * tl.exp2((b_max - b_ref) * _LOG2E) + tl.exp2((b_x - b_ref) * _LOG2E)
            b_max = b_new
            b_fin += (b_x > float("-inf")).to(tl.int32)
            b_bad += ((b_x != b_x) | (b_x == float("inf"))).to(tl.int32)
        x_max = tl.max(b_max, axis=1)
        n_fin = tl.sum(b_fin, axis=1)
        n_bad = tl.sum(b_bad, axis=1)
    bad = n_bad > 0
    shift = tl.where((n_fin > 0) & ~bad, x_max, 0.0)
    passes = tl.full((), 1, tl.int32)
    c_hi = tl.full([ROWS], 1.0, tl.float32)
    c_lo = tl.zeros([ROWS], tl.float32)
    norm = tl.full([ROWS], 1.0, tl.float32)  # Σp at the final c
    row_passes = tl.full([ROWS], 1, tl.int32)
    if RESIDENT:
        b_v = _scaled(b_x, shift, t, ALPHA_KIND, False)

    # the pass from which a general-kind row ran over its captured support (0: none)
    captured_at = tl.zeros([ROWS], tl.int32)
    if ALPHA_KIND == ALPHA_SOFTMAX:
        if RESIDENT:
            norm = tl.sum(tl.exp2(b_v * _LOG2E), axis=1)
        else:
            norm = tl.sum(b_sum * tl.exp2((b_max - shift[:, None]) * _LOG2E), axis=1)
    else:
        n_fin_f = tl.maximum(n_fin, 1).to(tl.float32)
        n_pow = tl.exp2(-t * tl.log2(n_fin_f))  # n^{-t}
        lo_hi = tl.minimum(n_pow, 1.0)
        lo_lo = tl.zeros([ROWS], tl.float32)
        hi_hi = tl.maximum(n_pow, 1.0)
        hi_lo = tl.zeros([ROWS], tl.float32)
        width_1 = hi_hi - lo_hi  # bracket widths after the last two passes
        width_2 = width_1 * 2.0
        prev_step = tl.zeros([ROWS], tl.float32)  # a resident row's Newton step of the last pass
        done = (n_fin == 0) | bad | ~m_row
        # Candidates (docs/maths.md, "Candidates of the general kind"): a plain row's Newton
        # iterates fall monotonically to c*, so the support at an iterate above c* holds
        # every later one. A swept row counts its support in every pass; once every row's
        # count fits CANDIDATES slots, the next pass also stores the support there (it can
        # only have shrunk), and the later evaluations run over the slots alone, without
        # reading the row again.
        CAPTURE: tl.constexpr = (ALPHA_KIND == ALPHA_GENERAL) & (CANDIDATES > 0) & (not RESIDENT)
        SLOTS: tl.constexpr = CANDIDATES if CANDIDATES > 0 else 1
        p_cand = cand_ptr + rows[:, None] * SLOTS
        b_cand = tl.full([ROWS, SLOTS], _FAR_BELOW, tl.float32)
        n_support = tl.where(done, 0, n_fin)
        captured = passes < 0
        if SUBSET > 0:
            # the subset: the row's entries (resident) or the lanes' maxima over the chunks
            # (swept, pass 1's), in groups of BLOCK // SUBSET that are a thread's own in the
            # loads' layout (BLOCK // SUBSET apart), one subset value per group
            if RESIDENT:
                b_vs = b_v
            elif ALPHA_KIND == ALPHA_GENERAL:
                b_vs = _scaled(b_max, shift, t, ALPHA_KIND, True)
            else:
                b_vs = _scaled(b_max, shift, t, ALPHA_KIND, False)
            if SUBSET < BLOCK:
                b_vs = tl.max(tl.reshape(b_vs, [ROWS, BLOCK // SUBSET, SUBSET]), axis=1)
            if ALPHA_KIND == ALPHA_GENERAL:
                if plain:
                    c_hi = _subset_start(b_vs, done, t, e, near_one, ALPHA_KIND)
            else:
                c_hi = _subset_start(b_vs, done, t, e, near_one, ALPHA_KIND)
        while (passes < max_passes) & (tl.sum((~done).to(tl.int32), axis=0) > 0):
            attempted = passes < 0
            if RESIDENT:
                if plain:
                    s_a, s_b, s_q2, d_min = _pass_sums(b_v, c_hi, c_lo, t, e, near_one,
                                                       ALPHA_KIND, True)
                else:
                    s_a, s_b, s_q2, d_min = _pass_sums(b_v, c_hi, c_lo, t, e, near_one,
                                                       ALPHA_KIND, False)
            else:
                if plain:
                    if CAPTURE:
                        if captured:
                            s_a, s_b, s_q2, d_min = _pass_sums(b_cand, c_hi, c_lo, t, e,
                                                               near_one, ALPHA_KIND, True)
                        else:
                            attempted = tl.max(tl.where(done, 0, n_support), axis=0) <= CANDIDATES
                            if attempted:
                                s_a, s_b, s_q2, d_min, n_support = _chunk_sums(
                                    p_x, m_row, o_col, n_cols, shift, c_hi, c_lo, t, e, near_one,
                                    p_cand, ROWS, BLOCK, ALPHA_KIND, True, SUPPORT_STORE,
                                    CANDIDATES)
                            else:
                                s_a, s_b, s_q2, d_min, n_support = _chunk_sums(
                                    p_x, m_row, o_col, n_cols, shift, c_hi, c_lo, t, e, near_one,
                                    p_cand, ROWS, BLOCK, ALPHA_KIND, True, SUPPORT_COUNT,
                                    CANDIDATES)
                    else:
                        s_a, s_b, s_q2, d_min, _ = _chunk_sums(p_x, m_row, o_col, n_cols, shift,
                                                               c_hi, c_lo, t, e, near_one, p_cand,
                                                               ROWS, BLOCK, ALPHA_KIND, True)
                else:
                    s_a, s_b, s_q2, d_min, _ = _chunk_sums(p_x, m_row, o_col, n_cols, shift, c_hi,
                                                           c_lo, t, e, near_one, p_cand, ROWS,
                                                           BLOCK, ALPHA_KIND, False)
            passes += 1
            at_cap = passes >= max_passes
            if ALPHA_KIND == ALPHA_GENERAL:
                f = s_a - 1.0
                # φ increases with c; Σp − 1 has φ's sign for t > 0 and the opposite for t < 0.
                c_above = (f > 0) == (t > 0)
                hi_hi = tl.where(c_above, c_hi, hi_hi)
                hi_lo = tl.where(c_above, c_lo, hi_lo)
                lo_hi = tl.where(c_above, lo_hi, c_hi)
                lo_lo = tl.where(c_above, lo_lo, c_lo)
                to_lo = (lo_hi - c_hi) + (lo_lo - c_lo)
                to_hi = (hi_hi - c_hi) + (hi_lo - c_lo)
                width = to_hi - to_lo
                # Newton on φ: δ = −(P − P^(1−t)) / Σd^(e−1)
                step = -_pow_gap(s_a, t) / tl.where(s_b > 0, s_b, 1.0)
                if need_low:
                    # α > 2 above c*: the entry nearest to leaving dominates Σd^(e−1); the step
                    # on the support without it is the right one when that entry leaves first.
                    p_min = _pow_pos(d_min, e)
                    rest = s_a - p_min
                    rest_slope = s_b - tl.where(d_min < float("inf"),
                                                p_min / tl.where(d_min > 0, d_min, 1.0), 0.0)
                    step_leave = -_pow_gap(rest, t) / tl.where(rest_slope > 0, rest_slope, 1.0)
                    leaves = ((t > 1.0) & c_above & (rest > 0) & (rest_slope > 0)
                              & (step_leave < -d_min))
                    step = tl.where(leaves, step_leave, step)
                # NaN/inf steps fail the bracket test and bisect. For α ≤ 2 the steps are
                # monotone (φ convex or concave); for α > 2 two passes that did not halve the
                # bracket make the next step a bisection as well.
                stalled = (t > 1.0) & (width > 0.5 * width_2)
                inside = (step > to_lo) & (step < to_hi) & ~stalled
                step = tl.where(inside, step, 0.5 * (to_lo + to_hi))
                width_2 = width_1
                width_1 = width
                converged = (tl.abs(f) <= tol) | (width <= 5.7e-14 * tl.abs(c_hi)) | (t == 0.0)
                stop = converged | at_cap
                next_hi, next_lo = _add_to_pair(c_hi, c_lo, step)
                fresh = ~done
                # A plain resident row's last step needs no evaluation of its own: Newton from
                # above on a convex φ converges quadratically, Σp − 1 falling by about the
                # square of the step's ratio to the one before, and the output pass
                # normalises by its own Σp. Taken when that predicts |Σp − 1| ≤ tol / 10
                # after the step (docs/maths.md, "The last step without its evaluation").
                finished = stop
                if RESIDENT:
                    ratio = step / tl.where(prev_step != 0.0, prev_step, 1.0)
                    quadratic = (inside & c_above & (prev_step != 0.0)
                                 & (tl.abs(f) * ratio * ratio <= 0.1 * tol))
                    finished = tl.where(plain, stop | quadratic, stop)
                    prev_step = step
                if CAPTURE:
                    # Only from an iterate above c* (after one below it, c rises and the
                    # support may grow), and only if every row's support fits its slots; a
                    # row stopping here needs no more.
                    fits = stop | ((n_support <= CANDIDATES) & c_above)
                    fits = tl.sum((fresh & ~fits).to(tl.int32), axis=0) == 0
                    if attempted & fits:
                        captured = attempted & fits
                        captured_at = tl.where(fresh & ~stop, passes, captured_at)
                        b_cand = _load_candidates(p_cand, n_support, SLOTS)
                row_passes = tl.where(fresh, passes, row_passes)
                if not RESIDENT:
                    # a resident row's output pass sums its own p (`finished` rows took a step
                    # after their last evaluation)
                    norm = tl.where(fresh & stop, s_a, norm)
                c_hi = tl.where(fresh & ~stop, next_hi, c_hi)
                c_lo = tl.where(fresh & ~stop, next_lo, c_lo)
                done = done | finished
            else:
                step, exact, final, fallback = _exact_step(s_a, s_b, s_q2, d_min, ALPHA_KIND)
                fresh = ~done
                row_passes = tl.where(fresh, passes, row_passes)
                stop = final | at_cap
                if ALPHA_KIND == ALPHA_SPARSEMAX:
                    norm = tl.where(fresh & at_cap & ~final, s_a, norm)
                else:
                    norm = tl.where(fresh & at_cap & ~final, s_q2, norm)
                c_hi = tl.where(fresh & (final | ~at_cap), c_hi + tl.where(exact, step, fallback), c_hi)
                done = done | stop

    if RESIDENT:
        if plain:
            b_p = _p_at(b_v, c_hi, c_lo, t, e, near_one, ALPHA_KIND, True)
        else:
            b_p = _p_at(b_v, c_hi, c_lo, t, e, near_one, ALPHA_KIND, False)
        if ALPHA_KIND == ALPHA_GENERAL:
            # rows that settled took a step after their last evaluation
            norm = tl.sum(b_p, axis=1)
    inv_norm = tl.where(norm > 0, 1.0 / norm, 0.0)
    inv_norm = tl.where(bad, float("nan"), inv_norm)
    if RESIDENT:
        tl.store(p_p, (b_p * inv_norm[:, None]).to(p_ptr.dtype.element_ty), mask=m_tile)
    elif plain:
        _chunk_store(p_x, p_p, m_row, o_col, n_cols, shift, c_hi, c_lo, t, e, near_one, inv_norm,
                     BLOCK, ALPHA_KIND, True)
    else:
        _chunk_store(p_x, p_p, m_row, o_col, n_cols, shift, c_hi, c_lo, t, e, near_one, inv_norm,
                     BLOCK, ALPHA_KIND, False)
    if ALPHA_KIND == ALPHA_SOFTMAX:
        c_hi = inv_norm  # the threshold c of softmax is 1/Σexp(u)
    else:
        c_hi = tl.where(t == 0.0, inv_norm, c_hi)
    # One record per row (STATS_COLUMNS), so that a call allocates one buffer for them: a
    # small call's host time is a few microseconds per allocation (and a fill launch for
    # a zeroed one), as much as its kernel on a GPU.
    p_stats = stats_ptr + STATS_COLUMNS * rows
    tl.store(p_stats + STAT_C_HI, c_hi, mask=m_row)
    tl.store(p_stats + STAT_C_LO, c_lo, mask=m_row)
    tl.store(p_stats + STAT_PASSES, row_passes.to(tl.float32, bitcast=True), mask=m_row)
    tl.store(p_stats + STAT_CAPTURED_AT, captured_at.to(tl.float32, bitcast=True), mask=m_row)


# ----------------------------------------------------------------------------- backward

@triton.jit
def _jacobian_weight(b_p, t, ALPHA_KIND: tl.constexpr):
    """s = p^(2−α) on the support, 0 elsewhere.  [ROWS, BLOCK]"""
    b_pos = b_p > 0
    if ALPHA_KIND == ALPHA_SPARSEMAX:
        b_s = tl.where(b_pos, 1.0, 0.0)
    elif ALPHA_KIND == ALPHA_ENTMAX15:
        b_s = tl.sqrt(tl.where(b_pos, b_p, 0.0))
    elif ALPHA_KIND == ALPHA_SOFTMAX:
        b_s = tl.where(b_pos, b_p, 0.0)
    else:
        b_s = tl.where(b_pos, tl.exp2((1.0 - t[:, None]) * log2_approx(tl.where(b_pos, b_p, 1.0))), 0.0)
    # NaN in p (rows of NaN scores) stays NaN in dx.
    return tl.where(b_p != b_p, b_p, b_s)


@triton.jit
def _bwd_sums(b_p, b_g, t, ALPHA_KIND: tl.constexpr, NEED_DALPHA: tl.constexpr):
    """Σs, Σsg and, for dα, `_dalpha_sums`.  [ROWS]"""
    b_s = _jacobian_weight(b_p, t, ALPHA_KIND)
    s_sum = tl.sum(b_s, axis=1)
    sg_sum = tl.sum(b_s * b_g, axis=1)
    zero = tl.zeros_like(s_sum)
    gp = zero
    gpl = zero
    pl = zero
    pr = zero
    gpr = zero
    if NEED_DALPHA:
        gp, gpl, pl, pr, gpr = _dalpha_sums(b_p, b_g, t)
    return s_sum, sg_sum, gp, gpl, pl, pr, gpr


@triton.jit
def _dalpha_sums(b_p, b_g, t):
    """Σgp, Σgp·log p, Σp·log p, Σp·r, Σgp·r (r: see below), the sums dα needs.  [ROWS]"""
    t_safe = tl.where(t == 0.0, 1.0, t)[:, None]
    b_logp = tl.log(tl.where(b_p > 0, b_p, 1.0))
    # r = (e^y − 1 − y)/t² with y = −t·log p, i.e. s = p(1 − t·log p + t²·r);
    # a series for small y, where the direct form cancels.
    b_y = -t[:, None] * b_logp
    b_series = 1.0 / 362880.0  # 1/9!, the y^7 coefficient
    for k in tl.static_range(7):
        b_series = b_series * b_y + 1.0 / _FACT[6 - k]
    b_r = tl.where(tl.abs(b_y) < 0.5, b_logp * b_logp * b_series,
                   (tl.exp(b_y) - 1.0 - b_y) / (t_safe * t_safe))
    b_gp = b_g * b_p
    gp = tl.sum(b_gp, axis=1)
    gpl = tl.sum(b_gp * b_logp, axis=1)
    pl = tl.sum(b_p * b_logp, axis=1)
    pr = tl.sum(b_p * b_r, axis=1)
    gpr = tl.sum(b_gp * b_r, axis=1)
    return gp, gpl, pl, pr, gpr


@triton.jit
def entmax_rowwise_bwd_kernel(
    p_ptr, g_ptr, dx_ptr, dalpha_ptr, alpha_ptr,
    n_rows, n_cols, stride_p_row, stride_g_row, stride_dx_row, alpha_stride,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, ALPHA_KIND: tl.constexpr, NEED_DALPHA: tl.constexpr,
    RESIDENT: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_row = rows < n_rows
    o_col = tl.arange(0, BLOCK)
    p_p = p_ptr + rows[:, None] * stride_p_row + o_col[None, :]
    p_g = g_ptr + rows[:, None] * stride_g_row + o_col[None, :]
    p_dx = dx_ptr + rows[:, None] * stride_dx_row + o_col[None, :]
    t = _row_alpha(alpha_ptr, rows, m_row, alpha_stride, ALPHA_KIND) - 1.0

    if RESIDENT:
        m_tile = m_row[:, None] & (o_col[None, :] < n_cols)
        b_p = tl.load(p_p, mask=m_tile, other=0.0).to(tl.float32)
        b_g = tl.load(p_g, mask=m_tile, other=0.0).to(tl.float32)
        s_sum, sg_sum, gp, gpl, pl, pr, gpr = _bwd_sums(b_p, b_g, t, ALPHA_KIND, NEED_DALPHA)
    else:
        # Σs and Σsg summed entry by entry over the chunks and reduced across the warps
        # once, as the forward's passes (`_pass_terms`); the dα sums, only on request,
        # chunk by chunk (five more per-entry accumulators would not fit the registers)
        b_s_sum = tl.zeros([ROWS, BLOCK], tl.float32)
        b_sg_sum = tl.zeros([ROWS, BLOCK], tl.float32)
        gp = tl.zeros([ROWS], tl.float32)
        gpl = tl.zeros([ROWS], tl.float32)
        pl = tl.zeros([ROWS], tl.float32)
        pr = tl.zeros([ROWS], tl.float32)
        gpr = tl.zeros([ROWS], tl.float32)
        for start in range(0, n_cols, BLOCK):
            m_tile = m_row[:, None] & (start + o_col[None, :] < n_cols)
            b_pc = tl.load(p_p + start, mask=m_tile, other=0.0).to(tl.float32)
            b_gc = tl.load(p_g + start, mask=m_tile, other=0.0).to(tl.float32)
            b_s = _jacobian_weight(b_pc, t, ALPHA_KIND)
            b_s_sum += b_s
            b_sg_sum += b_s * b_gc
            if NEED_DALPHA:
                c_gp, c_gpl, c_pl, c_pr, c_gpr = _dalpha_sums(b_pc, b_gc, t)
                gp += c_gp
                gpl += c_gpl
                pl += c_pl
                pr += c_pr
                gpr += c_gpr
        s_sum = tl.sum(b_s_sum, axis=1)
        sg_sum = tl.sum(b_sg_sum, axis=1)
    # Σ g p̃ with the escort p̃ = s / Σs; an empty support gives 0.
    s_safe = tl.where(s_sum > 0, s_sum, 1.0)
    g_escort = tl.where(s_sum > 0, sg_sum / s_safe, 0.0)
    g_escort = tl.where(s_sum != s_sum, s_sum, g_escort)

    if RESIDENT:
        b_s = _jacobian_weight(b_p, t, ALPHA_KIND)
        tl.store(p_dx, (b_s * (b_g - g_escort[:, None])).to(dx_ptr.dtype.element_ty), mask=m_tile)
    else:
        for start in range(0, n_cols, BLOCK):
            m_tile = m_row[:, None] & (start + o_col[None, :] < n_cols)
            b_pc = tl.load(p_p + start, mask=m_tile, other=0.0).to(tl.float32)
            b_gc = tl.load(p_g + start, mask=m_tile, other=0.0).to(tl.float32)
            b_s = _jacobian_weight(b_pc, t, ALPHA_KIND)
            tl.store(p_dx + start, (b_s * (b_gc - g_escort[:, None])).to(dx_ptr.dtype.element_ty), mask=m_tile)

    if NEED_DALPHA:
        t_safe = tl.where(t == 0.0, 1.0, t)
        # docs/maths.md "Gradient of alpha", summed over g:
        #   dα = Σg(p − p̃)/t² + (Σgh − Σgp̃·Σh)/t, h = −p log p.
        # Far from α = 1 directly:
        d_direct = (gp - g_escort) / (t_safe * t_safe) + (g_escort * pl - gpl) / t_safe
        # Near α = 1 its two terms are O(1/t) and cancel (fp32 at α = 1.001: 10% error).
        # With s = p(1 − t·log p + t²·r) the same expression regroups exactly into
        #   [Σgp·Σpr − Σgpr + t(Σgpr·Σp log p − Σgp log p·Σpr)] / Σs
        #     + (Σp − 1)(Σgp/t² − Σgp log p/t) / Σs.
        # The second line is zero on the simplex and is dropped: evaluated literally it
        # turns p's normalisation rounding (~1e-7) into an error of 1e-7/t² (α = 1.0001:
        # O(1)). At t = 0 the first line is the exact limit −½(Σgp log²p − Σgp·Σp log²p).
        d_stable = (gp * pr - gpr + t * (gpr * pl - gpl * pr)) / s_safe
        d_alpha = tl.where(tl.abs(t) < 0.25, d_stable, d_direct)
        d_alpha = tl.where(s_sum > 0, d_alpha, 0.0)
        tl.store(dalpha_ptr + rows, tl.where(s_sum != s_sum, s_sum, d_alpha), mask=m_row)


# ----------------------------------------------------------------------------- tile table

def plain_alpha(alpha) -> bool:
    """Whether a python-float α of the general kind makes every row plain in the forward
    (1.25 <= α <= 2: `entmax_rowwise_fwd_kernel`'s ``plain``), so that the launch can be
    compiled with ALL_PLAIN. A tensor α may hold any values: the kernel decides per program."""
    return (isinstance(alpha, (int, float)) and common.alpha_kind(alpha) == common.ALPHA_GENERAL
            and _PLAIN_T_MIN.value <= float(alpha) - 1.0 <= _PLAIN_T_MAX.value)


def tile_config(n_cols: int, alpha_kind: int) -> dict:
    """(ROWS, BLOCK, RESIDENT, num_warps) for rows of n_cols entries of one α kind
    (``entmax_fast.common.ALPHA_*``), forward and backward.

    A table, not triton.autotune: the kernels are bound by memory for every shape the rule
    below produces, so what matters is a rule that keeps each thread's share of the tile
    small enough for registers and the whole tile large enough to keep memory busy, and a
    table keeps the first call free of tuning runs, keeps the configuration deterministic
    (identical results run to run), and lets the AOT check (triton_kernels/aot.py) compile
    exactly the configurations that can run. The rule: one row per program and at most 16
    fp32 entries per thread (one warp per 256 entries up to 512, 2 warps at 1024, measured
    on a GPU; 4 warps up to 2048 and, for a stack-free compile, at 4096 (32 per thread),
    16 beyond) and resident rows up to RESIDENT_MAX_COLS[alpha_kind]; longer rows are swept
    in CHUNK_BLOCK chunks by 4 warps, the general kind's beyond WIDE_CHUNK_COLS by 8. Up to
    8192 entries every kind takes the same configuration.

    The α kind sets the resident limit and the chunked warps because a pass costs different
    work per entry. Forward of 512 fp32 rows of 32768 entries on an H200 (commit 4642e72,
    ms):

        α 1.5 (entmax15):        chunked 4 warps 0.166, resident 16 warps 0.106,
                                 resident 32 warps 0.116, chunked 8 warps 0.159;
        α 1.3 (general kind):    chunked 4 warps 0.233, resident 16 warps 0.645,
                                 resident 32 warps 0.601, chunked 8 warps 0.186.

    A chunked row is read again on every pass (64 MB a pass there, more than the H200's L2
    holds); a resident one once. The closed forms' pass is a few operations per entry, so
    resident on 16 warps wins although it spills at 32768 (AOT, sm_90: 296 bytes of stack
    in the entmax15 forward, 64 in sparsemax's; none at 16384). Timed at 16384 and 32768 in
    fp32 and bf16, forward and backward (H200, commit 11185a4): resident beats chunked on
    forward + backward for both closed forms at both lengths and dtypes (sparsemax's fp32
    forward 3.3× at 32768), although entmax15's bf16 forward alone is 4-20 % slower
    resident. The general kind's pass (a log2 and an exp2 per entry, the threshold as an
    fp32 pair) spills 872 bytes of stack resident on 16 warps and ran 2.8× slower than
    chunked, so it stays chunked above 8192; on 8 warps above 16384 (forward + backward
    0.275 against 0.335 ms at 32768 fp32), on 4 at 16384, where 8 warps were 9 % slower.
    Softmax (one pass, no iteration) was not timed and keeps the table it had. Forward and
    backward share the entry (the launchers key both on length and kind).
    `bench/bench_rowwise_gpu.py --sweep` times the neighbours of each entry on a GPU.
    """
    if n_cols > RESIDENT_MAX_COLS[alpha_kind]:
        wide = alpha_kind == common.ALPHA_GENERAL and n_cols > WIDE_CHUNK_COLS
        return {"ROWS": 1, "BLOCK": CHUNK_BLOCK, "RESIDENT": False, "num_warps": 8 if wide else 4}
    # The next power of two >= n_cols, in plain integers (triton.next_power_of_2 is a
    # ConstexprFunction: microseconds per host call).
    block = max(16, 1 << (max(n_cols, 1) - 1).bit_length())
    if block <= 1024:
        # One row per program, one warp per 256 entries up to 512 and two warps at 1024:
        # each row carries ~15 scalars through the loop (threshold and bracket pairs, sums,
        # flags), replicated over the threads that hold it; 4+ rows per program spilled
        # (AOT: up to 312 bytes of stack), and 2 rows left an 8-byte stack frame on sm_90
        # for blocks of 128–512. At 1024 the table's 4 warps spent a pass on cross-warp
        # reductions: on an H100 (commit 4a08cac) 16384×1024 fp32 forwards
        # took 0.0582 ms at 2 warps, 0.0596 at 1, 0.0755 at 4 (α 1.5), and 0.282 / 0.326 /
        # 0.310 ms at α 1.3.
        return {"ROWS": 1, "BLOCK": block, "RESIDENT": True, "num_warps": max(1, min(block // 256, 2))}
    if block <= 2048:
        return {"ROWS": 1, "BLOCK": block, "RESIDENT": True, "num_warps": 4}
    # 4096 by 8 warps left an 8-byte stack frame in the entmax15 forward on sm_80, by 16
    # warps in the fp16/bf16 general-α forward on sm_90 (AOT); by 4 warps none.
    return {"ROWS": 1, "BLOCK": block, "RESIDENT": True, "num_warps": 4 if block <= 4096 else 16}


def candidate_slots(n_cols: int, config: dict, alpha_kind: int) -> int:
    """Slots per row for a swept general-kind row's captured support (0: none): a quarter of
    its length's next power of two, at most 8 per thread (1024 on 4 warps, 2048 = CHUNK_BLOCK
    on 8), none below 128. sm_90 fp32 forward (AOT): 99 → 128 registers on 8 warps with
    2048 slots (two programs per SM either way); on 4 warps 128 → 168 with 1024 slots,
    213 with 2048 (four programs per SM → three, two).

    Swept rows only: there every evaluation over the slots spares a read of the whole row
    (a 32768-entry fp32 row is 128 KiB; 1024 of them do not fit the L2), for a counting
    add per entry in the passes before. Resident rows are already on chip, and storing their
    support (a prefix count over the row, then the stores) compiled to 782 sm_90
    instructions per 1024-entry row on 2 warps against 205 for an evaluation over the row
    and 81 over 256 slots: a loss at the three evaluations it would spare.

    On N(0, 1) rows at α 1.3 the supports of the Newton iterates hold 7318, 1135, 372, 290
    of 32768 entries (float64 replica of the iteration): counted at the second evaluation,
    stored at the third, the fourth and fifth run over the slots."""
    if alpha_kind != common.ALPHA_GENERAL or config["RESIDENT"]:
        return 0
    quarter = max(16, 1 << (max(n_cols, 1) - 1).bit_length()) // 4
    return min(quarter, 256 * config["num_warps"], CHUNK_BLOCK) if quarter >= 128 else 0


def start_subset(config: dict, alpha_kind: int) -> int:
    """Subset values per row from which the forward's iteration starts (`SUBSET`; 0: from
    c = 1), each the largest of a group of entries one thread holds. Swept rows: 4 per
    thread from the chunk's lanes, which pass 1 fills with maxima over the chunks anyway; an
    iteration over them costs a few operations per thread and the reductions, against a
    sweep over the row. Resident rows: 8 per thread where a thread holds at least
    SUBSET_MIN_PER_THREAD entries (4096 on 4 warps, 16384 and 32768 on 16); below, an
    iteration over the subset costs its reductions across the warps, about what an
    evaluation over 16 entries per thread costs, for fewer evaluations saved. Softmax rows
    do not iterate. AOT (sm_90): the same registers and stacks as from c = 1 with triton
    3.6; with 3.9 the general kind's 8-warp sweep takes 158 registers instead of 126 (one
    program per SM instead of two)."""
    if alpha_kind == common.ALPHA_SOFTMAX:
        return 0
    per_thread = config["ROWS"] * config["BLOCK"] // (32 * config["num_warps"])
    if not config["RESIDENT"]:
        return config["BLOCK"] // max(1, per_thread // 4)
    if per_thread < SUBSET_MIN_PER_THREAD:
        return 0
    return config["BLOCK"] * 8 // per_thread


def _config_blocks(alpha_kind: int) -> list[int]:
    """Every n_cols class `tile_config` distinguishes for one α kind (one representative
    length each)."""
    lengths = [16]
    while lengths[-1] < RESIDENT_MAX_COLS[alpha_kind]:
        lengths.append(lengths[-1] * 2)
    lengths.append(RESIDENT_MAX_COLS[alpha_kind] + 1)
    if alpha_kind == common.ALPHA_GENERAL:
        lengths.append(WIDE_CHUNK_COLS + 1)
    return lengths


# ----------------------------------------------------------------------------- AOT contract

FWD_POINTERS = {"x_ptr": TENSOR, "p_ptr": TENSOR, "stats_ptr": "*fp32", "alpha_ptr": "*fp32",
                "cand_ptr": "*fp32"}
BWD_POINTERS = {"p_ptr": TENSOR, "g_ptr": TENSOR, "dx_ptr": TENSOR, "dalpha_ptr": "*fp32",
                "alpha_ptr": "*fp32"}


def aot_configs() -> list[dict]:
    """Every (kernel, specialisation) the launchers can choose, for triton_kernels/aot.py.

    Integer arguments are i32 (what the JIT picks for row lengths and strides below 2³¹);
    the row index is widened to int64 inside the kernels.
    """
    configs = []
    for dtype_key in DTYPE_KEYS.values():
        for alpha_kind in (common.ALPHA_GENERAL, common.ALPHA_SOFTMAX, common.ALPHA_ENTMAX15,
                           common.ALPHA_SPARSEMAX):
            for n_cols in _config_blocks(alpha_kind):
                cfg = tile_config(n_cols, alpha_kind)
                shape = {k: cfg[k] for k in ("ROWS", "BLOCK", "RESIDENT")}
                # the warps too: the general kind chunks rows on 4 warps and longer ones on 8
                tag = (f"r{cfg['ROWS']}_b{cfg['BLOCK']}_{'res' if cfg['RESIDENT'] else 'chunk'}"
                       f"_w{cfg['num_warps']}")
                candidates = candidate_slots(n_cols, cfg, alpha_kind)
                subset = start_subset(cfg, alpha_kind)
                # the general kind also compiled for a python-float α that makes every row plain
                for plain in (False, True) if alpha_kind == common.ALPHA_GENERAL else (False,):
                    configs.append({
                        "name": (f"fwd_{dtype_key}_k{alpha_kind}_{tag}" + (f"_c{candidates}" if candidates else "")
                                 + ("_plain" if plain else "")),
                        "fn": entmax_rowwise_fwd_kernel,
                        "signature": kernel_signature(entmax_rowwise_fwd_kernel, dtype_key, FWD_POINTERS,
                                                      floats=("tol",)),
                        "constexprs": dict(shape, ALPHA_KIND=alpha_kind, CANDIDATES=candidates,
                                           SUBSET=subset, ALL_PLAIN=plain),
                        "num_warps": cfg["num_warps"], "num_stages": 1,
                    })
                for need in (False, True) if alpha_kind == common.ALPHA_GENERAL else (False,):
                    configs.append({
                        "name": f"bwd_{dtype_key}_k{alpha_kind}_{tag}_da{int(need)}",
                        "fn": entmax_rowwise_bwd_kernel,
                        "signature": kernel_signature(entmax_rowwise_bwd_kernel, dtype_key, BWD_POINTERS),
                        "constexprs": dict(shape, ALPHA_KIND=alpha_kind, NEED_DALPHA=need),
                        "num_warps": cfg["num_warps"], "num_stages": 1,
                    })
    return configs
