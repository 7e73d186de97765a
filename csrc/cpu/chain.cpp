// CRF marginals and SparseMAP over a chain, CPU operators: rows in parallel, each row by the
// shared row functions of csrc/common/chain_algos.h (docs/maths.md, "Chain marginals: CRF
// and SparseMAP"), except the CRF's rows without −inf, NaN or +inf, which run four at a time
// in the lanes of a vector (crf_plain_rows below). The operators take rows x (R, n) and one
// 2x2 transition matrix per row (R, 2, 2); the forward returns (mu, saved): for SparseMAP
// saved is the float64 TV-prox output its backward reads the fused groups from, for the CRF
// an empty tensor (its backward recomputes the forward messages).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/chain_algos.h"
#include "../common/chain_ops.h"
#include "isa_dispatch.h"
#include "vector_math.h"

namespace entmax_fast {
namespace chain_cpu {

using chain::ChainKind;

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// The two states' unaries of n scores (chain_algos.h's unary): exp(−max(s, 0)) to unary0,
// exp(min(s, 0)) to unary1: one is 1, the other exp(−|s|), one branch-free
// vec_exp_nonpositive per entry so that the loop vectorises (masked, −inf, entries get 1 and
// 0 and are not read).
template <bool kFma, typename T>
ENTMAX_FAST_ALWAYS_INLINE void crf_state_unaries_body(const T* x, double* unary0, double* unary1, int64_t n) {
  using entmax_fast_cpu::vecmath::select;
  for (int64_t j = 0; j < n; ++j) {
    // select(), not a conditional expression: under -ftrapping-math that is a branch, and the
    // loop then does not vectorise.
    const double s = static_cast<double>(x[j]);
    const bool positive = s > 0.0;
    const double small = entmax_fast_cpu::vecmath::vec_exp_nonpositive<kFma>(-std::fabs(s));
    unary0[j] = select(positive, small, 1.0);
    unary1[j] = select(positive, 1.0, small);
  }
}

// Whether a row is plain: only finite entries (no −inf, NaN or +inf), by integer tests on the
// exponent field, a loop that vectorises (the same test by floating-point compares did not,
// and was a quarter of the CRF backward's perf samples once its recursions ran in lanes:
// 4096 rows of 1024 float32, one thread, x86-64 with AVX2).
template <typename T>
bool row_is_plain(const T* x, int64_t n) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr Bits kExponent = sizeof(T) == 4 ? Bits(0x7F800000u) : Bits(0x7FF0000000000000ull);
  Bits special = 0;
  for (int64_t j = 0; j < n; ++j) {
    Bits bits;
    __builtin_memcpy(&bits, x + j, sizeof(bits));
    special |= Bits((bits & kExponent) == kExponent);
  }
  return special == 0;
}

template <typename T>
void crf_state_unaries_portable(const T* x, double* unary, int64_t n) {
  crf_state_unaries_body<false>(x, unary, unary + n, n);
}

#if ENTMAX_FAST_AVX2_KERNELS
template <typename T>
ENTMAX_FAST_TARGET_AVX2 void crf_state_unaries_avx2(const T* x, double* unary, int64_t n) {
  crf_state_unaries_body<true>(x, unary, unary + n, n);
}
#endif

// A row's unaries: state 0 to unary[0, n), state 1 to unary[n, 2n).
template <typename T>
void crf_state_unaries(const T* x, double* unary, int64_t n) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (entmax_fast_cpu::use_avx2_kernels()) return crf_state_unaries_avx2(x, unary, n);
#endif
  crf_state_unaries_portable(x, unary, n);
}

