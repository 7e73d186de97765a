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

namespace entmax_fast {
namespace chain_cpu {

using chain::ChainKind;

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

void forward_rows(ChainKind kind, const at::Tensor& x, const at::Tensor& transitions, at::Tensor& mu,
                  at::Tensor& saved) {
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "chain_forward", [&] {
    const scalar_t* p_x = x.data_ptr<scalar_t>();
    const scalar_t* p_t = transitions.data_ptr<scalar_t>();
    scalar_t* p_mu = mu.data_ptr<scalar_t>();
    double* p_saved = kind == ChainKind::kSparseMAP ? saved.data_ptr<double>() : nullptr;
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      std::vector<double> scratch(kind == ChainKind::kCRF ? 3 * n : 0);
      for (int64_t row = begin; row < end; ++row) {
        if (kind == ChainKind::kCRF) {
          chain::crf_forward_row(p_x + row * n, p_t + row * 4, p_mu + row * n, scratch.data(), n);
        } else {
          chain::sparsemap_forward_row(p_x + row * n, p_t + row * 4, p_mu + row * n, p_saved + row * n, n);
        }
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
      std::vector<double> scratch(kind == ChainKind::kCRF ? 5 * n : 0);
      for (int64_t row = begin; row < end; ++row) {
        if (kind == ChainKind::kCRF) {
          chain::crf_backward_row(p_x + row * n, p_t + row * 4, p_g + row * n, p_dx + row * n, p_dt + row * 4,
                                  scratch.data(), n);
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
