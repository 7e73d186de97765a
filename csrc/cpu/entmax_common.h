// Row solvers shared by the CPU row-wise op and the CPU attention op.
//
// Convention (MATH.md, common brief): with u = z - max(z),
//   p_i = [1 + (alpha-1)(u_i - mu)]_+ ^ (1/(alpha-1))      (exp(u_i - mu) at alpha == 1),
// mu in [0, (1 - n^(1-alpha))/(alpha-1)], chosen so that sum p = 1. A row is summarised by
// (max, mu); the attention backward recomputes p from these two numbers.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace entmax_fast_cpu {

enum class RowKind { Softmax, Sparsemax, Entmax15, General };

inline RowKind row_kind(double alpha) {
  if (alpha == 1.0) return RowKind::Softmax;
  if (alpha == 2.0) return RowKind::Sparsemax;
  if (alpha == 1.5) return RowKind::Entmax15;
  return RowKind::General;
}

// mu is kept in double: for alpha > 2 near a uniform row, base = 1 + (alpha-1)(u - mu) is a
// tiny difference of O(1) numbers and a float mu would lose most of its digits.
template <typename T>
struct RowStats {
  T max;
  double mu;
};

// Everything needed to evaluate p_i and s_i = p_i^(2-alpha) for one alpha.
template <typename T>
struct EntmaxParams {
  RowKind kind;
  double alpha;
  double am1;       // alpha - 1
  double exponent;  // 1 / (alpha - 1)

  explicit EntmaxParams(double a)
      : kind(row_kind(a)), alpha(a), am1(a - 1.0), exponent(a == 1.0 ? 0.0 : 1.0 / (a - 1.0)) {}

  // The General kind's base 1 + (alpha-1)(u - mu), in double; <= 0 outside the support.
  inline double general_base(T z, T zmax, double mu) const {
    return 1.0 + am1 * ((static_cast<double>(z) - static_cast<double>(zmax)) - mu);
  }

  // p of a score z in a row with maximum zmax; unnormalised for the General kind.
  inline T prob(T z, T zmax, double mu) const {
    const T mu_t = static_cast<T>(mu);
    switch (kind) {
      case RowKind::Softmax:
        return std::exp(z - zmax - mu_t);
      case RowKind::Sparsemax: {
        T b = z - zmax - mu_t + T(1);
        return b > T(0) ? b : T(0);
      }
      case RowKind::Entmax15: {
        T b = T(1) + T(0.5) * (z - zmax - mu_t);
        return b > T(0) ? b * b : T(0);
      }
      default: {
        // base <= 0 is outside the support; -inf scores land there for alpha > 1 and give
        // exp(-inf) = 0 for alpha < 1.
        const double b = general_base(z, zmax, mu) - 1.0;
        return b > -1.0 ? static_cast<T>(std::exp(std::log1p(b) * exponent)) : T(0);
      }
    }
  }

  // s = p^(2-alpha) on the support (the Jacobian weights of MATH.md §2), 0 elsewhere.
  inline T jacobian_weight(T z, T zmax, double mu, T p) const {
    switch (kind) {
      case RowKind::Softmax:
        return p;
      case RowKind::Sparsemax:
        return p > T(0) ? T(1) : T(0);
      case RowKind::Entmax15: {
        T b = T(1) + T(0.5) * (z - zmax - static_cast<T>(mu));
        return b > T(0) ? b : T(0);
      }
      default: {
        // p^(2-alpha) = base^(1/(alpha-1) - 1) = p / base.
        const double base = general_base(z, zmax, mu);
        return (p > T(0) && base > 0.0) ? static_cast<T>(static_cast<double>(p) / base) : T(0);
      }
    }
  }
};

template <typename T>
inline T row_max(const T* z, int64_t n) {
  T m0 = -std::numeric_limits<T>::infinity(), m1 = m0, m2 = m0, m3 = m0;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    m0 = z[j] > m0 ? z[j] : m0;
    m1 = z[j + 1] > m1 ? z[j + 1] : m1;
    m2 = z[j + 2] > m2 ? z[j + 2] : m2;
    m3 = z[j + 3] > m3 ? z[j + 3] : m3;
  }
  for (; j < n; ++j) m0 = z[j] > m0 ? z[j] : m0;
  return std::max(std::max(m0, m1), std::max(m2, m3));
}

