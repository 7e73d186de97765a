// fusedmax and oscarmax, CUDA operators: host side (argument checks, outputs, scratch memory,
// stream). The kernels are in structured.cu; the schemas and the CPU operators in
// csrc/cpu/structured.cpp. Built only with CUDA (a CUDAExtension defines
// ENTMAX_FAST_WITH_CUDA); a CPU build compiles this file to nothing.
#ifdef ENTMAX_FAST_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../common/structured_algos.h"
#include "../common/structured_checks.h"
#include "../common/structured_ops.h"
#include "structured_cuda.h"

namespace entmax_fast {
namespace structured_cuda {

using structured::Prox;

at::Tensor scratch_memory(size_t bytes, const at::Tensor& like) {
  if (bytes == 0) return at::Tensor();
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

std::vector<at::Tensor> forward_impl(const char* op, Prox kind, bool project, const at::Tensor& x_in, double reg,
                                     const char* reg_name, const c10::optional<at::Tensor>& lengths_in) {
  structured::check_forward_args(op, x_in, reg, reg_name, lengths_in);
  TORCH_CHECK(x_in.is_cuda(), op, ": CUDA implementation called with a ", x_in.device(), " tensor");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  // No range check of lengths here (it would sync with the host): the kernel clamps them.
  const at::Tensor lengths = lengths_in.has_value() ? lengths_in->to(at::kLong).contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(x);
  at::Tensor p = project ? at::empty_like(x) : at::Tensor();
  const int kind_id = static_cast<int>(kind);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "structured_forward_cuda", [&] {
    const at::Tensor scratch = scratch_memory(forward_scratch_bytes<scalar_t>(kind_id, rows, n), x);
    C10_CUDA_CHECK(launch_forward<scalar_t>(kind_id, project, x.data_ptr<scalar_t>(),
                                            lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr,
                                            project ? p.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), rows,
                                            n, reg, scratch.defined() ? scratch.data_ptr() : nullptr, stream));
  });
  if (project) return {p, y};
  return {y};
}

at::Tensor backward_impl(const char* op, Prox kind, const at::Tensor& grad_in, const at::Tensor& p_in,
                         const at::Tensor& y_in, double reg, const char* reg_name) {
  structured::check_backward_args(op, grad_in, p_in, y_in, reg, reg_name);
  TORCH_CHECK(p_in.is_cuda() && grad_in.device() == p_in.device() && y_in.device() == p_in.device(), op,
              ": grad, p and y must be on the same CUDA device, got ", grad_in.device(), ", ", p_in.device(), ", ",
              y_in.device());
  const c10::cuda::CUDAGuard guard(p_in.device());
  const at::Tensor grad = grad_in.contiguous(), p = p_in.contiguous(), y = y_in.contiguous();
  const int64_t n = p.size(-1);
  const int64_t rows = n == 0 ? 0 : p.numel() / n;
  at::Tensor dz = at::empty_like(p);
  // With reg == 0 the prox is the identity: every group is a singleton even where inputs tie.
  const bool grouped = reg > 0;
  const int kind_id = static_cast<int>(kind);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "structured_backward_cuda", [&] {
    const at::Tensor scratch = scratch_memory(backward_scratch_bytes<scalar_t>(kind_id, grouped, rows, n), p);
    C10_CUDA_CHECK(launch_backward<scalar_t>(kind_id, grouped, grad.data_ptr<scalar_t>(), p.data_ptr<scalar_t>(),
                                             y.data_ptr<scalar_t>(), dz.data_ptr<scalar_t>(), rows, n,
                                             scratch.defined() ? scratch.data_ptr() : nullptr, stream));
  });
  return dz;
}

}  // namespace structured_cuda
}  // namespace entmax_fast

TORCH_LIBRARY_IMPL(entmax_fast, CUDA, m) {
  entmax_fast::structured::StructuredOps<entmax_fast::structured_cuda::forward_impl,
                                          entmax_fast::structured_cuda::backward_impl>::register_for(m);
}

#endif  // ENTMAX_FAST_WITH_CUDA
