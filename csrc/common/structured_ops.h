// The fusedmax/oscarmax operators, written once for every device: a device file defines
// forward_impl and backward_impl (checks, launch) and registers
// StructuredOps<forward_impl, backward_impl> for its dispatch key.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "kinds.h"

namespace entmax_fast {
namespace structured {

// project: sparsemax of the prox (the mapping) or the prox alone. Returns {p, y} or {y}.
using ForwardImpl = std::vector<at::Tensor> (*)(const char* op, Prox kind, bool project, const at::Tensor& x,
                                                double reg, const char* reg_name,
                                                const c10::optional<at::Tensor>& lengths);
using BackwardImpl = at::Tensor (*)(const char* op, Prox kind, const at::Tensor& grad, const at::Tensor& p,
                                    const at::Tensor& y, double reg, const char* reg_name);

template <ForwardImpl forward, BackwardImpl backward>
struct StructuredOps {
  static std::tuple<at::Tensor, at::Tensor> fusedmax_forward(const at::Tensor& x, double lam,
                                                             const c10::optional<at::Tensor>& lengths) {
    auto out = forward("fusedmax", Prox::kTV, true, x, lam, "lam", lengths);
    return {out[0], out[1]};
  }

  static at::Tensor fusedmax_backward(const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y, double lam) {
    return backward("fusedmax_backward", Prox::kTV, grad, p, y, lam, "lam");
  }

  static std::tuple<at::Tensor, at::Tensor> oscarmax_forward(const at::Tensor& x, double beta,
                                                             const c10::optional<at::Tensor>& lengths) {
    auto out = forward("oscarmax", Prox::kOSCAR, true, x, beta, "beta", lengths);
    return {out[0], out[1]};
  }

  static at::Tensor oscarmax_backward(const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y, double beta) {
    return backward("oscarmax_backward", Prox::kOSCAR, grad, p, y, beta, "beta");
  }

  static at::Tensor tv1d_prox(const at::Tensor& x, double lam, const c10::optional<at::Tensor>& lengths) {
    return forward("tv1d_prox", Prox::kTV, false, x, lam, "lam", lengths)[0];
  }

  static at::Tensor oscar_prox(const at::Tensor& x, double beta, const c10::optional<at::Tensor>& lengths) {
    return forward("oscar_prox", Prox::kOSCAR, false, x, beta, "beta", lengths)[0];
  }

  static void register_for(torch::Library& m) {
    m.impl("fusedmax_forward", &fusedmax_forward);
    m.impl("fusedmax_backward", &fusedmax_backward);
    m.impl("oscarmax_forward", &oscarmax_forward);
    m.impl("oscarmax_backward", &oscarmax_backward);
    m.impl("tv1d_prox", &tv1d_prox);
    m.impl("oscar_prox", &oscar_prox);
  }
};

}  // namespace structured
}  // namespace entmax_fast
