// Chain marginals (CRF and SparseMAP) of one row, written once for the CPU operators
// (csrc/cpu/chain.cpp) and the CUDA kernels (csrc/cuda/chain.cu, one row per thread), where
// the same functions are __host__ __device__. docs/maths.md, "Chain marginals: CRF and
// SparseMAP".
//
// A row's chain runs over its valid positions (score not -inf) in order; masked positions
// get weight 0 and gradient 0. A row holding NaN or +inf at a valid position gets NaN
// weights and gradients (torch.softmax's rule). Arithmetic is in Acc (double on every
// device): the CRF's messages are products of exponentials of score and transition
// differences, and the TV scan of SparseMAP subtracts scores of any size.
//
// CRF: forward-backward in scaled probability space. Each step's unaries are
// exp(s·b − max(s, 0)) (one exp(−|s|) per position, kept for the second sweep) and the
// transitions exp(T − max T), both at most 1, so the messages only shrink; they are rescaled
// by a power of two when they get small.
// The backward is the covariance Cov(z, g·z) (and Cov(n_ab, g·z) for the transitions) by
// the expectation semiring: each message carries its derivative along g.
//
// SparseMAP: on a chain the pair marginals can be maximised out in closed form. With
// w = T00 + T11 − T01 − T10 the pair term of an edge is, up to a constant,
// a·μ_{j-1} + b·μ_j − (|w|/2)·|ν_j − ν_{j−1}|, where a = (T10 − T00 + T11 − T01)/2,
// b = (T01 − T00 + T11 − T10)/2 and ν = μ for w ≥ 0, ν = μ with every other position
// flipped (ν_j = 1 − μ_j at odd chain index) for w < 0. So ν = clip(prox_TV(c', |w|/2), 0, 1)
// with c = s plus the edges' linear terms, c'_j = 1 − c_j at flipped positions: the same
// TV scan as fusedmax (structured_algos.h), then a clip. Its Jacobian is that of the prox
// (the mean over each fused group) on the groups strictly inside (0, 1), and zero on the
// groups clipped to 0 or 1.
#pragma once

#include <cmath>
#include <cstdint>

#include "structured_algos.h"

