// Row solvers shared by the CPU row-wise op and the CPU attention op.
//
// Convention (docs/maths.md, "Threshold of the row-wise mappings"): with u = z - max(z),
//   p_i = [1 + (alpha-1)(u_i - mu)]_+ ^ (1/(alpha-1))      (exp(u_i - mu) at alpha == 1),
// mu in [0, (1 - n^(1-alpha))/(alpha-1)], chosen so that sum p = 1. A row is summarised by
// (max, mu); the attention backward recomputes p from these two numbers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/kinds.h"
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif
#include "isa_dispatch.h"
#include "vector_math.h"

namespace entmax_fast_cpu {

using entmax_fast::AlphaKind;
using entmax_fast::alpha_kind;

// mu is kept in double: for alpha > 2 near a uniform row, base = 1 + (alpha-1)(u - mu) is a
// tiny difference of O(1) numbers and a float mu would lose most of its digits.
template <typename T>
struct RowStats {
  T max;
  double mu;
};

// A cut in T a relative 1e-6 below a bound computed in double: beyond the rounding of the
// bound's terms and of the cast, so that every entry above the bound lies above the cut.
template <typename T>
inline T cut_below(double bound) {
  return static_cast<T>(bound - 1e-6 * (1.0 + std::abs(bound)));
}

// Everything needed to evaluate p_i and s_i = p_i^(2-alpha) for one alpha.
template <typename T>
struct EntmaxParams {
  AlphaKind kind;
  double alpha;
  double am1;       // alpha - 1
  double exponent;  // 1 / (alpha - 1)
  // k when alpha = 1 + 1/k for an integer k in [3, kMaxIntegerExponent] (1.25, 4/3, 1.2, 1.1,
  // ...), else 0: then p = base^k by multiplications. 1 + 1/k is rarely a double, so k is
  // accepted within 8 ulps of 1/(alpha-1); base^(k(1+d)) and base^k then differ by a relative
  // |d log p| < 2e-15 |log p| (1e-13 at p = 1e-20).
  int integer_exponent;

  static constexpr int kMaxIntegerExponent = 16;

  explicit EntmaxParams(double a)
      : kind(alpha_kind(a)),
        alpha(a),
        am1(a - 1.0),
        exponent(a == 1.0 ? 0.0 : 1.0 / (a - 1.0)),
        integer_exponent(detect_integer_exponent(kind, exponent)) {}

  PowerLaw law() const { return {am1, exponent, integer_exponent}; }

  static int detect_integer_exponent(AlphaKind kind, double exponent) {
    if (kind != AlphaKind::kGeneral || !(exponent >= 2.5 && exponent <= kMaxIntegerExponent + 0.5)) return 0;
    const double k = std::round(exponent);
    return std::abs(exponent - k) <= 8.0 * std::numeric_limits<double>::epsilon() * k ? static_cast<int>(k) : 0;
  }

  // p of a score z in a row with maximum zmax, for the kinds with a closed form; General rows
  // get theirs, a whole row at a time, from general_mu (forward) or general_probs (backward).
  // Formed in double from the double mu and rounded once: with mu (or u = z - zmax) rounded to
  // T, every entry of a wide support would carry the same error and the row sum would drift
  // by about support size x ulp (1 + 2.7e-4 for sparsemax of 10007 zeros in float).
  inline T prob(T z, T zmax, double mu) const {
    const double u = static_cast<double>(z) - static_cast<double>(zmax);
    switch (kind) {
      case AlphaKind::kSoftmax:
        return std::exp(static_cast<T>(u - mu));
      case AlphaKind::kSparsemax: {
        const double b = u - mu + 1.0;
        return b > 0.0 ? static_cast<T>(b) : T(0);
      }
      case AlphaKind::kEntmax15: {
        const double b = 1.0 + 0.5 * (u - mu);
        return b > 0.0 ? static_cast<T>(b * b) : T(0);
      }
      case AlphaKind::kGeneral:
        break;
    }
    throw std::logic_error("EntmaxParams::prob: General rows go through general_mu/general_probs");
  }

  // The closed forms' scale of y = scale (z - zmax), in which sparsemax's p is [y - t]_+ and
  // 1.5-entmax's [y - t]_+^2, t = scale mu - 1: 1 and 1/2 (the threshold solvers work in y).
  inline double closed_form_scale() const { return kind == AlphaKind::kSparsemax ? 1.0 : 0.5; }

  // Scores at or below this value get p = 0 at the row's (max, mu), for sparsemax and
  // 1.5-entmax (-inf for the other kinds): p > 0 needs u - mu + 1 > 0 (sparsemax) or
  // 1 + (u - mu)/2 > 0; the cut lies below that bound (cut_below), so that an entry above it
  // still gets its p from prob() exactly. Rows of wide L are mostly below it: comparing in T
  // skips their double arithmetic.
  inline T support_cut(T zmax, double mu) const {
    if (kind != AlphaKind::kSparsemax && kind != AlphaKind::kEntmax15) return -std::numeric_limits<T>::infinity();
    return cut_below<T>(static_cast<double>(zmax) + mu - 1.0 / closed_form_scale());
  }

  // s = p^(2-alpha) on the support (the Jacobian weights of docs/maths.md, "Backward"), 0
  // elsewhere, for the kinds with a closed form (General rows: general_weights).
  inline T jacobian_weight(T z, T zmax, double mu, T p) const {
    switch (kind) {
      case AlphaKind::kSoftmax:
        return p;
      case AlphaKind::kSparsemax:
        return p > T(0) ? T(1) : T(0);
      case AlphaKind::kEntmax15: {
        const double b = 1.0 + 0.5 * ((static_cast<double>(z) - static_cast<double>(zmax)) - mu);
        return b > 0.0 ? static_cast<T>(b) : T(0);
      }
      case AlphaKind::kGeneral:
        break;
    }
    throw std::logic_error("EntmaxParams::jacobian_weight: General rows go through general_weights");
  }
};

// Max of a row, or NaN when the row holds a NaN or +inf (such a row gives an all-NaN p, as
// torch.softmax does), and how many entries are finite (not -inf), which the General kind's
// bracket needs. !(z < inf) is true exactly for NaN and +inf.
template <typename T>
struct RowMax {
  T max;
  int64_t finite;
};

template <typename T>
ENTMAX_FAST_ALWAYS_INLINE RowMax<T> row_max_body(const T* z, int64_t n) {
  constexpr T inf = std::numeric_limits<T>::infinity();
  T m = -inf;
  int invalid = 0;
  int64_t finite = 0;
#pragma omp simd reduction(max : m) reduction(| : invalid) reduction(+ : finite)
  for (int64_t j = 0; j < n; ++j) {
    m = z[j] > m ? z[j] : m;
    invalid |= !(z[j] < inf);
    finite += z[j] != -inf;
  }
  return {invalid ? std::numeric_limits<T>::quiet_NaN() : m, finite};
}

// Calls fn(j), in order, for the entries j < n with z[j] > cut: a block of entries none of
// which exceeds the cut costs one vector comparison, and on the rows of attention at long
// lengths, where a few percent of the entries are candidates, most blocks are such.
// kAvx2: the caller runs the AVX2 kernels (float rows then visit only a block's hits).
#if ENTMAX_FAST_AVX2_KERNELS
template <typename F>
ENTMAX_FAST_TARGET_AVX2 inline void for_each_above_float_avx2(const float* z, int64_t n, float cut, F&& fn) {
  const __m256 cuts = _mm256_set1_ps(cut);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    unsigned mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + j), cuts, _CMP_GT_OQ)));
    while (mask != 0) {
      fn(j + __builtin_ctz(mask));
      mask &= mask - 1;
    }
  }
  for (; j < n; ++j)
    if (z[j] > cut) fn(j);
}
#endif

