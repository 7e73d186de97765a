// Entmax attention on CPU, memory-bounded: the scores of a tile of queries come from one
// GEMM into a per-thread buffer, each row's threshold is found while the row is in cache,
// then P.V is a second GEMM. Only (max, mu) per query row is saved; the backward recomputes
// P from them. Nothing of size B*H*Lq*Lk is ever allocated.
//
// Score options (docs/attention.md, "Score options"), applied in its order: scale, softcap,
// ALiBi, float mask, boolean masks and window, sink, threshold.
// - The top-left causal limit and the window (pos - left <= j <= pos + right, pos = i + Lk -
//   Lq) leave each query one contiguous range of keys, whose ends never decrease from one
//   query to the next. A tile computes scores only on the union of its rows' ranges, so a
//   window costs O(Lq * window) work and memory, not Lq x Lk; keys outside a row's range get
//   weight 0 without being scored.
// - softcap and ALiBi change the scores where they are formed, in the forward and in the
//   backward's recomputation; the backward keeps the cap's slope 1/cosh^2(s/softcap) of each
//   score (a third tile buffer, only when capping) to multiply dz by.
// - A sink is one more entry appended to the row in place (the tile's rows get a spare
//   column for it): the row solvers, the saved (max, mu), the backward's Jacobian sums and
//   the alpha gradient all include it as an ordinary entry whose value, hence g, is zero.
//   Its own dz, s_sink * (0 - delta), summed over the head's rows, is dsinks.
// Each option is tested once per row or tile, never per score, so that a call without options
// does only the plain path's per-score work.
//
// Unlike the row-wise kernels, the tasks here call ATen ops (mm_out, addmm_, zero_) on the
// outputs. at::parallel_for runs tasks on pool threads with those threads' own thread-local
// state, not the caller's; under torch.inference_mode() the outputs are inference tensors,
// and an in-place op on one from a thread outside inference mode raises. So every task runs
// under the caller's state (at::wrapPropagateTLSState), as the calling thread's own share does.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "row_solvers.h"

namespace entmax_fast_cpu {
namespace {

constexpr int64_t kQueryTile = 64;

struct AttentionShape {
  int64_t B, H, Hk, Lq, Lk, E, Ev, group, n_tiles;
};

AttentionShape check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, const at::Tensor& alpha) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "entmax_attention (cpu): query, key, value must be 4-D (B, H, L, E), got ", q.dim(), "-D, ",
              k.dim(), "-D, ", v.dim(), "-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "entmax_attention (cpu): query, key, value must be CPU tensors");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              "entmax_attention (cpu): query, key, value must share one floating dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  AttentionShape s{};
  s.B = q.size(0);
  s.H = q.size(1);
  s.Lq = q.size(2);
  s.E = q.size(3);
  s.Hk = k.size(1);
  s.Lk = k.size(2);
  s.Ev = v.size(3);
  TORCH_CHECK(k.size(0) == s.B && v.size(0) == s.B, "entmax_attention (cpu): batch sizes differ: query ", s.B,
              ", key ", k.size(0), ", value ", v.size(0));
  TORCH_CHECK(k.size(3) == s.E, "entmax_attention (cpu): key must have query's last dim ", s.E, ", got ",
              k.size(3));
  TORCH_CHECK(v.size(1) == s.Hk && v.size(2) == s.Lk, "entmax_attention (cpu): value must have key's heads and ",
              "length (", s.Hk, ", ", s.Lk, "), got (", v.size(1), ", ", v.size(2), ")");
  TORCH_CHECK(s.Hk > 0 && s.H % s.Hk == 0, "entmax_attention (cpu): query heads (", s.H,
              ") must be a multiple of key/value heads (", s.Hk, ")");
  TORCH_CHECK(alpha.dim() == 1 && alpha.size(0) == s.H, "entmax_attention (cpu): alpha must have shape (", s.H,
              ",), got ", alpha.sizes());
  if (mask.has_value()) {
    const auto& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()),
                "entmax_attention (cpu): attn_mask must be bool or floating, got ", m.scalar_type());
    TORCH_CHECK(m.dim() <= 4, "entmax_attention (cpu): attn_mask must broadcast to (", s.B, ", ", s.H, ", ", s.Lq,
                ", ", s.Lk, "), got ", m.sizes());
  }
  s.group = s.H / s.Hk;
  s.n_tiles = (s.Lq + kQueryTile - 1) / kQueryTile;
  return s;
}

