// Branch-free exp, log and powers for the General kind's passes (row_solvers.h).
//
// Every pass of the General kind evaluates base^e for base = 1 + (alpha-1)(u - mu) on a row.
// glibc's scalar exp(log1p()) costs ~12 ns per entry here, so these passes dominated the
// whole mapping. They are written once as branch-free loop bodies and instantiated
//  - for the baseline ISA: std::exp/std::log, or multiplications for an integer exponent;
//  - for AVX2+FMA, chosen at run time on x86-64: the vectorisable vec_log/vec_exp below
//    (relative error ~3e-16 each, so a converged f(mu) stays within its double tolerance).
// All selections are bit masks (select()): under GCC's default -ftrapping-math a conditional
// expression whose arms compute floating values becomes a branch, and the loop then does not
// vectorise.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "isa_dispatch.h"

namespace entmax_fast_cpu {

namespace vecmath {

ENTMAX_FAST_ALWAYS_INLINE double select(bool take_a, double a, double b) {
  const uint64_t mask = uint64_t(0) - static_cast<uint64_t>(take_a);
  return std::bit_cast<double>((std::bit_cast<uint64_t>(a) & mask) | (std::bit_cast<uint64_t>(b) & ~mask));
}

template <bool kFma>
ENTMAX_FAST_ALWAYS_INLINE double mul_add(double a, double b, double c) {
  if constexpr (kFma) {
#if defined(__GNUC__)
    return __builtin_fma(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  } else {
    return a * b + c;
  }
}

constexpr double kLn2Hi = 6.93147180369123816490e-01;  // ln 2 with its low 32 bits zero
constexpr double kLn2Lo = 1.90821492927058770002e-10;

// log x for finite x > 0, subnormals included.
template <bool kFma>
ENTMAX_FAST_ALWAYS_INLINE double vec_log(double x) {
  const bool subnormal = x < 0x1p-1022;
  const uint64_t bits = std::bit_cast<uint64_t>(select(subnormal, x * 0x1p54, x));
  const double m1 = std::bit_cast<double>((bits & 0x000FFFFFFFFFFFFFull) | 0x3FF0000000000000ull);
  // m in [sqrt(1/2), sqrt(2)), so that |t| <= 0.172 below.
  const bool upper = m1 > 1.4142135623730951;
  const double m = select(upper, 0.5 * m1, m1);
  // The exponent field as a double via (2^52 + field) - 2^52: AVX2 has no int64 -> double.
  const double field = std::bit_cast<double>(0x4330000000000000ull | (bits >> 52)) - 0x1p52;
  const double k = field - select(subnormal, 1023.0 + 54.0, 1023.0) + select(upper, 1.0, 0.0);
  // log m = 2 atanh t = 2t (1 + t^2/3 + t^4/5 + ...), t = (m - 1)/(m + 1); the t^20 term is
  // below 2^-53 relative.
  const double t = (m - 1.0) / (m + 1.0);
  const double t2 = t * t;
  // Estrin's scheme: a shorter dependency chain than Horner's, which the loops are bound by.
  const double t4 = t2 * t2;
  const double t8 = t4 * t4;
  const double a0 = mul_add<kFma>(t2, 1.0 / 5, 1.0 / 3);
  const double a1 = mul_add<kFma>(t2, 1.0 / 9, 1.0 / 7);
  const double a2 = mul_add<kFma>(t2, 1.0 / 13, 1.0 / 11);
  const double a3 = mul_add<kFma>(t2, 1.0 / 17, 1.0 / 15);
  const double b0 = mul_add<kFma>(t4, a1, a0);
  const double b1 = mul_add<kFma>(t4, 1.0 / 19, a3);
  const double s = mul_add<kFma>(t8, mul_add<kFma>(t4, b1, a2), b0);
  const double two_t = t + t;
  return mul_add<kFma>(k, kLn2Hi, two_t + mul_add<kFma>(two_t * t2, s, k * kLn2Lo));
}

// exp y for −708 < y < 709; outside, a meaningless value (the callers below select theirs).
template <bool kFma>
ENTMAX_FAST_ALWAYS_INLINE double exp_in_range(double y) {
  constexpr double kShift = 0x1.8p52;  // adding it rounds to an integer held in the low bits
  const double shifted = mul_add<kFma>(y, 1.4426950408889634, kShift);
  const double n = shifted - kShift;
  const double r = mul_add<kFma>(-n, kLn2Lo, mul_add<kFma>(-n, kLn2Hi, y));  // |r| <= ln2/2
  // Taylor series to r^13 (the next term is below 2^-53 relative), by Estrin's scheme.
  const double r2 = r * r;
  const double r4 = r2 * r2;
  const double r8 = r4 * r4;
  const double c01 = 1.0 + r;
  const double c23 = mul_add<kFma>(r, 1.0 / 6.0, 0.5);
  const double c45 = mul_add<kFma>(r, 1.0 / 120.0, 1.0 / 24.0);
  const double c67 = mul_add<kFma>(r, 1.0 / 5040.0, 1.0 / 720.0);
  const double c89 = mul_add<kFma>(r, 1.0 / 362880.0, 1.0 / 40320.0);
  const double c1011 = mul_add<kFma>(r, 1.0 / 39916800.0, 1.0 / 3628800.0);
  const double c1213 = mul_add<kFma>(r, 1.0 / 6227020800.0, 1.0 / 479001600.0);
  const double c03 = mul_add<kFma>(r2, c23, c01);
  const double c47 = mul_add<kFma>(r2, c67, c45);
  const double c811 = mul_add<kFma>(r2, c1011, c89);
  const double c07 = mul_add<kFma>(r4, c47, c03);
  const double c813 = mul_add<kFma>(r4, c1213, c811);
  const double s = mul_add<kFma>(r8, c813, c07);
  // 2^n from n + 1023 in the exponent field; n is the shifted value's low bits.
  const uint64_t biased = std::bit_cast<uint64_t>(shifted) - 0x4338000000000000ull + 1023ull;
  return s * std::bit_cast<double>(biased << 52);
}

// exp y; 0 below e^-708 (no subnormal results: such masses are below any tolerance here),
// +inf from e^709 on, 0 for NaN.
template <bool kFma>
ENTMAX_FAST_ALWAYS_INLINE double vec_exp(double y) {
  const bool in_range = (y > -708.0) & (y < 709.0);
  return select(in_range, exp_in_range<kFma>(y), select(y >= 709.0, std::numeric_limits<double>::infinity(), 0.0));
}

// vec_exp y for y <= 0 (or NaN), with the one selection that range needs: the CRF unaries'
// (chain.cpp) with vec_exp's other selections took 4-5% longer (4096x1024 float32, one
// thread, x86-64 with AVX2, at f6ebbf6).
template <bool kFma>
ENTMAX_FAST_ALWAYS_INLINE double vec_exp_nonpositive(double y) {
  return select(y > -708.0, exp_in_range<kFma>(y), 0.0);
}

ENTMAX_FAST_ALWAYS_INLINE float fma_float(float a, float b, float c) {
#if defined(__GNUC__)
  return __builtin_fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

ENTMAX_FAST_ALWAYS_INLINE float select_float(bool take_a, float a, float b) {
  const uint32_t mask = uint32_t(0) - static_cast<uint32_t>(take_a);
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & mask) | (std::bit_cast<uint32_t>(b) & ~mask));
}

// x^beta in float for finite x > 0 (subnormals included), within 2 ulps of powf: log2 x =
// k + log2 m is split so that beta * k, the large part, is carried exactly (its fma residual)
// into 2^r. Only for FMA targets: without a fused multiply-add the residual is not exact.
ENTMAX_FAST_ALWAYS_INLINE float vec_pow_float(float x, float beta) {
  const bool subnormal = x < 0x1p-126f;
  const uint32_t bits = std::bit_cast<uint32_t>(select_float(subnormal, x * 0x1p24f, x));
  const float m1 = std::bit_cast<float>((bits & 0x007FFFFFu) | 0x3F800000u);
  const bool upper = m1 > 1.41421356f;
  const float m = select_float(upper, 0.5f * m1, m1);
  const float field = std::bit_cast<float>(0x4B000000u | (bits >> 23)) - 0x1p23f;
  const float k = field - select_float(subnormal, 127.0f + 24.0f, 127.0f) + select_float(upper, 1.0f, 0.0f);
  const float t = (m - 1.0f) / (m + 1.0f);
  const float t2 = t * t;
  // Polynomials by Estrin's scheme: the loops are bound by these dependency chains.
  const float s = fma_float(t2 * t2, fma_float(t2, 1.0f / 9, 1.0f / 7), fma_float(t2, 1.0f / 5, 1.0f / 3));
  const float ct = t * 2.8853900817779268f;  // 2/ln 2
  const float log2m = fma_float(ct * t2, s, ct);
  const float prod = beta * k;
  const float prod_err = fma_float(beta, k, -prod);
  const float total = fma_float(beta, log2m, prod);
  constexpr float kShift = 0x1.8p23f;
  const float shifted = total + kShift;
  const float n = shifted - kShift;
  const float r = (prod - n) + fma_float(beta, log2m, prod_err);
  // 2^r = e^(r ln2), |r| <= 1/2 + rounding: Taylor to degree 7.
  const float r2 = r * r;
  const float e01 = fma_float(r, 6.9314718055994531e-01f, 1.0f);
  const float e23 = fma_float(r, 5.5504108664821580e-02f, 2.4022650695910071e-01f);
  const float e45 = fma_float(r, 1.3333558146428443e-03f, 9.6181291076284772e-03f);
  const float e67 = fma_float(r, 1.5252733804059840e-05f, 1.5403530393381609e-04f);
  const float e = fma_float(r2 * r2, fma_float(r2, e67, e45), fma_float(r2, e23, e01));
  const uint32_t biased = std::bit_cast<uint32_t>(shifted) - 0x4B400000u + 127u;
  const float v = e * std::bit_cast<float>(biased << 23);
  const bool in_range = (total > -126.0f) & (total < 127.5f);
  return select_float(in_range, v, select_float(total >= 127.5f, std::numeric_limits<float>::infinity(), 0.0f));
}

ENTMAX_FAST_ALWAYS_INLINE double select_same(bool take_a, double a, double b) { return select(take_a, a, b); }
ENTMAX_FAST_ALWAYS_INLINE float select_same(bool take_a, float a, float b) { return select_float(take_a, a, b); }

// q^m for an integer 0 <= m < 16 by squarings: the same instructions for every lane.
template <typename F>
ENTMAX_FAST_ALWAYS_INLINE F small_integer_power(F q, int m) {
  F result = F(1), square = q;
  for (int bit = 0; bit < 4; ++bit) {
    result *= select_same((m >> bit) & 1, square, F(1));
    square *= square;
  }
  return result;
}

}  // namespace vecmath

// How a kernel raises base to the power e: by the std:: functions (skipping, by a branch, the
// entries outside the support), by vec_log/vec_exp (AVX2 build), or by multiplications
// (integer e; vectorises on any ISA).
enum class PowerMethod { Std, Vector, Integer };

// alpha's power law, as the kernels need it.
struct PowerLaw {
  double am1;            // alpha - 1
  double exponent;       // 1 / (alpha - 1)
  int integer_exponent;  // EntmaxParams::integer_exponent
};

// base^e (0 where base <= 0 or is not finite) and, with it, base^(e-1) and base^(e-2).
template <PowerMethod kMethod, bool kFma>
struct PowerTerms {
  double p, p_over_q, p_over_q2;

  ENTMAX_FAST_ALWAYS_INLINE PowerTerms(double q, const PowerLaw& law) {
    const bool inside = (q > 0.0) & (q < std::numeric_limits<double>::infinity());
    if constexpr (kMethod == PowerMethod::Integer) {
      p_over_q2 = vecmath::small_integer_power(q, law.integer_exponent - 2);
      p_over_q = p_over_q2 * q;
      p = p_over_q * q;
    } else {
      if constexpr (kMethod == PowerMethod::Vector) {
        p = vecmath::vec_exp<kFma>(law.exponent * vecmath::vec_log<kFma>(q));
      } else {
        p = std::exp(std::log(q) * law.exponent);
      }
      const double inv_q = 1.0 / q;
      p_over_q = p * inv_q;
      p_over_q2 = p_over_q * inv_q;
    }
    p = vecmath::select(inside, p, 0.0);
    p_over_q = vecmath::select(inside, p_over_q, 0.0);
    p_over_q2 = vecmath::select(inside, p_over_q2, 0.0);
  }
};

}  // namespace entmax_fast_cpu
