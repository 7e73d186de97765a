// fusedmax and oscarmax (Niculae & Blondel 2017), CPU operators (docs/maths.md, "fusedmax
// and oscarmax").
//
//   fusedmax(z; lam) = sparsemax(prox_TV(z; lam))      prox_TV: Condat's direct algorithm
//   oscarmax(z; beta) = sparsemax(prox_OWL(z; w)),     w_i = beta (n - i), sort + PAV
//
// Every op works on the last dimension. A row's valid positions are those with index
// < lengths[row] (when lengths is given) whose input is not -inf; the prox and the
// projection see only the valid entries, in order (masked positions are sliced away, so the
// TV chain links the valid neighbours on either side of a masked position). Masked positions
// get p = 0 and y = -inf; a row without valid positions gives p = 0. A row holding NaN or
// +inf at a valid position gets NaN weights and prox (torch.softmax's rule), and its
// gradient is NaN. Any finite scores give finite weights: the row algorithms work on
// scaled (and for TV shifted) values, see csrc/common/structured_algos.h, which holds the
// algorithms shared with the CUDA kernels.
//
// The forward returns (p, y), y the prox output. The backward finds the groups of the prox
// from y by exact equality (the prox writes one value per group), which is why y is stored in
// the dtype it was computed in, and why fp16/bf16 are upcast to fp32 by the Python wrapper.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/structured_algos.h"
#include "../common/structured_checks.h"
#include "../common/structured_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace entmax_fast {
namespace structured_cpu {

using structured::Prox;

// ---------------------------------------------------------------------------------------
// Host-only parts: the sort of OSCAR (a radix sort; the GPU uses a bitonic network) and the
// candidate list of Michelot's iteration.

template <typename T>
struct OscarScratch {
  using Key = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  std::vector<Key> keys, keys_tmp;
  std::vector<uint32_t> order, order_tmp;
  std::vector<T> magnitude, block_sum;
  std::vector<int64_t> block_len, block_first;
  void reserve(int64_t n) {
    keys.resize(n);
    keys_tmp.resize(n);
    order.resize(n);
    order_tmp.resize(n);
    magnitude.resize(n);
    block_sum.resize(n);
    block_len.resize(n);
    block_first.resize(n);
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
    keys[i] = structured::descending_abs_key(v[i]);
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

// OSCAR prox in place: sort |v| decreasingly, PAV on the sorted magnitudes (shared with
// the GPU), restore order and signs.
template <typename T>
void oscar_prox_inplace(T* v, int64_t m, T beta, OscarScratch<T>& s) {
  if (m == 0 || beta == T(0)) return;
  const uint32_t* order = order_by_abs_desc(v, m, s);
  T* magnitude = s.magnitude.data();
  for (int64_t r = 0; r < m; ++r) magnitude[r] = std::fabs(v[order[r]]);
  const structured::PavBlocks<T, int64_t> blocks{s.block_sum.data(), s.block_len.data(), s.block_first.data()};
  structured::oscar_pav_inplace<T, int64_t>(magnitude, m, beta, blocks);
  for (int64_t r = 0; r < m; ++r) {
    T& x = v[order[r]];
    x = structured::with_sign_of(x, magnitude[r]);
  }
}

// Michelot's threshold over d[0..m) with a shrinking candidate list: each reduction keeps
// only the entries above the current tau, so later passes touch the support's superset only.
template <typename T>
T sparsemax_threshold(const T* d, int64_t m, std::vector<T>& candidates) {
  candidates.assign(d, d + m);
  int64_t count = m;
  return structured::sparsemax_threshold<T, int64_t>([&](T tau, T& sum, int64_t& kept, T& smallest) {
    T* c = candidates.data();
    kept = 0;
    sum = T(0);
    smallest = structured::positive_infinity<T>();
    for (int64_t i = 0; i < count; ++i) {
      if (c[i] > tau) {
        sum += c[i];
        smallest = std::min(smallest, c[i]);
        c[kept++] = c[i];
      }
    }
    count = kept;
  });
}

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

// ---------------------------------------------------------------------------------------
// Forward: (p, y) or, when project is false, only y (the prox; p is left undefined).

template <typename T>
void forward_rows(Prox kind, bool project, const T* x, const int64_t* lengths, T* p, T* y, int64_t rows, int64_t n,
                  double reg) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T nan = std::numeric_limits<T>::quiet_NaN();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    std::vector<T> candidates, projected(project ? 0 : n);
    OscarScratch<T> oscar;
    if (kind == Prox::kOSCAR) oscar.reserve(n);
    for (int64_t row = begin; row < end; ++row) {
      const T* x_row = x + row * n;
      T* y_row = y + row * n;
      T* p_row = project ? p + row * n : nullptr;
      const int64_t len = lengths ? lengths[row] : n;
      // The valid entries are packed at the front of y_row, where the prox works in place.
      int64_t m = 0;
      bool poisoned = false;
      T max_value = neg_inf, max_abs = T(0);
      for (int64_t j = 0; j < len; ++j) {
        const T v = x_row[j];
        if (structured::is_masked(v)) continue;
        poisoned |= structured::poisons_row(v);
        max_value = std::max(max_value, v);
        max_abs = std::max(max_abs, std::fabs(v));
        y_row[m++] = v;
      }
      if (poisoned) {
        std::fill(y_row, y_row + n, nan);
        if (project) std::fill(p_row, p_row + n, nan);
        continue;
      }
      const auto transform = structured::make_row_transform(kind, max_value, max_abs);
      for (int64_t i = 0; i < m; ++i) y_row[i] = transform.to_work(y_row[i]);
      const T work_reg = static_cast<T>(structured::work_regularisation(kind, reg, transform.exponent, m));
      if (kind == Prox::kTV) {
        structured::tv1d_prox_inplace<T, int64_t>(y_row, m, work_reg);
      } else {
        oscar_prox_inplace(y_row, m, work_reg, oscar);
      }
      // The projection's input d is packed at the front of p_row (or of a scratch row).
      T* d = project ? p_row : projected.data();
      T tau = T(0);
      if (m > 0) {
        const T work_max = *std::max_element(y_row, y_row + m);
        for (int64_t i = 0; i < m; ++i) {
          d[i] = transform.to_projection_input(y_row[i], work_max);
          y_row[i] = transform.to_prox_output(y_row[i]);
        }
        if (project) tau = sparsemax_threshold(d, m, candidates);
      }
      // Unpack from the end: packed index k <= j, so no packed entry is overwritten unread.
      int64_t k = m;
      for (int64_t j = n - 1; j >= 0; --j) {
        const bool valid = j < len && !structured::is_masked(x_row[j]);
        if (valid) --k;
        y_row[j] = valid ? y_row[k] : neg_inf;
        if (project) p_row[j] = valid ? std::max(d[k] - tau, T(0)) : T(0);
      }
    }
  });
}

