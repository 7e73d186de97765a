// fusedmax and oscarmax, CUDA kernels (MATH.md §4; semantics and algorithms as in
// csrc/cpu/structured.cpp, which also holds the schemas and, under ENTMAX_FAST_WITH_CUDA,
// the host side of the CUDA operators that call the launchers below).
//
// This file includes no torch header: the kernels take raw pointers, which keeps an
// nvcc compile to a few seconds instead of about a minute for the ATen headers.
//
// One thread per row: Condat's TV algorithm and PAV are sequential scans whose restarts
// depend on the data, so a row cannot be split across threads without changing the
// algorithm. Rows are independent, so a grid of rows keeps the GPU busy when there are
// many rows (attention: B·H·Lq rows); a single long row runs on one thread.
//
// Differences from the CPU operators, both to avoid a host sync: lengths are clamped to
// [0, n] instead of checked, and a row holding NaN or +inf gets NaN weights and prox
// instead of raising.
// ENTMAX_FAST_HOST_EMULATION: tests/test_structured.py compiles the kernels with g++ and runs
// them row by row on the host (no GPU here); it drops the runtime header and the launchers.
#ifndef ENTMAX_FAST_HOST_EMULATION
#include <cuda_runtime.h>
#endif

#include <cmath>
#include <cstdint>

