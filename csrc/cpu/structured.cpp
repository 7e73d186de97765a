// fusedmax and oscarmax (Niculae & Blondel 2017), CPU operators. MATH.md §4.
//
//   fusedmax(z; lam) = sparsemax(prox_TV(z; lam))      prox_TV: Condat's direct algorithm
//   oscarmax(z; beta) = sparsemax(prox_OWL(z; w)),     w_i = beta (n - i), sort + PAV
//
// Every op works on the last dimension. A row's valid positions are those with index
// < lengths[row] (when lengths is given) whose input is not -inf; the prox and the
// projection see only the valid entries, in order (masked positions are sliced away, so the
// TV chain links the valid neighbours on either side of a masked position). Masked positions
// get p = 0 and y = -inf; a row without valid positions gives p = 0.
//
// The forward returns (p, y), y the prox output. The backward finds the groups of the prox
// from y by exact equality (the prox writes one value per group), which is why y is stored in
// the dtype it was computed in, and why fp16/bf16 are upcast to fp32 by the Python wrapper.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace entmax_fast {
namespace structured_cpu {

enum class Prox { kTV, kOSCAR };

// ---------------------------------------------------------------------------------------
// Per-row algorithms on a contiguous buffer of the m valid entries.

// Condat (2013), "A direct algorithm for 1-D total variation denoising", in place: every
// read is at an index >= k0 and every write at an index < k0, so input and output can share
// the buffer. Each segment is written with one value, which the backward relies on.
template <typename T>
void tv1d_prox_inplace(T* w, int64_t width, T lambda) {
  if (width <= 1 || lambda == T(0)) return;
  int64_t k = 0, k0 = 0, kplus = 0, kminus = 0;
  T umin = lambda, umax = -lambda;
  T vmin = w[0] - lambda, vmax = w[0] + lambda;
  const T twolambda = T(2) * lambda;
  const T minlambda = -lambda;
  for (;;) {
    while (k == width - 1) {  // right boundary
      if (umin < T(0)) {      // vmin too high: negative jump
        do w[k0++] = vmin; while (k0 <= kminus);
        k = kminus = k0;
        vmin = w[k0];
        umin = lambda;
        umax = vmin + umin - vmax;
      } else if (umax > T(0)) {  // vmax too low: positive jump
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
    if (umin < minlambda) {  // negative jump
      do w[k0++] = vmin; while (k0 <= kminus);
      k = kplus = kminus = k0;
      vmin = w[k0];
      vmax = vmin + twolambda;
      umin = lambda;
      umax = minlambda;
    } else {
      umax += w[k + 1] - vmax;
      if (umax > lambda) {  // positive jump
        do w[k0++] = vmax; while (k0 <= kplus);
        k = kplus = kminus = k0;
        vmax = w[k0];
        vmin = vmax - twolambda;
        umin = lambda;
        umax = minlambda;
      } else {  // no jump: extend the segment
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

// Bit pattern of |v| whose unsigned order is the order of |v| (non-negative IEEE floats
// order like their bits), complemented so that an ascending sort gives decreasing |v|.
inline uint32_t descending_abs_key(float v) {
  const float a = std::fabs(v);
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  return ~bits;
}
inline uint64_t descending_abs_key(double v) {
  const double a = std::fabs(v);
  uint64_t bits;
  std::memcpy(&bits, &a, sizeof(bits));
  return ~bits;
}

template <typename T>
struct OscarScratch {
  using Key = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  std::vector<Key> keys, keys_tmp;
  std::vector<uint32_t> order, order_tmp;
  std::vector<T> block_sum;
  std::vector<int64_t> block_len;
  void reserve(int64_t n) {
    keys.resize(n);
    keys_tmp.resize(n);
    order.resize(n);
    order_tmp.resize(n);
    block_sum.resize(n);
    block_len.resize(n);
  }
};

// Indices of v[0..m) by decreasing |v|: LSD radix sort on the key bytes (passes whose byte
// is the same for every key are skipped). For rows of a few hundred entries this is ~4x
// faster than std::sort. Returns a pointer into s.order or s.order_tmp.
template <typename T>
const uint32_t* order_by_abs_desc(const T* v, int64_t m, OscarScratch<T>& s) {
  using Key = typename OscarScratch<T>::Key;
  Key* keys = s.keys.data();
  Key* keys_tmp = s.keys_tmp.data();
  uint32_t* order = s.order.data();
  uint32_t* order_tmp = s.order_tmp.data();
  for (int64_t i = 0; i < m; ++i) {
    keys[i] = descending_abs_key(v[i]);
    order[i] = static_cast<uint32_t>(i);
  }
  if (m < 48) {
    for (int64_t i = 1; i < m; ++i) {  // insertion sort
      const Key key = keys[i];
      const uint32_t index = order[i];
      int64_t j = i - 1;
      for (; j >= 0 && keys[j] > key; --j) {
        keys[j + 1] = keys[j];
        order[j + 1] = order[j];
      }
      keys[j + 1] = key;
      order[j + 1] = index;
    }
    return order;
  }
  for (unsigned shift = 0; shift < 8 * sizeof(Key); shift += 8) {
    int64_t count[257] = {0};
    for (int64_t i = 0; i < m; ++i) ++count[((keys[i] >> shift) & 0xff) + 1];
    if (count[((keys[0] >> shift) & 0xff) + 1] == m) continue;
    for (int d = 0; d < 256; ++d) count[d + 1] += count[d];
    for (int64_t i = 0; i < m; ++i) {
      const int64_t at = count[(keys[i] >> shift) & 0xff]++;
      keys_tmp[at] = keys[i];
      order_tmp[at] = order[i];
    }
    std::swap(keys, keys_tmp);
    std::swap(order, order_tmp);
  }
  return order;
}

// prox of the OSCAR-weighted OWL norm: sort |v| decreasingly, subtract w_r = beta (m-1-r),
// non-increasing isotonic regression by pool-adjacent-violators, clip at 0, restore order
// and signs. Blocks with equal means are pooled too, so distinct groups have distinct |y|.
template <typename T>
void oscar_prox_inplace(T* v, int64_t m, T beta, OscarScratch<T>& s) {
  if (m == 0 || beta == T(0)) return;
  const uint32_t* order = order_by_abs_desc(v, m, s);
  T* bsum = s.block_sum.data();
  int64_t* blen = s.block_len.data();
  int64_t nb = 0;
  for (int64_t r = 0; r < m; ++r) {
    bsum[nb] = std::fabs(v[order[r]]) - beta * T(m - 1 - r);
    blen[nb] = 1;
    ++nb;
    while (nb > 1 && bsum[nb - 2] / T(blen[nb - 2]) <= bsum[nb - 1] / T(blen[nb - 1])) {
      bsum[nb - 2] += bsum[nb - 1];
      blen[nb - 2] += blen[nb - 1];
      --nb;
    }
  }
  int64_t r = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const T mean = bsum[b] / T(blen[b]);
    const T t = mean > T(0) ? mean : T(0);
    for (int64_t c = 0; c < blen[b]; ++c, ++r) {
      T& x = v[order[r]];
      x = x > T(0) ? t : (x < T(0) ? -t : T(0));
    }
  }
}

// Sparsemax threshold of v[0..m) by Michelot's algorithm: start from the candidates
// {v > max - 1} (a superset of the support), then drop entries <= tau until none is
// dropped; tau only increases, so the support is never lost. Expected linear time.
template <typename T>
T simplex_threshold(const T* v, int64_t m, std::vector<T>& candidates) {
  T vmax = v[0];
  for (int64_t i = 1; i < m; ++i) vmax = std::max(vmax, v[i]);
  T tau = vmax - T(1);
  candidates.clear();
  T sum = 0;
  for (int64_t i = 0; i < m; ++i) {
    if (v[i] > tau) {
      candidates.push_back(v[i]);
      sum += v[i];
    }
  }
  T* scratch = candidates.data();
  int64_t count = static_cast<int64_t>(candidates.size());
  tau = (sum - T(1)) / T(count);
  for (;;) {
    int64_t kept = 0;
    T kept_sum = 0;
    for (int64_t i = 0; i < count; ++i) {
      if (scratch[i] > tau) {
        scratch[kept++] = scratch[i];
        kept_sum += scratch[i];
      }
    }
    if (kept == count || kept == 0) break;
    count = kept;
    tau = (kept_sum - T(1)) / T(count);
  }
  return tau;
}

// ---------------------------------------------------------------------------------------
// Argument checks shared by the ops.

void check_forward_args(const char* op, const at::Tensor& x, double reg, const char* reg_name,
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

void check_backward_args(const char* op, const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y,
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
at::Tensor checked_lengths(const char* op, const c10::optional<at::Tensor>& lengths, int64_t n) {
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

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

// ---------------------------------------------------------------------------------------
// Forward: (p, y) or, when project is false, only y (the prox; p is left undefined).

template <typename T>
void forward_rows(Prox kind, bool project, const T* x, const int64_t* lengths, T* p, T* y, int64_t rows, int64_t n,
                  T reg, std::atomic<bool>& found_bad) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<T> candidates;
    OscarScratch<T> oscar;
    if (kind == Prox::kOSCAR) oscar.reserve(n);
    for (int64_t row = begin; row < end; ++row) {
      const T* x_row = x + row * n;
      T* y_row = y + row * n;
      T* p_row = project ? p + row * n : nullptr;
      const int64_t len = lengths ? lengths[row] : n;
      // The valid entries are packed at the front of y_row, where the prox works in place.
      int64_t m = 0;
      bool bad = false;
      for (int64_t j = 0; j < len; ++j) {
        const T v = x_row[j];
        if (v == neg_inf) continue;
        bad |= !std::isfinite(v);
        y_row[m++] = v;
      }
      if (bad) found_bad.store(true, std::memory_order_relaxed);
      if (kind == Prox::kTV) {
        tv1d_prox_inplace(y_row, m, reg);
      } else {
        oscar_prox_inplace(y_row, m, reg, oscar);
      }
      const T tau = (project && m > 0) ? simplex_threshold(y_row, m, candidates) : T(0);
      // Unpack from the end: packed index k <= j, so no packed entry is overwritten unread.
      int64_t k = m;
      for (int64_t j = n - 1; j >= 0; --j) {
        const bool valid = j < len && x_row[j] != neg_inf;
        const T v = valid ? y_row[--k] : neg_inf;
        y_row[j] = v;
        if (project) p_row[j] = valid ? std::max(v - tau, T(0)) : T(0);
      }
    }
  });
}

std::vector<at::Tensor> forward_impl(const char* op, Prox kind, bool project, const at::Tensor& x_in, double reg,
                                     const char* reg_name, const c10::optional<at::Tensor>& lengths_in) {
  check_forward_args(op, x_in, reg, reg_name, lengths_in);
  TORCH_CHECK(x_in.device().is_cpu(), op, ": CPU implementation called with a ", x_in.device(), " tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const at::Tensor lengths = checked_lengths(op, lengths_in, n);
  at::Tensor y = at::empty_like(x);
  at::Tensor p = project ? at::empty_like(x) : at::Tensor();
  std::atomic<bool> found_bad{false};
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "structured_forward", [&] {
    forward_rows<scalar_t>(kind, project, x.data_ptr<scalar_t>(), lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr,
                           project ? p.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), rows, n,
                           static_cast<scalar_t>(reg), found_bad);
  });
  TORCH_CHECK(!found_bad.load(), op, ": X must be finite except for -inf (masked positions); found NaN or +inf");
  if (project) return {p, y};
  return {y};
}

// ---------------------------------------------------------------------------------------
// Backward: dz = J_prox (J_sparsemax g), both Jacobians symmetric.

template <typename T>
void backward_rows(Prox kind, const T* g, const T* p, const T* y, T* dz, int64_t rows, int64_t n, bool grouped) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<T> u(n), group_value, group_sum;
    std::vector<int64_t> group_count;
    for (int64_t row = begin; row < end; ++row) {
      const T* g_row = g + row * n;
      const T* p_row = p + row * n;
      const T* y_row = y + row * n;
      T* dz_row = dz + row * n;
      // J_sparsemax g = s * (g - mean_S g), S the support.
      T g_sum = 0;
      int64_t support = 0;
      for (int64_t j = 0; j < n; ++j) {
        if (p_row[j] > T(0)) {
          g_sum += g_row[j];
          ++support;
        }
      }
      const T g_mean = support > 0 ? g_sum / T(support) : T(0);
      for (int64_t j = 0; j < n; ++j) u[j] = p_row[j] > T(0) ? g_row[j] - g_mean : T(0);
      if (!grouped) {
        std::copy(u.begin(), u.end(), dz_row);
        continue;
      }
      if (kind == Prox::kTV) {
        // Groups: runs of equal y over consecutive valid positions (masked ones skipped).
        std::fill(dz_row, dz_row + n, T(0));
        int64_t run_start = 0, run_len = 0;
        T run_value = 0, run_sum = 0;
        auto flush = [&](int64_t run_end) {
          const T mean = run_sum / T(run_len);
          for (int64_t i = run_start; i < run_end; ++i)
            if (y_row[i] != neg_inf) dz_row[i] = mean;
        };
        for (int64_t j = 0; j < n; ++j) {
          if (y_row[j] == neg_inf) continue;
          if (run_len > 0 && y_row[j] == run_value) {
            run_sum += u[j];
            ++run_len;
            continue;
          }
          if (run_len > 0) flush(j);
          run_start = j;
          run_value = y_row[j];
          run_sum = u[j];
          run_len = 1;
        }
        if (run_len > 0) flush(n);
      } else {
        // Groups: valid entries with equal |y| != 0; dz_i = sign(y_i) mean_G sign(y_j) u_j.
        // u vanishes off the support, so only groups holding a support entry can give a
        // non-zero dz: their values are found by binary search among the support's |y|
        // (O(n log |S|) instead of sorting the whole row).
        group_value.clear();
        for (int64_t j = 0; j < n; ++j)
          if (p_row[j] > T(0) && y_row[j] != T(0)) group_value.push_back(std::fabs(y_row[j]));
        std::sort(group_value.begin(), group_value.end());
        group_value.erase(std::unique(group_value.begin(), group_value.end()), group_value.end());
        group_sum.assign(group_value.size(), T(0));
        group_count.assign(group_value.size(), 0);
        auto group_of = [&](T value) -> int64_t {
          const auto it = std::lower_bound(group_value.begin(), group_value.end(), std::fabs(value));
          return it != group_value.end() && *it == std::fabs(value) ? it - group_value.begin() : -1;
        };
        for (int64_t j = 0; j < n; ++j) {
          if (y_row[j] == neg_inf || y_row[j] == T(0)) continue;
          const int64_t group = group_of(y_row[j]);
          if (group < 0) continue;
          group_sum[group] += y_row[j] > T(0) ? u[j] : -u[j];
          ++group_count[group];
        }
        for (int64_t j = 0; j < n; ++j) {
          const int64_t group = (y_row[j] == neg_inf || y_row[j] == T(0)) ? -1 : group_of(y_row[j]);
          const T mean = group < 0 ? T(0) : group_sum[group] / T(group_count[group]);
          dz_row[j] = y_row[j] > T(0) ? mean : -mean;
        }
      }
    }
  });
}

at::Tensor backward_impl(const char* op, Prox kind, const at::Tensor& grad_in, const at::Tensor& p_in,
                         const at::Tensor& y_in, double reg, const char* reg_name) {
  check_backward_args(op, grad_in, p_in, y_in, reg, reg_name);
  TORCH_CHECK(p_in.device().is_cpu(), op, ": CPU implementation called with a ", p_in.device(), " tensor");
  const at::Tensor grad = grad_in.contiguous(), p = p_in.contiguous(), y = y_in.contiguous();
  const int64_t n = p.size(-1);
  const int64_t rows = n == 0 ? 0 : p.numel() / n;
  at::Tensor dz = at::empty_like(p);
  // With reg == 0 the prox is the identity: every group is a singleton even where inputs tie.
  const bool grouped = reg > 0;
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "structured_backward", [&] {
    backward_rows<scalar_t>(kind, grad.data_ptr<scalar_t>(), p.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                            dz.data_ptr<scalar_t>(), rows, n, grouped);
  });
  return dz;
}

std::tuple<at::Tensor, at::Tensor> fusedmax_forward(const at::Tensor& x, double lam,
                                                    const c10::optional<at::Tensor>& lengths) {
  auto out = forward_impl("fusedmax", Prox::kTV, true, x, lam, "lam", lengths);
  return {out[0], out[1]};
}

at::Tensor fusedmax_backward(const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y, double lam) {
  return backward_impl("fusedmax_backward", Prox::kTV, grad, p, y, lam, "lam");
}

std::tuple<at::Tensor, at::Tensor> oscarmax_forward(const at::Tensor& x, double beta,
                                                    const c10::optional<at::Tensor>& lengths) {
  auto out = forward_impl("oscarmax", Prox::kOSCAR, true, x, beta, "beta", lengths);
  return {out[0], out[1]};
}

at::Tensor oscarmax_backward(const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y, double beta) {
  return backward_impl("oscarmax_backward", Prox::kOSCAR, grad, p, y, beta, "beta");
}

at::Tensor tv1d_prox(const at::Tensor& x, double lam, const c10::optional<at::Tensor>& lengths) {
  return forward_impl("tv1d_prox", Prox::kTV, false, x, lam, "lam", lengths)[0];
}

at::Tensor oscar_prox(const at::Tensor& x, double beta, const c10::optional<at::Tensor>& lengths) {
  return forward_impl("oscar_prox", Prox::kOSCAR, false, x, beta, "beta", lengths)[0];
}

}  // namespace structured_cpu
}  // namespace entmax_fast