// Sparsemax threshold by support iterations (Michelot): t = (sum_S u - 1)/|S|, drop the
// entries <= t, repeat. Starting from a superset of the support t only grows and the
// loop ends, exactly, when no entry is dropped. Returns mu = t + 1.
template <typename T>
inline double sparsemax_mu(const T* z, int64_t n, T zmax, double* work) {
  int64_t k = 0;
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    T u = z[j] - zmax;
    // Entries with u <= -1 are outside the support whatever the threshold.
    if (u > T(-1)) {
      work[k++] = u;
      sum += u;
    }
  }
  double t = (sum - 1.0) / static_cast<double>(k);
  for (;;) {
    int64_t kept = 0;
    double kept_sum = 0;
    for (int64_t i = 0; i < k; ++i) {
      const double u = work[i];
      if (u > t) {
        work[kept++] = u;
        kept_sum += u;
      }
    }
    // The top entry (u = 0) always stays because t < 0, so kept >= 1.
    if (kept == k) break;
    k = kept;
    t = (kept_sum - 1.0) / static_cast<double>(k);
  }
  return t + 1.0;
}

// 1.5-entmax threshold on y = u/2, p = [y - t]_+^2 (t = mu/2 - 1).
// h(t) = sum [y - t]_+^2 - 1 is convex and decreasing, so Newton steps from t = -1
// (h >= 0) stay left of the root and shrink the candidate set S = {y > t} monotonically.
// For the current S the closed-form root of sum_S (y - t)^2 = 1 is exact as soon as every
// entry of S lies above it (then S is the support).
template <typename T>
inline double entmax15_mu(const T* z, int64_t n, T zmax, double* work) {
  int64_t k = 0;
  for (int64_t j = 0; j < n; ++j) {
    T y = T(0.5) * (z[j] - zmax);
    if (y > T(-1)) work[k++] = y;
  }
  double t = -1.0;
  for (int iter = 0; iter < 100; ++iter) {
    int64_t kept = 0;
    double s1 = 0, s2 = 0;
    double ymin = std::numeric_limits<double>::infinity();
    for (int64_t i = 0; i < k; ++i) {
      const double y = work[i];
      if (y > t) {
        work[kept++] = y;
        s1 += y;
        s2 += y * y;
        ymin = std::min(ymin, y);
      }
    }
    k = kept;
    const double kd = static_cast<double>(k);
    const double mean = s1 / kd;
    const double spread = s2 - kd * mean * mean;  // k * variance of S
    const double closed_form = mean - std::sqrt(std::max(0.0, (1.0 - spread) / kd));
    if (closed_form <= ymin) {
      t = std::max(t, closed_form);
      break;
    }
    const double h = s2 - 2.0 * t * s1 + kd * t * t - 1.0;
    const double slope = 2.0 * (s1 - kd * t);  // -h'(t) > 0: every y in S exceeds t
    const double next = t + h / slope;
    if (!(next > t)) break;  // rounding floor reached: t is the root to working precision
    t = next;
  }
  return 2.0 * (t + 1.0);
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

// Any alpha > 0, alpha != 1: safeguarded Halley iteration on mu within the bracket
// [0, (1 - n^(1-alpha))/(alpha-1)], f(mu) = sum p - 1 (decreasing), f'(mu) = -sum p/base,
// all in double. Steps leaving the bracket are bisections.
// For alpha > 1 an entry outside the support at the bracket's left end stays outside (the
// support shrinks as mu grows), so the candidates are compacted as the left end moves.
// alpha - 1 below which general_mu takes Newton steps on log(sum p) (measured on Gaussian
// rows: fewer passes below, more above).
constexpr double kLogNewtonBelow = 0.4;

template <typename T>
inline double general_mu(const T* z, int64_t n, T zmax, const EntmaxParams<T>& prm, double* work) {
  const double am1 = prm.am1;
  int64_t k = 0;
  int64_t n_finite = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (z[j] == -std::numeric_limits<T>::infinity()) continue;
    ++n_finite;
    const double u = static_cast<double>(z[j]) - static_cast<double>(zmax);
    if (am1 < 0 || am1 * u > -1.0) work[k++] = u;
  }
  double lo = 0.0;
  double hi = (1.0 - std::pow(static_cast<double>(n_finite), -am1)) / am1;
  double mu = 0.0;
  // Converged to double precision even for float rows: Newton's last steps are cheap and
  // the float output then only carries its own rounding.
  const double eps = std::numeric_limits<double>::epsilon();
  const double tol = 2.0 * eps * static_cast<double>(std::max<int64_t>(n_finite, 1));
  const double resolution = 4.0 * eps;
  for (int iter = 0; iter < 400; ++iter) {
    double f = -1.0, slope = 0.0, curvature = 0.0;
    int64_t kept = 0;
    for (int64_t i = 0; i < k; ++i) {
      const double u = work[i];
      const double b = am1 * (u - mu);
      if (b > -1.0) {
        const double p = std::exp(std::log1p(b) * prm.exponent);
        const double p_over_q = p / (1.0 + b);
        f += p;
        slope += p_over_q;
        curvature += p_over_q / (1.0 + b);
      }
      if (am1 < 0 || am1 * (u - lo) > -1.0) work[kept++] = u;
    }
    k = kept;
    if (f > 0) {
      lo = mu;
    } else {
      hi = mu;
    }
    if (std::abs(f) <= tol || hi - lo <= resolution * std::max(1.0, std::abs(mu))) break;
    // For alpha <= 2, f is convex and Newton from the left end (f(0) >= 0) increases
    // monotonically to the root. Near alpha = 1 the mass behaves like exp(-mu), and Newton
    // on log(sum p) (exact for softmax) needs about half the passes. For alpha > 2 f has
    // concave pieces: every fourth step is a bisection there, which bounds the steps.
    // Halley steps (cubic convergence; f'' = (2 - alpha) sum p/q^2 costs no transcendental),
    // on log(sum p) near alpha = 1, falling back to Newton where the Halley denominator is
    // not positive.
    const double mass = f + 1.0;
    const double f2 = (2.0 - prm.alpha) * curvature;
    double value, d1, d2;
    if (am1 < kLogNewtonBelow) {
      value = std::log(mass);
      d1 = -slope / mass;
      d2 = (f2 * mass - slope * slope) / (mass * mass);
    } else {
      value = f;
      d1 = -slope;
      d2 = f2;
    }
    const double halley_denominator = 2.0 * d1 * d1 - value * d2;
    double next = halley_denominator > 0 ? mu - 2.0 * value * d1 / halley_denominator : mu - value / d1;
    const bool forced_bisection = am1 > 1.0 && iter % 4 == 3;
    if (!(slope > 0) || !(next > lo && next < hi) || forced_bisection) next = 0.5 * (lo + hi);
    mu = next;
  }
  return mu;
}

