// What the CPU attention (entmax_attention.cpp: forward, backward, support count) and the
// decoding operator (entmax_kvcache.cpp) share: the compute type, the score options checked
// once and read by the kernels, the keys a query may see, and the scores' transformation in
// the order of docs/attention.md ("Score options"): scale, softcap, ALiBi.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace entmax_fast_cpu {

// float64 inputs are computed in float64, every other floating dtype in float32.
inline at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The score options of one call, as an operator receives them, checked and in the compute
// type.
struct ScoreOptionTensors {
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  double softcap = 0.0;                         // 0: no cap
  at::Tensor alibi_slopes;                      // undefined, or (H,) / (B, H) contiguous
  at::Tensor sinks;                             // undefined, or (H,) contiguous
};

// op names the operator in the messages; B and H are the query's batch size and heads.
inline ScoreOptionTensors check_score_options(const char* op, int64_t B, int64_t H, at::ScalarType ct,
                                              at::IntArrayRef window_size, double softcap,
                                              const std::optional<at::Tensor>& alibi_slopes,
                                              const std::optional<at::Tensor>& sinks) {
  ScoreOptionTensors o;
  TORCH_CHECK(window_size.size() == 2 && window_size[0] >= -1 && window_size[1] >= -1, op,
              " (cpu): window_size must be (left, right) with each >= -1, got ", window_size);
  o.window_left = window_size[0];
  o.window_right = window_size[1];
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), op, " (cpu): softcap must be finite and >= 0, got ", softcap);
  o.softcap = softcap;
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(at::isFloatingType(a.scalar_type()) && a.device().is_cpu() &&
                    ((a.dim() == 1 && a.size(0) == H) || (a.dim() == 2 && a.size(0) == B && a.size(1) == H)),
                op, " (cpu): alibi_slopes must be a floating CPU tensor of shape (", H, ",) or (", B, ", ", H,
                "), got ", a.sizes());
    o.alibi_slopes = a.detach().to(ct).contiguous();
  }
  if (sinks.has_value()) {
    const at::Tensor& t = *sinks;
    TORCH_CHECK(at::isFloatingType(t.scalar_type()) && t.device().is_cpu() && t.dim() == 1 && t.size(0) == H, op,
                " (cpu): sinks must be a floating CPU tensor of shape (", H, ",), got ", t.sizes());
    o.sinks = t.detach().to(ct).contiguous();
  }
  return o;
}

// The score options read by the kernels for one compute type T.
template <typename T>
struct ScoreOptions {
  int64_t window_left = -1, window_right = -1;
  T softcap = T(0);
  const T* alibi = nullptr;  // slope of (b, h) at alibi[b * alibi_batch_stride + h]
  int64_t alibi_batch_stride = 0;
  const T* sinks = nullptr;

  explicit ScoreOptions(const ScoreOptionTensors& o)
      : window_left(o.window_left), window_right(o.window_right), softcap(static_cast<T>(o.softcap)) {
    if (o.alibi_slopes.defined()) {
      alibi = o.alibi_slopes.const_data_ptr<T>();
      alibi_batch_stride = o.alibi_slopes.dim() == 2 ? o.alibi_slopes.size(1) : 0;
    }
    if (o.sinks.defined()) sinks = o.sinks.const_data_ptr<T>();
  }
  T alibi_slope(int64_t b, int64_t h) const { return alibi != nullptr ? alibi[b * alibi_batch_stride + h] : T(0); }
  bool has_sink() const { return sinks != nullptr; }
  // One spare column per row of a buffer for the sink's entry.
  int64_t sink_columns() const { return has_sink() ? 1 : 0; }
};

// Keys [begin, end) of a query at key position pos among n_keys keys, before key end_limit
// (the causal limit; n_keys when there is none), within the window's bounds (-1: unbounded).
// Empty when end == begin. Both ends are non-decreasing in pos.
struct KeyRange {
  int64_t begin, end;
};

inline KeyRange key_range(int64_t pos, int64_t n_keys, int64_t end_limit, int64_t window_left, int64_t window_right) {
  int64_t begin = 0, end = std::min(n_keys, end_limit);
  if (window_left >= 0) begin = std::max(begin, pos - window_left);
  if (window_right >= 0) end = std::min(end, pos + window_right + 1);
  return {begin, std::max(begin, end)};
}

// The scores z[0:len] of one query, dot products on entry: scaled, capped, and biased by
// ALiBi's -slope * |distance_to_first - j| (distance_to_first: the query's position minus
// the first key's). With cap_slopes, the cap's derivative 1/cosh^2(s/softcap) of each entry
// is stored there (1/cosh^2 rather than 1 - tanh^2, which rounds to 0 where tanh rounds to
// +-1). Each option is tested once per row, never per score; a scale of 1 (scores formed
// from scaled queries) costs no pass.
template <typename T>
inline void transform_scores(T* z, int64_t len, T scale, const ScoreOptions<T>& o, T slope,
                             int64_t distance_to_first, T* cap_slopes) {
  if (o.softcap > T(0)) {
    const T softcap = o.softcap;
    for (int64_t j = 0; j < len; ++j) {
      const T x = z[j] * scale / softcap;
      z[j] = softcap * std::tanh(x);
      if (cap_slopes != nullptr) {
        const T c = std::cosh(x);
        cap_slopes[j] = T(1) / (c * c);
      }
    }
  } else if (scale != T(1)) {
    for (int64_t j = 0; j < len; ++j) z[j] *= scale;
  }
  if (o.alibi != nullptr) {
    for (int64_t j = 0; j < len; ++j) z[j] -= slope * static_cast<T>(std::abs(distance_to_first - j));
  }
}

}  // namespace entmax_fast_cpu