namespace entmax_fast {
namespace chain {

template <typename T>
ENTMAX_FAST_HD bool is_masked(T v) {
  return structured::is_masked(v);
}

template <typename T>
ENTMAX_FAST_HD bool poisons_row(T v) {
  return structured::poisons_row(v);
}

// Whether any valid entry of the row is NaN or +inf.
template <typename T>
ENTMAX_FAST_HD bool row_is_poisoned(const T* x, int64_t n) {
  bool poisoned = false;
  for (int64_t j = 0; j < n; ++j) poisoned |= poisons_row(x[j]);
  return poisoned;
}

// The transitions of a row as exp(T − max T), indexed [2·previous + current].
struct ChainTransitions {
  double e[4];
  template <typename T>
  ENTMAX_FAST_HD explicit ChainTransitions(const T* t) {
    double top = static_cast<double>(t[0]);
    for (int i = 1; i < 4; ++i) top = fmax(top, static_cast<double>(t[i]));
    for (int i = 0; i < 4; ++i) e[i] = exp(static_cast<double>(t[i]) - top);
  }
};

// ---------------------------------------------------------------------------------------
// CRF. A two-state message is kept as two doubles, each with its full relative precision
// (a pair normalised to sum 1 and stored as one number p lost it in 1 − p: a message
// 1 − 8e-40 is 1, and a marginal that needed the 8e-40 came out 1 instead of ~0). Every
// quantity read at a position (marginal, covariance, pair terms) is a ratio of products of
// messages taken at that position, so any positive factor per position cancels: a message
// is divided by its larger entry only when that falls below 2^-256 (with its tangent), which
// keeps a division off most steps of the recursion, and every stored message's larger entry
// in [2^-256, 1], so that a product of two (α β at a key) cannot underflow. Only evidence
// beyond ~745 nats on both sides of a key (double's exp range) meets 0/0.

constexpr double kRescaleBelow = 0x1p-256;

ENTMAX_FAST_HD void rescale(double& m0, double& m1, double& t0, double& t1) {
  const double top = m0 > m1 ? m0 : m1;
  if (top < kRescaleBelow) {
    const double inverse = 1.0 / top;
    m0 *= inverse;
    m1 *= inverse;
    t0 *= inverse;
    t1 *= inverse;
  }
}

// The two states' unaries of entry j (score s), exp(−max(s, 0)) and exp(min(s, 0)): read from
// unary where the caller gave them (see crf_forward_row), else one of them exp(−|s|), which
// the first sweep over the row forms into small[j] (kForm) and the second reads back.
template <bool kForm>
ENTMAX_FAST_HD void state_unaries(double s, const double* unary, double* small, int64_t j, int64_t n, double& u0,
                                  double& u1) {
  if (unary) {
    u0 = unary[j];
    u1 = unary[n + j];
    return;
  }
  if (kForm) small[j] = exp(-fabs(s));
  u0 = s > 0 ? small[j] : 1.0;
  u1 = s > 0 ? 1.0 : small[j];
}

// Forward: mu[j] = P(z_j = 1). scratch: 3n doubles (the forward message of each position and
// its exp(−|s|)). unary, where given: the two states' unaries of the row, exp(−max(s, 0)) at
// [0, n) and exp(min(s, 0)) at [n, 2n), computed by the caller (the CPU operators, by a
// vectorised exp over the row; read rather than chosen by the sign of s, a branch the
// compiler emits and random scores mispredict half the time); scratch's third part unused.
template <typename T>
ENTMAX_FAST_HD void crf_forward_row(const T* x, const T* transitions, T* mu, double* scratch, int64_t n,
                                    const double* unary = nullptr) {
  const T nan = static_cast<T>(NAN);
  if (row_is_poisoned(x, n)) {
    for (int64_t j = 0; j < n; ++j) mu[j] = nan;
    return;
  }
  const ChainTransitions tr(transitions);
  const double* E = tr.e;
  double* alpha0 = scratch;
  double* alpha1 = scratch + n;
  double* small = scratch + 2 * n;
  bool started = false;
  double a0 = 0.0, a1 = 0.0, unused0 = 0.0, unused1 = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    if (is_masked(x[j])) continue;
    double u0, u1;
    state_unaries<true>(static_cast<double>(x[j]), unary, small, j, n, u0, u1);
    if (started) {
      const double next0 = u0 * (a0 * E[0] + a1 * E[2]);
      a1 = u1 * (a0 * E[1] + a1 * E[3]);
      a0 = next0;
    } else {
      a0 = u0;
      a1 = u1;
      started = true;
    }
    rescale(a0, a1, unused0, unused1);
    alpha0[j] = a0;
    alpha1[j] = a1;
  }
  double b0 = 1.0, b1 = 1.0;
  for (int64_t j = n - 1; j >= 0; --j) {
    if (is_masked(x[j])) {
      mu[j] = T(0);
      continue;
    }
    const double on = alpha1[j] * b1, off = alpha0[j] * b0;
    mu[j] = static_cast<T>(on / (on + off));
    double u0, u1;
    state_unaries<false>(static_cast<double>(x[j]), unary, small, j, n, u0, u1);
    const double v0 = u0 * b0, v1 = u1 * b1;
    b0 = E[0] * v0 + E[1] * v1;
    b1 = E[2] * v0 + E[3] * v1;
    rescale(b0, b1, unused0, unused1);
  }
}

// Backward: dx = Cov(z, g·z), dtransitions[ab] = Cov(n_ab, g·z). scratch: 5n doubles (per
// position the forward message, its tangent along g, scaled alike, and exp(−|s|)); with
// unary, the states' unaries as for the forward (scratch's fifth part then unused).
template <typename T>
ENTMAX_FAST_HD void crf_backward_row(const T* x, const T* transitions, const T* g, T* dx, T* dtransitions,
                                     double* scratch, int64_t n, const double* unary = nullptr) {
  if (row_is_poisoned(x, n)) {
    const T nan = static_cast<T>(NAN);
    for (int64_t j = 0; j < n; ++j) dx[j] = nan;
    for (int i = 0; i < 4; ++i) dtransitions[i] = nan;
    return;
  }
  const ChainTransitions tr(transitions);
  const double* E = tr.e;
  double* alpha0 = scratch;
  double* alpha1 = scratch + n;
  double* tangent0 = scratch + 2 * n;
  double* tangent1 = scratch + 3 * n;
  double* small = scratch + 4 * n;
  // Forward with the tangent along g: t_j(b) = d/dε of the message at s + εg, scaled as it.
  bool started = false;
  double a0 = 0.0, a1 = 0.0, t0 = 0.0, t1 = 0.0;
  int64_t last = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (is_masked(x[j])) continue;
    double u0, u1;
    state_unaries<true>(static_cast<double>(x[j]), unary, small, j, n, u0, u1);
    const double gj = static_cast<double>(g[j]);
    if (started) {
      const double A0 = a0 * E[0] + a1 * E[2], A1 = a0 * E[1] + a1 * E[3];
      const double D0 = t0 * E[0] + t1 * E[2], D1 = t0 * E[1] + t1 * E[3];
      a0 = u0 * A0;
      a1 = u1 * A1;
      t0 = u0 * D0;
      t1 = u1 * (D1 + gj * A1);
    } else {
      a0 = u0;
      a1 = u1;
      t0 = 0.0;
      t1 = u1 * gj;
      started = true;
    }
    rescale(a0, a1, t0, t1);
    alpha0[j] = a0;
    alpha1[j] = a1;
    tangent0[j] = t0;
    tangent1[j] = t1;
    last = j;
  }
  for (int i = 0; i < 4; ++i) dtransitions[i] = T(0);
  for (int64_t j = last + 1; j < n; ++j) dx[j] = T(0);
  if (last < 0) return;
  const double G = (t0 + t1) / (a0 + a1);  // E[g·z]
  // Backward: β and its tangent r (scaled alike); each valid j gives dx_j, each edge
  // (previous valid → j) its pair terms, summed without the factor E[ab] (applied once).
  double b0 = 1.0, b1 = 1.0, r0 = 0.0, r1 = 0.0;
  double pair[4] = {0, 0, 0, 0}, pair_tangent[4] = {0, 0, 0, 0};
  for (int64_t j = last; j >= 0; --j) {
    if (is_masked(x[j])) {
      dx[j] = T(0);
      continue;
    }
    const double inverse_n = 1.0 / (alpha0[j] * b0 + alpha1[j] * b1);
    dx[j] = static_cast<T>((tangent1[j] * b1 + alpha1[j] * r1 - alpha1[j] * b1 * G) * inverse_n);
    double u0, u1;
    state_unaries<false>(static_cast<double>(x[j]), unary, small, j, n, u0, u1);
    const double gj = static_cast<double>(g[j]);
    const double v0 = u0 * b0, v1 = u1 * b1;
    const double w0 = u0 * r0, w1 = u1 * (r1 + gj * b1);
    int64_t prev = j - 1;
    while (prev >= 0 && is_masked(x[prev])) {
      dx[prev] = T(0);
      --prev;
    }
    if (prev >= 0) {
      const double p0 = alpha0[prev], p1 = alpha1[prev], q0 = tangent0[prev], q1 = tangent1[prev];
      const double inverse_w =
          1.0 / (p0 * (E[0] * v0 + E[1] * v1) + p1 * (E[2] * v0 + E[3] * v1));
      pair[0] += p0 * v0 * inverse_w;
      pair[1] += p0 * v1 * inverse_w;
      pair[2] += p1 * v0 * inverse_w;
      pair[3] += p1 * v1 * inverse_w;
      pair_tangent[0] += (q0 * v0 + p0 * w0) * inverse_w;
      pair_tangent[1] += (q0 * v1 + p0 * w1) * inverse_w;
      pair_tangent[2] += (q1 * v0 + p1 * w0) * inverse_w;
      pair_tangent[3] += (q1 * v1 + p1 * w1) * inverse_w;
    }
    b0 = E[0] * v0 + E[1] * v1;
    b1 = E[2] * v0 + E[3] * v1;
    r0 = E[0] * w0 + E[1] * w1;
    r1 = E[2] * w0 + E[3] * w1;
    rescale(b0, b1, r0, r1);
    j = prev + 1;  // the loop's decrement lands on prev
  }
  for (int i = 0; i < 4; ++i) dtransitions[i] = static_cast<T>(E[i] * (pair_tangent[i] - G * pair[i]));
}