namespace entmax_fast {
namespace structured_cuda {

enum class Prox { kTV, kOSCAR };

constexpr int kThreads = 128;

template <typename T>
__device__ __forceinline__ T neg_inf() {
  return static_cast<T>(-INFINITY);
}

template <typename T>
__device__ __forceinline__ T abs_value(T v) {
  return v < T(0) ? -v : v;
}

// Keys whose unsigned ascending order is the decreasing order of |v|.
__device__ __forceinline__ uint32_t descending_abs_key(float v) { return ~__float_as_uint(fabsf(v)); }
__device__ __forceinline__ unsigned long long descending_abs_key(double v) {
  return ~static_cast<unsigned long long>(__double_as_longlong(fabs(v)));
}

template <typename T>
struct KeyType {
  using type = unsigned long long;
};
template <>
struct KeyType<float> {
  using type = uint32_t;
};

// Condat's direct algorithm, in place (see the CPU source for why in place is safe).
template <typename T>
__device__ void tv1d_prox_inplace(T* w, int64_t width, T lambda) {
  if (width <= 1 || lambda == T(0)) return;
  int64_t k = 0, k0 = 0, kplus = 0, kminus = 0;
  T umin = lambda, umax = -lambda;
  T vmin = w[0] - lambda, vmax = w[0] + lambda;
  const T twolambda = T(2) * lambda;
  const T minlambda = -lambda;
  for (;;) {
    while (k == width - 1) {
      if (umin < T(0)) {
        do w[k0++] = vmin; while (k0 <= kminus);
        k = kminus = k0;
        vmin = w[k0];
        umin = lambda;
        umax = vmin + umin - vmax;
      } else if (umax > T(0)) {
        do w[k0++] = vmax; while (k0 <= kplus);
        k = kplus = k0;
        vmax = w[k0];
        umax = minlambda;
        umin = vmax + umax - vmin;
      } else {
        vmin += umin / T(k - k0 + 1);
        do w[k0++] = vmin; while (k0 <= k);
        return;
      }
    }
    umin += w[k + 1] - vmin;
    if (umin < minlambda) {
      do w[k0++] = vmin; while (k0 <= kminus);
      k = kplus = kminus = k0;
      vmin = w[k0];
      vmax = vmin + twolambda;
      umin = lambda;
      umax = minlambda;
    } else {
      umax += w[k + 1] - vmax;
      if (umax > lambda) {
        do w[k0++] = vmax; while (k0 <= kplus);
        k = kplus = kminus = k0;
        vmax = w[k0];
        vmin = vmax - twolambda;
        umin = lambda;
        umax = minlambda;
      } else {
        k++;
        if (umin >= lambda) {
          kminus = k;
          vmin += (umin - lambda) / T(kminus - k0 + 1);
          umin = lambda;
        }
        if (umax <= minlambda) {
          kplus = k;
          vmax += (umax + lambda) / T(kplus - k0 + 1);
          umax = minlambda;
        }
      }
    }
  }
}

// In-place heap sort of (keys, order) by ascending key: O(m log m), no extra memory.
template <typename Key>
__device__ void heap_sort(Key* keys, int32_t* order, int64_t m) {
  auto sift_down = [&](int64_t root, int64_t end) {
    while (2 * root + 1 < end) {
      int64_t child = 2 * root + 1;
      if (child + 1 < end && keys[child] < keys[child + 1]) ++child;
      if (!(keys[root] < keys[child])) return;
      const Key key = keys[root];
      keys[root] = keys[child];
      keys[child] = key;
      const int32_t index = order[root];
      order[root] = order[child];
      order[child] = index;
      root = child;
    }
  };
  for (int64_t start = m / 2 - 1; start >= 0; --start) sift_down(start, m);
  for (int64_t end = m - 1; end > 0; --end) {
    const Key key = keys[0];
    keys[0] = keys[end];
    keys[end] = key;
    const int32_t index = order[0];
    order[0] = order[end];
    order[end] = index;
    sift_down(0, end);
  }
}

// OSCAR prox in place: sort |v| decreasingly, subtract w_r = beta (m-1-r), PAV
// (non-increasing, equal means pooled), clip at 0, restore order and signs.
template <typename T>
__device__ void oscar_prox_inplace(T* v, int64_t m, T beta, typename KeyType<T>::type* keys, int32_t* order,
                                   T* block_sum, int32_t* block_len) {
  if (m == 0 || beta == T(0)) return;
  for (int64_t i = 0; i < m; ++i) {
    keys[i] = descending_abs_key(v[i]);
    order[i] = static_cast<int32_t>(i);
  }
  heap_sort(keys, order, m);
  int64_t nb = 0;
  for (int64_t r = 0; r < m; ++r) {
    block_sum[nb] = abs_value(v[order[r]]) - beta * T(m - 1 - r);
    block_len[nb] = 1;
    ++nb;
    while (nb > 1 && block_sum[nb - 2] / T(block_len[nb - 2]) <= block_sum[nb - 1] / T(block_len[nb - 1])) {
      block_sum[nb - 2] += block_sum[nb - 1];
      block_len[nb - 2] += block_len[nb - 1];
      --nb;
    }
  }
  int64_t r = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const T mean = block_sum[b] / T(block_len[b]);
    const T t = mean > T(0) ? mean : T(0);
    for (int32_t c = 0; c < block_len[b]; ++c, ++r) {
      T& x = v[order[r]];
      x = x > T(0) ? t : (x < T(0) ? -t : T(0));
    }
  }
}

// Michelot's sparsemax threshold without scratch memory: each pass recounts the entries
// above tau; passes stop when the set no longer shrinks.
template <typename T>
__device__ T simplex_threshold(const T* v, int64_t m) {
  T vmax = v[0];
  for (int64_t i = 1; i < m; ++i) vmax = v[i] > vmax ? v[i] : vmax;
  T tau = vmax - T(1);
  int64_t previous = -1;
  for (;;) {
    T sum = 0;
    int64_t count = 0;
    for (int64_t i = 0; i < m; ++i) {
      if (v[i] > tau) {
        sum += v[i];
        ++count;
      }
    }
    if (count == previous || count == 0) return tau;
    previous = count;
    tau = (sum - T(1)) / T(count);
  }
}

template <typename T>
__global__ void forward_kernel(Prox kind, bool project, const T* __restrict__ x, const int64_t* __restrict__ lengths,
                               T* __restrict__ p, T* __restrict__ y, int64_t rows, int64_t n, T reg,
                               typename KeyType<T>::type* keys, int32_t* order, T* block_sum, int32_t* block_len) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const T* x_row = x + row * n;
  T* y_row = y + row * n;
  T* p_row = project ? p + row * n : nullptr;
  int64_t len = lengths ? lengths[row] : n;
  len = len < 0 ? 0 : (len > n ? n : len);
  // The valid entries are packed at the front of y_row, where the prox works in place.
  int64_t m = 0;
  bool bad = false;
  for (int64_t j = 0; j < len; ++j) {
    const T v = x_row[j];
    if (v == neg_inf<T>()) continue;
    bad |= !isfinite(v);
    y_row[m++] = v;
  }
  if (bad) {
    const T nan = static_cast<T>(NAN);
    for (int64_t j = 0; j < n; ++j) {
      y_row[j] = nan;
      if (project) p_row[j] = nan;
    }
    return;
  }
  if (kind == Prox::kTV) {
    tv1d_prox_inplace(y_row, m, reg);
  } else {
    oscar_prox_inplace(y_row, m, reg, keys + row * n, order + row * n, block_sum + row * n, block_len + row * n);
  }
  const T tau = (project && m > 0) ? simplex_threshold(y_row, m) : T(0);
  // Unpack from the end: packed index k <= j, so no packed entry is overwritten unread.
  int64_t k = m;
  for (int64_t j = n - 1; j >= 0; --j) {
    const bool valid = j < len && x_row[j] != neg_inf<T>();
    const T v = valid ? y_row[--k] : neg_inf<T>();
    y_row[j] = v;
    if (project) p_row[j] = valid ? (v > tau ? v - tau : T(0)) : T(0);
  }
}