at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The score options of one call, as the operators receive them, checked and in the compute
// type (docs/attention.md, "Score options").
struct ScoreOptionTensors {
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  double softcap = 0.0;                         // 0: no cap
  at::Tensor alibi_slopes;                      // undefined, or (H,) / (B, H) contiguous
  at::Tensor sinks;                             // undefined, or (H,) contiguous
};

ScoreOptionTensors check_score_options(const AttentionShape& s, at::ScalarType ct, at::IntArrayRef window_size,
                                       double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                       const std::optional<at::Tensor>& sinks) {
  ScoreOptionTensors o;
  TORCH_CHECK(window_size.size() == 2 && window_size[0] >= -1 && window_size[1] >= -1,
              "entmax_attention (cpu): window_size must be (left, right) with each >= -1, got ", window_size);
  o.window_left = window_size[0];
  o.window_right = window_size[1];
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "entmax_attention (cpu): softcap must be finite and >= 0, got ",
              softcap);
  o.softcap = softcap;
  if (alibi_slopes.has_value()) {
    const at::Tensor& a = *alibi_slopes;
    TORCH_CHECK(at::isFloatingType(a.scalar_type()) && a.device().is_cpu() &&
                    ((a.dim() == 1 && a.size(0) == s.H) || (a.dim() == 2 && a.size(0) == s.B && a.size(1) == s.H)),
                "entmax_attention (cpu): alibi_slopes must be a floating CPU tensor of shape (", s.H, ",) or (", s.B,
                ", ", s.H, "), got ", a.sizes());
    o.alibi_slopes = a.detach().to(ct).contiguous();
  }
  if (sinks.has_value()) {
    const at::Tensor& t = *sinks;
    TORCH_CHECK(at::isFloatingType(t.scalar_type()) && t.device().is_cpu() && t.dim() == 1 && t.size(0) == s.H,
                "entmax_attention (cpu): sinks must be a floating CPU tensor of shape (", s.H, ",), got ", t.sizes());
    o.sinks = t.detach().to(ct).contiguous();
  }
  return o;
}

// The score options read by the kernels for one dtype.
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
  bool has_sink() const { return sinks != nullptr; }
  // One spare column per row of a tile for the sink's entry.
  int64_t sink_columns() const { return has_sink() ? 1 : 0; }
};

// Keys [begin, end) that query i may attend to after the top-left causal limit and the
// window (empty when end == begin). Both ends are non-decreasing in i, so the keys of queries
// [q0, q0 + tq) lie in [range(q0).begin, range(q0 + tq - 1).end).
struct KeyRange {
  int64_t begin, end;
};

inline KeyRange key_range(int64_t i, const AttentionShape& s, bool is_causal, int64_t window_left,
                          int64_t window_right) {
  const int64_t pos = i + s.Lk - s.Lq;  // the query's key position, counted from the bottom right
  int64_t begin = 0, end = s.Lk;
  if (is_causal) end = std::min(end, i + 1);
  if (window_left >= 0) begin = std::max(begin, pos - window_left);
  if (window_right >= 0) end = std::min(end, pos + window_right + 1);
  return {begin, std::max(begin, end)};
}

// A tile of queries [q0, q0 + tq) and the keys [k0, k0 + kn) any of them attends to. The
// tile's buffers hold a row per query with stride ld = kn (+ 1 for a sink's entry).
struct QueryTile {
  int64_t q0, tq, k0, kn, ld;
};

template <typename T>
QueryTile query_tile(int64_t tile, const AttentionShape& s, bool is_causal, const ScoreOptions<T>& opts) {
  QueryTile t{};
  t.q0 = tile * kQueryTile;
  t.tq = std::min(kQueryTile, s.Lq - t.q0);
  t.k0 = key_range(t.q0, s, is_causal, opts.window_left, opts.window_right).begin;
  const int64_t k1 = key_range(t.q0 + t.tq - 1, s, is_causal, opts.window_left, opts.window_right).end;
  t.kn = std::max<int64_t>(0, k1 - t.k0);
  t.ld = t.kn + opts.sink_columns();
  return t;
}

// The widest key span of any tile: the per-thread buffers' row length (Lk without a window).
template <typename T>
int64_t widest_tile_span(const AttentionShape& s, bool is_causal, const ScoreOptions<T>& opts) {
  int64_t widest = 0;
  for (int64_t tile = 0; tile < s.n_tiles; ++tile) widest = std::max(widest, query_tile(tile, s, is_causal, opts).kn);
  return widest;
}

// Read access to a mask broadcast to (B, H, Lq, Lk) without materialising it.
template <typename T>
struct MaskView {
  const bool* bool_ptr = nullptr;
  const T* add_ptr = nullptr;
  int64_t sb = 0, sh = 0, sq = 0, sk = 0;

