// The CRF / SparseMAP chain operators, written once for every device: a device file defines
// the four row launchers (checks done here) and registers ChainOps<...> for its dispatch key.
// Schemas: csrc/cpu/chain.cpp.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace entmax_fast {
namespace chain {

enum class ChainKind : int { kCRF = 0, kSparseMAP = 1 };

// Arguments of a forward: x (R, n) float32/float64, transitions (R, 2, 2) of x's dtype and
// device. Raised as RuntimeError (the public layer checks first, with its own messages).
inline void check_forward_args(const char* op, const at::Tensor& x, const at::Tensor& transitions) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, op,
              ": x must be float32 or float64 (fp16/bf16 are upcast by the Python wrapper), got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D (rows, n), got ", x.dim(), " dims");
  TORCH_CHECK(transitions.dim() == 3 && transitions.size(0) == x.size(0) && transitions.size(1) == 2 &&
                  transitions.size(2) == 2,
              op, ": transitions must have shape (", x.size(0), ", 2, 2) (one per row), got ", transitions.sizes());
  TORCH_CHECK(transitions.scalar_type() == x.scalar_type(), op, ": transitions must have x's dtype ",
              x.scalar_type(), ", got ", transitions.scalar_type());
  TORCH_CHECK(transitions.device() == x.device(), op, ": transitions must be on x's device ", x.device(), ", got ",
              transitions.device());
}

inline void check_backward_args(const char* op, const at::Tensor& grad, const at::Tensor& x,
                                const at::Tensor& transitions, const at::Tensor& saved, bool needs_saved) {
  check_forward_args(op, x, transitions);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type() && grad.device() == x.device(), op,
              ": grad must match x (shape ", x.sizes(), ", ", x.scalar_type(), ", ", x.device(), "), got ",
              grad.sizes(), ", ", grad.scalar_type(), ", ", grad.device());
  if (needs_saved) {
    TORCH_CHECK(saved.sizes() == x.sizes() && saved.scalar_type() == at::kDouble && saved.device() == x.device(), op,
                ": saved must be the forward's float64 prox output of x's shape ", x.sizes(), ", got ",
                saved.sizes(), " ", saved.scalar_type());
  }
}

// forward(kind, x, transitions, mu, saved) fills mu and saved; backward fills dx, dT.
using ForwardRows = void (*)(ChainKind kind, const at::Tensor& x, const at::Tensor& transitions, at::Tensor& mu,
                             at::Tensor& saved);
using BackwardRows = void (*)(ChainKind kind, const at::Tensor& grad, const at::Tensor& x,
                              const at::Tensor& transitions, const at::Tensor& saved, at::Tensor& dx,
                              at::Tensor& dtransitions);

template <ForwardRows forward_rows, BackwardRows backward_rows>
struct ChainOps {
  static std::tuple<at::Tensor, at::Tensor> forward(const char* op, ChainKind kind, const at::Tensor& x_in,
                                                    const at::Tensor& transitions_in) {
    check_forward_args(op, x_in, transitions_in);
    const at::Tensor x = x_in.contiguous(), transitions = transitions_in.contiguous();
    at::Tensor mu = at::empty_like(x);
    at::Tensor saved = kind == ChainKind::kSparseMAP ? at::empty(x.sizes(), x.options().dtype(at::kDouble))
                                                     : at::empty({0}, x.options());
    if (x.numel() > 0) forward_rows(kind, x, transitions, mu, saved);
    return {mu, saved};
  }

  static std::tuple<at::Tensor, at::Tensor> backward(const char* op, ChainKind kind, const at::Tensor& grad_in,
                                                     const at::Tensor& x_in, const at::Tensor& transitions_in,
                                                     const at::Tensor& saved_in) {
    check_backward_args(op, grad_in, x_in, transitions_in, saved_in, kind == ChainKind::kSparseMAP);
    const at::Tensor grad = grad_in.contiguous(), x = x_in.contiguous(), transitions = transitions_in.contiguous();
    const at::Tensor saved = saved_in.contiguous();
    at::Tensor dx = at::empty_like(x);
    at::Tensor dtransitions = at::zeros_like(transitions);
    if (x.numel() > 0) backward_rows(kind, grad, x, transitions, saved, dx, dtransitions);
    return {dx, dtransitions};
  }

  static std::tuple<at::Tensor, at::Tensor> crf_forward(const at::Tensor& x, const at::Tensor& transitions) {
    return forward("crf_forward", ChainKind::kCRF, x, transitions);
  }
  static std::tuple<at::Tensor, at::Tensor> crf_backward(const at::Tensor& grad, const at::Tensor& x,
                                                         const at::Tensor& transitions, const at::Tensor& mu,
                                                         const at::Tensor& saved) {
    return backward("crf_backward", ChainKind::kCRF, grad, x, transitions, saved);
  }
  static std::tuple<at::Tensor, at::Tensor> sparsemap_forward(const at::Tensor& x, const at::Tensor& transitions) {
    return forward("sparsemap_forward", ChainKind::kSparseMAP, x, transitions);
  }
  static std::tuple<at::Tensor, at::Tensor> sparsemap_backward(const at::Tensor& grad, const at::Tensor& x,
                                                               const at::Tensor& transitions, const at::Tensor& mu,
                                                               const at::Tensor& saved) {
    return backward("sparsemap_backward", ChainKind::kSparseMAP, grad, x, transitions, saved);
  }

  static void register_for(torch::Library& m) {
    m.impl("crf_forward", &crf_forward);
    m.impl("crf_backward", &crf_backward);
    m.impl("sparsemap_forward", &sparsemap_forward);
    m.impl("sparsemap_backward", &sparsemap_backward);
  }
};

}  // namespace chain
}  // namespace entmax_fast