template <typename T>
__global__ void backward_kernel(Prox kind, bool grouped, const T* __restrict__ g, const T* __restrict__ p,
                                const T* __restrict__ y, T* __restrict__ dz, int64_t rows, int64_t n,
                                typename KeyType<T>::type* keys, int32_t* order) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  const T* g_row = g + row * n;
  const T* p_row = p + row * n;
  const T* y_row = y + row * n;
  T* dz_row = dz + row * n;
  // J_sparsemax g = s * (g - mean_S g); u_j is recomputed where needed instead of stored.
  T g_sum = 0;
  int64_t support = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (p_row[j] > T(0)) {
      g_sum += g_row[j];
      ++support;
    }
  }
  const T g_mean = support > 0 ? g_sum / T(support) : T(0);
  auto u = [&](int64_t j) { return p_row[j] > T(0) ? g_row[j] - g_mean : T(0); };
  for (int64_t j = 0; j < n; ++j) dz_row[j] = grouped ? T(0) : u(j);
  if (!grouped) return;
  if (kind == Prox::kTV) {
    // Groups: runs of equal y over consecutive valid positions (masked ones skipped).
    int64_t run_start = 0, run_len = 0;
    T run_value = 0, run_sum = 0;
    for (int64_t j = 0; j <= n; ++j) {
      const bool at_end = j == n;
      if (!at_end && y_row[j] == neg_inf<T>()) continue;
      if (!at_end && run_len > 0 && y_row[j] == run_value) {
        run_sum += u(j);
        ++run_len;
        continue;
      }
      if (run_len > 0) {
        const T mean = run_sum / T(run_len);
        for (int64_t i = run_start; i < j; ++i)
          if (y_row[i] != neg_inf<T>()) dz_row[i] = mean;
      }
      if (at_end) break;
      run_start = j;
      run_value = y_row[j];
      run_sum = u(j);
      run_len = 1;
    }
    return;
  }
  // Groups: valid entries with equal |y| != 0; dz_i = sign(y_i) mean_G sign(y_j) u_j.
  typename KeyType<T>::type* row_keys = keys + row * n;
  int32_t* row_order = order + row * n;
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (y_row[j] != neg_inf<T>() && y_row[j] != T(0)) {
      row_keys[count] = descending_abs_key(y_row[j]);
      row_order[count] = static_cast<int32_t>(j);
      ++count;
    }
  }
  heap_sort(row_keys, row_order, count);
  for (int64_t a = 0; a < count;) {
    int64_t b = a;
    T sum = 0;
    while (b < count && row_keys[b] == row_keys[a]) {
      const int64_t j = row_order[b];
      sum += y_row[j] > T(0) ? u(j) : -u(j);
      ++b;
    }
    const T mean = sum / T(b - a);
    for (int64_t c = a; c < b; ++c) {
      const int64_t j = row_order[c];
      dz_row[j] = y_row[j] > T(0) ? mean : -mean;
    }
    a = b;
  }
}

#ifndef ENTMAX_FAST_HOST_EMULATION
// ---------------------------------------------------------------------------------------
// Launchers (called from csrc/cpu/structured.cpp). kind: 0 = TV, 1 = OSCAR. keys holds
// rows x n uint32 (float) or uint64 (double) entries; keys, order and the block arrays are
// needed by OSCAR only (the backward needs keys and order) and may be null otherwise.

constexpr unsigned int blocks_for(int64_t rows) { return static_cast<unsigned int>((rows + kThreads - 1) / kThreads); }

template <typename T>
cudaError_t launch_forward(int kind, bool project, const T* x, const int64_t* lengths, T* p, T* y, int64_t rows,
                           int64_t n, T reg, void* keys, int32_t* order, T* block_sum, int32_t* block_len,
                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  forward_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(
      kind == 0 ? Prox::kTV : Prox::kOSCAR, project, x, lengths, p, y, rows, n, reg,
      static_cast<typename KeyType<T>::type*>(keys), order, block_sum, block_len);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(int kind, bool grouped, const T* g, const T* p, const T* y, T* dz, int64_t rows,
                            int64_t n, void* keys, int32_t* order, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  backward_kernel<T><<<blocks_for(rows), kThreads, 0, stream>>>(
      kind == 0 ? Prox::kTV : Prox::kOSCAR, grouped, g, p, y, dz, rows, n,
      static_cast<typename KeyType<T>::type*>(keys), order);
  return cudaGetLastError();
}

template cudaError_t launch_forward<float>(int, bool, const float*, const int64_t*, float*, float*, int64_t, int64_t,
                                           float, void*, int32_t*, float*, int32_t*, cudaStream_t);
template cudaError_t launch_forward<double>(int, bool, const double*, const int64_t*, double*, double*, int64_t,
                                            int64_t, double, void*, int32_t*, double*, int32_t*, cudaStream_t);
template cudaError_t launch_backward<float>(int, bool, const float*, const float*, const float*, float*, int64_t,
                                            int64_t, void*, int32_t*, cudaStream_t);
template cudaError_t launch_backward<double>(int, bool, const double*, const double*, const double*, double*,
                                             int64_t, int64_t, void*, int32_t*, cudaStream_t);
#endif  // ENTMAX_FAST_HOST_EMULATION

}  // namespace structured_cuda
}  // namespace entmax_fast