  // Applies the mask of row (b, h, i), keys [first_key, first_key + len), to z[0:len]
  // (scores already scaled, capped and biased).
  void apply(T* z, int64_t len, int64_t b, int64_t h, int64_t i, int64_t first_key) const {
    const int64_t base = b * sb + h * sh + i * sq + first_key * sk;
    if (bool_ptr != nullptr) {
      const bool* m = bool_ptr + base;
      for (int64_t j = 0; j < len; ++j)
        if (!m[j * sk]) z[j] = -std::numeric_limits<T>::infinity();
    } else if (add_ptr != nullptr) {
      const T* m = add_ptr + base;
      for (int64_t j = 0; j < len; ++j) z[j] += m[j * sk];
    }
  }
};

template <typename T>
MaskView<T> make_mask_view(const std::optional<at::Tensor>& mask, const AttentionShape& s, at::Tensor& holder) {
  MaskView<T> view;
  if (!mask.has_value()) return view;
  at::Tensor m = *mask;
  if (m.scalar_type() != at::kBool) m = m.to(c10::CppTypeToScalarType<T>::value);
  holder = m.expand({s.B, s.H, s.Lq, s.Lk});
  view.sb = holder.stride(0);
  view.sh = holder.stride(1);
  view.sq = holder.stride(2);
  view.sk = holder.stride(3);
  if (m.scalar_type() == at::kBool) {
    view.bool_ptr = holder.const_data_ptr<bool>();
  } else {
    view.add_ptr = holder.const_data_ptr<T>();
  }
  return view;
}

// The row of query q0 + i within its tile: keys [tile.k0 + start, tile.k0 + start + len).
struct RowSpan {
  int64_t start, len;
};

inline RowSpan row_span(const QueryTile& tile, int64_t i, const AttentionShape& s, bool is_causal,
                        int64_t window_left, int64_t window_right) {
  const KeyRange r = key_range(tile.q0 + i, s, is_causal, window_left, window_right);
  return {r.begin - tile.k0, r.end - r.begin};
}

// A (tq, kn) view, row stride ld, of a per-thread buffer.
inline at::Tensor tile_view(at::Tensor& buffer, const QueryTile& tile) {
  return buffer.view(-1).narrow(0, 0, tile.tq * tile.ld).view({tile.tq, tile.ld}).narrow(1, 0, tile.kn);
}

// Scores of the tile's rows on their own key spans, in the order of docs/attention.md: scale,
// softcap, ALiBi, the float or boolean mask (the causal limit and the window are the spans).
// Entries outside a row's span are left unset: callers read only the span. With
// cap_slopes, the cap's derivative 1/cosh^2(s/softcap) of each entry is stored there, at the
// entry's place in the tile layout (1/cosh^2 rather than 1 - tanh^2, which rounds to 0 where
// tanh rounds to +-1).
template <typename T>
at::Tensor tile_scores(at::Tensor& buffer, T* cap_slopes, const at::Tensor& q_bh, const at::Tensor& k_bh,
                       const QueryTile& tile, T scale, const ScoreOptions<T>& opts, const MaskView<T>& mask,
                       const AttentionShape& s, bool is_causal, int64_t b, int64_t h) {
  at::Tensor scores = tile_view(buffer, tile);
  at::mm_out(scores, q_bh.narrow(0, tile.q0, tile.tq), k_bh.narrow(0, tile.k0, tile.kn).t());
  T* z = scores.data_ptr<T>();
  const T softcap = opts.softcap;
  const T slope = opts.alibi != nullptr ? opts.alibi[b * opts.alibi_batch_stride + h] : T(0);
  for (int64_t i = 0; i < tile.tq; ++i) {
    const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
    T* zi = z + i * tile.ld + span.start;
    if (softcap > T(0)) {
      T* slopes_i = cap_slopes != nullptr ? cap_slopes + i * tile.ld + span.start : nullptr;
      for (int64_t j = 0; j < span.len; ++j) {
        const T x = zi[j] * scale / softcap;
        zi[j] = softcap * std::tanh(x);
        if (slopes_i != nullptr) {
          const T c = std::cosh(x);
          slopes_i[j] = T(1) / (c * c);
        }
      }
    } else {
      for (int64_t j = 0; j < span.len; ++j) zi[j] *= scale;
    }
    if (opts.alibi != nullptr) {
      // -slope * |pos - j| for key j = k0 + start + jj.
      const int64_t offset = tile.q0 + i + s.Lk - s.Lq - (tile.k0 + span.start);
      for (int64_t j = 0; j < span.len; ++j) zi[j] -= slope * static_cast<T>(std::abs(offset - j));
    }
    mask.apply(zi, span.len, b, h, tile.q0 + i, tile.k0 + span.start);
  }
  return scores;
}