// ---------------------------------------------------------------------------------------
// SparseMAP through the TV prox.

struct SparsemapCoefficients {
  double into;   // added to c_j for j with a previous position (b above)
  double outof;  // added to c_j for j with a next position (a above)
  double lambda;
  bool flip;  // w < 0: odd chain positions are flipped
  double sign_w;
  template <typename T>
  ENTMAX_FAST_HD explicit SparsemapCoefficients(const T* t) {
    const double t00 = t[0], t01 = t[1], t10 = t[2], t11 = t[3];
    const double w = t00 + t11 - t01 - t10;
    into = (t01 - t00 + t11 - t10) / 2;
    outof = (t10 - t00 + t11 - t01) / 2;
    lambda = fabs(w) / 2;
    flip = w < 0;
    sign_w = w > 0 ? 1.0 : (w < 0 ? -1.0 : 0.0);
  }
};

// Forward: mu (T, n) and y (double, n): the prox output at valid positions (packed in
// chain order at the front of y while working, then unpacked), NaN elsewhere.
template <typename T>
ENTMAX_FAST_HD void sparsemap_forward_row(const T* x, const T* transitions, T* mu, double* y, int64_t n) {
  const double nan = static_cast<double>(NAN);
  if (row_is_poisoned(x, n)) {
    for (int64_t j = 0; j < n; ++j) {
      mu[j] = static_cast<T>(nan);
      y[j] = nan;
    }
    return;
  }
  const SparsemapCoefficients k(transitions);
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j)
    if (!is_masked(x[j])) y[m++] = static_cast<double>(x[j]);
  for (int64_t i = 0; i < m; ++i) {
    double c = y[i] + (i > 0 ? k.into : 0.0) + (i + 1 < m ? k.outof : 0.0);
    if (k.flip && (i & 1)) c = 1.0 - c;
    y[i] = c;
  }
  structured::tv1d_prox_inplace<double, int64_t>(y, m, k.lambda);
  int64_t i = m;
  for (int64_t j = n - 1; j >= 0; --j) {
    if (is_masked(x[j])) {
      mu[j] = T(0);
      y[j] = nan;
      continue;
    }
    --i;
    const double v = y[i];
    const double clipped = v < 0.0 ? 0.0 : (v > 1.0 ? 1.0 : v);
    mu[j] = static_cast<T>(k.flip && (i & 1) ? 1.0 - clipped : clipped);
    y[j] = v;
  }
}