template <bool kAvx2, typename T, typename F>
ENTMAX_FAST_ALWAYS_INLINE void for_each_above_body(const T* z, int64_t n, T cut, F&& fn) {
#if ENTMAX_FAST_AVX2_KERNELS
  if constexpr (kAvx2 && std::is_same<T, float>::value) return for_each_above_float_avx2(z, n, cut, fn);
#endif
  constexpr int64_t kBlock = 16;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    int hits = 0;
#pragma omp simd reduction(| : hits)
    for (int64_t e = 0; e < kBlock; ++e) hits |= z[j + e] > cut;
    if (!hits) continue;
    for (int64_t e = 0; e < kBlock; ++e)
      if (z[j + e] > cut) fn(j + e);
  }
  for (; j < n; ++j)
    if (z[j] > cut) fn(j);
}

// Max of a row (NaN as row_max), with the entries dealt round-robin to kMaxLanes lanes and the
// largest of each lane into lanes[0, kMaxLanes) (-inf for a lane without entries): distinct
// entries, among the row's largest, from which closed_form_mu bounds the threshold before it
// reads the row again.
constexpr int64_t kMaxLanes = 16;

template <typename T>
ENTMAX_FAST_ALWAYS_INLINE T row_max_lanes_body(const T* z, int64_t n, T* lanes) {
  constexpr T inf = std::numeric_limits<T>::infinity();
  T m[kMaxLanes];
  for (int64_t e = 0; e < kMaxLanes; ++e) m[e] = -inf;
  int invalid = 0;
  int64_t j = 0;
  for (; j + kMaxLanes <= n; j += kMaxLanes) {
#pragma omp simd reduction(| : invalid)
    for (int64_t e = 0; e < kMaxLanes; ++e) {
      const T x = z[j + e];
      m[e] = x > m[e] ? x : m[e];
      invalid |= !(x < inf);
    }
  }
  for (int64_t e = 0; j + e < n; ++e) {
    const T x = z[j + e];
    m[e] = x > m[e] ? x : m[e];
    invalid |= !(x < inf);
  }
  T best = -inf;
  for (int64_t e = 0; e < kMaxLanes; ++e) {
    best = m[e] > best ? m[e] : best;
    lanes[e] = m[e];
  }
  return invalid ? std::numeric_limits<T>::quiet_NaN() : best;
}

#if ENTMAX_FAST_AVX2_KERNELS
// Float rows: the 16 lanes in two registers, and NaN or +inf (!(x < inf)) noted by a mask
// OR-ed per block; the portable body's reduction of that flag folds it per block.
ENTMAX_FAST_TARGET_AVX2 inline float row_max_lanes_float_avx2(const float* z, int64_t n, float* lanes) {
  static_assert(kMaxLanes == 16, "two registers of 8 lanes");
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 high = low;
  __m256 invalid = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + kMaxLanes <= n; j += kMaxLanes) {
    const __m256 a = _mm256_loadu_ps(z + j);
    const __m256 b = _mm256_loadu_ps(z + j + 8);
    low = _mm256_max_ps(a, low);  // a > low ? a : low, as the portable body (a NaN keeps low)
    high = _mm256_max_ps(b, high);
    invalid = _mm256_or_ps(invalid, _mm256_or_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ), _mm256_cmp_ps(b, inf, _CMP_NLT_UQ)));
  }
  _mm256_storeu_ps(lanes, low);
  _mm256_storeu_ps(lanes + 8, high);
  bool bad = _mm256_movemask_ps(invalid) != 0;
  for (int64_t e = 0; j + e < n; ++e) {
    const float x = z[j + e];
    lanes[e] = x > lanes[e] ? x : lanes[e];
    bad |= !(x < std::numeric_limits<float>::infinity());
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < kMaxLanes; ++e) best = lanes[e] > best ? lanes[e] : best;
  return bad ? std::numeric_limits<float>::quiet_NaN() : best;
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 inline T row_max_lanes_avx2(const T* z, int64_t n, T* lanes) {
  if constexpr (std::is_same<T, float>::value) {
    return row_max_lanes_float_avx2(z, n, lanes);
  } else {
    return row_max_lanes_body(z, n, lanes);
  }
}
#endif

template <typename T>
inline T row_max_lanes(const T* z, int64_t n, T* lanes) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return row_max_lanes_avx2(z, n, lanes);
#endif
  return row_max_lanes_body(z, n, lanes);
}

// The entries of a row above a cut at or below y = factor * (z - zmax) = floor, in order: y
// (in double) into y_out, the column into columns; returns how many. The cut lies below the
// bound (cut_below), so the entries above floor are all there, with a few just below it that
// the threshold solvers drop on their first pass. y_out and columns need kGatherSlack entries
// past the last one written.
constexpr int64_t kGatherSlack = 8;

template <typename T>
ENTMAX_FAST_ALWAYS_INLINE T gather_cut(T zmax, double factor, double floor) {
  return cut_below<T>(static_cast<double>(zmax) + floor / factor);
}

template <bool kAvx2, typename T>
ENTMAX_FAST_ALWAYS_INLINE int64_t gather_above_body(const T* z, int64_t n, T zmax, double factor, double floor,
                                                    double* y_out, int64_t* columns) {
  const double zmax_d = static_cast<double>(zmax);
  int64_t k = 0;
  for_each_above_body<kAvx2>(z, n, gather_cut(zmax, factor, floor), [&](int64_t j) {
    y_out[k] = factor * (static_cast<double>(z[j]) - zmax_d);
    columns[k++] = j;
  });
  return k;
}

#if ENTMAX_FAST_AVX2_KERNELS
// For each 8-bit mask, the lanes whose bit is set, in order, then zeros: the permutation that
// packs a block's hits to its front.
struct PackTable {
  alignas(32) int32_t lanes[256][8];
  constexpr PackTable() : lanes() {
    for (int mask = 0; mask < 256; ++mask) {
      int count = 0;
      for (int lane = 0; lane < 8; ++lane)
        if (mask & (1 << lane)) lanes[mask][count++] = lane;
    }
  }
};
inline constexpr PackTable kPackTable{};

// Float rows: per block of 8, the hits packed by one permutation and stored whole (the
// slack takes the lanes past the hits), without a branch per hit: at L 1024, where 2 % of a
// Gaussian row is above the cut (tools/threshold_candidates.py), one block in seven
// (1 - 0.98^8) holds a hit.
ENTMAX_FAST_TARGET_AVX2 inline int64_t gather_above_float_avx2(const float* z, int64_t n, float zmax, double factor,
                                                               double floor, double* y_out, int64_t* columns) {
  const float cut = gather_cut(zmax, factor, floor);
  const __m256 cuts = _mm256_set1_ps(cut);
  const __m256d zmaxs = _mm256_set1_pd(static_cast<double>(zmax));
  const __m256d factors = _mm256_set1_pd(factor);
  int64_t k = 0;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 values = _mm256_loadu_ps(z + j);
    const unsigned mask = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(values, cuts, _CMP_GT_OQ)));
    if (mask == 0) continue;
    const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPackTable.lanes[mask]));
    const __m256 packed = _mm256_permutevar8x32_ps(values, lanes);
    const __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(packed));
    const __m256d high = _mm256_cvtps_pd(_mm256_extractf128_ps(packed, 1));
    _mm256_storeu_pd(y_out + k, _mm256_mul_pd(_mm256_sub_pd(low, zmaxs), factors));
    _mm256_storeu_pd(y_out + k + 4, _mm256_mul_pd(_mm256_sub_pd(high, zmaxs), factors));
    const __m256i first = _mm256_set1_epi64x(j);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(columns + k),
                        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(lanes)), first));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(columns + k + 4),
                        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(lanes, 1)), first));
    k += __builtin_popcount(mask);
  }
  for (; j < n; ++j) {
    if (z[j] > cut) {
      y_out[k] = factor * (static_cast<double>(z[j]) - static_cast<double>(zmax));
      columns[k++] = j;
    }
  }
  return k;
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 inline int64_t gather_above_avx2(const T* z, int64_t n, T zmax, double factor, double floor,
                                                         double* y_out, int64_t* columns) {
  if constexpr (std::is_same<T, float>::value) {
    return gather_above_float_avx2(z, n, zmax, factor, floor, y_out, columns);
  } else {
    return gather_above_body<true>(z, n, zmax, factor, floor, y_out, columns);
  }
}
#endif