template <typename T>
void attention_forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, const double* alpha, double scale_d, bool is_causal,
                            const ScoreOptionTensors& option_tensors, const AttentionShape& s, at::Tensor& out,
                            at::Tensor& stats) {
  at::Tensor mask_holder;
  const MaskView<T> mask_view = make_mask_view<T>(mask, s, mask_holder);
  const ScoreOptions<T> opts(option_tensors);
  const T scale = static_cast<T>(scale_d);
  double* stats_ptr = stats.data_ptr<double>();
  const int64_t row_capacity = widest_tile_span(s, is_causal, opts) + opts.sink_columns();
  const int64_t total = s.B * s.H * s.n_tiles;
  at::parallel_for(0, total, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
    at::Tensor buffer = at::empty({kQueryTile * row_capacity}, q.options());
    RowWorkspace work(row_capacity);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = (task / s.n_tiles) % s.H;
      const int64_t b = task / (s.n_tiles * s.H);
      const int64_t hk = h / s.group;
      const QueryTile tile = query_tile(task % s.n_tiles, s, is_causal, opts);
      at::Tensor out_tile = out.select(0, b).select(0, h).narrow(0, tile.q0, tile.tq);
      double* st = stats_ptr + ((b * s.H + h) * s.Lq + tile.q0) * 2;
      if (tile.kn == 0) {
        // No query of the tile has a key: zero rows, whatever the sink (its value is zero).
        out_tile.zero_();
        for (int64_t i = 0; i < tile.tq; ++i) {
          st[2 * i] = -std::numeric_limits<double>::infinity();
          st[2 * i + 1] = 0.0;
        }
        continue;
      }
      const EntmaxParams<T> prm(alpha[h]);
      at::Tensor scores = tile_scores<T>(buffer, nullptr, q.select(0, b).select(0, h), k.select(0, b).select(0, hk),
                                         tile, scale, opts, mask_view, s, is_causal, b, h);
      T* z = scores.data_ptr<T>();
      for (int64_t i = 0; i < tile.tq; ++i) {
        T* zi = z + i * tile.ld;
        const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
        if (span.len == 0) {
          // A query without keys: zeros (a sink alone would take the whole row, and its value is zero).
          std::fill(zi, zi + tile.kn, T(0));
          st[2 * i] = -std::numeric_limits<double>::infinity();
          st[2 * i + 1] = 0.0;
          continue;
        }
        int64_t n = span.len;
        // The sink's entry right after the span: ld leaves room for it past the last span.
        if (opts.has_sink()) zi[span.start + n++] = opts.sinks[h];
        const RowStats<T> rs = entmax_row_inplace(zi + span.start, n, prm, work);
        std::fill(zi, zi + span.start, T(0));
        // Also clears the sink's weight where it sits inside the tile's (tq, kn) view.
        std::fill(zi + span.start + span.len, zi + tile.kn, T(0));
        st[2 * i] = rs.max;
        st[2 * i + 1] = rs.mu;
      }
      at::mm_out(out_tile, scores, v.select(0, b).select(0, hk).narrow(0, tile.k0, tile.kn));
    }
  }));
}

// Returns (out in the input dtype, stats (B, H, Lq, 2) = (row max, mu) in float64, both over
// the row with its sink when there is one).
std::tuple<at::Tensor, at::Tensor> entmax_attention_fwd_cpu(const at::Tensor& query, const at::Tensor& key,
                                                            const at::Tensor& value,
                                                            const std::optional<at::Tensor>& attn_mask,
                                                            const at::Tensor& alpha_in, double scale, bool is_causal,
                                                            at::IntArrayRef window_size, double softcap,
                                                            const std::optional<at::Tensor>& alibi_slopes,
                                                            const std::optional<at::Tensor>& sinks) {
  const AttentionShape s = check_attention_args(query, key, value, attn_mask, alpha_in);
  const at::ScalarType ct = compute_type(query.scalar_type());
  const ScoreOptionTensors options = check_score_options(s, ct, window_size, softcap, alibi_slopes, sinks);
  // detach: the GEMMs below run on worker threads and must never be recorded by autograd.
  const at::Tensor q = query.detach().to(ct).contiguous();
  const at::Tensor k = key.detach().to(ct).contiguous();
  const at::Tensor v = value.detach().to(ct).contiguous();
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  at::Tensor out = at::empty({s.B, s.H, s.Lq, s.Ev}, q.options());
  at::Tensor stats = at::empty({s.B, s.H, s.Lq, 2}, q.options().dtype(at::kDouble));
  if (out.numel() > 0 || stats.numel() > 0) {
    if (s.Lk == 0) {
      out.zero_();
      stats.select(3, 0).fill_(-std::numeric_limits<double>::infinity());
      stats.select(3, 1).zero_();
    } else {
      AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_fwd", [&] {
        attention_forward_impl<scalar_t>(q, k, v, attn_mask, alpha.const_data_ptr<double>(), scale, is_causal,
                                         options, s, out, stats);
      });
    }
  }
  return {out.to(query.scalar_type()), stats};
}

