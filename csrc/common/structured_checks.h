// Argument checks of the fusedmax / oscarmax operators, shared by the CPU operators
// (csrc/cpu/structured.cpp) and the host side of the CUDA ones (csrc/cuda/structured_ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace entmax_fast {
namespace structured {

inline void check_forward_args(const char* op, const at::Tensor& x, double reg, const char* reg_name,
                        const c10::optional<at::Tensor>& lengths) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, op,
              ": X must be float32 or float64 (fp16/bf16 are upcast by the Python wrapper), got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, op, ": X must have at least 1 dimension, got a 0-d tensor");
  TORCH_CHECK(std::isfinite(reg) && reg >= 0, op, ": ", reg_name, " must be finite and >= 0, got ", reg);
  TORCH_CHECK(x.numel() / std::max<int64_t>(x.size(-1), 1) < (int64_t(1) << 31) &&
                  x.size(-1) < (int64_t(1) << 31),
              op, ": X is too large (rows and row length must be < 2^31)");
  if (lengths.has_value()) {
    const at::Tensor& len = *lengths;
    const auto expected = x.sizes().slice(0, x.dim() - 1);
    TORCH_CHECK(len.sizes() == expected, op, ": lengths must have shape ", expected,
                " (X's shape without the last dimension), got ", len.sizes());
    TORCH_CHECK(at::isIntegralType(len.scalar_type(), /*includeBool=*/false), op,
                ": lengths must have an integer dtype, got ", len.scalar_type());
    TORCH_CHECK(len.device() == x.device(), op, ": lengths must be on X's device (", x.device(),
                "), got ", len.device());
  }
}

inline void check_backward_args(const char* op, const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y,
                         double reg, const char* reg_name) {
  TORCH_CHECK(grad.sizes() == p.sizes() && y.sizes() == p.sizes(), op,
              ": grad, p and y must have the same shape, got ", grad.sizes(), ", ", p.sizes(), ", ", y.sizes());
  TORCH_CHECK(grad.scalar_type() == p.scalar_type() && y.scalar_type() == p.scalar_type(), op,
              ": grad, p and y must have the same dtype, got ", grad.scalar_type(), ", ", p.scalar_type(),
              ", ", y.scalar_type());
  TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble, op,
              ": p must be float32 or float64, got ", p.scalar_type());
  TORCH_CHECK(p.dim() >= 1, op, ": p must have at least 1 dimension");
  TORCH_CHECK(std::isfinite(reg) && reg >= 0, op, ": ", reg_name, " must be finite and >= 0, got ", reg);
}

// lengths as a contiguous int64 CPU tensor, checked to lie in [0, n].
inline at::Tensor checked_lengths(const char* op, const c10::optional<at::Tensor>& lengths, int64_t n) {
  if (!lengths.has_value()) return at::Tensor();
  at::Tensor len = lengths->to(at::kLong).contiguous();
  if (len.numel() > 0) {
    const int64_t lo = len.min().item<int64_t>();
    const int64_t hi = len.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi <= n, op, ": lengths must lie in [0, ", n, "] (the size of the last dimension), got values in [",
                lo, ", ", hi, "]");
  }
  return len;
}

}  // namespace structured
}  // namespace entmax_fast