template <typename T>
inline int64_t gather_above(const T* z, int64_t n, T zmax, double factor, double floor, double* y_out,
                            int64_t* columns) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return gather_above_avx2(z, n, zmax, factor, floor, y_out, columns);
#endif
  return gather_above_body<false>(z, n, zmax, factor, floor, y_out, columns);
}

// Sparsemax threshold t of p = [u - t]_+ over the k entries u (overwritten), a superset of
// the support, by support iterations (Michelot): t = (sum_S u - 1)/|S|, drop the entries
// <= t, repeat. Starting from a superset of the support t only grows and the loop ends,
// exactly, when no entry is dropped.
inline double sparsemax_threshold(double* u, int64_t k) {
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += u[i];
  double t = (sum - 1.0) / static_cast<double>(k);
  for (;;) {
    // Branch-free compaction: each entry is written at the next free slot, kept by advancing
    // the count (which entries drop is data-dependent and mispredicted as a branch); the
    // select()s are bit masks, as a conditional with floating arms compiles to a branch.
    int64_t kept = 0;
    double kept_sum = 0;
    for (int64_t i = 0; i < k; ++i) {
      const double x = u[i];
      const bool keep = x > t;
      u[kept] = x;
      kept += keep;
      kept_sum += vecmath::select(keep, x, 0.0);
    }
    // The top entry (u = 0) always stays because t < 0, so kept >= 1.
    if (kept == k) break;
    k = kept;
    t = (kept_sum - 1.0) / static_cast<double>(k);
  }
  return t;
}

// 1.5-entmax threshold t of p = [y - t]_+^2 over the k entries y (overwritten; every entry
// above the threshold among them), from a start t at or left of the root.
// h(t) = sum [y - t]_+^2 - 1 is convex and decreasing, so Newton steps from the left stay
// left of the root and shrink the candidate set S = {y > t} monotonically. For the current S
// the closed-form root of sum_S (y - t)^2 = 1 is exact as soon as every entry of S lies above
// it (then S is the support). The result is never below the start.
inline double entmax15_threshold(double* y, int64_t k, double t) {
  for (int iter = 0; iter < 100; ++iter) {
    int64_t kept = 0;
    double s1 = 0, s2 = 0;
    double ymin = std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < k; ++i) {
      // Branch-free, as in sparsemax_threshold.
      const double x = y[i];
      const bool keep = x > t;
      y[kept] = x;
      kept += keep;
      const double kept_x = vecmath::select(keep, x, 0.0);
      s1 += kept_x;
      s2 += kept_x * kept_x;
      ymin = std::min(ymin, vecmath::select(keep, x, std::numeric_limits<double>::infinity()));
    }
    k = kept;
    const double kd = static_cast<double>(k);
    const double mean = s1 / kd;
    const double spread = s2 - kd * mean * mean;  // k * variance of S
    const double closed_form = mean - std::sqrt(std::max(0.0, (1.0 - spread) / kd));
    if (closed_form <= ymin) return std::max(t, closed_form);
    const double h = s2 - 2.0 * t * s1 + kd * t * t - 1.0;
    const double slope = 2.0 * (s1 - kd * t);  // -h'(t) > 0: every y in S exceeds t
    const double next = t + h / slope;
    if (!(next > t)) break;  // rounding floor reached: t is the root to working precision
    t = next;
  }
  return t;
}

// Scratch space of one row solve: gathered candidates u (or sparsemax/1.5-entmax's work),
// their columns, and p of the last pass.
struct RowWorkspace {
  std::vector<double> values;
  std::vector<int64_t> index;
  std::vector<double> probs;
  explicit RowWorkspace(int64_t n)
      : values(static_cast<size_t>(n + kGatherSlack)),
        index(static_cast<size_t>(n + kGatherSlack)),
        probs(static_cast<size_t>(n)) {}
};

// How far below the sub-row's threshold the candidates start: beyond the rounding (~1e-16
// of O(1) values) of both thresholds, so that an entry left out gets p = 0 from prob().
constexpr double kThresholdBoundMargin = 1e-9;

// mu of a sparsemax or 1.5-entmax row with finite max zmax, in y = factor * (z - zmax)
// (factor 1 for sparsemax, 1/2 for 1.5-entmax; mu = (t + 1) / factor): the threshold t of
// any subset of a row's entries is at most the row's (adding entries only adds mass), so the
// row's lane maxima (row_max_lanes) give a lower bound t_lo; only entries
// with y above it are read again: gathered with their columns (work.index: *candidates of
// them, a superset of the support at the returned mu, in column order) and solved from there
// (their y, in work.values, are compacted by the solve). On N(0, 1) rows that leaves 2.1 % of a 1.5-entmax row at L 1024 and
// 1.1 % at L 2048, for supports of 1.8 % and 1.0 %; the bound y > -1 without the lanes left
// 11.3 % and 8.0 % (tools/threshold_candidates.py, 50 rows per length).
template <typename T>
inline double closed_form_mu(const T* z, int64_t n, T zmax, const T* lanes, const EntmaxParams<T>& prm,
                             RowWorkspace& work, int64_t* candidates) {
  const bool sparsemax = prm.kind == AlphaKind::kSparsemax;
  const double factor = prm.closed_form_scale();
  const double zmax_d = static_cast<double>(zmax);
  double sub_row[kMaxLanes];
  int64_t k = 0;
  for (int64_t e = 0; e < kMaxLanes; ++e) {
    const double y = factor * (static_cast<double>(lanes[e]) - zmax_d);
    if (y > -1.0) sub_row[k++] = y;  // the others have p = 0 whatever the threshold
  }
  const double t_sub = sparsemax ? sparsemax_threshold(sub_row, k) : entmax15_threshold(sub_row, k, -1.0);
  const double t_lo = std::max(-1.0, t_sub - kThresholdBoundMargin);
  double* y = work.values.data();
  k = gather_above(z, n, zmax, factor, t_lo - kThresholdBoundMargin, y, work.index.data());
  *candidates = k;
  const double t = sparsemax ? sparsemax_threshold(y, k) : entmax15_threshold(y, k, t_lo);
  return (t + 1.0) / factor;
}

// Softmax: returns mu = log sum exp(u) and leaves exp(u) in p.
template <typename T>
inline double softmax_mu(const T* z, int64_t n, T zmax, T* p) {
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    T e = std::exp(z[j] - zmax);
    p[j] = e;
    sum += e;
  }
  return std::log(sum);
}

// Sums over entries u = x - shift of one General-kind row at mu: mass = sum p (= f + 1),
// slope = sum p/q (= -f'), curvature = sum p/q^2 (= f''/(2 - alpha)), and how many entries
// lie outside the support at mu (q = base <= 0; -inf scores included for alpha > 1).
// x is either the row itself (shift = its max) or the gathered candidates (shift = 0).
struct GeneralSums {
  double mass = 0, slope = 0, curvature = 0, outside = 0;
};

