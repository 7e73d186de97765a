// CRF marginals and SparseMAP over a chain, CPU operators: rows in parallel, each row by the
// shared row functions of csrc/common/chain_algos.h (docs/maths.md, "Chain marginals: CRF
// and SparseMAP"). The operators take rows x (R, n) and one 2x2 transition matrix per row
// (R, 2, 2); the forward returns (mu, saved): for SparseMAP saved is the float64 TV-prox
// output its backward reads the fused groups from, for the CRF an empty tensor (its backward
// recomputes the forward messages).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../common/chain_algos.h"
#include "../common/chain_ops.h"
#include "isa_dispatch.h"
#include "vector_math.h"

namespace entmax_fast {
namespace chain_cpu {

using chain::ChainKind;

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// The two states' unaries of a row (chain_algos.h's unary): exp(−max(s, 0)) to unary[0, n),
// exp(min(s, 0)) to unary[n, 2n), by the branch-free vec_exp so that the loop vectorises
// (masked, −inf, entries get 1 and 0 and are not read).
template <bool kFma, typename T>
ENTMAX_FAST_ALWAYS_INLINE void crf_state_unaries_body(const T* x, double* unary, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    // select(), not std::fmax/fmin: those are calls into libm (their NaN rule), and the loop
    // then does not vectorise.
    const double s = static_cast<double>(x[j]);
    const bool positive = s > 0.0;
    unary[j] = entmax_fast_cpu::vecmath::vec_exp<kFma>(entmax_fast_cpu::vecmath::select(positive, -s, 0.0));
    unary[n + j] = entmax_fast_cpu::vecmath::vec_exp<kFma>(entmax_fast_cpu::vecmath::select(positive, 0.0, s));
  }
}

template <typename T>
void crf_state_unaries_portable(const T* x, double* unary, int64_t n) {
  crf_state_unaries_body<false>(x, unary, n);
}

#if ENTMAX_FAST_AVX2_KERNELS
template <typename T>
ENTMAX_FAST_TARGET_AVX2 void crf_state_unaries_avx2(const T* x, double* unary, int64_t n) {
  crf_state_unaries_body<true>(x, unary, n);
}
#endif

template <typename T>
void crf_state_unaries(const T* x, double* unary, int64_t n) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (entmax_fast_cpu::use_avx2_kernels()) return crf_state_unaries_avx2(x, unary, n);
#endif
  crf_state_unaries_portable(x, unary, n);
}

// Rows whose CRF forwards run interleaved: the forward of (4096, 1024) float32 rows, one
// thread, took 57.9 ms one row at a time, 35.9 ms two and 30.4 ms four at a time (x86-64,
// median of 5, a shared 2-core host at load 3.9; on top of 11d5fda).
constexpr int kCrfForwardLanes = 4;

// The CRF forward of rows [begin, end): plain rows (chain::row_is_plain) K at a time by
// chain::crf_forward_plain_rows, the others (and the last < K plain ones) one at a time.
template <int K, typename T>
void crf_forward_range(const T* p_x, const T* p_t, T* p_mu, int64_t n, int64_t begin, int64_t end) {
  // [0, 2Kn): messages; [2Kn, 4Kn): the pending plain rows' unaries; then 5n for a row alone
  // (crf_forward_row's scratch, and its unaries).
  std::vector<double> scratch(4 * K * n + 5 * n);
  double* unary = scratch.data() + 2 * K * n;
  double* alone = scratch.data() + 4 * K * n;
  const T* x[K];
  const T* t[K];
  T* mu[K];
  int pending = 0;
  for (int64_t row = begin; row < end; ++row) {
    const T* x_row = p_x + row * n;
    if (K > 1 && chain::row_is_plain(x_row, n)) {
      x[pending] = x_row;
      t[pending] = p_t + row * 4;
      mu[pending] = p_mu + row * n;
      crf_state_unaries(x_row, unary + 2 * pending * n, n);
      if (++pending == K) {
        chain::crf_forward_plain_rows<K>(t, mu, unary, scratch.data(), n);
        pending = 0;
      }
      continue;
    }
    crf_state_unaries(x_row, alone + 3 * n, n);
    chain::crf_forward_row(x_row, p_t + row * 4, p_mu + row * n, alone, n, alone + 3 * n);
  }
  for (int k = 0; k < pending; ++k) {
    chain::crf_forward_row(x[k], t[k], mu[k], alone, n, unary + 2 * k * n);
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
      if (kind == ChainKind::kCRF) return crf_forward_range<kCrfForwardLanes>(p_x, p_t, p_mu, n, begin, end);
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
      std::vector<double> scratch(kind == ChainKind::kCRF ? 7 * n : 0);
      for (int64_t row = begin; row < end; ++row) {
        if (kind == ChainKind::kCRF) {
          crf_state_unaries(p_x + row * n, scratch.data() + 5 * n, n);
          chain::crf_backward_row(p_x + row * n, p_t + row * 4, p_g + row * n, p_dx + row * n, p_dt + row * 4,
                                  scratch.data(), n, scratch.data() + 5 * n);
        } else {
          chain::sparsemap_backward_row(p_x + row * n, p_t + row * 4, p_g + row * n, p_saved + row * n,
                                        p_dx + row * n, p_dt + row * 4, n);
        }
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