// ---------------------------------------------------------------------------------------
// The CRF of K plain rows at once, one SIMD lane per row.
//
// One row at a time (chain::crf_forward_row, crf_backward_row) is bound by the recursions'
// latency: each step's messages wait on the previous step's multiply-adds. Here the K rows'
// recursions run in the lanes of one vector of K doubles (GCC's vector extension), their
// inputs transposed to position-major order ([j][k]) so that a step reads one vector per
// quantity. float64 arithmetic and the one-row functions' rescaling rule (a message divided
// by its larger entry when that falls below 2^-256, here when any lane's does: a branch taken
// rarely, its test cheapened per block of steps by note_low); the products u_b·E_ab are
// formed first, so that a step of a recursion is one multiply and one multiply-add (the
// results differ from the one-row functions' by rounding).
// Two changes in the backward save work:
//  - the pair term of the edge (j−1, j) has the normaliser Σ_ab α_{j−1}(a) E_ab u_j(b) β_j(b)
//    = (α_j·β_j) / c_j, c_j the forward's rescale factor at j (1 but at the few positions
//    where it rescaled, which it records): one division per position serves the key and its
//    edge;
//  - only the pair term of n_11 is summed: with m chain positions, n_01 + n_11 = Σ_{j≥2} z_j,
//    n_10 + n_11 = Σ_{j≤m−1} z_j and Σ_ab n_ab = m − 1, so Cov(n_ab, g·z) for the other three
//    follow from Cov(n_11, g·z) and the sums of dx_j = Cov(z_j, g·z).
//
// (An alias template with a dependent vector_size drops the attribute: one typedef per K;
// K = 4 only, see kCrfLanes.)
// Vectors are read and written in place through `memory` (unaligned, may alias double) and
// never passed by value, so that no vector crosses a call in the baseline-ISA build (GCC
// warns that such a call's ABI differs without AVX).
template <int K>
struct LanesOf;
template <>
struct LanesOf<4> {
  typedef double type __attribute__((vector_size(32)));
  typedef double memory __attribute__((vector_size(32), aligned(8), may_alias));
  typedef long long mask __attribute__((vector_size(32)));  // a comparison's lanes: all ones or zero
};
template <int K>
using Lanes = typename LanesOf<K>::type;
template <int K>
using LaneMask = typename LanesOf<K>::mask;

// Lanes of a where take_a, else of b (bitwise: no conditional expression on vectors, which
// not every GCC-compatible compiler accepts).
template <int K>
ENTMAX_FAST_ALWAYS_INLINE void select_lanes(const LaneMask<K>& take_a, const Lanes<K>& a, const Lanes<K>& b,
                                            Lanes<K>& out) {
  out = (Lanes<K>)(((LaneMask<K>)a & take_a) | ((LaneMask<K>)b & ~take_a));
}

// Two-vector shuffles: __builtin_shuffle in GCC (__builtin_shufflevector only from GCC 12),
// __builtin_shufflevector in Clang.
#if defined(__clang__)
#define ENTMAX_FAST_SHUFFLE4(a, b, i0, i1, i2, i3) __builtin_shufflevector(a, b, i0, i1, i2, i3)
#else
#define ENTMAX_FAST_SHUFFLE4(a, b, i0, i1, i2, i3) __builtin_shuffle(a, b, LaneMask<4>{i0, i1, i2, i3})
#endif

template <int K>
ENTMAX_FAST_ALWAYS_INLINE const typename LanesOf<K>::memory& lanes_at(const double* p) {
  return *reinterpret_cast<const typename LanesOf<K>::memory*>(p);
}

template <int K>
ENTMAX_FAST_ALWAYS_INLINE typename LanesOf<K>::memory& lanes_at(double* p) {
  return *reinterpret_cast<typename LanesOf<K>::memory*>(p);
}

// Divides each lane's message (m0, m1) and tangent (t0, t1) by the lane's larger message
// entry where that is below chain::kRescaleBelow (chain::rescale per lane); factor: the
// factors applied (1 elsewhere). Returns whether any lane was rescaled.
template <int K>
ENTMAX_FAST_ALWAYS_INLINE bool any_lane(const LaneMask<K>& mask) {
  long long any = 0;
  for (int k = 0; k < K; ++k) any |= mask[k];
  return any != 0;
}

template <int K>
ENTMAX_FAST_ALWAYS_INLINE bool rescale_lanes(Lanes<K>& m0, Lanes<K>& m1, Lanes<K>& t0, Lanes<K>& t1,
                                             Lanes<K>& factor) {
  Lanes<K> top;
  select_lanes<K>((LaneMask<K>)(m0 > m1), m0, m1, top);
  const LaneMask<K> below = (LaneMask<K>)(top < chain::kRescaleBelow);
  factor = Lanes<K>{} + 1.0;
  if (__builtin_expect(!any_lane<K>(below), 1)) return false;
  select_lanes<K>(below, factor / top, factor, factor);
  m0 *= factor;
  m1 *= factor;
  t0 *= factor;
  t1 *= factor;
  return true;
}

// The sweeps' cheap test, in lanes: whether a message's entries sum to below twice
// chain::kRescaleBelow, which they do wherever the larger is below kRescaleBelow (the sum,
// rounded, is at least the larger entry and at most twice it). A block's steps run with it
// alone, noted across the block (an add, a compare and an or a step); only where it held at
// some step does the block run again from its start with rescale_lanes at every step (its
// selection of the larger entry, reduction across lanes and branch took ~12% of the time
// of either operator: 4096x1024 float32, one thread, x86-64 with AVX2, at 5ffdf45), so that
// every result is that of rescale_lanes at every step.
template <int K>
ENTMAX_FAST_ALWAYS_INLINE void note_low(const Lanes<K>& m0, const Lanes<K>& m1, LaneMask<K>& low) {
  low |= (LaneMask<K>)(m0 + m1 < 2.0 * chain::kRescaleBelow);
}