// p_out[i] receives p rounded to T (the output type), so that the pass that meets the
// tolerance leaves the row's p behind and no further pass is needed.
template <PowerMethod kMethod, bool kFma, typename T, typename X>
ENTMAX_FAST_ALWAYS_INLINE GeneralSums general_sums_body(const X* x, int64_t k, double shift, const PowerLaw& law_in,
                                                        double mu, double* p_out) {
  const PowerLaw law = law_in;  // a local copy: the stores to p_out cannot alias it
  double mass = 0, slope = 0, curvature = 0, outside = 0;
  if constexpr (kMethod == PowerMethod::Std) {
    for (int64_t i = 0; i < k; ++i) {
      const double q = 1.0 + law.am1 * ((static_cast<double>(x[i]) - shift) - mu);
      double p = 0.0;
      if (q > 0.0) {
        const PowerTerms<kMethod, kFma> t(q, law);
        p = t.p;
        mass += t.p;
        slope += t.p_over_q;
        curvature += t.p_over_q2;
      } else {
        outside += 1.0;
      }
      p_out[i] = static_cast<double>(static_cast<T>(p));
    }
  } else {
#pragma omp simd reduction(+ : mass, slope, curvature, outside)
    for (int64_t i = 0; i < k; ++i) {
      const double q = 1.0 + law.am1 * ((static_cast<double>(x[i]) - shift) - mu);
      const PowerTerms<kMethod, kFma> t(q, law);
      mass += t.p;
      slope += t.p_over_q;
      curvature += t.p_over_q2;
      outside += vecmath::select(q > 0.0, 0.0, 1.0);
      p_out[i] = static_cast<double>(static_cast<T>(t.p));
    }
  }
  return {mass, slope, curvature, outside};
}

// general_sums_body in float precision (8 float lanes, vec_pow_float, float sums): for the
// first Halley steps, which only need to bring mu near the root.
template <bool kInteger, typename X>
ENTMAX_FAST_ALWAYS_INLINE GeneralSums general_sums_float_body(const X* x, int64_t k, double shift,
                                                              const PowerLaw& law, double mu) {
  const float am1 = static_cast<float>(law.am1), exponent = static_cast<float>(law.exponent);
  const int integer_exponent = law.integer_exponent;
  const float shift_f = static_cast<float>(shift), mu_f = static_cast<float>(mu);
  float mass = 0, slope = 0, curvature = 0, outside = 0;
#pragma omp simd reduction(+ : mass, slope, curvature, outside)
  for (int64_t i = 0; i < k; ++i) {
    const float q = vecmath::fma_float(am1, (static_cast<float>(x[i]) - shift_f) - mu_f, 1.0f);
    const bool inside = (q > 0.0f) & (q < std::numeric_limits<float>::infinity());
    float p, p_over_q, p_over_q2;
    if constexpr (kInteger) {
      p_over_q2 = vecmath::small_integer_power(q, integer_exponent - 2);
      p_over_q = p_over_q2 * q;
      p = p_over_q * q;
    } else {
      p = vecmath::vec_pow_float(q, exponent);
      const float inv_q = 1.0f / q;
      p_over_q = p * inv_q;
      p_over_q2 = p_over_q * inv_q;
    }
    mass += vecmath::select_float(inside, p, 0.0f);
    slope += vecmath::select_float(inside, p_over_q, 0.0f);
    curvature += vecmath::select_float(inside, p_over_q2, 0.0f);
    outside += vecmath::select_float(q > 0.0f, 0.0f, 1.0f);
  }
  return {mass, slope, curvature, outside};
}

// The candidates of a row (finite, and u > -1/(alpha-1) for alpha > 1), counted.
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE int64_t count_candidates_body(const T* z, int64_t n, double zmax, double am1) {
  const T minus_inf = -std::numeric_limits<T>::infinity();
  int64_t candidates = 0;
#pragma omp simd reduction(+ : candidates)
  for (int64_t j = 0; j < n; ++j) {
    candidates += (z[j] != minus_inf) & ((am1 < 0) | (am1 * (static_cast<double>(z[j]) - zmax) > -1.0));
  }
  return candidates;
}

// Jacobian weights s = p^beta (beta = 2 - alpha) of a normalised row p (0 off the support);
// returns (sum s, sum s g).
template <PowerMethod kMethod, bool kFma, typename T>
ENTMAX_FAST_ALWAYS_INLINE std::pair<double, double> general_weights_body(const T* p, const T* g, T* s, int64_t n,
                                                                         double beta) {
  double s_total = 0, sg_total = 0;
  if constexpr (kMethod == PowerMethod::Std) {
    // No simd pragma on a loop that cannot vectorise: its per-lane reduction copies would
    // then live in memory.
    for (int64_t j = 0; j < n; ++j) {
      const T sj = p[j] > T(0) ? static_cast<T>(std::pow(p[j], static_cast<T>(beta))) : T(0);
      s[j] = sj;
      s_total += static_cast<double>(sj);
      sg_total += static_cast<double>(sj) * static_cast<double>(g[j]);
    }
  } else {
#pragma omp simd reduction(+ : s_total, sg_total)
    for (int64_t j = 0; j < n; ++j) {
      T sj;
      if constexpr (std::is_same<T, float>::value) {
        // Eight float lanes rather than four double ones, at the old float path's accuracy (powf).
        sj = vecmath::select_float(p[j] > 0.0f, vecmath::vec_pow_float(p[j], static_cast<float>(beta)), 0.0f);
      } else {
        const double pj = static_cast<double>(p[j]);
        sj = static_cast<T>(vecmath::select(pj > 0.0, vecmath::vec_exp<kFma>(beta * vecmath::vec_log<kFma>(pj)), 0.0));
      }
      s[j] = sj;
      s_total += static_cast<double>(sj);
      sg_total += static_cast<double>(sj) * static_cast<double>(g[j]);
    }
  }
  return {s_total, sg_total};
}

// The attention backward's p of a General-kind row from its saved (max, mu), written over
// the scores z in place: the same q and power method as the forward's final general_sums
// pass, so that p, rounded to T, is the forward's (before renormalisation). Returns sum p.
// Where w is not null, p/q of each entry goes there (0 off the support): the Jacobian
// weight p^(2-alpha) of the row once p is divided by its sum P is (p/q) P^(alpha-2), since
// p^(2-alpha) = q^((2-alpha)/(alpha-1)) = q^(1/(alpha-1) - 1); no power beyond p's own.
template <PowerMethod kMethod, bool kFma, typename T>
ENTMAX_FAST_ALWAYS_INLINE double general_probs_body(T* z, T* w, int64_t n, double zmax, const PowerLaw& law_in,
                                                    double mu) {
  const PowerLaw law = law_in;  // a local copy: the stores to z cannot alias it
  double total = 0;
  if constexpr (kMethod == PowerMethod::Std) {
    for (int64_t j = 0; j < n; ++j) {
      const double q = 1.0 + law.am1 * ((static_cast<double>(z[j]) - zmax) - mu);
      T p = T(0), p_over_q = T(0);
      if (q > 0.0) {
        const PowerTerms<kMethod, kFma> terms(q, law);
        p = static_cast<T>(terms.p);
        p_over_q = static_cast<T>(terms.p_over_q);
      }
      z[j] = p;
      if (w != nullptr) w[j] = p_over_q;
      total += static_cast<double>(p);
    }
  } else if (w != nullptr) {
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      const double q = 1.0 + law.am1 * ((static_cast<double>(z[j]) - zmax) - mu);
      const PowerTerms<kMethod, kFma> terms(q, law);
      const T p = static_cast<T>(terms.p);
      z[j] = p;
      w[j] = static_cast<T>(terms.p_over_q);
      total += static_cast<double>(p);
    }
  } else {
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      const double q = 1.0 + law.am1 * ((static_cast<double>(z[j]) - zmax) - mu);
      const T p = static_cast<T>(PowerTerms<kMethod, kFma>(q, law).p);
      z[j] = p;
      total += static_cast<double>(p);
    }
  }
  return total;
}

