// fusedmax / oscarmax row algorithms, one implementation for the CPU operators
// (csrc/cpu/structured.cpp, plain C++) and the CUDA kernels (csrc/cuda/structured.cu), where
// the same functions are __host__ __device__. docs/maths.md, "fusedmax and oscarmax".
//
// Per row, on the m valid entries (not -inf, index < length), in this order:
//   1. RowTransform: scale by 2^-e so that |v| < 1 (exact: a power of two), and for TV also
//      subtract the scaled row max (its prox commutes with shifts). Without it, fp32 scores
//      of ~3e7 gave +inf weights (max - 1 rounds to max, so no entry lay above the
//      threshold) and scores near FLT_MAX overflowed the scans' differences and sums.
//   2. The prox on the work values: Condat's TV scan, or sort + pool-adjacent-violators.
//   3. The sparsemax threshold of d = (w - max w) 2^e (max d = 0) by Michelot's iteration,
//      written once over a caller-supplied reduction (a serial loop on the host, a block
//      reduction on the GPU).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kinds.h"

#if defined(__CUDACC__)
#define ENTMAX_FAST_HD __host__ __device__ __forceinline__
#else
#define ENTMAX_FAST_HD inline
#endif

namespace entmax_fast {
namespace structured {

using Prox = entmax_fast::Prox;

template <typename T>
ENTMAX_FAST_HD T positive_infinity() {
  return static_cast<T>(INFINITY);
}

template <typename T>
ENTMAX_FAST_HD bool is_masked(T v) {
  return v == -positive_infinity<T>();
}

// NaN or +inf: the whole row's weights and prox become NaN (torch.softmax's rule).
template <typename T>
ENTMAX_FAST_HD bool poisons_row(T v) {
  return v != v || v == positive_infinity<T>();
}

ENTMAX_FAST_HD float times_pow2(float v, int exponent) { return ldexpf(v, exponent); }
ENTMAX_FAST_HD double times_pow2(double v, int exponent) { return ldexp(v, exponent); }

ENTMAX_FAST_HD int binary_exponent(float v) {
  int exponent = 0;
  frexpf(v, &exponent);
  return exponent;
}
ENTMAX_FAST_HD int binary_exponent(double v) {
  int exponent = 0;
  frexp(v, &exponent);
  return exponent;
}

// Maps a row's valid entries to the work values the prox runs on, and back. Scaling is a
// multiplication by 2^-exponent (or 2^exponent) where that power is a float, else ldexp
// (fp32 rows with max |v| >= 2^127); both are exact up to subnormal results.
template <typename T>
struct RowTransform {
  int exponent;  // work = v 2^-exponent - shift, |v| 2^-exponent < 1
  T shift;
  T down, up;  // 2^-exponent and 2^exponent, used when both are finite and non-zero
  bool by_multiplication;
  ENTMAX_FAST_HD T scale_down(T v) const { return by_multiplication ? v * down : times_pow2(v, -exponent); }
  ENTMAX_FAST_HD T scale_up(T v) const { return by_multiplication ? v * up : times_pow2(v, exponent); }
  ENTMAX_FAST_HD T to_work(T v) const { return scale_down(v) - shift; }
  ENTMAX_FAST_HD T to_prox_output(T w) const { return scale_up(w + shift); }
  // Sparsemax is shift invariant: projecting w - max w keeps the threshold arithmetic near
  // 0 whatever the row's offset; an overflow gives -inf, which gets weight 0.
  ENTMAX_FAST_HD T to_projection_input(T w, T w_max) const { return scale_up(w - w_max); }
};

template <typename T>
ENTMAX_FAST_HD RowTransform<T> make_row_transform(Prox kind, T max_value, T max_abs) {
  RowTransform<T> transform;
  transform.exponent = max_abs > T(0) ? binary_exponent(max_abs) : 0;
  transform.down = times_pow2(T(1), -transform.exponent);
  transform.up = times_pow2(T(1), transform.exponent);
  transform.by_multiplication = transform.down != T(0) && transform.up != T(0) &&
                                transform.down != positive_infinity<T>() && transform.up != positive_infinity<T>();
  transform.shift = kind == Prox::kTV ? transform.scale_down(max_value) : T(0);
  return transform;
}

// The regularisation in work units (the prox is positively homogeneous: prox_r(c z) =
// c prox_{r/c}(z)), capped where a larger value cannot change the result, so that a huge
// lam or beta over a tiny row neither overflows nor reaches the scans as inf:
// TV: with |w| < 2 every partial sum of w - mean(w) is below 2m, and lam above that fuses
// the whole row; OSCAR: with |w| < 1 and beta >= 2, |w|_(r) - beta (m-1-r) increases with r,
// so PAV pools everything into one block of mean <= 1 - beta/2 <= 0: all zeros.
ENTMAX_FAST_HD double work_regularisation(Prox kind, double reg, int exponent, int64_t m) {
  const double scaled = ldexp(reg, -exponent);
  const double cap = kind == Prox::kTV ? 4.0 * static_cast<double>(m) : 4.0;
  return scaled < cap ? scaled : cap;
}

// Condat (2013), "A direct algorithm for 1-D total variation denoising", as a resumable
// state machine. The scan keeps the bounds vmin/vmax of the open segment [k0, k]; every read
// is at an index >= k0 and every write at an index < k0, so input and output may share the
// buffer. Each segment is written with one value, which the backward relies on (it finds
// the groups by exact equality).
//
// A jump in the main loop restarts the scan at k0 from a state that depends only on k0, the
// jump's sign and the input from k0 on (k = kplus = kminus = k0, the bounds from in[k0], umin
// = lambda, umax = -lambda). Two scans that restart at the same position with the same sign
// therefore compute the same operations from there on; the CUDA forward runs one scan per
// chunk of the row from an arbitrary start and joins them where they meet (block_tv_prox in
// csrc/cuda/structured.cu). The restarts of the row-end loop are not of this kind.
enum class TvRestart : uint8_t { kNone = 0, kNegative = 1, kPositive = 2 };
enum class TvStop { kPaused, kRestarted, kDone };

template <typename T, typename Index>
struct TvScan {
  Index k, k0, kplus, kminus;
  T umin, umax, vmin, vmax;