// One step's test in a block: rescale_lanes where the block runs exactly, else note_low.
template <int K>
ENTMAX_FAST_ALWAYS_INLINE void check_step(bool exact, Lanes<K>& m0, Lanes<K>& m1, Lanes<K>& t0, Lanes<K>& t1,
                                          Lanes<K>& factor, LaneMask<K>& low) {
  if (exact) {
    rescale_lanes<K>(m0, m1, t0, t1, factor);
  } else {
    note_low<K>(m0, m1, low);
  }
}

// Whether a block's run stands: it ran exactly, or no message fell low in it.
template <int K>
ENTMAX_FAST_ALWAYS_INLINE bool block_stands(bool exact, const LaneMask<K>& low) {
  return exact || __builtin_expect(!any_lane<K>(low), 1);
}

// Four rows' entries [j, j + 4) as four vectors, and back: a 4x4 transpose by shuffles,
// so that moving rows to and from position-major order costs a few vector operations per
// four entries (element by element it took a third of the backward's time).
template <typename T>
struct QuadOf;
template <>
struct QuadOf<float> {
  typedef float type __attribute__((vector_size(16), aligned(4), may_alias));
};
template <>
struct QuadOf<double> {
  typedef double type __attribute__((vector_size(32), aligned(8), may_alias));
};

ENTMAX_FAST_ALWAYS_INLINE void transpose4(Lanes<4>& r0, Lanes<4>& r1, Lanes<4>& r2, Lanes<4>& r3) {
  const Lanes<4> t0 = ENTMAX_FAST_SHUFFLE4(r0, r1, 0, 4, 2, 6), t1 = ENTMAX_FAST_SHUFFLE4(r0, r1, 1, 5, 3, 7);
  const Lanes<4> t2 = ENTMAX_FAST_SHUFFLE4(r2, r3, 0, 4, 2, 6), t3 = ENTMAX_FAST_SHUFFLE4(r2, r3, 1, 5, 3, 7);
  r0 = ENTMAX_FAST_SHUFFLE4(t0, t2, 0, 1, 4, 5);
  r1 = ENTMAX_FAST_SHUFFLE4(t1, t3, 0, 1, 4, 5);
  r2 = ENTMAX_FAST_SHUFFLE4(t0, t2, 2, 3, 6, 7);
  r3 = ENTMAX_FAST_SHUFFLE4(t1, t3, 2, 3, 6, 7);
}

// out[j·4 + k] = rows[k][j], as double, for j in [begin, end).
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE void rows_to_lanes(const T* const* rows, double* out, int64_t begin, int64_t end) {
  using Quad = typename QuadOf<T>::type;
  int64_t j = begin;
  for (; j + 4 <= end; j += 4) {
    Lanes<4> r[4];
    for (int k = 0; k < 4; ++k) r[k] = __builtin_convertvector(*reinterpret_cast<const Quad*>(rows[k] + j), Lanes<4>);
    transpose4(r[0], r[1], r[2], r[3]);
    for (int i = 0; i < 4; ++i) lanes_at<4>(out + (j + i) * 4) = r[i];
  }
  for (; j < end; ++j) {
    for (int k = 0; k < 4; ++k) out[j * 4 + k] = static_cast<double>(rows[k][j]);
  }
}

// rows[k][j] = in[j·4 + k], rounded to T, for j in [begin, end).
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE void lanes_to_rows(const double* in, T* const* rows, int64_t begin, int64_t end) {
  using Quad = typename QuadOf<T>::type;
  int64_t j = begin;
  for (; j + 4 <= end; j += 4) {
    Lanes<4> r[4];
    for (int i = 0; i < 4; ++i) r[i] = lanes_at<4>(in + (j + i) * 4);
    transpose4(r[0], r[1], r[2], r[3]);
    for (int k = 0; k < 4; ++k) *reinterpret_cast<Quad*>(rows[k] + j) = __builtin_convertvector(r[k], Quad);
  }
  for (; j < end; ++j) {
    for (int k = 0; k < 4; ++k) rows[k][j] = static_cast<T>(in[j * 4 + k]);
  }
}

// K plain rows (row_is_plain) of one call: scores, transitions, and for the backward the
// incoming gradient and dtransitions (grad null: the forward); out: mu or dx.
template <int K, typename T>
struct PlainRows {
  const T* x[K];
  const T* transitions[K];
  const T* grad[K];
  T* out[K];
  T* dtransitions[K];
  // The next rows' scores and gradients (bytes 0: none), prefetched during the first sweep:
  // read only once the compute is done, they would wait on memory.
  const char* prefetch[2];
  int64_t prefetch_bytes[2];
};

