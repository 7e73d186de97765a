// Interface between the CRF / SparseMAP CUDA kernels (chain.cu, no torch headers) and their
// host side (chain_ops.cpp, which owns the tensors, the scratch memory and the stream).
#pragma once

#include <cstddef>
#include <cstdint>

#ifndef ENTMAX_FAST_HOST_EMULATION
#include <cuda_runtime_api.h>
#endif

namespace entmax_fast {
namespace chain_cuda {

// kind: an entmax_fast::chain::ChainKind as int (0 CRF, 1 SparseMAP).
#ifndef ENTMAX_FAST_HOST_EMULATION
// Bytes of global scratch a launch needs (the CRF's per-thread messages; 0 for SparseMAP).
size_t scratch_bytes(bool backward, int kind, int64_t rows, int64_t n);

template <typename T>
cudaError_t launch_forward(int kind, const T* x, const T* transitions, T* mu, double* saved, int64_t rows, int64_t n,
                           void* scratch, cudaStream_t stream);
template <typename T>
cudaError_t launch_backward(int kind, const T* grad, const T* x, const T* transitions, const double* saved, T* dx,
                            T* dtransitions, int64_t rows, int64_t n, void* scratch, cudaStream_t stream);
#endif

}  // namespace chain_cuda
}  // namespace entmax_fast