std::vector<at::Tensor> forward_impl(const char* op, Prox kind, bool project, const at::Tensor& x_in, double reg,
                                     const char* reg_name, const c10::optional<at::Tensor>& lengths_in) {
  structured::check_forward_args(op, x_in, reg, reg_name, lengths_in);
  TORCH_CHECK(x_in.device().is_cpu(), op, ": CPU implementation called with a ", x_in.device(), " tensor");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const at::Tensor lengths = structured::checked_lengths(op, lengths_in, n);
  at::Tensor y = at::empty_like(x);
  at::Tensor p = project ? at::empty_like(x) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "structured_forward", [&] {
    forward_rows<scalar_t>(kind, project, x.data_ptr<scalar_t>(), lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr,
                           project ? p.data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>(), rows, n, reg);
  });
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
      bool poisoned = false;
      for (int64_t j = 0; j < n; ++j) {
        poisoned |= p_row[j] != p_row[j];
        if (p_row[j] > T(0)) {
          g_sum += g_row[j];
          ++support;
        }
      }
      if (poisoned) {  // the forward's NaN row (NaN or +inf input): NaN gradient, as softmax
        std::fill(dz_row, dz_row + n, std::numeric_limits<T>::quiet_NaN());
        continue;
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
  structured::check_backward_args(op, grad_in, p_in, y_in, reg, reg_name);
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
  entmax_fast::structured::StructuredOps<entmax_fast::structured_cpu::forward_impl,
                                          entmax_fast::structured_cpu::backward_impl>::register_for(m);
}