  // The scan of the row that begins at `at` (the whole row's scan when at = 0).
  ENTMAX_FAST_HD void start(const T* in, Index at, T lambda) {
    k = k0 = kplus = kminus = at;
    umin = lambda;
    umax = -lambda;
    vmin = in[at] - lambda;
    vmax = in[at] + lambda;
  }

  // Scans on until the next step would read in[stop] with stop < width (kPaused: resume
  // with a larger stop), until on_restart(k0, sign) returns true after a main-loop jump
  // (kRestarted: out is written below k0), or to the row's end (kDone: out[0, width) is
  // written from the start position on).
  template <typename OnRestart>
  ENTMAX_FAST_HD TvStop run(const T* in, T* out, Index stop, Index width, T lambda, OnRestart&& on_restart) {
    const T twolambda = T(2) * lambda;
    const T minlambda = -lambda;
    for (;;) {
      if (k == stop - 1) {
        if (stop < width) return TvStop::kPaused;
        if (umin < T(0)) {  // vmin too high: negative jump
          do out[k0++] = vmin; while (k0 <= kminus);
          k = kminus = k0;
          vmin = in[k0];
          umin = lambda;
          umax = vmin + umin - vmax;
        } else if (umax > T(0)) {  // vmax too low: positive jump
          do out[k0++] = vmax; while (k0 <= kplus);
          k = kplus = k0;
          vmax = in[k0];
          umax = minlambda;
          umin = vmax + umax - vmin;
        } else {
          vmin += umin / T(k - k0 + 1);
          do out[k0++] = vmin; while (k0 <= k);
          return TvStop::kDone;
        }
        continue;
      }
      umin += in[k + 1] - vmin;
      if (umin < minlambda) {  // negative jump
        do out[k0++] = vmin; while (k0 <= kminus);
        k = kplus = kminus = k0;
        vmin = in[k0];
        vmax = vmin + twolambda;
        umin = lambda;
        umax = minlambda;
        if (on_restart(k0, TvRestart::kNegative)) return TvStop::kRestarted;
        continue;
      }
      umax += in[k + 1] - vmax;
      if (umax > lambda) {  // positive jump
        do out[k0++] = vmax; while (k0 <= kplus);
        k = kplus = kminus = k0;
        vmax = in[k0];
        vmin = vmax - twolambda;
        umin = lambda;
        umax = minlambda;
        if (on_restart(k0, TvRestart::kPositive)) return TvStop::kRestarted;
        continue;
      }
      k++;  // no jump: extend the segment
      if (umin >= lambda) {
        kminus = k;
        vmin += (umin - lambda) / T(kminus - k0 + 1);
        umin = lambda;
      }
      if (umax <= minlambda) {
        kplus = k;
        vmax += (umax + lambda) / T(kplus - k0 + 1);
        umax = minlambda;
      }
    }
  }
};

// The whole row's scan on one thread, in place.
template <typename T, typename Index>
ENTMAX_FAST_HD void tv1d_prox_inplace(T* w, Index width, T lambda) {
  if (width <= 1 || lambda == T(0)) return;
  TvScan<T, Index> scan;
  scan.start(w, Index(0), lambda);
  scan.run(w, w, width, width, lambda, [](Index, TvRestart) { return false; });
}

// Keys whose unsigned ascending order is the decreasing order of |v| (non-negative IEEE
// floats order like their bit patterns; the complement reverses the order).
ENTMAX_FAST_HD uint32_t descending_abs_key(float v) {
  const float a = fabsf(v);
  uint32_t bits;
  memcpy(&bits, &a, sizeof(bits));
  return ~bits;
}
ENTMAX_FAST_HD uint64_t descending_abs_key(double v) {
  const double a = fabs(v);
  uint64_t bits;
  memcpy(&bits, &a, sizeof(bits));
  return ~bits;
}

template <typename T>
struct AbsKey;
template <>
struct AbsKey<float> {
  using type = uint32_t;
};
template <>
struct AbsKey<double> {
  using type = uint64_t;
};

// Pool-adjacent-violators for a non-increasing fit, with the blocks kept at their ranks: a
// block of ranks [s, s + len[s]) has its sum at sum[s], first[] of its last rank is s (the
// way back to the previous block), and its other ranks have len 0 (`starts`). Pooling in
// any order gives the same blocks up to rounding, so a range's blocks can be pooled on their
// own and the ranges joined afterwards (the CUDA forward does so in parallel,
// block_oscar_pav). Blocks with equal means are pooled too, so neighbouring blocks have
// distinct levels.
template <typename T, typename Index>
struct PavBlocks {
  T* sum;
  Index* len;
  Index* first;