// d(g·μ)/dλ at λ = 0+ with w = 0: y holds c (the prox with λ = 0 is the identity), taken
// flipped (c'_j = 1 − c_j at odd chain index, g alike) when `flip`. The prox's group rule
// with the groups λ = 0+ starts from: runs of exactly equal c' over consecutive valid
// positions (equal inputs fuse at once; compared by ==, as the backward groups y), each
// moving by −(left − right)/size. A group passes its rate where the clip lets it move:
// strictly inside (0, 1), or at 0 moving up, or at 1 moving down (a one-sided derivative).
// Without two equal neighbours, the usual case, every group is one position and its rate
// is right - left, both signs of data-dependent differences: formed without a branch. With
// the group loop's branches the rule took SparseMAP's forward + backward at T = 0 from 52 ms
// (no rule) to 92 ms, branch-free to 74-77 ms (4096 x 1024 float32, 2 threads, idle 2-core
// x86-64, bench/bench_structured.py --chain-only). *tie tells the caller to group instead.
template <typename T>
ENTMAX_FAST_HD double sparsemap_dlambda_at_zero_singletons(const T* x, const T* g, const double* y, int64_t n,
                                                           bool flip, bool* tie) {
  double total = 0.0, previous_value = 0.0, previous_g = 0.0, previous_left = 0.0;
  bool any_tie = false, started = false;
  int64_t chain_index = 0;
  // The previous position's term once its right neighbour's sign is known.
  auto add = [&](double right) {
    const double rate = right - previous_left;
    // & rather than &&: no short-circuit branch.
    const double inside = static_cast<double>((previous_value > 0.0) & (previous_value < 1.0));
    const double up = static_cast<double>((previous_value == 0.0) & (rate > 0.0));
    const double down = static_cast<double>((previous_value == 1.0) & (rate < 0.0));
    total += previous_g * rate * (inside + up + down);
  };
  for (int64_t j = 0; j < n; ++j) {
    if (is_masked(x[j])) continue;
    const double sign = 1.0 - 2.0 * static_cast<double>(flip & ((chain_index & 1) != 0));
    const double v = (1.0 - sign) / 2 + sign * y[j];  // 1 - y[j] where flipped
    if (started) {
      const double right = static_cast<double>(v > previous_value) - static_cast<double>(v < previous_value);
      any_tie |= v == previous_value;
      add(right);
      previous_left = right;
    }
    previous_value = v;
    previous_g = sign * static_cast<double>(g[j]);
    started = true;
    ++chain_index;
  }
  if (started) add(0.0);
  *tie = any_tie;
  return total;
}