// At step j of a sweep, prefetches cache line j/2 of the next rows' scores (even j) or
// gradients (odd j): K rows of n entries are K·n/16 lines of float, K·n/8 of double, so that
// a sweep of n steps covers both ranges for K = 4.
template <int K, typename T>
ENTMAX_FAST_ALWAYS_INLINE void prefetch_next(const PlainRows<K, T>& rows, int64_t j) {
  const int64_t offset = (j >> 1) * 64;
  if (offset < rows.prefetch_bytes[j & 1]) __builtin_prefetch(rows.prefetch[j & 1] + offset, 0, 3);
}

// Positions per block of a sweep. The recursions wait on latency (a step on the previous
// step's multiply-add) and leave execution units idle, so the work that does not depend on
// them runs beside them, a block at a time: while the first sweep's steps run through one
// block, the next block's entries move to position-major order and get their unaries (the
// exps); the second sweep moves each block's outputs back to the rows once its steps are done.
// A multiple of 4 (the transposes); at 4 and 8 the forward took ~11% and ~3% longer than at
// 16, at 32 about as long or 1-2% longer (4096x1024 float32, one thread, at 5ffdf45 and
// 0a9f527).
constexpr int64_t kCrfBlock = 16;

// The K plain rows' positions [begin, end) to position-major order, scores (and gradients in
// the backward), and the scores' unaries.
template <int K, bool kFma, typename T>
ENTMAX_FAST_ALWAYS_INLINE void take_block(const PlainRows<K, T>& rows, double* p_scores, double* p_grad,
                                          double* p_unary0, double* p_unary1, int64_t begin, int64_t end) {
  rows_to_lanes(rows.x, p_scores, begin, end);
  if (p_grad) rows_to_lanes(rows.grad, p_grad, begin, end);
  const int64_t at = begin * K;
  if (end - begin == kCrfBlock) {  // a constant count: the exp loop unrolled
    crf_state_unaries_body<kFma>(p_scores + at, p_unary0 + at, p_unary1 + at, K * kCrfBlock);
  } else {
    crf_state_unaries_body<kFma>(p_scores + at, p_unary0 + at, p_unary1 + at, K * (end - begin));
  }
}

// Doubles from one array of a group's scratch (crf_plain_rows_body) to the next: K·n and 40
// more, so that the arrays' entries at one position fall in different L1 cache sets (at K·n
// alone, a multiple of 4 KiB whenever n is a multiple of 128, all eight fell in one): 2-3%
// less time for either operator (4096x1024 float32, one thread, a C++ driver of the rows,
// median of 7, four alternated runs, shared 2-core host at load ~3.3, at 4da6526).
template <int K>
constexpr int64_t crf_group_stride(int64_t n) {
  return K * n + 40;
}