// The forward's saved (B, H, Lq, 2) row statistics, checked against the call's shape, in
// float64 and contiguous, for the backward and the support count.
at::Tensor checked_stats(const at::Tensor& stats, const AttentionShape& s, const char* op) {
  TORCH_CHECK(stats.dim() == 4 && stats.size(0) == s.B && stats.size(1) == s.H && stats.size(2) == s.Lq &&
                  stats.size(3) == 2,
              op, " (cpu): stats must have shape (", s.B, ", ", s.H, ", ", s.Lq, ", 2), got ", stats.sizes());
  return stats.detach().to(at::kDouble).contiguous();
}

// The p of a General-kind row from its saved (max, mu), written over the row's scores z (the
// sink's entry included): the forward's kernel at its final mu, renormalised as the forward
// did, gives the forward's p; scalar pow per entry here cost more than the rest of the backward.
template <typename T>
void saved_general_probs(T* z, int64_t n, T zmax, double mu, const EntmaxParams<T>& prm) {
  const double p_total = general_probs(z, n, static_cast<double>(zmax), prm.law(), mu);
  if (p_total > 0) {
    const T inv = static_cast<T>(1.0 / p_total);
    for (int64_t j = 0; j < n; ++j) z[j] *= inv;
  }
}

template <typename T>
void attention_backward_impl(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const std::optional<at::Tensor>& mask, const at::Tensor& stats,
                             const double* alpha, double scale_d, bool is_causal, bool need_alpha_grad,
                             const ScoreOptionTensors& option_tensors, const AttentionShape& s, at::Tensor& dq,
                             at::Tensor& dk, at::Tensor& dv, double* dalpha_part, double* dsinks_part) {
  at::Tensor mask_holder;
  const MaskView<T> mask_view = make_mask_view<T>(mask, s, mask_holder);
  const ScoreOptions<T> opts(option_tensors);
  const bool capped = opts.softcap > T(0);
  const T scale = static_cast<T>(scale_d);
  const double* stats_ptr = stats.const_data_ptr<double>();
  const int64_t row_capacity = widest_tile_span(s, is_causal, opts) + opts.sink_columns();
  // One task per (batch, key/value head): the query heads of a GQA group accumulate into
  // the same dK/dV, so they stay in one task and no two tasks write the same memory.
  at::parallel_for(0, s.B * s.Hk, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
    at::Tensor prob_buffer = at::empty({kQueryTile * row_capacity}, q.options());
    at::Tensor grad_buffer = at::empty({kQueryTile * row_capacity}, q.options());
    at::Tensor cap_slope_buffer = capped ? at::empty({kQueryTile * row_capacity}, q.options()) : at::Tensor();
    T* cap_slopes = capped ? cap_slope_buffer.data_ptr<T>() : nullptr;
    std::vector<T> weights(row_capacity);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.Hk;
      const int64_t hk = task % s.Hk;
      const at::Tensor k_bh = k.select(0, b).select(0, hk);
      const at::Tensor v_bh = v.select(0, b).select(0, hk);
      at::Tensor dk_bh = dk.select(0, b).select(0, hk);
      at::Tensor dv_bh = dv.select(0, b).select(0, hk);
      for (int64_t h = hk * s.group; h < (hk + 1) * s.group; ++h) {
        const EntmaxParams<T> prm(alpha[h]);
        const at::Tensor q_bh = q.select(0, b).select(0, h);
        const at::Tensor do_bh = grad_out.select(0, b).select(0, h);
        at::Tensor dq_bh = dq.select(0, b).select(0, h);
        double dalpha_acc = 0, dsinks_acc = 0;
        for (int64_t tile_index = 0; tile_index < s.n_tiles; ++tile_index) {
          const QueryTile tile = query_tile(tile_index, s, is_causal, opts);
          if (tile.kn == 0) continue;
          const double* st = stats_ptr + ((b * s.H + h) * s.Lq + tile.q0) * 2;
          at::Tensor probs = tile_scores<T>(prob_buffer, cap_slopes, q_bh, k_bh, tile, scale, opts, mask_view, s,
                                            is_causal, b, h);
          at::Tensor dprobs = tile_view(grad_buffer, tile);
          const at::Tensor do_tile = do_bh.narrow(0, tile.q0, tile.tq);
          const at::Tensor k_tile = k_bh.narrow(0, tile.k0, tile.kn);
          at::mm_out(dprobs, do_tile, v_bh.narrow(0, tile.k0, tile.kn).t());
          T* pz = probs.data_ptr<T>();
          T* gz = dprobs.data_ptr<T>();
          for (int64_t i = 0; i < tile.tq; ++i) {
            T* p_row = pz + i * tile.ld;
            T* g_row = gz + i * tile.ld;
            const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
            const T zmax = static_cast<T>(st[2 * i]);
            const double mu = st[2 * i + 1];
            if (std::isnan(zmax)) {
              // A NaN row of the forward (NaN or +inf score) passes NaN on to every gradient
              // it touches, as softmax attention's backward does.
              std::fill(p_row, p_row + tile.kn, std::numeric_limits<T>::quiet_NaN());
              std::fill(g_row, g_row + tile.kn, std::numeric_limits<T>::quiet_NaN());
              if (need_alpha_grad) dalpha_acc = std::numeric_limits<double>::quiet_NaN();
              if (opts.has_sink()) dsinks_acc = std::numeric_limits<double>::quiet_NaN();
              continue;
            }
            if (span.len == 0 || !(zmax > -std::numeric_limits<T>::infinity())) {
              // No key, or every key masked: zero weights (with a sink, a one-hot row on it,
              // whose Jacobian term is zero).
              std::fill(p_row, p_row + tile.kn, T(0));
              std::fill(g_row, g_row + tile.kn, T(0));
              continue;
            }
            T* p = p_row + span.start;
            T* g = g_row + span.start;
            int64_t n = span.len;
            if (opts.has_sink()) {
              // The sink as the row's last entry; its value is zero, so is its g.
              p[n] = opts.sinks[h];
              g[n] = T(0);
              ++n;
            }
            // p and the Jacobian weights s = p^(2-alpha) from the saved (max, mu), while the
            // scaled, masked scores are still in the row.
            double s_total = 0, sg_total = 0;
            if (prm.kind == AlphaKind::kGeneral) {
              saved_general_probs(p, n, zmax, mu, prm);
              std::tie(s_total, sg_total) = general_weights(p, g, weights.data(), n, 2.0 - prm.alpha);
            } else {
              for (int64_t j = 0; j < n; ++j) {
                const T pj = prm.prob(p[j], zmax, mu);
                weights[j] = prm.jacobian_weight(p[j], zmax, mu, pj);
                p[j] = pj;
                s_total += weights[j];
                sg_total += static_cast<double>(weights[j]) * g[j];
              }
            }
            if (need_alpha_grad) dalpha_acc += row_alpha_grad(p, g, n, prm.alpha);
            const double delta_d = s_total > 0 ? sg_total / s_total : 0.0;
            const T delta = static_cast<T>(delta_d);
            // The sink's dz = s_sink (g_sink - delta) with g_sink = 0.
            if (opts.has_sink()) dsinks_acc -= static_cast<double>(weights[span.len]) * delta_d;
            // dZ (docs/attention.md, "Backward"), with the score scale folded in for dQ and dK,
            // and the cap's slope where the scores were capped.
            if (capped) {
              const T* slope = cap_slopes + i * tile.ld + span.start;
              for (int64_t j = 0; j < span.len; ++j) g[j] = scale * slope[j] * weights[j] * (g[j] - delta);
            } else {
              for (int64_t j = 0; j < span.len; ++j) g[j] = scale * weights[j] * (g[j] - delta);
            }
            // Outside the span, the sink's entry included where it lies inside the view.
            std::fill(p_row, p, T(0));
            std::fill(p + span.len, p_row + tile.kn, T(0));
            std::fill(g_row, g, T(0));
            std::fill(g + span.len, g_row + tile.kn, T(0));
          }
          dv_bh.narrow(0, tile.k0, tile.kn).addmm_(probs.t(), do_tile);
          at::Tensor dq_tile = dq_bh.narrow(0, tile.q0, tile.tq);
          at::mm_out(dq_tile, dprobs, k_tile);
          dk_bh.narrow(0, tile.k0, tile.kn).addmm_(dprobs.t(), q_bh.narrow(0, tile.q0, tile.tq));
        }
        dalpha_part[b * s.H + h] = dalpha_acc;
        dsinks_part[b * s.H + h] = dsinks_acc;
      }
    }
  }));
}