template <typename T>
ENTMAX_FAST_ALWAYS_INLINE int64_t count_positive_body(const T* p, int64_t n) {
  int64_t count = 0;
#pragma omp simd reduction(+ : count)
  for (int64_t j = 0; j < n; ++j) count += p[j] > T(0);
  return count;
}

// z = p / sum p, rounded to T, from a row's p in double (each already rounded to T); returns
// how many are > 0.
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE int64_t normalised_probs_body(const double* p, int64_t n, T* z) {
  double total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) total += p[j];
  const T inv = static_cast<T>(1.0 / total);
  int64_t positive = 0;
#pragma omp simd reduction(+ : positive)
  for (int64_t j = 0; j < n; ++j) {
    const T pj = static_cast<T>(p[j]) * inv;
    z[j] = pj;
    positive += pj > T(0);
  }
  return positive;
}

// (sum p, number of p > 0) of a row in one pass.
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE std::pair<double, int64_t> total_and_support_body(const T* p, int64_t n) {
  double total = 0;
  int64_t count = 0;
#pragma omp simd reduction(+ : total, count)
  for (int64_t j = 0; j < n; ++j) {
    total += static_cast<double>(p[j]);
    count += p[j] > T(0);
  }
  return {total, count};
}

template <typename T>
ENTMAX_FAST_ALWAYS_INLINE double row_alpha_grad_vector_body(const T* p, const T* g, int64_t n, double alpha,
                                                            double p_total);

#if ENTMAX_FAST_AVX2_KERNELS
// The General kind's vector passes, once per vector instruction set.
namespace avx2 {
#define ENTMAX_FAST_ISA_TARGET ENTMAX_FAST_TARGET_AVX2
#include "general_kernels.inc"
#undef ENTMAX_FAST_ISA_TARGET
}  // namespace avx2

namespace avx512 {
#define ENTMAX_FAST_ISA_TARGET ENTMAX_FAST_TARGET_AVX512
#include "general_kernels.inc"
#undef ENTMAX_FAST_ISA_TARGET
}  // namespace avx512
#endif

// The method general_sums uses for `law` on this machine.
inline PowerMethod power_method(const PowerLaw& law) {
  if (law.integer_exponent) return PowerMethod::Integer;
  return use_avx2_kernels() ? PowerMethod::Vector : PowerMethod::Std;
}

template <typename T>
inline RowMax<T> row_max(const T* z, int64_t n) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx512_kernels()) return avx512::row_max(z, n);
  if (use_avx2_kernels()) return avx2::row_max(z, n);
#endif
  return row_max_body(z, n);
}

template <typename T, typename X>
inline GeneralSums general_sums(const X* x, int64_t k, double shift, const PowerLaw& law, double mu, double* p_out) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx512_kernels()) return avx512::general_sums<T>(x, k, shift, law, mu, p_out);
  if (use_avx2_kernels()) return avx2::general_sums<T>(x, k, shift, law, mu, p_out);
#endif
  return law.integer_exponent ? general_sums_body<PowerMethod::Integer, false, T>(x, k, shift, law, mu, p_out)
                              : general_sums_body<PowerMethod::Std, false, T>(x, k, shift, law, mu, p_out);
}

#if ENTMAX_FAST_AVX2_KERNELS
// general_sums in float precision; only where the vector kernels run (use_avx2_kernels()).
template <typename X>
inline GeneralSums general_sums_float(const X* x, int64_t k, double shift, const PowerLaw& law, double mu) {
  if (use_avx512_kernels()) return avx512::general_sums_float(x, k, shift, law, mu);
  return avx2::general_sums_float(x, k, shift, law, mu);
}
#endif

template <typename T>
inline int64_t count_candidates(const T* z, int64_t n, double zmax, double am1) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx512_kernels()) return avx512::count_candidates(z, n, zmax, am1);
  if (use_avx2_kernels()) return avx2::count_candidates(z, n, zmax, am1);
#endif
  return count_candidates_body(z, n, zmax, am1);
}

template <typename T>
inline double general_probs(T* z, T* w, int64_t n, double zmax, const PowerLaw& law, double mu) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx512_kernels()) return avx512::general_probs(z, w, n, zmax, law, mu);
  if (use_avx2_kernels()) return avx2::general_probs(z, w, n, zmax, law, mu);
#endif
  return law.integer_exponent ? general_probs_body<PowerMethod::Integer, false>(z, w, n, zmax, law, mu)
                              : general_probs_body<PowerMethod::Std, false>(z, w, n, zmax, law, mu);
}

template <typename T>
inline int64_t count_positive(const T* p, int64_t n) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx512_kernels()) return avx512::count_positive(p, n);
  if (use_avx2_kernels()) return avx2::count_positive(p, n);
#endif
  return count_positive_body(p, n);
}

template <typename T>
inline int64_t normalised_probs(const double* p, int64_t n, T* z) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx512_kernels()) return avx512::normalised_probs(p, n, z);
  if (use_avx2_kernels()) return avx2::normalised_probs(p, n, z);
#endif
  return normalised_probs_body(p, n, z);
}

template <typename T>
inline std::pair<double, int64_t> total_and_support(const T* p, int64_t n) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx512_kernels()) return avx512::total_and_support(p, n);
  if (use_avx2_kernels()) return avx2::total_and_support(p, n);
#endif
  return total_and_support_body(p, n);
}

template <typename T>
inline std::pair<double, double> general_weights(const T* p, const T* g, T* s, int64_t n, double beta) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) {
    // A lane costs ~1/8 (float) or ~1/4 (double) of a pow call at AVX2's width, which the
    // portable loop spends on the support only: on sparse rows that loop is the faster one.
    const int64_t support = count_positive(p, n);
    if ((std::is_same<T, float>::value ? 8 : 4) * support > n) {
      if (use_avx512_kernels()) return avx512::general_weights(p, g, s, n, beta);
      return avx2::general_weights(p, g, s, n, beta);
    }
  }
#endif
  return general_weights_body<PowerMethod::Std, false>(p, g, s, n, beta);
}

// Copies the entries u = x - shift that are inside the support at mu = lo (and finite) to
// the front of u, with their column in `index` (from_row: the column is i; else index[i]).
// Branch-free: every entry is written at the next free slot, kept by advancing the count.
// x may be u itself (compaction in place).
template <typename X>
inline int64_t gather_candidates(const X* x, int64_t k, double shift, double am1, double lo, bool from_row, double* u,
                                 int64_t* index) {
  int64_t kept = 0;
  for (int64_t i = 0; i < k; ++i) {
    const double ui = static_cast<double>(x[i]) - shift;
    const int64_t col = from_row ? i : index[i];
    const double q = 1.0 + am1 * (ui - lo);
    u[kept] = ui;
    index[kept] = col;
    kept += (q > 0.0) & (q < std::numeric_limits<double>::infinity());
  }
  return kept;
}

// Where general_mu left the entries that can be in the support: the whole row (gathered =
// false, k = n), or the first k of the workspace (u = z - max(z), column in index);
// work.probs[0..k) holds their p at mu, rounded to T. root: mu one Newton step on, the threshold
// to save (see general_mu).
struct GeneralSolution {
  double mu;
  double root;
  int64_t k;
  bool gathered;
};