template <typename T>
ENTMAX_FAST_HD double sparsemap_dlambda_at_zero(const T* x, const T* g, const double* y, int64_t n, bool flip) {
  bool tie = false;
  const double singletons = sparsemap_dlambda_at_zero_singletons(x, g, y, n, flip, &tie);
  if (!tie) return singletons;
  double total = 0.0, group_value = 0.0, group_sum = 0.0, group_left = 0.0;
  int64_t group_size = 0, chain_index = 0;
  auto close = [&](double right) {
    const double rate = -(group_left - right) / static_cast<double>(group_size);
    const bool moves = (group_value > 0.0 && group_value < 1.0) || (group_value == 0.0 && rate > 0.0) ||
                       (group_value == 1.0 && rate < 0.0);
    if (moves) total += group_sum * rate;
  };
  for (int64_t j = 0; j < n; ++j) {
    if (is_masked(x[j])) continue;
    const bool flipped = flip && (chain_index & 1);
    const double v = flipped ? 1.0 - y[j] : y[j];
    if (group_size > 0 && v != group_value) {
      const double right = v > group_value ? 1.0 : -1.0;
      close(right);
      group_left = right;
      group_size = 0;
    }
    if (group_size == 0) {
      group_value = v;
      group_sum = 0.0;
    }
    group_sum += flipped ? -static_cast<double>(g[j]) : static_cast<double>(g[j]);
    ++group_size;
    ++chain_index;
  }
  if (group_size > 0) close(0.0);
  return total;
}