TORCH_LIBRARY_FRAGMENT(entmax_fast, m) {
  m.def("fusedmax_forward(Tensor x, float lam, Tensor? lengths=None) -> (Tensor, Tensor)");
  m.def("fusedmax_backward(Tensor grad, Tensor p, Tensor y, float lam) -> Tensor");
  m.def("oscarmax_forward(Tensor x, float beta, Tensor? lengths=None) -> (Tensor, Tensor)");
  m.def("oscarmax_backward(Tensor grad, Tensor p, Tensor y, float beta) -> Tensor");
  m.def("tv1d_prox(Tensor x, float lam, Tensor? lengths=None) -> Tensor");
  m.def("oscar_prox(Tensor x, float beta, Tensor? lengths=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(entmax_fast, CPU, m) {
  m.impl("fusedmax_forward", &entmax_fast::structured_cpu::fusedmax_forward);
  m.impl("fusedmax_backward", &entmax_fast::structured_cpu::fusedmax_backward);
  m.impl("oscarmax_forward", &entmax_fast::structured_cpu::oscarmax_forward);
  m.impl("oscarmax_backward", &entmax_fast::structured_cpu::oscarmax_backward);
  m.impl("tv1d_prox", &entmax_fast::structured_cpu::tv1d_prox);
  m.impl("oscar_prox", &entmax_fast::structured_cpu::oscar_prox);
}

// ---------------------------------------------------------------------------------------
// CUDA operators: host side. The kernels are in csrc/cuda/structured.cu, which includes no
// torch header (it compiles in seconds); this part is built only with CUDA.
#ifdef ENTMAX_FAST_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace entmax_fast {
namespace structured_cuda {

template <typename T>
cudaError_t launch_forward(int kind, bool project, const T* x, const int64_t* lengths, T* p, T* y, int64_t rows,
                           int64_t n, T reg, void* keys, int32_t* order, T* block_sum, int32_t* block_len,
                           cudaStream_t stream);
template <typename T>
cudaError_t launch_backward(int kind, bool grouped, const T* g, const T* p, const T* y, T* dz, int64_t rows,
                            int64_t n, void* keys, int32_t* order, cudaStream_t stream);

using structured_cpu::Prox;

std::vector<at::Tensor> cuda_forward_impl(const char* op, Prox kind, bool project, const at::Tensor& x_in, double reg,
                                     const char* reg_name, const c10::optional<at::Tensor>& lengths_in) {
  structured_cpu::check_forward_args(op, x_in, reg, reg_name, lengths_in);
  TORCH_CHECK(x_in.is_cuda(), op, ": CUDA implementation called with a ", x_in.device(), " tensor");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  // No range check of lengths here (it would sync with the host): the kernel clamps them.
  const at::Tensor lengths = lengths_in.has_value() ? lengths_in->to(at::kLong).contiguous() : at::Tensor();
  at::Tensor y = at::empty_like(x);
  at::Tensor p = project ? at::empty_like(x) : at::Tensor();
  const bool oscar = kind == Prox::kOSCAR;
  at::Tensor keys, order, block_sum, block_len;
  if (oscar && rows > 0) {
    keys = at::empty({rows, n}, x.options().dtype(x.scalar_type() == at::kFloat ? at::kInt : at::kLong));
    order = at::empty({rows, n}, x.options().dtype(at::kInt));
    block_sum = at::empty({rows, n}, x.options());
    block_len = at::empty({rows, n}, x.options().dtype(at::kInt));
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "structured_forward_cuda", [&] {
    C10_CUDA_CHECK(launch_forward<scalar_t>(
        oscar ? 1 : 0, project, x.data_ptr<scalar_t>(), lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr,
        project ? p.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), rows, n, static_cast<scalar_t>(reg),
        keys.defined() ? keys.data_ptr() : nullptr, order.defined() ? order.data_ptr<int32_t>() : nullptr,
        block_sum.defined() ? block_sum.data_ptr<scalar_t>() : nullptr,
        block_len.defined() ? block_len.data_ptr<int32_t>() : nullptr, stream));
  });
  if (project) return {p, y};
  return {y};
}

at::Tensor cuda_backward_impl(const char* op, Prox kind, const at::Tensor& grad_in, const at::Tensor& p_in,
                         const at::Tensor& y_in, double reg, const char* reg_name) {
  structured_cpu::check_backward_args(op, grad_in, p_in, y_in, reg, reg_name);
  TORCH_CHECK(p_in.is_cuda() && grad_in.device() == p_in.device() && y_in.device() == p_in.device(), op,
              ": grad, p and y must be on the same CUDA device, got ", grad_in.device(), ", ", p_in.device(), ", ",
              y_in.device());
  const c10::cuda::CUDAGuard guard(p_in.device());
  const at::Tensor grad = grad_in.contiguous(), p = p_in.contiguous(), y = y_in.contiguous();
  const int64_t n = p.size(-1);
  const int64_t rows = n == 0 ? 0 : p.numel() / n;
  at::Tensor dz = at::empty_like(p);
  const bool grouped = reg > 0;
  const bool sort = grouped && kind == Prox::kOSCAR;
  at::Tensor keys, order;
  if (sort && rows > 0) {
    keys = at::empty({rows, n}, p.options().dtype(p.scalar_type() == at::kFloat ? at::kInt : at::kLong));
    order = at::empty({rows, n}, p.options().dtype(at::kInt));
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "structured_backward_cuda", [&] {
    C10_CUDA_CHECK(launch_backward<scalar_t>(
        kind == Prox::kOSCAR ? 1 : 0, grouped, grad.data_ptr<scalar_t>(), p.data_ptr<scalar_t>(),
        y.data_ptr<scalar_t>(), dz.data_ptr<scalar_t>(), rows, n, keys.defined() ? keys.data_ptr() : nullptr,
        order.defined() ? order.data_ptr<int32_t>() : nullptr, stream));
  });
  return dz;
}

std::tuple<at::Tensor, at::Tensor> fusedmax_forward(const at::Tensor& x, double lam,
                                                    const c10::optional<at::Tensor>& lengths) {
  auto out = cuda_forward_impl("fusedmax", Prox::kTV, true, x, lam, "lam", lengths);
  return {out[0], out[1]};
}

at::Tensor fusedmax_backward(const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y, double lam) {
  return cuda_backward_impl("fusedmax_backward", Prox::kTV, grad, p, y, lam, "lam");
}

std::tuple<at::Tensor, at::Tensor> oscarmax_forward(const at::Tensor& x, double beta,
                                                    const c10::optional<at::Tensor>& lengths) {
  auto out = cuda_forward_impl("oscarmax", Prox::kOSCAR, true, x, beta, "beta", lengths);
  return {out[0], out[1]};
}

at::Tensor oscarmax_backward(const at::Tensor& grad, const at::Tensor& p, const at::Tensor& y, double beta) {
  return cuda_backward_impl("oscarmax_backward", Prox::kOSCAR, grad, p, y, beta, "beta");
}

at::Tensor tv1d_prox(const at::Tensor& x, double lam, const c10::optional<at::Tensor>& lengths) {
  return cuda_forward_impl("tv1d_prox", Prox::kTV, false, x, lam, "lam", lengths)[0];
}

at::Tensor oscar_prox(const at::Tensor& x, double beta, const c10::optional<at::Tensor>& lengths) {
  return cuda_forward_impl("oscar_prox", Prox::kOSCAR, false, x, beta, "beta", lengths)[0];
}

}  // namespace structured_cuda
}  // namespace entmax_fast

TORCH_LIBRARY_IMPL(entmax_fast, CUDA, m) {
  m.impl("fusedmax_forward", &entmax_fast::structured_cuda::fusedmax_forward);
  m.impl("fusedmax_backward", &entmax_fast::structured_cuda::fusedmax_backward);
  m.impl("oscarmax_forward", &entmax_fast::structured_cuda::oscarmax_forward);
  m.impl("oscarmax_backward", &entmax_fast::structured_cuda::oscarmax_backward);
  m.impl("tv1d_prox", &entmax_fast::structured_cuda::tv1d_prox);
  m.impl("oscar_prox", &entmax_fast::structured_cuda::oscar_prox);
}
#endif  // ENTMAX_FAST_WITH_CUDA