// scratch: 8 crf_group_stride<K>(n) doubles; rescaled: n positions.
template <int K, bool kFma, typename T>
ENTMAX_FAST_ALWAYS_INLINE void crf_plain_rows_body(const PlainRows<K, T>& rows, double* scratch, int64_t* rescaled,
                                                   int64_t n) {
  static_assert(K == 4, "the transposes are 4x4");
  static_assert(kCrfBlock % 4 == 0, "blocks of whole 4x4 transposes");
  using V = Lanes<K>;
  const bool backward = rows.grad[0] != nullptr;
  const int64_t stride = crf_group_stride<K>(n);  // from one array of K·n to the next
  double* p_scores = scratch;          // [j][k]; the output (mu or dx) once the unaries are taken
  double* p_unary = scratch + stride;  // state 0; state 1 from p_unary + stride
  double* p_alpha0 = scratch + 3 * stride;
  double* p_alpha1 = scratch + 4 * stride;
  double* p_grad = backward ? scratch + 5 * stride : nullptr;  // backward only, as the two below
  double* p_tangent1 = scratch + 6 * stride;                   // the forward tangent's state 1
  // The forward's rescales, rare: the positions (increasing) and their factors.
  double* p_factor = scratch + 7 * stride;
  int64_t rescales = 0;
  // The first sweep's blocks [begin, end), each taking the next block at its start (no lambda:
  // its body would not get this function's target ISA).
  take_block<K, kFma>(rows, p_scores, p_grad, p_unary, p_unary + stride, 0, std::min(n, kCrfBlock));
  // The second sweep's blocks, from the last: the first position of the block holding n − 1.
  const int64_t last_block = (n - 1) / kCrfBlock * kCrfBlock;
  V E[4];
  for (int k = 0; k < K; ++k) {
    const chain::ChainTransitions tr(rows.transitions[k]);
    for (int i = 0; i < 4; ++i) E[i][k] = tr.e[i];
  }
  const V zero = V{}, one = V{} + 1.0;
  double* p_out = p_scores;
  V factor;
  // Each block's steps run with note_low (exact false), and again with rescale_lanes (exact
  // true) from the block's start where note_low held at some step; the sweep's later blocks
  // then run with rescale_lanes at once (exact_rest): rows that rescale every few steps, as
  // with transitions of ±20 and more, would otherwise run most blocks twice. The baseline-ISA
  // build runs every block with rescale_lanes (kCheapRescaleTest false): there, a vector two
  // SSE2 halves in 16 registers, the cheap pass made the forward slower, 55 -> 66 ms
  // (4096x1024 float32, one thread, median of 5, shared 2-core host at load ~3, at 0e4ea17).
  constexpr bool kCheapRescaleTest = kFma;
  if (!backward) {
    // crf_forward_row's sweeps.
    V a0 = lanes_at<K>(p_unary), a1 = lanes_at<K>(p_unary + stride), unused0 = zero, unused1 = zero;
    rescale_lanes<K>(a0, a1, unused0, unused1, factor);
    lanes_at<K>(p_alpha0) = a0;
    lanes_at<K>(p_alpha1) = a1;
    bool exact_rest = !kCheapRescaleTest;
    for (int64_t begin = 0; begin < n; begin += kCrfBlock) {
      const int64_t end = std::min(n, begin + kCrfBlock);
      if (end < n) {
        take_block<K, kFma>(rows, p_scores, p_grad, p_unary, p_unary + stride, end, std::min(n, end + kCrfBlock));
      }
      const V start0 = a0, start1 = a1;
      for (bool exact = exact_rest;; exact = true) {
        LaneMask<K> low = {};
        for (int64_t j = std::max<int64_t>(begin, 1); j < end; ++j) {
          const int64_t at = j * K;
          prefetch_next(rows, j);
          const V u0 = lanes_at<K>(p_unary + at), u1 = lanes_at<K>(p_unary + stride + at);
          const V next0 = (u0 * E[0]) * a0 + (u0 * E[2]) * a1;
          a1 = (u1 * E[1]) * a0 + (u1 * E[3]) * a1;
          a0 = next0;
          check_step<K>(exact, a0, a1, unused0, unused1, factor, low);
          lanes_at<K>(p_alpha0 + at) = a0;
          lanes_at<K>(p_alpha1 + at) = a1;
        }
        if (block_stands<K>(exact, low)) break;
        exact_rest = true;
        a0 = start0;
        a1 = start1;
      }
    }
    V b0 = one, b1 = one;
    exact_rest = !kCheapRescaleTest;
    for (int64_t begin = last_block; begin >= 0; begin -= kCrfBlock) {
      const int64_t end = std::min(n, begin + kCrfBlock);
      const V start0 = b0, start1 = b1;
      for (bool exact = exact_rest;; exact = true) {
        LaneMask<K> low = {};
        for (int64_t j = end - 1; j >= begin; --j) {
          const int64_t at = j * K;
          const V on = lanes_at<K>(p_alpha1 + at) * b1, off = lanes_at<K>(p_alpha0 + at) * b0;
          lanes_at<K>(p_out + at) = on / (on + off);
          const V u0 = lanes_at<K>(p_unary + at), u1 = lanes_at<K>(p_unary + stride + at);
          const V next0 = (E[0] * u0) * b0 + (E[1] * u1) * b1;
          b1 = (E[2] * u0) * b0 + (E[3] * u1) * b1;
          b0 = next0;
          check_step<K>(exact, b0, b1, unused0, unused1, factor, low);
        }
        if (block_stands<K>(exact, low)) break;
        exact_rest = true;
        b0 = start0;
        b1 = start1;
      }
      lanes_to_rows(p_out, rows.out, begin, end);
    }
    return;
  }
  // crf_backward_row's forward, with the tangent along g (t0, t1).
  V a0 = lanes_at<K>(p_unary), a1 = lanes_at<K>(p_unary + stride), t0 = zero, t1 = a1 * lanes_at<K>(p_grad);
  if (rescale_lanes<K>(a0, a1, t0, t1, factor)) {
    lanes_at<K>(p_factor) = factor;
    rescaled[rescales++] = 0;
  }
  lanes_at<K>(p_alpha0) = a0;
  lanes_at<K>(p_alpha1) = a1;
  lanes_at<K>(p_tangent1) = t1;
  bool exact_rest = !kCheapRescaleTest;
  for (int64_t begin = 0; begin < n; begin += kCrfBlock) {
    const int64_t end = std::min(n, begin + kCrfBlock);
    if (end < n) {
      take_block<K, kFma>(rows, p_scores, p_grad, p_unary, p_unary + stride, end, std::min(n, end + kCrfBlock));
    }
    const V start_a0 = a0, start_a1 = a1, start_t0 = t0, start_t1 = t1;
    for (bool exact = exact_rest;; exact = true) {
      LaneMask<K> low = {};
      for (int64_t j = std::max<int64_t>(begin, 1); j < end; ++j) {
        const int64_t at = j * K;
        prefetch_next(rows, j);
        const V u0 = lanes_at<K>(p_unary + at), u1 = lanes_at<K>(p_unary + stride + at);
        const V e00 = u0 * E[0], e10 = u0 * E[2], e01 = u1 * E[1], e11 = u1 * E[3];
        const V next_a0 = e00 * a0 + e10 * a1, next_a1 = e01 * a0 + e11 * a1;
        const V next_t0 = e00 * t0 + e10 * t1;
        t1 = e01 * t0 + e11 * t1 + lanes_at<K>(p_grad + at) * next_a1;
        t0 = next_t0;
        a0 = next_a0;
        a1 = next_a1;
        if (!exact) {
          note_low<K>(a0, a1, low);
        } else if (rescale_lanes<K>(a0, a1, t0, t1, factor)) {
          lanes_at<K>(p_factor + rescales * K) = factor;
          rescaled[rescales++] = j;
        }
        lanes_at<K>(p_alpha0 + at) = a0;
        lanes_at<K>(p_alpha1 + at) = a1;
        lanes_at<K>(p_tangent1 + at) = t1;
      }
      if (block_stands<K>(exact, low)) break;
      exact_rest = true;
      a0 = start_a0;
      a1 = start_a1;
      t0 = start_t0;
      t1 = start_t1;
    }
  }
  const V G = (t0 + t1) / (a0 + a1);  // E[g·z]
  // Backward: β, its tangent r; dx_j; the n_11 pair terms without the factor E_11.
  V b0 = one, b1 = one, r0 = zero, r1 = zero;
  V pair = zero, pair_tangent = zero, sum_dx = zero, dx_last = zero;
  exact_rest = !kCheapRescaleTest;
  for (int64_t begin = last_block; begin >= 0; begin -= kCrfBlock) {
    const int64_t end = std::min(n, begin + kCrfBlock);
    const V start_b0 = b0, start_b1 = b1, start_r0 = r0, start_r1 = r1;
    const V start_pair = pair, start_pair_tangent = pair_tangent, start_sum_dx = sum_dx;
    const int64_t start_rescales = rescales;
    for (bool exact = exact_rest;; exact = true) {
      LaneMask<K> low = {};
      for (int64_t j = end - 1; j >= begin; --j) {
        const int64_t at = j * K;
        const V alpha1 = lanes_at<K>(p_alpha1 + at);
        const V inverse = 1.0 / (lanes_at<K>(p_alpha0 + at) * b0 + alpha1 * b1);
        const V dx_j = (lanes_at<K>(p_tangent1 + at) * b1 + alpha1 * (r1 - b1 * G)) * inverse;
        lanes_at<K>(p_out + at) = dx_j;
        if (j == n - 1) dx_last = dx_j;
        sum_dx += dx_j;
        if (j == 0) break;
        const V u0 = lanes_at<K>(p_unary + at), u1 = lanes_at<K>(p_unary + stride + at);
        const V r1_g = r1 + lanes_at<K>(p_grad + at) * b1;  // u1 times it: the tangent of v1 = u1 b1
        V inverse_w = inverse * u1;
        if (rescales > 0 && rescaled[rescales - 1] == j) {
          --rescales;
          inverse_w *= lanes_at<K>(p_factor + rescales * K);
        }
        const V v1_w = b1 * inverse_w, w1_w = r1_g * inverse_w;
        const V p1 = lanes_at<K>(p_alpha1 + at - K), q1 = lanes_at<K>(p_tangent1 + at - K);
        pair += p1 * v1_w;
        pair_tangent += q1 * v1_w + p1 * w1_w;
        const V e00 = E[0] * u0, e01 = E[1] * u1, e10 = E[2] * u0, e11 = E[3] * u1;
        const V next_b0 = e00 * b0 + e01 * b1, next_r0 = e00 * r0 + e01 * r1_g;
        b1 = e10 * b0 + e11 * b1;
        r1 = e10 * r0 + e11 * r1_g;
        b0 = next_b0;
        r0 = next_r0;
        check_step<K>(exact, b0, b1, r0, r1, factor, low);
      }
      if (block_stands<K>(exact, low)) break;
      exact_rest = true;
      b0 = start_b0;
      b1 = start_b1;
      r0 = start_r0;
      r1 = start_r1;
      pair = start_pair;
      pair_tangent = start_pair_tangent;
      sum_dx = start_sum_dx;
      rescales = start_rescales;
    }
    lanes_to_rows(p_out, rows.out, begin, end);
  }
  const V c11 = E[3] * (pair_tangent - G * pair);
  const V into = sum_dx - lanes_at<K>(p_out);  // Cov(Σ_{j≥2} z_j, g·z)
  const V outof = sum_dx - dx_last;            // Cov(Σ_{j≤m−1} z_j, g·z)
  for (int k = 0; k < K; ++k) {
    rows.dtransitions[k][0] = static_cast<T>(c11[k] - into[k] - outof[k]);
    rows.dtransitions[k][1] = static_cast<T>(into[k] - c11[k]);
    rows.dtransitions[k][2] = static_cast<T>(outof[k] - c11[k]);
    rows.dtransitions[k][3] = static_cast<T>(c11[k]);
  }
}

