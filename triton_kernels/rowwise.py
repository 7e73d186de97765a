"""Row-wise α-entmax kernels: forward (threshold by sorting or by root finding) and backward.

Every row of ``x`` (R, n) is mapped to ``p = α-entmax(x_row)``, in the threshold form of
``entmax_fast.reference.mappings`` written multiplicatively so that the iteration variable
keeps full fp32 resolution where the support is small:

    u = x − max(x),  t = α − 1,
    α ≠ 1:  p_i = [c + t·u_i]_+ ^ (1/t),   c = 1 − t·μ
    α = 1:  p_i = c · exp(u_i),            c = exp(−μ)

(μ as in the reference; ``c`` is the support's largest ``[·]_+`` base, which for a sparse
row is a small number that fp32 holds to 1e-7 relative, while μ ≈ 1/t would lose it).
``F(c) = Σ p_i − 1`` is increasing in c for t ≥ 0 and decreasing for t < 0, with the
root in ``c ∈ [min(1, n^{−t}), max(1, n^{−t})]`` (``[1/n, 1]`` at t = 0).

Two ways to find c:

- sort (`_entmax_fwd_sort_kernel`, α = 2 and α = 1.5 given as python floats, rows that fit
  one block): ``tl.sort`` + prefix sums give the support and c in closed form (MATH.md §1),
  exact, one read of the row.
- root finding (`_entmax_fwd_root_kernel`, any α > 0, float or one per row, any length;
  rows longer than BLOCK are swept in chunks). Passes over the row:
    1. max and count of finite entries (softmax: online log-sum-exp, then done);
    2. (t > 0) a histogram of v = t·u over the only range that can reach the support,
       v ∈ (−1, 0], in NBINS bins. Putting every entry of a bin at the bin's upper / lower
       edge bounds F from above / below, so bisection on these NBINS-term sums (registers
       only) gives a bracket [lo, hi] around c that is about one bin wide, and the root of
       the bin-centre sum a starting point c0 inside it;
    3+. each pass evaluates F, F', F'' at c (one read), the entry nearest to leaving the
       support (smallest d > 0) and the gap to the next entry to enter; it shrinks the
       bracket and steps: for t > 0 to the root of a model that is Taylor for all entries
       but those two, which it keeps exact (F's kinks are where entries enter; for α > 2
       their slope is infinite and plain Halley steps stall there); else Halley, falling
       back to Newton and to bisection when a step leaves the bracket. It stops when
       |F(c)| ≤ tol, when the bracket is below resolution, or after max_passes.
       c is carried as an unevaluated pair of fp32 (hi + lo) so that entries at d ≈ 0 keep
       their precision (see `_pmap`).
  The output pass (not counted) writes p(c) / Σp(c) with Σp(c) from the last evaluation,
  so the output sums to one to rounding. Rows with α = 1 in a per-row α take one
  evaluation pass: c·exp(u) normalised by its sum is exact for any c.

Backward (`_entmax_bwd_kernel`, MATH.md §2): one pass of sums, one pass writing dx; dα
(when asked) from the same pass, in a regrouped form that stays accurate as α → 1.

Choice per call (`choose_method`): sort when α ∈ {2, 1.5} (python float) and
n ≤ SORT_MAX_COLS, root finding otherwise. Why that bound: see SORT_MAX_COLS.

Layout contract of the launchers: 2-D input (R, n); the row stride is free, the last
dimension must have stride 1 (a tensor whose last stride is not 1 is copied once with
``.contiguous()``, documented, not silent: see `entmax_rowwise_forward`). Outputs are
contiguous. Input may hold −inf (weight 0); a row with no finite entry gives zeros. +inf
and NaN inputs are not supported.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = [
    "entmax_rowwise_forward",
    "entmax_rowwise_backward",
    "entmax_rowwise_threshold",
    "choose_method",
    "aot_configs",
    "SORT_MAX_COLS",
]

KIND_GENERAL = 0  # α read per row from a fp32 pointer (one value, or one per row)
KIND_SPARSEMAX = 1  # α = 2
KIND_ENTMAX15 = 2  # α = 1.5
KIND_SOFTMAX = 3  # α = 1
# the same values as constexprs, the form a @triton.jit function may read from globals
_K_GENERAL = tl.constexpr(KIND_GENERAL)
_K_SPARSEMAX = tl.constexpr(KIND_SPARSEMAX)
_K_ENTMAX15 = tl.constexpr(KIND_ENTMAX15)
_K_SOFTMAX = tl.constexpr(KIND_SOFTMAX)
# 2!, 3!, …, 8!: Horner coefficients of the series Σ_k y^k / (k+2)! used by the backward
_FACT = tl.constexpr((2.0, 6.0, 24.0, 120.0, 720.0, 5040.0, 40320.0))

# Histogram resolution of pass 2 (bins over v ∈ (−1, 0]). Measured with
# bench/bench_rowwise_passes.py (--nbins, 8–32 rows per cell, n ∈ {1k, 8k, 64k}): worst
# case over α ∈ {1.25, 1.5, 2, 3} × σ² ∈ {1, 6} is 5 passes with 128 or 256 bins (α = 3,
# σ² = 1: a start one bin off leaves the first step 1e-5 short) and 4 with 512. Rows that
# fit the 128-wide block keep 128 bins: there every pass re-reads one resident block, and
# the register-only bisection over the bins would cost more than the pass it saves.
NBINS = 512
NBINS_SMALL = 128
ROOT_BLOCKS = (128, 1024, 4096)
# Largest row the sort kernel takes (exact, one read). The rule comes from the compiled
# code and the pass counts, not from a timing (no GPU was available): tl.sort is a bitonic
# network of log2(B)(log2(B)+1)/2 stages over the whole block (55 at B = 1024, 78 at 4096)
# while root finding streams the row ≤ 4 times (bench), so sorting pays only for short
# rows; up to B = 1024 the sort kernel compiles without spills in ≤ 57 registers on
# sm_80/sm_90 (AOT table). `bench/bench_rowwise_passes.py --gpu` times the crossover.
SORT_MAX_COLS = 1024
SORT_BLOCKS = (128, 256, 512, 1024)
DEFAULT_TOL = 1e-6
DEFAULT_MAX_PASSES = 40

_IO_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@triton.jit
def _pmap(b_u, c_hi, c_lo, t, e, KIND: tl.constexpr):
    """p, dp/dc, d²p/dc² and the base d of entries u at the threshold c = c_hi + c_lo.
    [BLOCK] each (d is p itself for softmax, where it only feeds unused statistics).

    d = (c_hi + t·u) + c_lo: for the entries about to enter the support c_hi + t·u is exact
    (Sterbenz), so d keeps its relative precision down to d ≈ 0. For α > 2 that is what
    lets |Σp − 1| reach 1e-6 at all: p = d^(1/t) has an infinite slope at d = 0, and a
    plain fp32 c (steps of 6e-8) moves such an entry's p by ~1e-4.
    """
    if KIND == _K_SOFTMAX:
        b_eu = tl.exp(b_u)
        b_p = c_hi * b_eu
        b_dp = b_eu
        b_d2p = tl.zeros_like(b_eu)
        b_d = b_p
    elif KIND == _K_SPARSEMAX:
        b_d = (c_hi + b_u) + c_lo
        b_pos = b_d > 0
        b_p = tl.where(b_pos, b_d, 0.0)
        b_dp = tl.where(b_pos, 1.0, 0.0)
        b_d2p = tl.zeros_like(b_d)
    elif KIND == _K_ENTMAX15:
        b_d = (c_hi + 0.5 * b_u) + c_lo
        b_d0 = tl.maximum(b_d, 0.0)
        b_p = b_d0 * b_d0
        b_dp = 2.0 * b_d0
        b_d2p = tl.where(b_d > 0, 2.0, 0.0)
    else:
        b_d = (c_hi + t * b_u) + c_lo
        b_pos = b_d > 0
        # −inf entries: t > 0 gives d = −inf (excluded); t < 0 gives d = +inf and
        # exp2(e·inf) = exp2(−inf) = 0, so no NaN reaches the sums.
        b_ld = tl.log2(tl.where(b_pos, b_d, 1.0))
        b_p = tl.where(b_pos, tl.exp2(e * b_ld), 0.0)
        b_dp = tl.where(b_pos, e * b_p / b_d, 0.0)
        b_d2p = tl.where(b_pos, (e - 1.0) * b_dp / b_d, 0.0)
        # α = 1 rows of a per-row α: the exponential form.
        b_eu = tl.exp(b_u)
        b_p = tl.where(t == 0.0, c_hi * b_eu, b_p)
        b_dp = tl.where(t == 0.0, b_eu, b_dp)
        b_d2p = tl.where(t == 0.0, 0.0, b_d2p)
    return b_p, b_dp, b_d2p, b_d


@triton.jit
def _pow_pos(y, e):
    """[y]_+ ^ e for a scalar y (e > 0)."""
    return tl.where(y > 0, tl.exp2(e * tl.log2(tl.where(y > 0, y, 1.0))), 0.0)


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
def _alpha_of_row(alpha_ptr, row, alpha_stride, KIND: tl.constexpr):
    if KIND == _K_SPARSEMAX:
        alpha = tl.full((), 2.0, tl.float32)
    elif KIND == _K_ENTMAX15:
        alpha = tl.full((), 1.5, tl.float32)
    elif KIND == _K_SOFTMAX:
        alpha = tl.full((), 1.0, tl.float32)
    else:
        alpha = tl.load(alpha_ptr + row * alpha_stride).to(tl.float32)
    return alpha


@triton.jit
def _hist_excess(b_cnt, b_edge, c, e, KIND: tl.constexpr):
    """Σ_bins count · [c + edge]_+^e − 1: F with every entry of a bin moved to `edge`."""
    b_d = tl.maximum(c + b_edge, 0.0)
    if KIND == _K_SPARSEMAX:
        b_p = b_d
    elif KIND == _K_ENTMAX15:
        b_p = b_d * b_d
    else:
        b_p = tl.where(b_d > 0, tl.exp2(e * tl.log2(tl.where(b_d > 0, b_d, 1.0))), 0.0)
    return tl.sum(b_cnt * b_p, axis=0) - 1.0


@triton.jit
def _hist_bisect(b_cnt, b_edge, lo, hi, e, KIND: tl.constexpr, ITERS: tl.constexpr):
    """Bisection for the root of the (increasing) histogram bound; returns its bracket."""
    for _ in range(ITERS):
        mid = 0.5 * (lo + hi)
        below = _hist_excess(b_cnt, b_edge, mid, e, KIND) < 0
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo, hi


@triton.jit
def _entmax_fwd_root_kernel(
    x_ptr, p_ptr, c_ptr, passes_ptr, alpha_ptr,
    n_cols, stride_x_row, stride_p_row, alpha_stride, tol, max_passes,
    BLOCK: tl.constexpr, NBINS: tl.constexpr, KIND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_x = x_ptr + row * stride_x_row
    p_p = p_ptr + row * stride_p_row
    alpha = _alpha_of_row(alpha_ptr, row, alpha_stride, KIND)
    t = alpha - 1.0
    e = 1.0 / tl.where(t == 0.0, 1.0, t)  # unused on α = 1 rows
    o_col = tl.arange(0, BLOCK)

    # pass 1: max, number of finite entries; for softmax also the online sum of exp.
    b_max = tl.full([BLOCK], float("-inf"), tl.float32)
    b_fin = tl.zeros([BLOCK], tl.int32)
    b_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        m_col = start + o_col < n_cols
        b_x = tl.load(p_x + start + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
        b_new = tl.maximum(b_max, b_x)
        if KIND == _K_SOFTMAX:
            # a lane that has seen only −inf keeps sum 0 (avoids −inf − (−inf)).
            b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_sum = b_sum * tl.exp(b_max - b_ref) + tl.exp(b_x - b_ref)
        b_max = b_new
        b_fin += (b_x > float("-inf")).to(tl.int32)
    x_max = tl.max(b_max, axis=0)
    n_fin = tl.sum(b_fin, axis=0)
    x_shift = tl.where(n_fin > 0, x_max, 0.0)
    passes = tl.full((), 1, tl.int32)
    s0 = tl.full((), 1.0, tl.float32)

    if KIND == _K_SOFTMAX:
        total = tl.sum(b_sum * tl.exp(b_max - x_shift), axis=0)
        c_hi = tl.where(total > 0, 1.0 / total, 0.0)
        c_lo = tl.zeros((), tl.float32)
    else:
        n_fin_f = tl.maximum(n_fin, 1).to(tl.float32)
        n_pow = tl.exp2(-t * tl.log2(n_fin_f))  # n^{-t}
        lo = tl.minimum(n_pow, 1.0)
        hi = tl.maximum(n_pow, 1.0)
        c = tl.full((), 1.0, tl.float32)
        if t > 0:
            # pass 2: histogram of v = t·u over (−1, 0]; v ≤ −1 never reaches the support.
            b_hist = tl.zeros([NBINS], tl.int32)
            for start in range(0, n_cols, BLOCK):
                m_col = start + o_col < n_cols
                b_x = tl.load(p_x + start + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
                b_v = t * (b_x - x_shift)
                b_bin = tl.minimum(tl.maximum((b_v + 1.0) * NBINS, 0.0), NBINS - 1.0).to(tl.int32)
                b_hist += tl.histogram(b_bin, NBINS, mask=m_col & (b_v > -1.0))
            passes += 1
            b_cnt = b_hist.to(tl.float32)
            b_lower = -1.0 + tl.arange(0, NBINS).to(tl.float32) / NBINS  # [NBINS]
            # entries at their bins' upper edges overestimate F: its root is ≤ c*;
            # at the lower edges they underestimate it: its root is ≥ c*.
            root_above, _ = _hist_bisect(b_cnt, b_lower + 1.0 / NBINS, lo, hi, e, KIND, 14)
            _, root_below = _hist_bisect(b_cnt, b_lower, lo, hi, e, KIND, 14)
            lo = tl.maximum(lo, root_above)
            hi = tl.minimum(hi, root_below)
            mid_lo, mid_hi = _hist_bisect(b_cnt, b_lower + 0.5 / NBINS, lo, hi, e, KIND, 16)
            c = 0.5 * (mid_lo + mid_hi)

        # c, lo, hi as fp32 pairs (hi + lo part): see _pmap for why.
        c_hi = c
        c_lo = tl.zeros((), tl.float32)
        lo_hi = lo
        lo_lo = tl.zeros((), tl.float32)
        hi_hi = hi
        hi_lo = tl.zeros((), tl.float32)
        done = n_fin == 0
        while (passes < max_passes) & (done == 0):
            # Sums of p, p', p'' over the entries, except that the entry with the smallest
            # positive d (the next to leave the support) is kept apart per lane, so that the
            # step model below can treat it exactly without a cancelling subtraction.
            b_s0 = tl.zeros([BLOCK], tl.float32)
            b_s1 = tl.zeros([BLOCK], tl.float32)
            b_s2 = tl.zeros([BLOCK], tl.float32)
            b_dmin = tl.full([BLOCK], float("inf"), tl.float32)
            b_pmin = tl.zeros([BLOCK], tl.float32)
            b_dpmin = tl.zeros([BLOCK], tl.float32)
            b_d2pmin = tl.zeros([BLOCK], tl.float32)
            b_gap = tl.full([BLOCK], float("inf"), tl.float32)  # −d of entries still outside
            for start in range(0, n_cols, BLOCK):
                m_col = start + o_col < n_cols
                b_x = tl.load(p_x + start + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
                b_p, b_dp, b_d2p, b_d = _pmap(b_x - x_shift, c_hi, c_lo, t, e, KIND)
                b_new_min = (b_d > 0) & (b_d < b_dmin)
                b_s0 += tl.where(b_new_min, b_pmin, b_p)
                b_s1 += tl.where(b_new_min, b_dpmin, b_dp)
                b_s2 += tl.where(b_new_min, b_d2pmin, b_d2p)
                b_dmin = tl.where(b_new_min, b_d, b_dmin)
                b_pmin = tl.where(b_new_min, b_p, b_pmin)
                b_dpmin = tl.where(b_new_min, b_dp, b_dpmin)
                b_d2pmin = tl.where(b_new_min, b_d2p, b_d2pmin)
                b_gap = tl.minimum(b_gap, tl.where(b_d <= 0, -b_d, float("inf")))
            passes += 1
            lane_min = tl.argmin(b_dmin, axis=0)
            m_other = o_col != lane_min
            rest0 = tl.sum(b_s0, axis=0) + tl.sum(tl.where(m_other, b_pmin, 0.0), axis=0)
            rest1 = tl.sum(b_s1, axis=0) + tl.sum(tl.where(m_other, b_dpmin, 0.0), axis=0)
            rest2 = tl.sum(b_s2, axis=0) + tl.sum(tl.where(m_other, b_d2pmin, 0.0), axis=0)
            d_min = tl.min(b_dmin, axis=0)
            p_min = tl.sum(tl.where(m_other, 0.0, b_pmin), axis=0)
            s0 = rest0 + p_min
            s1 = rest1 + tl.sum(tl.where(m_other, 0.0, b_dpmin), axis=0)
            s2 = rest2 + tl.sum(tl.where(m_other, 0.0, b_d2pmin), axis=0)
            gap = tl.min(b_gap, axis=0)
            f = s0 - 1.0
            # F increases with c for t ≥ 0, decreases for t < 0.
            c_above = (f > 0) == (t >= 0)
            hi_hi = tl.where(c_above, c_hi, hi_hi)
            hi_lo = tl.where(c_above, c_lo, hi_lo)
            lo_hi = tl.where(c_above, lo_hi, c_hi)
            lo_lo = tl.where(c_above, lo_lo, c_lo)
            # bracket ends relative to c: [to_lo ≤ 0, to_hi ≥ 0]
            to_lo = (lo_hi - c_hi) + (lo_lo - c_lo)
            to_hi = (hi_hi - c_hi) + (hi_lo - c_lo)
            step_halley = -2.0 * f * s1 / (2.0 * s1 * s1 - f * s2)
            step_newton = -f / s1
            # NaN/inf steps (s1 = 0, overflow of s2) fail both tests and fall to bisection.
            halley_ok = (step_halley >= to_lo) & (step_halley <= to_hi)
            newton_ok = (step_newton >= to_lo) & (step_newton <= to_hi)
            step = tl.where(halley_ok, step_halley,
                            tl.where(newton_ok, step_newton, 0.5 * (to_lo + to_hi)))
            if t > 0:
                # Sparse rows: F has a kink wherever an entry enters the support (for α > 2
                # with an infinite slope), which Taylor/Halley steps cannot see. Model F
                # after a step δ by a Taylor expansion of all entries but the two next to a
                # kink, which are kept exact: the one that leaves at δ = −d_min and the one
                # that enters at δ = gap; solve the model by bisection (registers only).
                m_lo = to_lo
                m_hi = to_hi
                for _ in range(32):
                    m_mid = 0.5 * (m_lo + m_hi)
                    model = (rest0 - 1.0 + m_mid * (rest1 + 0.5 * m_mid * rest2)
                             + _pow_pos(d_min + m_mid, e) + _pow_pos(m_mid - gap, e))
                    m_lo = tl.where(model < 0, m_mid, m_lo)
                    m_hi = tl.where(model < 0, m_hi, m_mid)
                step_model = 0.5 * (m_lo + m_hi)
                # a model root on a bracket end would re-evaluate a known point
                model_ok = (step_model > to_lo) & (step_model < to_hi)
                step = tl.where(model_ok, step_model, step)
            # converged, or the bracket is below the pair's resolution (~2^-44 relative), or
            # out of passes: then keep the c whose Σp normalises the output.
            done = ((tl.abs(f) <= tol) | (step == 0.0) | (to_hi - to_lo <= 5.7e-14 * tl.abs(c_hi))
                    | (passes >= max_passes))
            # α = 1 rows of a per-row α: p = c·exp(u) normalised by its sum is exact for any c
            done = done | (t == 0.0)
            next_hi, next_lo = _add_to_pair(c_hi, c_lo, step)
            c_hi = tl.where(done, c_hi, next_hi)
            c_lo = tl.where(done, c_lo, next_lo)
        # ... and their threshold is c/Σp, i.e. 1/Σexp(u)
        c_hi = tl.where(t == 0.0, c_hi / tl.where(s0 > 0, s0, 1.0), c_hi)
        s0 = tl.where(t == 0.0, 1.0, s0)

    inv_s0 = tl.where(s0 > 0, 1.0 / s0, 0.0)
    for start in range(0, n_cols, BLOCK):
        m_col = start + o_col < n_cols
        b_x = tl.load(p_x + start + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
        b_p, _, _, _ = _pmap(b_x - x_shift, c_hi, c_lo, t, e, KIND)
        tl.store(p_p + start + o_col, (b_p * inv_s0).to(p_ptr.dtype.element_ty), mask=m_col)
    tl.store(c_ptr + 2 * row, c_hi)
    tl.store(c_ptr + 2 * row + 1, c_lo)
    tl.store(passes_ptr + row, passes)


@triton.jit
def _entmax_fwd_sort_kernel(
    x_ptr, p_ptr, c_ptr, passes_ptr,
    n_cols, stride_x_row, stride_p_row,
    BLOCK: tl.constexpr, KIND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o_col = tl.arange(0, BLOCK)
    m_col = o_col < n_cols
    b_x = tl.load(x_ptr + row * stride_x_row + o_col, mask=m_col, other=float("-inf")).to(tl.float32)
    m_fin = b_x > float("-inf")
    n_fin = tl.sum(m_fin.to(tl.int32), axis=0)
    x_shift = tl.where(n_fin > 0, tl.max(b_x, axis=0), 0.0)
    if KIND == _K_SPARSEMAX:
        b_v = b_x - x_shift
    else:
        b_v = 0.5 * (b_x - x_shift)
    b_sorted = tl.sort(b_v, descending=True)  # [BLOCK], −inf last
    b_sorted0 = tl.where(b_sorted > float("-inf"), b_sorted, 0.0)
    b_k = (o_col + 1).to(tl.float32)
    b_mean = tl.cumsum(b_sorted0, axis=0) / b_k
    if KIND == _K_SPARSEMAX:
        # Σ_{j≤k} (c + v_j) = 1
        b_ck = 1.0 / b_k - b_mean
    else:
        # Σ_{j≤k} (c + v_j)² = 1  →  c = −M + sqrt(M² − mean(v²) + 1/k)
        b_mean_sq = tl.cumsum(b_sorted0 * b_sorted0, axis=0) / b_k
        b_ck = -b_mean + tl.sqrt(tl.maximum(b_mean * b_mean - b_mean_sq + 1.0 / b_k, 0.0))
    m_support = (b_ck + b_sorted > 0) & (o_col < n_fin)
    last = tl.max(tl.where(m_support, o_col, -1), axis=0)
    c = tl.sum(tl.where(o_col == last, b_ck, 0.0), axis=0)
    b_d = tl.maximum(c + b_v, 0.0)
    if KIND == _K_SPARSEMAX:
        b_p = b_d
    else:
        b_p = b_d * b_d
    tl.store(p_ptr + row * stride_p_row + o_col, b_p.to(p_ptr.dtype.element_ty), mask=m_col)
    tl.store(c_ptr + 2 * row, c)
    tl.store(c_ptr + 2 * row + 1, 0.0)
    tl.store(passes_ptr + row, 1)


@triton.jit
def _jacobian_weight(b_p, t, KIND: tl.constexpr):
    """s = p^(2−α) on the support, 0 elsewhere.  [BLOCK]"""
    b_pos = b_p > 0
    if KIND == _K_SPARSEMAX:
        b_s = tl.where(b_pos, 1.0, 0.0)
    elif KIND == _K_ENTMAX15:
        b_s = tl.sqrt(b_p)
    elif KIND == _K_SOFTMAX:
        # same as b_p for p ≥ 0; the plain `b_s = b_p` form crashes LLVM's O3 pipeline
        # (segfault in make_llir) for fp32, BLOCK 4096, sm_90 with triton 3.9.
        b_s = tl.where(b_pos, b_p, 0.0)
    else:
        b_s = tl.where(b_pos, tl.exp2((1.0 - t) * tl.log2(tl.where(b_pos, b_p, 1.0))), 0.0)
    return b_s


@triton.jit
def _entmax_bwd_kernel(
    p_ptr, g_ptr, dx_ptr, dalpha_ptr, alpha_ptr,
    n_cols, stride_p_row, stride_g_row, stride_dx_row, alpha_stride,
    BLOCK: tl.constexpr, KIND: tl.constexpr, NEED_DALPHA: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_p = p_ptr + row * stride_p_row
    p_g = g_ptr + row * stride_g_row
    p_dx = dx_ptr + row * stride_dx_row
    t = _alpha_of_row(alpha_ptr, row, alpha_stride, KIND) - 1.0
    o_col = tl.arange(0, BLOCK)

    b_s_sum = tl.zeros([BLOCK], tl.float32)
    b_sg_sum = tl.zeros([BLOCK], tl.float32)
    b_gp_sum = tl.zeros([BLOCK], tl.float32)
    b_gpl_sum = tl.zeros([BLOCK], tl.float32)
    b_pl_sum = tl.zeros([BLOCK], tl.float32)
    b_pr_sum = tl.zeros([BLOCK], tl.float32)
    b_gpr_sum = tl.zeros([BLOCK], tl.float32)
    t_safe = tl.where(t == 0.0, 1.0, t)
    for start in range(0, n_cols, BLOCK):
        m_col = start + o_col < n_cols
        b_p = tl.load(p_p + start + o_col, mask=m_col, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + start + o_col, mask=m_col, other=0.0).to(tl.float32)
        b_s = _jacobian_weight(b_p, t, KIND)
        b_s_sum += b_s
        b_sg_sum += b_s * b_g
        if NEED_DALPHA:
            b_logp = tl.log(tl.where(b_p > 0, b_p, 1.0))
            # r = (e^y − 1 − y)/t² with y = −t·log p, i.e. s = p(1 − t·log p + t²·r);
            # a series for small y, where the direct form cancels.
            b_y = -t * b_logp
            b_series = 1.0 / 362880.0  # 1/9!, the y^7 coefficient
            for k in tl.static_range(7):
                b_series = b_series * b_y + 1.0 / _FACT[6 - k]
            b_r = tl.where(tl.abs(b_y) < 0.5, b_logp * b_logp * b_series,
                           (tl.exp(b_y) - 1.0 - b_y) / (t_safe * t_safe))
            b_gp = b_g * b_p
            b_gp_sum += b_gp
            b_gpl_sum += b_gp * b_logp
            b_pl_sum += b_p * b_logp
            b_pr_sum += b_p * b_r
            b_gpr_sum += b_gp * b_r
    s_sum = tl.sum(b_s_sum, axis=0)
    sg_sum = tl.sum(b_sg_sum, axis=0)
    # Σ g p̃ with the escort p̃ = s / Σs; an empty support gives 0.
    g_escort = tl.where(s_sum > 0, sg_sum / tl.where(s_sum > 0, s_sum, 1.0), 0.0)

    for start in range(0, n_cols, BLOCK):
        m_col = start + o_col < n_cols
        b_p = tl.load(p_p + start + o_col, mask=m_col, other=0.0).to(tl.float32)
        b_g = tl.load(p_g + start + o_col, mask=m_col, other=0.0).to(tl.float32)
        b_s = _jacobian_weight(b_p, t, KIND)
        tl.store(p_dx + start + o_col, (b_s * (b_g - g_escort)).to(dx_ptr.dtype.element_ty), mask=m_col)

    if NEED_DALPHA:
        gp = tl.sum(b_gp_sum, axis=0)
        gpl = tl.sum(b_gpl_sum, axis=0)
        pl = tl.sum(b_pl_sum, axis=0)
        pr = tl.sum(b_pr_sum, axis=0)
        gpr = tl.sum(b_gpr_sum, axis=0)
        # MATH.md §2 summed over g: dα = Σg(p − p̃)/t² + (Σgh − Σgp̃·Σh)/t, h = −p log p.
        # Far from α = 1 directly:
        d_direct = (gp - g_escort) / (t_safe * t_safe) + (g_escort * pl - gpl) / t_safe
        # Near α = 1 its two terms are O(1/t) and cancel (fp32 at α = 1.001: 10% error).
        # With s = p(1 − t·log p + t²·r) the same expression regroups exactly into
        #   [Σgp·Σpr − Σgpr + t(Σgpr·Σp log p − Σgp log p·Σpr)] / Σs
        #     + (Σp − 1)(Σgp/t² − Σgp log p/t) / Σs.
        # The second line is zero on the simplex and is dropped: evaluated literally it
        # turns p's normalisation rounding (~1e-7) into an error of 1e-7/t² (α = 1.0001:
        # O(1)). At t = 0 the first line is the exact limit −½(Σgp log²p − Σgp·Σp log²p).
        d_stable = (gp * pr - gpr + t * (gpr * pl - gpl * pr)) / tl.where(s_sum > 0, s_sum, 1.0)
        d_alpha = tl.where(tl.abs(t) < 0.25, d_stable, d_direct)
        tl.store(dalpha_ptr + row, tl.where(s_sum > 0, d_alpha, 0.0))


# ----------------------------------------------------------------------------- host side

def _num_warps(block: int) -> int:
    # 4–8 entries of the block per thread: the root kernel keeps ~8 per-lane statistics per
    # entry (sums and the per-lane minimum), 16 entries per thread took 227 registers.
    return max(4, min(16, block // 128))


def _nbins(block: int) -> int:
    return NBINS_SMALL if block <= 128 else NBINS


def _root_block(n: int) -> int:
    for block in ROOT_BLOCKS:
        if n <= block:
            return block
    return ROOT_BLOCKS[-1]


def _sort_block(n: int) -> int:
    for block in SORT_BLOCKS:
        if n <= block:
            return block
    raise ValueError(f"sort method takes rows of at most {SORT_BLOCKS[-1]} entries, got {n}")


def _alpha_args(alpha, n_rows: int, device):
    """(KIND, fp32 alpha tensor, stride) for the kernels; validates alpha."""
    if isinstance(alpha, torch.Tensor):
        if alpha.shape != (n_rows,):
            raise ValueError(f"alpha tensor must have shape ({n_rows},) (one per row), got {tuple(alpha.shape)}")
        if alpha.device != device:
            raise ValueError(f"alpha must be on {device}, got {alpha.device}")
        return KIND_GENERAL, alpha.to(torch.float32).contiguous(), 1
    alpha = float(alpha)
    if not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
    kind = {2.0: KIND_SPARSEMAX, 1.5: KIND_ENTMAX15, 1.0: KIND_SOFTMAX}.get(alpha, KIND_GENERAL)
    return kind, torch.full((1,), alpha, dtype=torch.float32, device=device), 0


def _check_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 2-D tensor (rows, n), got {got}")
    if x.dtype not in _IO_DTYPES:
        raise ValueError(f"{name} dtype must be float32, float16 or bfloat16, got {x.dtype}")
    # Kernels index columns with unit stride; another last stride costs one copy.
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def choose_method(n_cols: int, alpha) -> str:
    """'sort' for α ∈ {2, 1.5} (python float) rows of ≤ SORT_MAX_COLS, else 'root'."""
    if not isinstance(alpha, torch.Tensor) and float(alpha) in (2.0, 1.5) and n_cols <= SORT_MAX_COLS:
        return "sort"
    return "root"


def _forward(x: torch.Tensor, alpha, method: str = "auto", tol: float = DEFAULT_TOL,
             max_passes: int = DEFAULT_MAX_PASSES, nbins: int | None = None):
    """Returns (p, c, passes): output; threshold in c-form (module docstring) as (R, 2) fp32
    pairs, c = c[:, 0] + c[:, 1]; passes per row (int32)."""
    x = _check_rows("x", x)
    n_rows, n_cols = x.shape
    kind, alpha_t, alpha_stride = _alpha_args(alpha, n_rows, x.device)
    if not (tol > 0):
        raise ValueError(f"tol must be > 0, got {tol}")
    if max_passes < 3:
        raise ValueError(f"max_passes must be >= 3 (max, histogram, one evaluation), got {max_passes}")
    if method == "auto":
        method = choose_method(n_cols, alpha)
    if method not in ("sort", "root"):
        raise ValueError(f"method must be 'auto', 'sort' or 'root', got {method!r}")
    if method == "sort" and kind not in (KIND_SPARSEMAX, KIND_ENTMAX15):
        raise ValueError(f"method 'sort' needs alpha 2.0 or 1.5 given as a python float, got {alpha!r}")
    p = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    c = torch.empty((n_rows, 2), dtype=torch.float32, device=x.device)
    passes = torch.empty((n_rows,), dtype=torch.int32, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return p, c.fill_(0.0), passes.fill_(0)
    if method == "sort":
        block = _sort_block(n_cols)
        _entmax_fwd_sort_kernel[(n_rows,)](
            x, p, c, passes, n_cols, x.stride(0), p.stride(0),
            BLOCK=block, KIND=kind, num_warps=_num_warps(block), num_stages=1)
    else:
        block = _root_block(n_cols)
        _entmax_fwd_root_kernel[(n_rows,)](
            x, p, c, passes, alpha_t, n_cols, x.stride(0), p.stride(0), alpha_stride,
            float(tol), int(max_passes),
            BLOCK=block, NBINS=nbins or _nbins(block), KIND=kind, num_warps=_num_warps(block), num_stages=1)
    return p, c, passes


def entmax_rowwise_forward(x: torch.Tensor, alpha) -> torch.Tensor:
    """α-entmax of every row of ``x``.

    x: (R, n) float32/float16/bfloat16; row stride free, last stride 1 expected (else one
    ``.contiguous()`` copy). alpha: python float > 0, or float tensor (R,) of values > 0
    (not checked on the device, to avoid a host sync). Returns p (R, n) in x's dtype,
    computed in fp32. Method per `choose_method`.
    """
    return _forward(x, alpha)[0]


def entmax_rowwise_threshold(x: torch.Tensor, alpha, method: str = "auto", tol: float = DEFAULT_TOL,
                             max_passes: int = DEFAULT_MAX_PASSES):
    """(mu, passes): the reference's μ per row (fp32, (R,)) and passes over the row (int32).

    Passes count reads of the row before the output pass: 1 for sort and softmax; for root
    finding 1 (max) + 1 (histogram, α > 1) + one per evaluation of F.
    """
    _, c, passes = _forward(x, alpha, method, tol, max_passes)
    n_rows = x.shape[0]
    if isinstance(alpha, torch.Tensor):
        t = alpha.to(torch.float32) - 1
    else:
        t = torch.full((n_rows,), float(alpha) - 1, dtype=torch.float32, device=x.device)
    c = c.double().sum(-1)  # the pair, in float64 so that 1 − c keeps the low part
    t = t.double()
    t_safe = torch.where(t == 0, torch.ones_like(t), t)
    mu = torch.where(t == 0, -torch.log(c), (1 - c) / t_safe)
    return mu.float(), passes


def entmax_rowwise_backward(p: torch.Tensor, grad: torch.Tensor, alpha, need_alpha_grad: bool):
    """(dx, dalpha or None) of α-entmax from its output p (MATH.md §2).

    p, grad: (R, n), float32/float16/bfloat16 (last stride 1 expected). dx has grad's dtype;
    dalpha is fp32 (R,). At α = 1 dalpha uses the exact limit of ∂p/∂α.
    """
    p = _check_rows("p", p)
    grad = _check_rows("grad", grad)
    if grad.shape != p.shape:
        raise ValueError(f"grad must have p's shape {tuple(p.shape)}, got {tuple(grad.shape)}")
    n_rows, n_cols = p.shape
    kind, alpha_t, alpha_stride = _alpha_args(alpha, n_rows, p.device)
    dx = torch.empty((n_rows, n_cols), dtype=grad.dtype, device=p.device)
    dalpha = torch.zeros((n_rows,), dtype=torch.float32, device=p.device) if need_alpha_grad else None
    if n_rows == 0 or n_cols == 0:
        return dx, dalpha
    block = _root_block(n_cols)
    _entmax_bwd_kernel[(n_rows,)](
        p, grad, dx, dalpha if need_alpha_grad else alpha_t, alpha_t,
        n_cols, p.stride(0), grad.stride(0), dx.stride(0), alpha_stride,
        BLOCK=block, KIND=kind, NEED_DALPHA=bool(need_alpha_grad),
        num_warps=_num_warps(block), num_stages=1)
    return dx, dalpha


# ----------------------------------------------------------------------------- AOT contract

def aot_configs() -> list[dict]:
    """Every (kernel, specialisation) the launchers above can choose, for triton_kernels/aot.py.

    Integer arguments are listed as i32 (what the JIT picks for row lengths and strides
    below 2³¹); the row index is widened to int64 inside the kernels.
    """
    configs = []
    for dt_name in _IO_DTYPES.values():
        io = f"*{dt_name}"
        for kind in (KIND_GENERAL, KIND_SPARSEMAX, KIND_ENTMAX15, KIND_SOFTMAX):
            for block in ROOT_BLOCKS:
                configs.append({
                    "name": f"fwd_root_{dt_name}_k{kind}_b{block}",
                    "fn": _entmax_fwd_root_kernel,
                    "signature": {"x_ptr": io, "p_ptr": io, "c_ptr": "*fp32", "passes_ptr": "*i32",
                                  "alpha_ptr": "*fp32", "n_cols": "i32", "stride_x_row": "i32",
                                  "stride_p_row": "i32", "alpha_stride": "i32", "tol": "fp32",
                                  "max_passes": "i32", "BLOCK": "constexpr", "NBINS": "constexpr",
                                  "KIND": "constexpr"},
                    "constexprs": {"BLOCK": block, "NBINS": _nbins(block), "KIND": kind},
                    "num_warps": _num_warps(block), "num_stages": 1,
                })
                for need in (False, True):
                    configs.append({
                        "name": f"bwd_{dt_name}_k{kind}_b{block}_da{int(need)}",
                        "fn": _entmax_bwd_kernel,
                        "signature": {"p_ptr": io, "g_ptr": io, "dx_ptr": io, "dalpha_ptr": "*fp32",
                                      "alpha_ptr": "*fp32", "n_cols": "i32", "stride_p_row": "i32",
                                      "stride_g_row": "i32", "stride_dx_row": "i32",
                                      "alpha_stride": "i32", "BLOCK": "constexpr", "KIND": "constexpr",
                                      "NEED_DALPHA": "constexpr"},
                        "constexprs": {"BLOCK": block, "KIND": kind, "NEED_DALPHA": need},
                        "num_warps": _num_warps(block), "num_stages": 1,
                    })
        for kind in (KIND_SPARSEMAX, KIND_ENTMAX15):
            for block in SORT_BLOCKS:
                configs.append({
                    "name": f"fwd_sort_{dt_name}_k{kind}_b{block}",
                    "fn": _entmax_fwd_sort_kernel,
                    "signature": {"x_ptr": io, "p_ptr": io, "c_ptr": "*fp32", "passes_ptr": "*i32",
                                  "n_cols": "i32", "stride_x_row": "i32", "stride_p_row": "i32",
                                  "BLOCK": "constexpr", "KIND": "constexpr"},
                    "constexprs": {"BLOCK": block, "KIND": kind},
                    "num_warps": _num_warps(block), "num_stages": 1,
                })
    return configs
