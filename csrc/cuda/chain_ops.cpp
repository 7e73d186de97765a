// CRF marginals and SparseMAP over a chain, CUDA operators: host side (outputs, scratch
// memory, stream). The kernels are in chain.cu; the schemas, the checks and the CPU
// operators in csrc/common/chain_ops.h and csrc/cpu/chain.cpp. Built only with CUDA (a
// CUDAExtension defines ENTMAX_FAST_WITH_CUDA); a CPU build compiles this file to nothing.
#ifdef ENTMAX_FAST_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../common/chain_ops.h"
#include "chain_cuda.h"

namespace entmax_fast {
namespace chain_cuda {

using chain::ChainKind;

at::Tensor scratch_memory(size_t bytes, const at::Tensor& like) {
  if (bytes == 0) return at::Tensor();
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

void forward_cuda(ChainKind kind, const at::Tensor& x, const at::Tensor& transitions, at::Tensor& mu,
                  at::Tensor& saved) {
  TORCH_CHECK(x.is_cuda(), "chain operators: CUDA implementation called with a ", x.device(), " tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor scratch = scratch_memory(scratch_bytes(false, static_cast<int>(kind), x.size(0), x.size(1)), x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "chain_forward_cuda", [&] {
    C10_CUDA_CHECK(launch_forward<scalar_t>(static_cast<int>(kind), x.data_ptr<scalar_t>(),
                                            transitions.data_ptr<scalar_t>(), mu.data_ptr<scalar_t>(),
                                            kind == ChainKind::kSparseMAP ? saved.data_ptr<double>() : nullptr,
                                            x.size(0), x.size(1), scratch.defined() ? scratch.data_ptr() : nullptr,
                                            stream));
  });
}

void backward_cuda(ChainKind kind, const at::Tensor& grad, const at::Tensor& x, const at::Tensor& transitions,
                   const at::Tensor& saved, at::Tensor& dx, at::Tensor& dtransitions) {
  TORCH_CHECK(x.is_cuda(), "chain operators: CUDA implementation called with a ", x.device(), " tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor scratch = scratch_memory(scratch_bytes(true, static_cast<int>(kind), x.size(0), x.size(1)), x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "chain_backward_cuda", [&] {
    C10_CUDA_CHECK(launch_backward<scalar_t>(
        static_cast<int>(kind), grad.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), transitions.data_ptr<scalar_t>(),
        kind == ChainKind::kSparseMAP ? saved.data_ptr<double>() : nullptr, dx.data_ptr<scalar_t>(),
        dtransitions.data_ptr<scalar_t>(), x.size(0), x.size(1), scratch.defined() ? scratch.data_ptr() : nullptr,
        stream));
  });
}

}  // namespace chain_cuda
}  // namespace entmax_fast

TORCH_LIBRARY_IMPL(entmax_fast, CUDA, m) {
  entmax_fast::chain::ChainOps<entmax_fast::chain_cuda::forward_cuda,
                               entmax_fast::chain_cuda::backward_cuda>::register_for(m);
}
#endif  // ENTMAX_FAST_WITH_CUDA