  // mean(left) <= mean(right), cross-multiplied (lengths are positive): two products
  // instead of two IEEE divisions, on the sequential path of every pooling step. In work
  // units (|w| < 1, beta capped at 4) a block's |sum| stays below 4 m^2, so sum * len stays
  // far from overflow even at 64k entries.
  ENTMAX_FAST_HD bool violates(Index left, Index right) const {
    return sum[left] * T(len[right]) <= sum[right] * T(len[left]);
  }
  // The block at `right` joins its left neighbour at `left`; returns the pooled block's start.
  ENTMAX_FAST_HD Index pool(Index left, Index right) const {
    sum[left] += sum[right];
    len[left] += len[right];
    first[left + len[left] - 1] = left;
    len[right] = 0;
    return left;
  }
  // Pools the block at s with its left neighbours, no further left than `floor`.
  ENTMAX_FAST_HD Index settle_left(Index s, Index floor) const {
    while (s > floor && violates(first[s - 1], s)) s = pool(first[s - 1], s);
    return s;
  }
  // Appends rank r with value v as a block of its own, pooled with the blocks of [floor, r).
  ENTMAX_FAST_HD void append(Index r, T v, Index floor) const {
    sum[r] = v;
    len[r] = 1;
    first[r] = r;
    settle_left(r, floor);
  }
  // Joins the pooled ranges [floor, boundary) and [boundary, end).
  ENTMAX_FAST_HD void join(Index floor, Index boundary, Index end) const {
    Index s = first[boundary - 1];
    for (Index next = boundary; next < end && violates(s, next); next = s + len[s]) s = settle_left(pool(s, next), floor);
  }
  // Whether a block starts at rank r (of the appended ranks).
  ENTMAX_FAST_HD bool starts(Index r) const { return len[r] != 0; }
  // The OSCAR magnitude of the block at s: its mean clipped at 0.
  ENTMAX_FAST_HD T level(Index s) const {
    const T mean = sum[s] / T(len[s]);
    return mean > T(0) ? mean : T(0);
  }
};

// OSCAR's PAV input at rank r of m: |v|_(r) - w_r, w_r = beta (m-1-r).
template <typename T, typename Index>
ENTMAX_FAST_HD T oscar_pav_value(T magnitude, Index r, Index m, T beta) {
  return magnitude - beta * T(m - 1 - r);
}

// OSCAR prox magnitudes on one thread: magnitude[0..m) holds |v| sorted decreasingly and is
// replaced by the prox's |y| at the same ranks (non-increasing isotonic regression of
// oscar_pav_value, clipped at 0). blocks: scratch of m entries per array.
template <typename T, typename Index>
ENTMAX_FAST_HD void oscar_pav_inplace(T* magnitude, Index m, T beta, const PavBlocks<T, Index>& blocks) {
  for (Index r = 0; r < m; ++r) blocks.append(r, oscar_pav_value(magnitude[r], r, m, beta), Index(0));
  for (Index s = 0; s < m; s += blocks.len[s]) {
    const T level = blocks.level(s);
    for (Index r = s; r < s + blocks.len[s]; ++r) magnitude[r] = level;
  }
}

// Sign of original restored on an OSCAR magnitude (0 stays 0).
template <typename T>
ENTMAX_FAST_HD T with_sign_of(T original, T magnitude) {
  return original > T(0) ? magnitude : (original < T(0) ? -magnitude : T(0));
}

// Sparsemax threshold of d (max d = 0) by Michelot's algorithm: start at tau = -1 (every
// entry of the support lies above it), then tau = (sum_{d > tau} d - 1) / count until the set
// stops shrinking; tau only increases, so the support is never lost. reduce_above(tau, sum,
// count, smallest) sets the sum, count and smallest of the entries > tau; a reduction that
// drops the entries <= tau from its candidates (tau never decreases) is allowed. When the
// smallest entry of the set lies above the new tau, the next pass would find the same set
// and return this tau: it is returned without that pass.
template <typename T, typename Index, typename ReduceAbove>
ENTMAX_FAST_HD T sparsemax_threshold(ReduceAbove&& reduce_above) {
  T tau = T(-1);
  Index previous = -1;
  for (;;) {
    T sum = T(0), smallest = T(0);
    Index count = 0;
    reduce_above(tau, sum, count, smallest);
    if (count == previous || count == 0) return tau;
    previous = count;
    tau = (sum - T(1)) / T(count);
    if (smallest > tau) return tau;
  }
}

}  // namespace structured
}  // namespace entmax_fast