// Returns (dq, dk, dv) in the input dtype, dalpha (H,) and dsinks (H,) in float64 ((0,) when
// not needed).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> entmax_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& stats_in, const at::Tensor& alpha_in,
    double scale, bool is_causal, bool need_alpha_grad, at::IntArrayRef window_size, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, bool need_sinks_grad) {
  const AttentionShape s = entmax_fast_cpu::check_attention_args(query, key, value, attn_mask, alpha_in);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == s.B && grad_out.size(1) == s.H && grad_out.size(2) == s.Lq &&
                  grad_out.size(3) == s.Ev,
              "entmax_attention_backward (cpu): grad_out must have shape (", s.B, ", ", s.H, ", ", s.Lq, ", ", s.Ev,
              "), got ", grad_out.sizes());
  const at::Tensor stats = checked_stats(stats_in, s, "entmax_attention_backward");
  const at::ScalarType ct = compute_type(query.scalar_type());
  const ScoreOptionTensors options = check_score_options(s, ct, window_size, softcap, alibi_slopes, sinks);
  const at::Tensor q = query.detach().to(ct).contiguous();
  const at::Tensor k = key.detach().to(ct).contiguous();
  const at::Tensor v = value.detach().to(ct).contiguous();
  const at::Tensor g = grad_out.detach().to(ct).contiguous();
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  at::Tensor dq = at::zeros_like(q);
  at::Tensor dk = at::zeros_like(k);
  at::Tensor dv = at::zeros_like(v);
  at::Tensor dalpha_part = at::zeros({s.B, s.H}, q.options().dtype(at::kDouble));
  at::Tensor dsinks_part = at::zeros({s.B, s.H}, q.options().dtype(at::kDouble));
  if (s.Lk > 0 && s.Lq > 0 && s.B > 0) {
    AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_bwd", [&] {
      attention_backward_impl<scalar_t>(g, q, k, v, attn_mask, stats, alpha.const_data_ptr<double>(), scale,
                                        is_causal, need_alpha_grad, options, s, dq, dk, dv,
                                        dalpha_part.data_ptr<double>(), dsinks_part.data_ptr<double>());
    });
  }
  const at::ScalarType out_t = query.scalar_type();
  at::Tensor dalpha = need_alpha_grad ? dalpha_part.sum(0) : at::empty({0}, dalpha_part.options());
  const bool sinks_grad = need_sinks_grad && sinks.has_value();
  at::Tensor dsinks = sinks_grad ? dsinks_part.sum(0) : at::empty({0}, dsinks_part.options());
  return {dq.to(out_t), dk.to(out_t), dv.to(out_t), dalpha, dsinks};
}