// Solves one row in place: on entry z holds scores (any may be -inf), on exit p.
// `work` must hold n elements. A row without a finite entry gives zeros and max = -inf.
template <typename T>
inline RowStats<T> entmax_row_inplace(T* z, int64_t n, const EntmaxParams<T>& prm, double* work) {
  const T zmax = row_max(z, n);
  if (!(zmax > -std::numeric_limits<T>::infinity())) {
    std::fill(z, z + n, T(0));
    return {-std::numeric_limits<T>::infinity(), 0.0};
  }
  double mu;
  switch (prm.kind) {
    case RowKind::Softmax: {
      mu = softmax_mu(z, n, zmax, z);
      const T inv = static_cast<T>(std::exp(-mu));
      for (int64_t j = 0; j < n; ++j) z[j] *= inv;
      return {zmax, mu};
    }
    case RowKind::Sparsemax:
      mu = sparsemax_mu(z, n, zmax, work);
      for (int64_t j = 0; j < n; ++j) z[j] = prm.prob(z[j], zmax, mu);
      return {zmax, mu};
    case RowKind::Entmax15:
      mu = entmax15_mu(z, n, zmax, work);
      for (int64_t j = 0; j < n; ++j) z[j] = prm.prob(z[j], zmax, mu);
      return {zmax, mu};
    default: {
      mu = general_mu(z, n, zmax, prm, work);
      double total = 0;
      for (int64_t j = 0; j < n; ++j) {
        T p = prm.prob(z[j], zmax, mu);
        z[j] = p;
        total += p;
      }
      // Exact normalisation on the found support: the Newton tolerance never shows in sum p.
      const T inv = static_cast<T>(1.0 / total);
      for (int64_t j = 0; j < n; ++j) z[j] *= inv;
      return {zmax, mu};
    }
  }
}

// dalpha contribution of one row, sum_i g_i dp_i/dalpha (MATH.md §2), in double: the
// (p - p~)/(alpha-1)^2 term cancels catastrophically in float near alpha = 1.
// At alpha == 1 the exact limit -1/2 (p log^2 p - p sum p log^2 p) is used.
template <typename T>
inline double row_alpha_grad(const T* p, const T* g, int64_t n, double alpha) {
  double p_total = 0;
  for (int64_t j = 0; j < n; ++j) p_total += p[j];
  if (!(p_total > 0)) return 0.0;
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

}  // namespace entmax_fast_cpu