template <int K, typename T>
void crf_plain_rows_portable(const PlainRows<K, T>& rows, double* scratch, int64_t* rescaled, int64_t n) {
  crf_plain_rows_body<K, false>(rows, scratch, rescaled, n);
}

#if ENTMAX_FAST_AVX2_KERNELS
template <int K, typename T>
ENTMAX_FAST_TARGET_AVX2 void crf_plain_rows_avx2(const PlainRows<K, T>& rows, double* scratch, int64_t* rescaled,
                                                 int64_t n) {
  crf_plain_rows_body<K, true>(rows, scratch, rescaled, n);
}
#endif

template <int K, typename T>
void crf_plain_rows(const PlainRows<K, T>& rows, double* scratch, int64_t* rescaled, int64_t n) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (entmax_fast_cpu::use_avx2_kernels()) return crf_plain_rows_avx2<K>(rows, scratch, rescaled, n);
#endif
  crf_plain_rows_portable<K>(rows, scratch, rescaled, n);
}

// Rows per SIMD group: one AVX2 vector of doubles. Eight rows as 64-byte vectors (two AVX2
// vectors a step) were slower: 4096x1024 float32, one thread, forward 35 against 21 ms and
// backward 53-56 against 27-34 ms (x86-64, median of 15, shared 2-core host at load ~2,
// at aa89c7c). Two groups of four interleaved step by step would overlap two recursions'
// latency, but with the exps beside the first sweep and the rescale test per block the steps
// are no longer latency-bound: with each step's dependence on the previous one removed (a
// timing experiment, wrong results) the forward took 14.3 ms (15.9 in one run of three)
// against 14.6-14.8 ms (4096x1024 float32, one thread, median of 7, three alternated runs,
// x86-64 with AVX2, shared 2-core host at load ~2, at 52cb56a).
constexpr int kCrfLanes = 4;