// Any alpha > 0, alpha != 1: safeguarded Halley iteration on mu within the bracket
// [0, (1 - n^(1-alpha))/(alpha-1)], f(mu) = sum p - 1 (decreasing), f'(mu) = -sum p/base,
// all in double. Steps leaving the bracket are bisections.
// For alpha > 1 only u > -1/(alpha-1) can be in the support, and an entry outside the
// support at the bracket's left end stays outside (the support shrinks as mu grows): the
// passes read the row itself while most of it can be in the support, else a gathered copy
// of the candidates, compacted as the left end moves when that pays for its own pass.
// alpha - 1 below which general_mu takes Newton steps on log(sum p) (measured on Gaussian
// rows: fewer passes below, more above).
constexpr double kLogNewtonBelow = 0.4;
// general_mu's float-precision steps: at most kMaxFloatSteps, only for |e| <= kMaxFloatExponent
// (q's rounding grows by |e| in p). With err a bound on their relative error in sum p, they
// end once |f| <= max(kFloatStepsEnd, 4 err) (a double Halley step from there lands within
// the double tolerance) and move the bracket only where |f| > 16 err, beyond any rounding.
constexpr int kMaxFloatSteps = 8;
constexpr double kMaxFloatExponent = 64.0;
constexpr double kFloatStepsEnd = 1e-5;
// A float step taken from |f| at most this lands near enough the root that the double steps
// take no more passes than from where the float steps would otherwise end: the float pass that
// would only confirm it is not made. Halley on log(sum p) (alpha - 1 < kLogNewtonBelow): 0.1;
// on sum p - 1 with f convex (alpha <= 2): 0.01; above alpha 2 every step is confirmed (from
// 0.01 the double steps took 0.3-0.4 passes more per row). Measured as passes per row over
// 2000 N(0, s^2) float rows (s 0.1, 1, 4) of 64 to 4096 entries, alpha 1.1 to 3.5: one float
// pass fewer of three at alpha 1.1 (L 1024, s 1), 0.3-0.8 fewer of 4-5 at 1.6-1.99, the
// double passes unchanged within 0.05.
inline double float_last_step_from(double am1) {
  if (am1 < kLogNewtonBelow) return 0.1;
  return am1 <= 1.0 ? 0.01 : 0.0;
}

// finite: how many of the row's entries are finite (row_max).
template <typename T>
inline GeneralSolution general_mu(const T* z, int64_t n, int64_t finite, T zmax, const EntmaxParams<T>& prm,
                                  RowWorkspace& work) {
  const PowerLaw law = prm.law();
  const double am1 = prm.am1;
  const double zmax_d = static_cast<double>(zmax);
  double* u = work.values.data();
  int64_t* index = work.index.data();
  double* probs = work.probs.data();
  // Per entry, an Integer pass costs about what a gather does, a Vector pass ~3x, a Std pass
  // ~10x (but skips entries outside the support by a branch); a compaction pays when the
  // entries it drops would cost more in the two or three passes left.
  const PowerMethod method = power_method(law);
  bool float_steps = false;
#if ENTMAX_FAST_AVX2_KERNELS
  float_steps = method != PowerMethod::Std && std::abs(law.exponent) <= kMaxFloatExponent && use_avx2_kernels();
#endif
  // Which entries the passes read first: Std passes always a gathered copy of the candidates;
  // for alpha > 1 with float steps, the row, until the first step's count of the entries
  // outside the support at mu = 0 (the candidates' complement) decides, as compact() below;
  // otherwise a pass that counts the candidates decides.
  const bool gather_on_first_step = float_steps && am1 > 0;
  bool gathered = method == PowerMethod::Std;
  if (!gathered && !gather_on_first_step) {
    const int64_t candidates = count_candidates(z, n, zmax_d, am1);
    gathered = method == PowerMethod::Vector ? 8 * (n - candidates) > n : 4 * candidates < n;
  }
  int64_t k = gathered ? gather_candidates(z, n, zmax_d, am1, 0.0, true, u, index) : n;
  auto compaction_pays = [&](double outside) {
    switch (method) {
      case PowerMethod::Integer: return 4.0 * outside > 3.0 * static_cast<double>(k);
      case PowerMethod::Vector: return 8.0 * outside > static_cast<double>(k);
      default: return 4.0 * outside > static_cast<double>(k);
    }
  };
  double lo = 0.0;
  double hi = (1.0 - std::pow(static_cast<double>(finite), -am1)) / am1;
  double mu = 0.0;
  // After the bracket's left end moved to mu: entries outside the support there are out for
  // good.
  auto compact = [&](const GeneralSums& sums) {
    if (am1 > 0 && compaction_pays(sums.outside)) {
      k = gathered ? gather_candidates(u, k, 0.0, am1, lo, false, u, index)
                   : gather_candidates(z, n, zmax_d, am1, lo, true, u, index);
      gathered = true;
    }
  };
  // For alpha <= 2, f is convex and Newton from the left end (f(0) >= 0) increases
  // monotonically to the root. Near alpha = 1 the mass behaves like exp(-mu), and Newton
  // on log(sum p) (exact for softmax) needs about half the passes. For alpha > 2 f has
  // concave pieces: every fourth step is a bisection there, which bounds the steps.
  // Halley steps (cubic convergence; f'' = (2 - alpha) sum p/q^2 costs no transcendental),
  // on log(sum p) near alpha = 1, falling back to Newton where the Halley denominator is
  // not positive.
  auto next_mu = [&](const GeneralSums& sums, int iter) {
    const double mass = sums.mass, slope = sums.slope;
    const double f2 = (2.0 - prm.alpha) * sums.curvature;
    double value, d1, d2;
    if (am1 < kLogNewtonBelow) {
      value = std::log(mass);
      d1 = -slope / mass;
      d2 = (f2 * mass - slope * slope) / (mass * mass);
    } else {
      value = mass - 1.0;
      d1 = -slope;
      d2 = f2;
    }
    const double halley_denominator = 2.0 * d1 * d1 - value * d2;
    double next = halley_denominator > 0 ? mu - 2.0 * value * d1 / halley_denominator : mu - value / d1;
    const bool forced_bisection = am1 > 1.0 && iter % 4 == 3;
    if (!(slope > 0) || !(next > lo && next < hi) || forced_bisection) next = 0.5 * (lo + hi);
    return next;
  };
#if ENTMAX_FAST_AVX2_KERNELS
  if (float_steps) {
    // Float-precision steps first, ~3x cheaper than the double ones; the double steps then
    // need about two passes. Per term: q's rounding times |e|, the power's few ulps; the float
    // sums add up to k/8 roundings per lane (8 lanes or more).
    const double last_step_from = float_last_step_from(am1);
    for (int iter = 0; iter < kMaxFloatSteps; ++iter) {
      const GeneralSums sums =
          gathered ? general_sums_float(u, k, 0.0, law, mu) : general_sums_float(z, n, zmax_d, law, mu);
      const double f = sums.mass - 1.0;
      const double err = (2.0 * std::abs(law.exponent) + 8.0 + static_cast<double>(k) / 8.0) * 0x1p-24 *
                         std::max(1.0, sums.mass);
      // The first step's mu = 0 is the bracket's left end whatever f's rounding says: the
      // entries outside the support there are out for good.
      const bool first_gather = iter == 0 && gather_on_first_step;
      if (first_gather) compact(sums);
      if (std::abs(f) <= std::max(kFloatStepsEnd, 4.0 * err)) break;
      if (f > 16.0 * err) {
        lo = mu;
        if (!first_gather) compact(sums);
      } else if (f < -16.0 * err) {
        hi = mu;
      }
      mu = next_mu(sums, iter);
      if (std::abs(f) <= last_step_from) break;
    }
  }
#endif
  // Converged to double precision even for float rows: Newton's last steps are cheap and
  // the float output then only carries its own rounding.
  const double eps = std::numeric_limits<double>::epsilon();
  const double tol = 2.0 * eps * static_cast<double>(std::max<int64_t>(finite, 1));
  const double resolution = 4.0 * eps;
  constexpr int kMaxSteps = 400;
  for (int iter = 0;; ++iter) {
    const GeneralSums sums = gathered ? general_sums<T>(u, k, 0.0, law, mu, probs)
                                      : general_sums<T>(z, n, zmax_d, law, mu, probs);
    const double f = sums.mass - 1.0;
    if (f > 0) {
      lo = mu;
    } else {
      hi = mu;
    }
    // Ends on an evaluated mu, whose p the pass just left in probs. Within the tolerance mu
    // may still be a few ulps off the root, which the backward's weights p^(2-alpha) of entries
    // at the support's edge (q -> 0) amplify by (2-alpha) q^((2-alpha)/(alpha-1) - 1) for
    // alpha < 2 (1.6e3 at q = 2e-6, alpha 1.75: a float64 dq 3e-12 off). The saved threshold
    // is then one more Newton step on, from the sums this pass has, where that step exceeds the
    // resolution the bracket's stop uses (smaller ones are within f's rounding) and stays in
    // the bracket. p at it differs from the p left here by a relative dmu/q per entry: below
    // p's rounding except at that edge.
    const double mu_resolution = resolution * std::max(1.0, std::abs(mu));
    if (std::abs(f) <= tol || hi - lo <= mu_resolution || iter == kMaxSteps) {
      double root = mu;
      if (sums.slope > 0) {
        const double step = am1 < kLogNewtonBelow ? std::log(sums.mass) * sums.mass / sums.slope : f / sums.slope;
        if (std::abs(step) > mu_resolution && mu + step >= lo && mu + step <= hi) root = mu + step;
      }
      return {mu, root, k, gathered};
    }
    if (f > 0) compact(sums);
    mu = next_mu(sums, iter);
  }
}