// How many keys of the span of each query row get a nonzero weight at the row's saved
// (max, mu), the sink's entry not counted: the backward's recomputation of p, tile by tile,
// without its gradients. Rows of (B, H) and tiles are independent, split as the forward's.
template <typename T>
void attention_support_impl(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& mask,
                            const at::Tensor& stats, const double* alpha, double scale_d, bool is_causal,
                            const ScoreOptionTensors& option_tensors, const AttentionShape& s, at::Tensor& counts) {
  at::Tensor mask_holder;
  const MaskView<T> mask_view = make_mask_view<T>(mask, s, mask_holder);
  const ScoreOptions<T> opts(option_tensors);
  const T scale = static_cast<T>(scale_d);
  const double* stats_ptr = stats.const_data_ptr<double>();
  int64_t* counts_ptr = counts.data_ptr<int64_t>();
  const int64_t row_capacity = widest_tile_span(s, is_causal, opts) + opts.sink_columns();
  at::parallel_for(0, s.B * s.H * s.n_tiles, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
    at::Tensor buffer = at::empty({kQueryTile * row_capacity}, q.options());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = (task / s.n_tiles) % s.H;
      const int64_t b = task / (s.n_tiles * s.H);
      const int64_t hk = h / s.group;
      const QueryTile tile = query_tile(task % s.n_tiles, s, is_causal, opts);
      // counts starts at zero: rows without a nonzero weight are skipped.
      int64_t* row_counts = counts_ptr + (b * s.H + h) * s.Lq + tile.q0;
      if (tile.kn == 0) continue;
      const double* st = stats_ptr + ((b * s.H + h) * s.Lq + tile.q0) * 2;
      const EntmaxParams<T> prm(alpha[h]);
      at::Tensor scores = tile_scores<T>(buffer, nullptr, q.select(0, b).select(0, h), k.select(0, b).select(0, hk),
                                         tile, scale, opts, mask_view, s, is_causal, b, h);
      T* z = scores.data_ptr<T>();
      for (int64_t i = 0; i < tile.tq; ++i) {
        const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
        const T zmax = static_cast<T>(st[2 * i]);
        const double mu = st[2 * i + 1];
        // A NaN row of the forward has no nonzero weight to count; a row without keys, or with
        // every key masked, has only zeros (a sink alone takes its whole weight).
        if (std::isnan(zmax) || span.len == 0 || !(zmax > -std::numeric_limits<T>::infinity())) continue;
        T* p = z + i * tile.ld + span.start;
        int64_t support = 0;
        if (prm.kind == AlphaKind::kGeneral) {
          int64_t n = span.len;
          // The sink's entry takes part in the renormalisation, as in the forward.
          if (opts.has_sink()) p[n++] = opts.sinks[h];
          saved_general_probs(p, n, zmax, mu, prm);
          for (int64_t j = 0; j < span.len; ++j) support += p[j] > T(0);
        } else {
          for (int64_t j = 0; j < span.len; ++j) support += prm.prob(p[j], zmax, mu) > T(0);
        }
        row_counts[i] = support;
      }
    }
  }));
}