// The CRF forward (p_g null) or backward of rows [begin, end): plain rows K at a time by
// crf_plain_rows, the others (and the last < K plain ones) one at a time by
// chain::crf_forward_row / crf_backward_row. out: mu or dx.
template <int K, typename T>
void crf_range(const T* p_x, const T* p_t, const T* p_g, T* p_out, T* p_dt, int64_t n, int64_t begin,
               int64_t end) {
  // crf_plain_rows's scratch; then 7n for a row alone (crf_backward_row's 5n, or
  // crf_forward_row's 3n, and its unaries).
  const int64_t group_scratch = 8 * crf_group_stride<K>(n);
  std::vector<double> scratch(group_scratch + 7 * n);
  std::vector<int64_t> rescaled(n);
  double* alone = scratch.data() + group_scratch;
  auto one_row = [&](const T* x_row, const T* t_row, const T* g_row, T* out_row, T* dt_row) {
    crf_state_unaries(x_row, alone + 5 * n, n);
    if (p_g) {
      chain::crf_backward_row(x_row, t_row, g_row, out_row, dt_row, alone, n, alone + 5 * n);
    } else {
      chain::crf_forward_row(x_row, t_row, out_row, alone, n, alone + 5 * n);
    }
  };
  PlainRows<K, T> pending{};
  int count = 0;
  for (int64_t row = begin; row < end; ++row) {
    const T* x_row = p_x + row * n;
    const T* g_row = p_g ? p_g + row * n : nullptr;
    T* dt_row = p_dt ? p_dt + row * 4 : nullptr;
    if (!row_is_plain(x_row, n)) {
      one_row(x_row, p_t + row * 4, g_row, p_out + row * n, dt_row);
      continue;
    }
    pending.x[count] = x_row;
    pending.transitions[count] = p_t + row * 4;
    pending.grad[count] = g_row;
    pending.out[count] = p_out + row * n;
    pending.dtransitions[count] = dt_row;
    if (++count == K) {
      // The next K rows of this range (plain or not): their scores, and their gradients in the backward.
      const int64_t next_end = std::min(end, row + 1 + K);
      const T* ranges[2] = {p_x, p_g};
      for (int i = 0; i < 2; ++i) {
        pending.prefetch[i] = reinterpret_cast<const char*>(ranges[i] ? ranges[i] + (row + 1) * n : nullptr);
        pending.prefetch_bytes[i] = ranges[i] ? (next_end - row - 1) * n * static_cast<int64_t>(sizeof(T)) : 0;
      }
      crf_plain_rows<K>(pending, scratch.data(), rescaled.data(), n);
      count = 0;
    }
  }
  for (int k = 0; k < count; ++k) {
    one_row(pending.x[k], pending.transitions[k], pending.grad[k], pending.out[k], pending.dtransitions[k]);
  }
}