// p of a sparsemax or 1.5-entmax row from its (max, mu), over its scores z in place, and,
// where w is not null, the Jacobian weights into w: entries at or below support_cut() get 0
// (a block of 16 of them at the cost of one vector comparison), the others prob() and
// jacobian_weight().
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE void closed_form_probs_body(T* z, T* w, int64_t n, T zmax, double mu,
                                                      const EntmaxParams<T>& prm) {
  const T cut = prm.support_cut(zmax, mu);
  auto entry = [&](int64_t j) {
    if (z[j] > cut) {
      const T pj = prm.prob(z[j], zmax, mu);
      if (w != nullptr) w[j] = prm.jacobian_weight(z[j], zmax, mu, pj);
      z[j] = pj;
    } else {
      z[j] = T(0);
      if (w != nullptr) w[j] = T(0);
    }
  };
  constexpr int64_t kBlock = 16;
  int64_t j = 0;
  for (; j + kBlock <= n; j += kBlock) {
    int hits = 0;
#pragma omp simd reduction(| : hits)
    for (int64_t e = 0; e < kBlock; ++e) hits |= z[j + e] > cut;
    if (hits) {
      for (int64_t e = 0; e < kBlock; ++e) entry(j + e);
    } else {
      for (int64_t e = 0; e < kBlock; ++e) z[j + e] = T(0);
      if (w != nullptr)
        for (int64_t e = 0; e < kBlock; ++e) w[j + e] = T(0);
    }
  }
  for (; j < n; ++j) entry(j);
}

#if ENTMAX_FAST_AVX2_KERNELS
template <typename T>
ENTMAX_FAST_TARGET_AVX2 inline void closed_form_probs_avx2(T* z, T* w, int64_t n, T zmax, double mu,
                                                           const EntmaxParams<T>& prm) {
  closed_form_probs_body(z, w, n, zmax, mu, prm);
}
#endif

template <typename T>
inline void closed_form_probs(T* z, T* w, int64_t n, T zmax, double mu, const EntmaxParams<T>& prm) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return closed_form_probs_avx2(z, w, n, zmax, mu, prm);
#endif
  closed_form_probs_body(z, w, n, zmax, mu, prm);
}

// (max, mu) of a sparsemax or 1.5-entmax row, leaving z as it is: max NaN (and mu NaN) for a
// row holding NaN or +inf, -inf (mu 0) for a row without a finite entry. The columns of a
// superset of the support are left in work.index, *candidates of them (0 for those rows).
template <typename T>
inline RowStats<T> closed_form_stats(const T* z, int64_t n, const EntmaxParams<T>& prm, RowWorkspace& work,
                                     int64_t* candidates) {
  T lanes[kMaxLanes];
  const T zmax = row_max_lanes(z, n, lanes);
  *candidates = 0;
  if (std::isnan(zmax)) return {zmax, std::numeric_limits<double>::quiet_NaN()};
  if (!(zmax > -std::numeric_limits<T>::infinity())) return {-std::numeric_limits<T>::infinity(), 0.0};
  return {zmax, closed_form_mu(z, n, zmax, lanes, prm, work, candidates)};
}

// The support of a sparsemax or 1.5-entmax row at (max, mu) among the given columns (a
// superset of it, in column order), those below n only: the columns (plus offset) of the
// entries with p > 0 into index, their p into p and, where w is not null, their Jacobian
// weights into w; returns how many. The p and weights of closed_form_support.
template <typename T>
inline int64_t closed_form_support_among(const T* z, int64_t n, T zmax, double mu, const EntmaxParams<T>& prm,
                                         const int64_t* columns, int64_t n_columns, int64_t offset, int32_t* index,
                                         T* p, T* w) {
  int64_t count = 0;
  for (int64_t a = 0; a < n_columns; ++a) {
    const int64_t j = columns[a];
    if (j >= n) break;
    const T pj = prm.prob(z[j], zmax, mu);
    if (pj > T(0)) {
      index[count] = static_cast<int32_t>(j + offset);
      p[count] = pj;
      if (w != nullptr) w[count] = prm.jacobian_weight(z[j], zmax, mu, pj);
      ++count;
    }
  }
  return count;
}

// The support of a sparsemax or 1.5-entmax row at (max, mu), compact: the columns (plus
// offset) of the entries with p > 0 into index, their p into p and, where w is not null, their
// Jacobian weights into w, in column order; returns how many. The same p and weights as
// closed_form_probs, without a pass that writes the zeros: the entries above support_cut()
// gathered (their y and columns into work), then prob() of those.
template <typename T>
inline int64_t closed_form_support(const T* z, int64_t n, T zmax, double mu, const EntmaxParams<T>& prm,
                                   int64_t offset, int32_t* index, T* p, T* w, RowWorkspace& work) {
  // In y = factor * (z - zmax), p > 0 above t = factor * mu - 1: support_cut()'s bound.
  const double factor = prm.closed_form_scale();
  const int64_t k = gather_above(z, n, zmax, factor, factor * mu - 1.0, work.values.data(), work.index.data());
  return closed_form_support_among(z, n, zmax, mu, prm, work.index.data(), k, offset, index, p, w);
}