// Backward from the prox output y of the forward (read at valid positions only). Groups:
// runs of equal y over consecutive valid positions (the TV scan writes one value per group;
// with lambda = 0 every position is its own group). A group's value v moves with its inputs
// by their mean, and with lambda by −(left − right)/size, left = sign(v − previous group's
// value), right = sign(next group's value − v) (0 at the chain's ends).
// At w = 0 the loss has a kink in w (w > 0 leaves c as is, w < 0 flips it, both with
// λ = |w|/2 → 0+): dw is the element of least magnitude between the one-sided derivatives
// D+ = dλ+/2 and D− = −dλ−/2 (docs/maths.md): 0 where they straddle 0, their common value
// where the loss is smooth.
template <typename T>
ENTMAX_FAST_HD void sparsemap_backward_row(const T* x, const T* transitions, const T* g, const double* y, T* dx,
                                           T* dtransitions, int64_t n) {
  if (row_is_poisoned(x, n)) {
    const T nan = static_cast<T>(NAN);
    for (int64_t j = 0; j < n; ++j) dx[j] = nan;
    for (int i = 0; i < 4; ++i) dtransitions[i] = nan;
    return;
  }
  const SparsemapCoefficients k(transitions);
  const bool grouped = k.lambda > 0;
  int64_t m = 0;
  for (int64_t j = 0; j < n; ++j) m += !is_masked(x[j]);
  double sum_into = 0.0, sum_outof = 0.0, dlambda = 0.0;
  // The open group: its first position, first chain index, size, value, sum of the
  // (flipped) incoming gradient, and the sign towards the previous group.
  int64_t group_start = -1, group_index = 0, group_size = 0;
  double group_value = 0.0, group_sum = 0.0, group_left = 0.0;
  auto flush = [&](int64_t stop, double right) {
    const double mean = group_sum / static_cast<double>(group_size);
    if (grouped) dlambda += group_sum * -(group_left - right) / static_cast<double>(group_size);
    int64_t index = group_index;
    for (int64_t at = group_start; at < stop; ++at) {
      if (is_masked(x[at])) continue;
      const double dc = (k.flip && (index & 1)) ? -mean : mean;
      dx[at] = static_cast<T>(dc);
      if (index > 0) sum_into += dc;
      if (index + 1 < m) sum_outof += dc;
      ++index;
    }
  };
  int64_t chain_index = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (is_masked(x[j])) {
      dx[j] = T(0);
      continue;
    }
    const double v = y[j];
    if (group_size > 0 && (!grouped || v != group_value)) {
      const double right = v > group_value ? 1.0 : -1.0;
      flush(j, right);
      group_left = right;
      group_size = 0;
    }
    if (group_size == 0) {
      group_start = j;
      group_index = chain_index;
      group_value = v;
      group_sum = 0.0;
    }
    const double flipped = (k.flip && (chain_index & 1)) ? -1.0 : 1.0;
    group_sum += (v > 0.0 && v < 1.0) ? flipped * static_cast<double>(g[j]) : 0.0;
    ++group_size;
    ++chain_index;
  }
  if (group_size > 0) flush(n, 0.0);
  double dw = dlambda * k.sign_w / 2;
  if (!grouped) {
    const double right_side = sparsemap_dlambda_at_zero(x, g, y, n, false) / 2;
    const double left_side = -sparsemap_dlambda_at_zero(x, g, y, n, true) / 2;
    const double low = fmin(left_side, right_side), high = fmax(left_side, right_side);
    dw = low > 0.0 ? low : (high < 0.0 ? high : 0.0);
  }
  const double A = sum_into, B = sum_outof;
  dtransitions[0] = static_cast<T>(-(A + B) / 2 + dw);
  dtransitions[1] = static_cast<T>((A - B) / 2 - dw);
  dtransitions[2] = static_cast<T>((B - A) / 2 - dw);
  dtransitions[3] = static_cast<T>((A + B) / 2 + dw);
}

}  // namespace chain
}  // namespace entmax_fast