// Returns (B, H, Lq) int64: per query row, the keys given a nonzero weight by the forward
// whose stats (B, H, Lq, 2) these are, with the same arguments (the sink not counted).
at::Tensor entmax_attention_support_cpu(const at::Tensor& query, const at::Tensor& key,
                                        const std::optional<at::Tensor>& attn_mask, const at::Tensor& stats_in,
                                        const at::Tensor& alpha_in, double scale, bool is_causal,
                                        at::IntArrayRef window_size, double softcap,
                                        const std::optional<at::Tensor>& alibi_slopes,
                                        const std::optional<at::Tensor>& sinks) {
  // The key stands in for the value, which the count never reads: its checks are the key's.
  const AttentionShape s = entmax_fast_cpu::check_attention_args(query, key, key, attn_mask, alpha_in);
  const at::Tensor stats = checked_stats(stats_in, s, "entmax_attention_support");
  const at::ScalarType ct = compute_type(query.scalar_type());
  const ScoreOptionTensors options = check_score_options(s, ct, window_size, softcap, alibi_slopes, sinks);
  const at::Tensor q = query.detach().to(ct).contiguous();
  const at::Tensor k = key.detach().to(ct).contiguous();
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  at::Tensor counts = at::zeros({s.B, s.H, s.Lq}, q.options().dtype(at::kLong));
  if (s.Lk > 0 && s.Lq > 0 && s.B > 0 && s.H > 0) {
    AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_support", [&] {
      attention_support_impl<scalar_t>(q, k, attn_mask, stats, alpha.const_data_ptr<double>(), scale, is_causal,
                                       options, s, counts);
    });
  }
  return counts;
}

}  // namespace
}  // namespace entmax_fast_cpu

// The score options (window_size, softcap, alibi_slopes, sinks) come last and default to
// none: a call without them passes only the plain arguments.
TORCH_LIBRARY_FRAGMENT(entmax_fast, m) {
  m.def(
      "entmax_attention_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor alpha, float scale, "
      "bool is_causal, int[2] window_size=[-1, -1], float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? sinks=None) -> (Tensor, Tensor)");
  m.def(
      "entmax_attention_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor stats, Tensor alpha, float scale, bool is_causal, bool need_alpha_grad, "
      "int[2] window_size=[-1, -1], float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "bool need_sinks_grad=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "entmax_attention_support(Tensor query, Tensor key, Tensor? attn_mask, Tensor stats, Tensor alpha, "
      "float scale, bool is_causal, int[2] window_size=[-1, -1], float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(entmax_fast, CPU, m) {
  m.impl("entmax_attention_fwd", &entmax_fast_cpu::entmax_attention_fwd_cpu);
  m.impl("entmax_attention_bwd", &entmax_fast_cpu::entmax_attention_bwd_cpu);
  m.impl("entmax_attention_support", &entmax_fast_cpu::entmax_attention_support_cpu);
}
