// CRF marginals and SparseMAP over a chain, CUDA kernels (docs/maths.md, "Chain marginals:
// CRF and SparseMAP"). The row functions are those of csrc/common/chain_algos.h, shared with
// the CPU operators; the host side is csrc/cuda/chain_ops.cpp. No torch header here.
//
// One row per thread, a grid-stride loop over the rows: both recursions are sequential along
// the row (forward-backward, Condat's TV scan), and a row's state is a few doubles. The
// loads are not coalesced (neighbouring threads read neighbouring rows); this layout was
// chosen for being the CPU's code as it is, not measured on a GPU.
//
// ENTMAX_FAST_HOST_EMULATION: tests/test_chain_cuda.py compiles this file with g++, with the
// CUDA built-ins of tests/test_structured.py's emulation harness, and runs the kernels on the
// host, thread by thread (they hold no barrier).
#ifndef ENTMAX_FAST_HOST_EMULATION
#include <cuda_runtime.h>
#endif

#include <cstddef>
#include <cstdint>

#include "../common/chain_algos.h"
#include "chain_cuda.h"

namespace entmax_fast {
namespace chain_cuda {

constexpr int kThreads = 128;
// Threads of the whole grid at most: the CRF's scratch (3n doubles per thread forward, 5n
// backward) is sized by it, not by the row count.
constexpr int64_t kMaxGridThreads = int64_t(1) << 16;

struct ChainLaunchPlan {
  int threads;
  int64_t blocks;
};

// max_grid_threads: kMaxGridThreads on a GPU; the emulation tests pass fewer, so that threads
// loop over several rows.
__host__ __device__ inline ChainLaunchPlan plan_chain_launch(int64_t rows, int64_t max_grid_threads = kMaxGridThreads) {
  const int64_t wanted = rows < max_grid_threads ? rows : max_grid_threads;
  return ChainLaunchPlan{kThreads, (wanted + kThreads - 1) / kThreads};
}

template <typename T>
struct ChainParams {
  int kind;
  const T* grad;  // backward only
  const T* x;
  const T* transitions;
  T* mu;           // forward: the marginals
  double* saved;   // SparseMAP: the prox output (written by the forward, read by the backward)
  T* dx;           // backward
  T* dtransitions; // backward
  double* scratch; // CRF: 3n (forward) or 5n (backward) doubles per grid thread
  int64_t rows;
  int64_t n;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) chain_forward_kernel(ChainParams<T> params) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n = params.n;
  for (int64_t row = thread; row < params.rows; row += stride) {
    const T* x = params.x + row * n;
    const T* transitions = params.transitions + row * 4;
    if (params.kind == 0) {
      chain::crf_forward_row(x, transitions, params.mu + row * n, params.scratch + thread * 3 * n, n);
    } else {
      chain::sparsemap_forward_row(x, transitions, params.mu + row * n, params.saved + row * n, n);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) chain_backward_kernel(ChainParams<T> params) {
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n = params.n;
  for (int64_t row = thread; row < params.rows; row += stride) {
    const T* x = params.x + row * n;
    const T* transitions = params.transitions + row * 4;
    const T* grad = params.grad + row * n;
    if (params.kind == 0) {
      chain::crf_backward_row(x, transitions, grad, params.dx + row * n, params.dtransitions + row * 4,
                              params.scratch + thread * 5 * n, n);
    } else {
      chain::sparsemap_backward_row(x, transitions, grad, params.saved + row * n, params.dx + row * n,
                                    params.dtransitions + row * 4, n);
    }
  }
}

#ifndef ENTMAX_FAST_HOST_EMULATION
// ---------------------------------------------------------------------------------------
// Launchers (called from chain_ops.cpp).

size_t scratch_bytes(bool backward, int kind, int64_t rows, int64_t n) {
  if (kind != 0 || rows == 0 || n == 0) return 0;
  const ChainLaunchPlan plan = plan_chain_launch(rows);
  return static_cast<size_t>(plan.blocks * plan.threads) * (backward ? 5 : 3) * static_cast<size_t>(n) *
         sizeof(double);
}

template <typename T>
cudaError_t launch_forward(int kind, const T* x, const T* transitions, T* mu, double* saved, int64_t rows, int64_t n,
                           void* scratch, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const ChainLaunchPlan plan = plan_chain_launch(rows);
  const ChainParams<T> params{kind,    nullptr, x, transitions, mu, saved, nullptr, nullptr,
                              static_cast<double*>(scratch), rows, n};
  chain_forward_kernel<T><<<static_cast<unsigned>(plan.blocks), plan.threads, 0, stream>>>(params);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(int kind, const T* grad, const T* x, const T* transitions, const double* saved, T* dx,
                            T* dtransitions, int64_t rows, int64_t n, void* scratch, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const ChainLaunchPlan plan = plan_chain_launch(rows);
  const ChainParams<T> params{kind,          grad, x, transitions, nullptr, const_cast<double*>(saved), dx,
                              dtransitions, static_cast<double*>(scratch), rows, n};
  chain_backward_kernel<T><<<static_cast<unsigned>(plan.blocks), plan.threads, 0, stream>>>(params);
  return cudaGetLastError();
}

template cudaError_t launch_forward<float>(int, const float*, const float*, float*, double*, int64_t, int64_t,
                                           void*, cudaStream_t);
template cudaError_t launch_forward<double>(int, const double*, const double*, double*, double*, int64_t, int64_t,
                                            void*, cudaStream_t);
template cudaError_t launch_backward<float>(int, const float*, const float*, const float*, const double*, float*,
                                            float*, int64_t, int64_t, void*, cudaStream_t);
template cudaError_t launch_backward<double>(int, const double*, const double*, const double*, const double*,
                                             double*, double*, int64_t, int64_t, void*, cudaStream_t);
#endif  // ENTMAX_FAST_HOST_EMULATION

}  // namespace chain_cuda
}  // namespace entmax_fast