// Solves one row in place: on entry z holds scores (any may be -inf), on exit p; where
// support is not null, it receives how many entries have p > 0.
// `work` must hold n elements. A row without a finite entry gives zeros and max = -inf; a row
// holding NaN or +inf gives NaNs and max = mu = NaN.
template <typename T>
inline RowStats<T> entmax_row_inplace(T* z, int64_t n, const EntmaxParams<T>& prm, RowWorkspace& work,
                                      int64_t* support = nullptr) {
  const bool closed_form = prm.kind == AlphaKind::kSparsemax || prm.kind == AlphaKind::kEntmax15;
  int64_t unused_support;
  int64_t& positive = support != nullptr ? *support : unused_support;
  positive = 0;
  T lanes[kMaxLanes];
  RowMax<T> row{T(0), n};
  if (closed_form) {
    row.max = row_max_lanes(z, n, lanes);
  } else {
    row = row_max(z, n);
  }
  const T zmax = row.max;
  if (std::isnan(zmax)) {
    std::fill(z, z + n, std::numeric_limits<T>::quiet_NaN());
    return {zmax, std::numeric_limits<double>::quiet_NaN()};
  }
  if (!(zmax > -std::numeric_limits<T>::infinity())) {
    std::fill(z, z + n, T(0));
    return {-std::numeric_limits<T>::infinity(), 0.0};
  }
  double mu;
  switch (prm.kind) {
    case AlphaKind::kSoftmax: {
      mu = softmax_mu(z, n, zmax, z);
      const T inv = static_cast<T>(std::exp(-mu));
      for (int64_t j = 0; j < n; ++j) z[j] *= inv;
      if (support != nullptr) positive = count_positive(z, n);
      return {zmax, mu};
    }
    case AlphaKind::kSparsemax:
    case AlphaKind::kEntmax15: {
      int64_t k = 0;
      mu = closed_form_mu(z, n, zmax, lanes, prm, work, &k);
      // p of the candidates, then zeros over the row and p put back: on long rows, where the
      // candidates are a few percent, a fill instead of a pass of comparisons.
      const int64_t* columns = work.index.data();
      double* probs = work.probs.data();
      for (int64_t a = 0; a < k; ++a) probs[a] = static_cast<double>(prm.prob(z[columns[a]], zmax, mu));
      std::fill(z, z + n, T(0));
      for (int64_t a = 0; a < k; ++a) {
        z[columns[a]] = static_cast<T>(probs[a]);
        positive += probs[a] > 0.0;
      }
      return {zmax, mu};
    }
    default: {
      const GeneralSolution sol = general_mu(z, n, row.finite, zmax, prm, work);
      const double* probs = work.probs.data();
      // Exact normalisation on the found support: the Newton tolerance never shows in sum p.
      if (sol.gathered) {
        double total = 0;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < sol.k; ++i) total += probs[i];
        const T inv = static_cast<T>(1.0 / total);
        std::fill(z, z + n, T(0));
        for (int64_t i = 0; i < sol.k; ++i) {
          const T p = static_cast<T>(probs[i]) * inv;
          z[work.index[i]] = p;
          positive += p > T(0);
        }
      } else {
        positive = normalised_probs(probs, n, z);
      }
      return {zmax, sol.root};
    }
  }
}

// dalpha contribution of one row, sum_i g_i dp_i/dalpha (docs/maths.md, "Gradient of alpha"),
// in double: the (p - p~)/(alpha-1)^2 term cancels catastrophically in float near alpha = 1.
// At alpha == 1 the exact limit -1/2 (p log^2 p - p sum p log^2 p) is used.
template <typename T>
inline double row_alpha_grad_portable(const T* p, const T* g, int64_t n, double alpha, double p_total) {
  const double inv_total = 1.0 / p_total;
  if (alpha == 1.0) {
    double sum_plog2 = 0, sum_g_plog2 = 0, sum_g_p = 0;
    for (int64_t j = 0; j < n; ++j) {
      const double pj = p[j] * inv_total;
      if (pj > 0) {
        const double l = std::log(pj);
        sum_plog2 += pj * l * l;
        sum_g_plog2 += g[j] * pj * l * l;
        sum_g_p += g[j] * pj;
      }
    }
    return -0.5 * (sum_g_plog2 - sum_g_p * sum_plog2);
  }
  const double am1 = alpha - 1.0;
  const double beta = 2.0 - alpha;
  double s_total = 0, h_total = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double pj = p[j] * inv_total;
    if (pj > 0) {
      s_total += std::pow(pj, beta);
      h_total -= pj * std::log(pj);
    }
  }
  double acc = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double pj = p[j] * inv_total;
    if (pj > 0) {
      const double skewed = std::pow(pj, beta) / s_total;
      const double h = -pj * std::log(pj);
      acc += g[j] * ((pj - skewed) / (am1 * am1) + (h - skewed * h_total) / am1);
    }
  }
  return acc;
}

// row_alpha_grad_portable with vec_log/vec_exp, branch-free (0 < p enters through masks); for
// the vector kernel sets (FMA).
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE double row_alpha_grad_vector_body(const T* p, const T* g, int64_t n, double alpha,
                                                            double p_total) {
  using vecmath::select;
  const double inv_total = 1.0 / p_total;
  if (alpha == 1.0) {
    double sum_plog2 = 0, sum_g_plog2 = 0, sum_g_p = 0;
#pragma omp simd reduction(+ : sum_plog2, sum_g_plog2, sum_g_p)
    for (int64_t j = 0; j < n; ++j) {
      const double pj = p[j] * inv_total;
      const bool inside = pj > 0.0;
      const double l = vecmath::vec_log<true>(pj);
      const double plog2 = select(inside, pj * l * l, 0.0);
      sum_plog2 += plog2;
      sum_g_plog2 += select(inside, g[j] * plog2, 0.0);
      sum_g_p += select(inside, g[j] * pj, 0.0);
    }
    return -0.5 * (sum_g_plog2 - sum_g_p * sum_plog2);
  }
  const double am1 = alpha - 1.0;
  const double beta = 2.0 - alpha;
  double s_total = 0, h_total = 0;
#pragma omp simd reduction(+ : s_total, h_total)
  for (int64_t j = 0; j < n; ++j) {
    const double pj = p[j] * inv_total;
    const bool inside = pj > 0.0;
    const double l = vecmath::vec_log<true>(pj);
    s_total += select(inside, vecmath::vec_exp<true>(beta * l), 0.0);
    h_total += select(inside, -pj * l, 0.0);
  }
  const double inv_s_total = 1.0 / s_total;
  const double inv_am1 = 1.0 / am1;
  double acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) {
    const double pj = p[j] * inv_total;
    const bool inside = pj > 0.0;
    const double l = vecmath::vec_log<true>(pj);
    const double skewed = vecmath::vec_exp<true>(beta * l) * inv_s_total;
    const double h = -pj * l;
    acc += select(inside, g[j] * ((pj - skewed) * inv_am1 * inv_am1 + (h - skewed * h_total) * inv_am1), 0.0);
  }
  return acc;
}

template <typename T>
inline double row_alpha_grad(const T* p, const T* g, int64_t n, double alpha) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) {
    const auto [p_total, support] = total_and_support(p, n);
    if (!(p_total > 0)) return 0.0;
    // As in general_weights: the portable loop skips p = 0 by a branch, and its pow and log
    // on the support cost ~8x what the vector loop spends on every entry.
    if (8 * support > n) {
      if (use_avx512_kernels()) return avx512::row_alpha_grad(p, g, n, alpha, p_total);
      return avx2::row_alpha_grad(p, g, n, alpha, p_total);
    }
    return row_alpha_grad_portable(p, g, n, alpha, p_total);
  }
#endif
  double p_total = 0;
  for (int64_t j = 0; j < n; ++j) p_total += p[j];
  if (!(p_total > 0)) return 0.0;
  return row_alpha_grad_portable(p, g, n, alpha, p_total);
}

}  // namespace entmax_fast_cpu
