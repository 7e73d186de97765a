// Interface between the fusedmax / oscarmax CUDA kernels (structured.cu, no torch headers)
// and their host side (structured_ops.cpp, which owns the tensors and the scratch memory).
#pragma once

#include <cstddef>
#include <cstdint>

#ifndef ENTMAX_FAST_HOST_EMULATION
#include <cuda_runtime_api.h>
#endif

namespace entmax_fast {
namespace structured_cuda {

// kind: an entmax_fast::Prox (csrc/common/kinds.h) as int.
#ifndef ENTMAX_FAST_HOST_EMULATION
// Bytes of global scratch a launch needs (0 when every row fits in shared memory).
template <typename T>
size_t forward_scratch_bytes(int kind, int64_t rows, int64_t n);
template <typename T>
size_t backward_scratch_bytes(int kind, bool grouped, int64_t rows, int64_t n);

template <typename T>
cudaError_t launch_forward(int kind, bool project, const T* x, const int64_t* lengths, T* p, T* y, int64_t rows,
                           int64_t n, double reg, void* scratch, cudaStream_t stream);
template <typename T>
cudaError_t launch_backward(int kind, bool grouped, const T* g, const T* p, const T* y, T* dz, int64_t rows,
                            int64_t n, void* scratch, cudaStream_t stream);
#endif

}  // namespace structured_cuda
}  // namespace entmax_fast