void forward_rows(ChainKind kind, const at::Tensor& x, const at::Tensor& transitions, at::Tensor& mu,
                  at::Tensor& saved) {
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "chain_forward", [&] {
    const scalar_t* p_x = x.data_ptr<scalar_t>();
    const scalar_t* p_t = transitions.data_ptr<scalar_t>();
    scalar_t* p_mu = mu.data_ptr<scalar_t>();
    double* p_saved = kind == ChainKind::kSparseMAP ? saved.data_ptr<double>() : nullptr;
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      if (kind == ChainKind::kCRF) {
        return crf_range<kCrfLanes, scalar_t>(p_x, p_t, nullptr, p_mu, nullptr, n, begin, end);
      }
      for (int64_t row = begin; row < end; ++row) {
        chain::sparsemap_forward_row(p_x + row * n, p_t + row * 4, p_mu + row * n, p_saved + row * n, n);
      }
    });
  });
}

void backward_rows(ChainKind kind, const at::Tensor& grad, const at::Tensor& x, const at::Tensor& transitions,
                   const at::Tensor& saved, at::Tensor& dx, at::Tensor& dtransitions) {
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "chain_backward", [&] {
    const scalar_t* p_g = grad.data_ptr<scalar_t>();
    const scalar_t* p_x = x.data_ptr<scalar_t>();
    const scalar_t* p_t = transitions.data_ptr<scalar_t>();
    const double* p_saved = kind == ChainKind::kSparseMAP ? saved.data_ptr<double>() : nullptr;
    scalar_t* p_dx = dx.data_ptr<scalar_t>();
    scalar_t* p_dt = dtransitions.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      if (kind == ChainKind::kCRF) {
        return crf_range<kCrfLanes>(p_x, p_t, p_g, p_dx, p_dt, n, begin, end);
      }
      for (int64_t row = begin; row < end; ++row) {
        chain::sparsemap_backward_row(p_x + row * n, p_t + row * 4, p_g + row * n, p_saved + row * n,
                                      p_dx + row * n, p_dt + row * 4, n);
      }
    });
  });
}

void check_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "chain operators: CPU implementation called with a ", x.device(), " tensor");
}

void forward_cpu(ChainKind kind, const at::Tensor& x, const at::Tensor& transitions, at::Tensor& mu,
                 at::Tensor& saved) {
  check_cpu(x);
  forward_rows(kind, x, transitions, mu, saved);
}

void backward_cpu(ChainKind kind, const at::Tensor& grad, const at::Tensor& x, const at::Tensor& transitions,
                  const at::Tensor& saved, at::Tensor& dx, at::Tensor& dtransitions) {
  check_cpu(x);
  backward_rows(kind, grad, x, transitions, saved, dx, dtransitions);
}

}  // namespace chain_cpu
}  // namespace entmax_fast

TORCH_LIBRARY_FRAGMENT(entmax_fast, m) {
  m.def("crf_forward(Tensor x, Tensor transitions) -> (Tensor, Tensor)");
  m.def("crf_backward(Tensor grad, Tensor x, Tensor transitions, Tensor mu, Tensor saved) -> (Tensor, Tensor)");
  m.def("sparsemap_forward(Tensor x, Tensor transitions) -> (Tensor, Tensor)");
  m.def("sparsemap_backward(Tensor grad, Tensor x, Tensor transitions, Tensor mu, Tensor saved) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(entmax_fast, CPU, m) {
  entmax_fast::chain::ChainOps<entmax_fast::chain_cpu::forward_cpu,
                               entmax_fast::chain_cpu::backward_cpu>::register_for(m);
}
