// Entmax attention on CPU, memory-bounded: the scores of a tile of queries come from one
// GEMM into a per-thread buffer and each row's threshold is found while the row is in cache.
// (max, mu) per query row is saved; the backward recomputes the scores (one GEMM) and P from
// them, except on the sparsemax and 1.5-entmax tiles whose supports the forward kept in a
// bounded pool (SupportLists): those take their supports' columns and scores from it. Nothing
// of size B*H*Lq*Lk is ever allocated.
//
// Cost follows the support: entmax weights are mostly zero (98-99 % at L >= 1024 with
// Gaussian inputs, alpha 1.5), so once a tile's weights are known the rest of the work is
// done either as dense GEMMs over the tile (P.V; dP = dO.V^T, dQ, dK, dV) or as sparse
// products over the supported (query, key) pairs only, chosen per tile from its measured
// support (sparse_tile()). Both paths are exact; neither uses atomics, so results depend on
// the input and the thread count only.
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
//   score (a tile buffer, only when capping) to multiply dz by.
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

#include "attention_common.h"
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
  // The sparse paths index a tile's keys in int32.
  TORCH_CHECK(s.Lk <= std::numeric_limits<int32_t>::max(), "entmax_attention (cpu): key length must be at most ",
              std::numeric_limits<int32_t>::max(), ", got ", s.Lk);
  s.group = s.H / s.Hk;
  s.n_tiles = (s.Lq + kQueryTile - 1) / kQueryTile;
  return s;
}

// Keys [begin, end) that query i may attend to after the top-left causal limit and the
// window. Both ends are non-decreasing in i, so the keys of queries [q0, q0 + tq) lie in
// [range(q0).begin, range(q0 + tq - 1).end).
inline KeyRange query_keys(int64_t i, const AttentionShape& s, bool is_causal, int64_t window_left,
                           int64_t window_right) {
  // pos: the query's key position, counted from the bottom right.
  return key_range(i + s.Lk - s.Lq, s.Lk, is_causal ? i + 1 : s.Lk, window_left, window_right);
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
  t.k0 = query_keys(t.q0, s, is_causal, opts.window_left, opts.window_right).begin;
  const int64_t k1 = query_keys(t.q0 + t.tq - 1, s, is_causal, opts.window_left, opts.window_right).end;
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

// Rows of a (B, H, L, E) tensor whose last dimension is contiguous, at any other strides: the
// (B, L, H, E) layout of a projection's heads seen as (B, H, L, E), or keys expanded over a
// GQA group, are read where they lie instead of copied (a copy of each input, and of the
// output gradient, rose the peak memory above SDPA's on such inputs).
template <typename T>
struct Rows {
  const T* data;
  int64_t batch_stride, head_stride, row_stride;
  explicit Rows(const at::Tensor& x)
      : data(x.const_data_ptr<T>()), batch_stride(x.stride(0)), head_stride(x.stride(1)), row_stride(x.stride(2)) {}
  const T* row(int64_t b, int64_t h, int64_t l) const { return data + b * batch_stride + h * head_stride + l * row_stride; }
};

// x itself when its rows are contiguous (what Rows and the GEMMs read), else a contiguous copy.
inline at::Tensor with_contiguous_rows(const at::Tensor& x) {
  return x.size(3) <= 1 || x.stride(3) == 1 ? x : x.contiguous();
}

// The row of query q0 + i within its tile: keys [tile.k0 + start, tile.k0 + start + len).
struct RowSpan {
  int64_t start, len;
};

inline RowSpan row_span(const QueryTile& tile, int64_t i, const AttentionShape& s, bool is_causal,
                        int64_t window_left, int64_t window_right) {
  const KeyRange r = query_keys(tile.q0 + i, s, is_causal, window_left, window_right);
  return {r.begin - tile.k0, r.end - r.begin};
}

// A (tq, kn) view, row stride ld, of a per-thread buffer.
inline at::Tensor tile_view(at::Tensor& buffer, const QueryTile& tile) {
  return buffer.view(-1).narrow(0, 0, tile.tq * tile.ld).view({tile.tq, tile.ld}).narrow(1, 0, tile.kn);
}

// Scores of the tile's rows on their own key spans, in the order of docs/attention.md: scale,
// softcap, ALiBi, the float or boolean mask (the causal limit and the window are the spans).
// Entries outside a row's span are left unset: callers read only the span. With
// cap_slopes, the cap's slope of each entry is stored there, at the entry's place in the
// tile layout (transform_scores). Without a cap the scale multiplies the tile's queries
// (query_buffer, kQueryTile x E) before the GEMM instead of its tq x kn scores after it: one
// pass over the scores less, exact where the scale is a power of two (1/sqrt(E) at E 64 or
// 256), else within a rounding of each product; the forward, the backward and the support
// count all form the scores here, so they agree.
template <typename T>
at::Tensor tile_scores(at::Tensor& buffer, at::Tensor& query_buffer, T* cap_slopes, const at::Tensor& q_bh,
                       const at::Tensor& k_bh, const QueryTile& tile, T scale, const ScoreOptions<T>& opts,
                       const MaskView<T>& mask, const AttentionShape& s, bool is_causal, int64_t b, int64_t h) {
  at::Tensor scores = tile_view(buffer, tile);
  const at::Tensor q_tile = q_bh.narrow(0, tile.q0, tile.tq);
  const at::Tensor keys_t = k_bh.narrow(0, tile.k0, tile.kn).t();
  T score_scale = scale;
  if (opts.softcap > T(0)) {
    at::mm_out(scores, q_tile, keys_t);
  } else {
    // By hand rather than at::mul_out, whose dispatch cost shows on a decoding call's
    // one-query tiles.
    at::Tensor q_scaled = query_buffer.narrow(0, 0, tile.tq);
    T* scaled = q_scaled.data_ptr<T>();
    const T* rows = q_tile.const_data_ptr<T>();
    const int64_t E = q_tile.size(1), row_stride = q_tile.stride(0);
    for (int64_t i = 0; i < tile.tq; ++i)
      for (int64_t e = 0; e < E; ++e) scaled[i * E + e] = rows[i * row_stride + e] * scale;
    at::mm_out(scores, q_scaled, keys_t);
    score_scale = T(1);
  }
  T* z = scores.data_ptr<T>();
  const T slope = opts.alibi_slope(b, h);
  for (int64_t i = 0; i < tile.tq; ++i) {
    const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
    T* zi = z + i * tile.ld + span.start;
    transform_scores(zi, span.len, score_scale, opts, slope, tile.q0 + i + s.Lk - s.Lq - (tile.k0 + span.start),
                     cap_slopes != nullptr ? cap_slopes + i * tile.ld + span.start : nullptr);
    mask.apply(zi, span.len, b, h, tile.q0 + i, tile.k0 + span.start);
  }
  return scores;
}

// A tile's remaining work after its weights are known (the forward's P.V; the backward's dP,
// dQ, dK, dV) takes the sparse path when its supported (query, key) pairs number fewer than
// one in kSparseDensityDivisor of its tq x kn entries, else the dense GEMMs. Per supported
// pair the sparse path does the GEMMs' multiply-adds (E or Ev of them per product) at a
// gather's pace instead of a GEMM's. The value is not tuned: the supports measured so far are
// under 6 % of a tile or all of it (docs/performance.md, "CPU attention").
constexpr int64_t kSparseDensityDivisor = 8;

inline bool sparse_tile(int64_t support, int64_t tq, int64_t kn) {
  return support * kSparseDensityDivisor < tq * kn;
}

// The supports the forward keeps for the backward, so that the backward's sparsemax and
// 1.5-entmax tiles skip their score GEMM and the gather of their support: per query row a
// share of `capacity` entries, pooled over the rows of its tile, each entry a supported
// column (from the tile's first key) and its score; `ends` holds where each row's entries end
// in its tile's pool, or -1 on every row of a tile the forward did not keep (its supports
// overflow the pool, it holds a NaN row, its scores are capped, whose slopes the backward
// needs, or its keys span more columns than 16 bits hold): the backward recomputes that
// tile's scores. capacity 0: nothing kept.
template <typename T>
struct SupportLists {
  int64_t capacity = 0;
  int16_t* columns = nullptr;
  T* scores = nullptr;
  int32_t* ends = nullptr;
};

constexpr int64_t kMaxKeptTileKeys = int64_t{std::numeric_limits<int16_t>::max()} + 1;

// The entries of row i of a kept tile: [first, last) of its pool.
inline std::pair<int64_t, int64_t> kept_row(const int32_t* tile_ends, int64_t i) {
  return {i == 0 ? 0 : tile_ends[i - 1], tile_ends[i]};
}

// Writes the columns j < n with p[j] > 0, plus offset, to index; returns how many.
template <bool kAvx2, typename T>
ENTMAX_FAST_ALWAYS_INLINE int64_t support_columns_body(const T* p, int64_t n, int64_t offset, int32_t* index) {
  int64_t count = 0;
  for_each_above_body<kAvx2>(p, n, T(0), [&](int64_t j) { index[count++] = static_cast<int32_t>(j + offset); });
  return count;
}

// out[0:Ev] = sum_a p[a] * values[index[a]] (rows of Ev elements, value_stride apart).
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE void support_values_body(const T* p, const int32_t* index, int64_t count, const T* values,
                                                   int64_t value_stride, int64_t Ev, T* out) {
  for (int64_t e = 0; e < Ev; ++e) out[e] = T(0);
  for (int64_t a = 0; a < count; ++a) {
    const T w = p[a];
    const T* value = values + static_cast<int64_t>(index[a]) * value_stride;
#pragma omp simd
    for (int64_t e = 0; e < Ev; ++e) out[e] += w * value[e];
  }
}

// dots[a] = x . rows[index[a]] (rows of E elements, row_stride apart).
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE void support_dots_body(const T* x, const int32_t* index, int64_t count, const T* rows,
                                                 int64_t row_stride, int64_t E, T* dots) {
  for (int64_t a = 0; a < count; ++a) {
    const T* row = rows + static_cast<int64_t>(index[a]) * row_stride;
    T sum = T(0);
#pragma omp simd reduction(+ : sum)
    for (int64_t e = 0; e < E; ++e) sum += x[e] * row[e];
    dots[a] = sum;
  }
}

// The sparse products of one query row i over its support (key index[a], dz ds[a], weight
// p[a]): dq_i = sum_a ds[a] k_a, and dk_a += ds[a] q_i, dv_a += p[a] dO_i. The task owns the
// dk and dv rows it adds to (contiguous); the keys' rows are key_stride apart.
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE void support_grads_body(const int32_t* index, int64_t count, const T* ds, const T* p,
                                                  const T* q_i, const T* do_i, const T* keys, int64_t key_stride,
                                                  T* dk, T* dv, int64_t E, int64_t Ev, T* dq_i) {
  for (int64_t e = 0; e < E; ++e) dq_i[e] = T(0);
  for (int64_t a = 0; a < count; ++a) {
    const int64_t j = index[a];
    const T d = ds[a], w = p[a];
    const T* key = keys + j * key_stride;
    T* dk_j = dk + j * E;
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) {
      dq_i[e] += d * key[e];
      dk_j[e] += d * q_i[e];
    }
    T* dv_j = dv + j * Ev;
#pragma omp simd
    for (int64_t e = 0; e < Ev; ++e) dv_j[e] += w * do_i[e];
  }
}

// A dense row's (sum w, sum w g), in double: its Jacobian weights w and dP row g.
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE std::pair<double, double> weight_sums_body(const T* w, const T* g, int64_t n) {
  double w_total = 0, wg_total = 0;
#pragma omp simd reduction(+ : w_total, wg_total)
  for (int64_t j = 0; j < n; ++j) {
    w_total += static_cast<double>(w[j]);
    wg_total += static_cast<double>(w[j]) * static_cast<double>(g[j]);
  }
  return {w_total, wg_total};
}

// A dense row's dz over its dP row g: scale w (g - delta).
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE void row_dz_body(T* g, const T* w, int64_t n, T scale, T delta) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) g[j] = scale * w[j] * (g[j] - delta);
}

// z *= factor over a row; returns how many entries are then > 0.
template <typename T>
ENTMAX_FAST_ALWAYS_INLINE int64_t scale_and_count_body(T* z, int64_t n, T factor) {
  int64_t positive = 0;
#pragma omp simd reduction(+ : positive)
  for (int64_t j = 0; j < n; ++j) {
    z[j] *= factor;
    positive += z[j] > T(0);
  }
  return positive;
}

#if ENTMAX_FAST_AVX2_KERNELS
template <typename T>
ENTMAX_FAST_TARGET_AVX2 int64_t support_columns_avx2(const T* p, int64_t n, int64_t offset, int32_t* index) {
  return support_columns_body<true>(p, n, offset, index);
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 void support_values_avx2(const T* p, const int32_t* index, int64_t count, const T* values,
                                                 int64_t value_stride, int64_t Ev, T* out) {
  support_values_body(p, index, count, values, value_stride, Ev, out);
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 void support_dots_avx2(const T* x, const int32_t* index, int64_t count, const T* rows,
                                               int64_t row_stride, int64_t E, T* dots) {
  support_dots_body(x, index, count, rows, row_stride, E, dots);
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 void support_grads_avx2(const int32_t* index, int64_t count, const T* ds, const T* p,
                                                const T* q_i, const T* do_i, const T* keys, int64_t key_stride, T* dk,
                                                T* dv, int64_t E, int64_t Ev, T* dq_i) {
  support_grads_body(index, count, ds, p, q_i, do_i, keys, key_stride, dk, dv, E, Ev, dq_i);
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 std::pair<double, double> weight_sums_avx2(const T* w, const T* g, int64_t n) {
  return weight_sums_body(w, g, n);
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 void row_dz_avx2(T* g, const T* w, int64_t n, T scale, T delta) {
  row_dz_body(g, w, n, scale, delta);
}

template <typename T>
ENTMAX_FAST_TARGET_AVX2 int64_t scale_and_count_avx2(T* z, int64_t n, T factor) {
  return scale_and_count_body(z, n, factor);
}
#endif

template <typename T>
int64_t support_columns(const T* p, int64_t n, int64_t offset, int32_t* index) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return support_columns_avx2(p, n, offset, index);
#endif
  return support_columns_body<false>(p, n, offset, index);
}

template <typename T>
void support_values(const T* p, const int32_t* index, int64_t count, const T* values, int64_t value_stride,
                    int64_t Ev, T* out) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return support_values_avx2(p, index, count, values, value_stride, Ev, out);
#endif
  support_values_body(p, index, count, values, value_stride, Ev, out);
}

template <typename T>
void support_dots(const T* x, const int32_t* index, int64_t count, const T* rows, int64_t row_stride, int64_t E,
                  T* dots) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return support_dots_avx2(x, index, count, rows, row_stride, E, dots);
#endif
  support_dots_body(x, index, count, rows, row_stride, E, dots);
}

template <typename T>
void support_grads(const int32_t* index, int64_t count, const T* ds, const T* p, const T* q_i, const T* do_i,
                   const T* keys, int64_t key_stride, T* dk, T* dv, int64_t E, int64_t Ev, T* dq_i) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels())
    return support_grads_avx2(index, count, ds, p, q_i, do_i, keys, key_stride, dk, dv, E, Ev, dq_i);
#endif
  support_grads_body(index, count, ds, p, q_i, do_i, keys, key_stride, dk, dv, E, Ev, dq_i);
}

template <typename T>
std::pair<double, double> weight_sums(const T* w, const T* g, int64_t n) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return weight_sums_avx2(w, g, n);
#endif
  return weight_sums_body(w, g, n);
}

template <typename T>
void row_dz(T* g, const T* w, int64_t n, T scale, T delta) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return row_dz_avx2(g, w, n, scale, delta);
#endif
  row_dz_body(g, w, n, scale, delta);
}

template <typename T>
int64_t scale_and_count(T* z, int64_t n, T factor) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return scale_and_count_avx2(z, n, factor);
#endif
  return scale_and_count_body(z, n, factor);
}

template <typename T>
void attention_forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, const double* alpha, double scale_d, bool is_causal,
                            const ScoreOptionTensors& option_tensors, const AttentionShape& s, at::Tensor& out,
                            at::Tensor& stats, const SupportLists<T>& kept) {
  at::Tensor mask_holder;
  const MaskView<T> mask_view = make_mask_view<T>(mask, s, mask_holder);
  const ScoreOptions<T> opts(option_tensors);
  const T scale = static_cast<T>(scale_d);
  double* stats_ptr = stats.data_ptr<double>();
  const Rows<T> value_rows(v);
  T* out_ptr = out.data_ptr<T>();
  const int64_t row_capacity = widest_tile_span(s, is_causal, opts) + opts.sink_columns();
  const int64_t total = s.B * s.H * s.n_tiles;
  at::parallel_for(0, total, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
    at::Tensor buffer = at::empty({kQueryTile * row_capacity}, q.options());
    at::Tensor query_buffer = at::empty({kQueryTile, s.E}, q.options());
    RowWorkspace work(row_capacity);
    // Per row of the tile: its support, compact (columns from the tile's first key, weights),
    // and its size; whether the row holds only its scores (its p being the compact lists).
    std::vector<int32_t> support_index(static_cast<size_t>(kQueryTile * row_capacity));
    std::vector<T> support_p(static_cast<size_t>(kQueryTile * row_capacity));
    int64_t support_count[kQueryTile];
    bool compact_only[kQueryTile];
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
      // Sparsemax and 1.5-entmax rows go from their threshold straight to the compact support;
      // the other kinds write p over the row first.
      const bool closed_form = prm.kind == AlphaKind::kSparsemax || prm.kind == AlphaKind::kEntmax15;
      at::Tensor scores = tile_scores<T>(buffer, query_buffer, nullptr, q.select(0, b).select(0, h),
                                         k.select(0, b).select(0, hk),
                                         tile, scale, opts, mask_view, s, is_causal, b, h);
      T* z = scores.data_ptr<T>();
      // Softmax weights are never zero: its tiles stay dense without counting.
      bool dense = prm.kind == AlphaKind::kSoftmax;
      int64_t support = 0;
      for (int64_t i = 0; i < tile.tq; ++i) {
        T* zi = z + i * tile.ld;
        const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
        support_count[i] = 0;
        compact_only[i] = false;
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
        int32_t* index = &support_index[i * row_capacity];
        T* p = &support_p[i * row_capacity];
        RowStats<T> rs;
        if (closed_form) {
          int64_t candidates = 0;
          rs = closed_form_stats(zi + span.start, n, prm, work, &candidates);
          st[2 * i] = rs.max;
          st[2 * i + 1] = rs.mu;
          if (std::isnan(rs.max)) {
            // A NaN row's weights are NaN, which the GEMM passes on.
            std::fill(zi, zi + tile.kn, T(0));
            std::fill(zi + span.start, zi + span.start + span.len, std::numeric_limits<T>::quiet_NaN());
            dense = true;
            continue;
          }
          compact_only[i] = true;
          if (rs.max > -std::numeric_limits<T>::infinity()) {
            support_count[i] = closed_form_support_among(zi + span.start, span.len, rs.max, rs.mu, prm,
                                                         work.index.data(), candidates, span.start, index, p,
                                                         static_cast<T*>(nullptr));
          }
          support += support_count[i];
          continue;
        }
        // Counted only (not in dense tiles): the lists are made once the tile is known to be
        // sparse. The sink's entry is no key.
        int64_t row_support = 0;
        rs = entmax_row_inplace(zi + span.start, n, prm, work, dense ? nullptr : &row_support);
        if (!dense && opts.has_sink() && zi[span.start + span.len] > T(0)) --row_support;
        std::fill(zi, zi + span.start, T(0));
        // Also clears the sink's weight where it sits inside the tile's (tq, kn) view.
        std::fill(zi + span.start + span.len, zi + tile.kn, T(0));
        st[2 * i] = rs.max;
        st[2 * i + 1] = rs.mu;
        if (std::isnan(rs.max)) dense = true;
        if (dense) continue;
        support_count[i] = row_support;
        support += support_count[i];
      }
      if (kept.capacity > 0 && closed_form && !dense && !(opts.softcap > T(0)) && tile.kn <= kMaxKeptTileKeys &&
          support <= tile.tq * kept.capacity) {
        // Before the dense path below writes p over the scores.
        const int64_t row0 = (b * s.H + h) * s.Lq + tile.q0;
        int16_t* kept_columns = kept.columns + row0 * kept.capacity;
        T* kept_scores = kept.scores + row0 * kept.capacity;
        int64_t at = 0;
        for (int64_t i = 0; i < tile.tq; ++i) {
          const int32_t* index = &support_index[i * row_capacity];
          const T* zi = z + i * tile.ld;
          for (int64_t a = 0; a < support_count[i]; ++a, ++at) {
            kept_columns[at] = static_cast<int16_t>(index[a]);
            kept_scores[at] = zi[index[a]];
          }
          kept.ends[row0 + i] = static_cast<int32_t>(at);
        }
      }
      const bool sparse = !dense && sparse_tile(support, tile.tq, tile.kn);
      for (int64_t i = 0; sparse && !closed_form && i < tile.tq; ++i) {
        if (support_count[i] == 0) continue;
        const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
        const T* zi = z + i * tile.ld;
        int32_t* index = &support_index[i * row_capacity];
        T* p = &support_p[i * row_capacity];
        support_count[i] = support_columns(zi + span.start, span.len, span.start, index);
        for (int64_t a = 0; a < support_count[i]; ++a) p[a] = zi[index[a]];
      }
      if (!sparse) {
        // The compact rows' p over the tile, zeros elsewhere.
        for (int64_t i = 0; i < tile.tq; ++i) {
          if (!compact_only[i]) continue;
          T* zi = z + i * tile.ld;
          std::fill(zi, zi + tile.kn, T(0));
          const int32_t* index = &support_index[i * row_capacity];
          const T* p = &support_p[i * row_capacity];
          for (int64_t a = 0; a < support_count[i]; ++a) zi[index[a]] = p[a];
        }
        at::mm_out(out_tile, scores, v.select(0, b).select(0, hk).narrow(0, tile.k0, tile.kn));
        continue;
      }
      const T* values = value_rows.row(b, hk, tile.k0);
      for (int64_t i = 0; i < tile.tq; ++i) {
        support_values(&support_p[i * row_capacity], &support_index[i * row_capacity], support_count[i], values,
                       value_rows.row_stride, s.Ev, out_ptr + ((b * s.H + h) * s.Lq + tile.q0 + i) * s.Ev);
      }
    }
  }));
}

// Returns (out in the input dtype, stats (B, H, Lq, 2) = (row max, mu) in float64, both over
// the row with its sink when there is one) and, for the backward, the supports it kept
// (SupportLists): columns (B, H, Lq, support_capacity) int16, scores alike in the compute
// dtype, ends (B, H, Lq) int32, or (B, H, 0) when support_capacity is 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> entmax_attention_fwd_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const at::Tensor& alpha_in, double scale, bool is_causal,
    at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, int64_t support_capacity) {
  const AttentionShape s = check_attention_args(query, key, value, attn_mask, alpha_in);
  TORCH_CHECK(support_capacity >= 0, "entmax_attention (cpu): support_capacity must be >= 0, got ",
              support_capacity);
  const at::ScalarType ct = compute_type(query.scalar_type());
  const ScoreOptionTensors options = check_score_options("entmax_attention", s.B, s.H, ct, window_size, softcap,
                                                         alibi_slopes, sinks);
  // detach: the GEMMs below run on worker threads and must never be recorded by autograd.
  const at::Tensor q = with_contiguous_rows(query.detach().to(ct));
  const at::Tensor k = with_contiguous_rows(key.detach().to(ct));
  const at::Tensor v = with_contiguous_rows(value.detach().to(ct));
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  at::Tensor out = at::empty({s.B, s.H, s.Lq, s.Ev}, q.options());
  at::Tensor stats = at::empty({s.B, s.H, s.Lq, 2}, q.options().dtype(at::kDouble));
  // Zeros past each row's entries: the outputs depend on the inputs only.
  at::Tensor kept_columns = at::zeros({s.B, s.H, s.Lq, support_capacity}, q.options().dtype(at::kShort));
  at::Tensor kept_scores = at::zeros({s.B, s.H, s.Lq, support_capacity}, q.options());
  at::Tensor kept_ends = at::full({s.B, s.H, support_capacity > 0 ? s.Lq : 0}, -1, q.options().dtype(at::kInt));
  if (out.numel() > 0 || stats.numel() > 0) {
    if (s.Lk == 0) {
      out.zero_();
      stats.select(3, 0).fill_(-std::numeric_limits<double>::infinity());
      stats.select(3, 1).zero_();
    } else {
      AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_fwd", [&] {
        SupportLists<scalar_t> kept;
        if (support_capacity > 0) {
          kept = {support_capacity, kept_columns.data_ptr<int16_t>(), kept_scores.data_ptr<scalar_t>(),
                  kept_ends.data_ptr<int32_t>()};
        }
        attention_forward_impl<scalar_t>(q, k, v, attn_mask, alpha.const_data_ptr<double>(), scale, is_causal,
                                         options, s, out, stats, kept);
      });
    }
  }
  return {out.to(query.scalar_type()), stats, kept_columns, kept_scores, kept_ends};
}

// The forward's saved (B, H, Lq, 2) row statistics, checked against the call's shape, in
// float64 and contiguous, for the backward and the support count.
at::Tensor checked_stats(const at::Tensor& stats, const AttentionShape& s, const char* op) {
  TORCH_CHECK(stats.dim() == 4 && stats.size(0) == s.B && stats.size(1) == s.H && stats.size(2) == s.Lq &&
                  stats.size(3) == 2,
              op, " (cpu): stats must have shape (", s.B, ", ", s.H, ", ", s.Lq, ", 2), got ", stats.sizes());
  return stats.detach().to(at::kDouble).contiguous();
}

// The forward's kept supports (SupportLists) as the backward received them: all three or none,
// checked against the call's shape and compute dtype.
struct KeptTensors {
  at::Tensor columns, scores, ends;
  template <typename T>
  SupportLists<T> lists() const {
    if (!columns.defined() || columns.size(3) == 0) return {};
    return {columns.size(3), columns.data_ptr<int16_t>(), scores.data_ptr<T>(), ends.data_ptr<int32_t>()};
  }
};

KeptTensors checked_kept_support(const std::optional<at::Tensor>& columns, const std::optional<at::Tensor>& scores,
                                 const std::optional<at::Tensor>& ends, const AttentionShape& s, at::ScalarType ct) {
  const bool any = columns.has_value() || scores.has_value() || ends.has_value();
  if (!any) return {};
  TORCH_CHECK(columns.has_value() && scores.has_value() && ends.has_value(),
              "entmax_attention_backward (cpu): support_columns, support_scores and support_ends come together, "
              "got only some of them");
  const int64_t capacity = columns->dim() == 4 ? columns->size(3) : -1;
  TORCH_CHECK(columns->dim() == 4 && columns->size(0) == s.B && columns->size(1) == s.H && columns->size(2) == s.Lq &&
                  columns->scalar_type() == at::kShort,
              "entmax_attention_backward (cpu): support_columns must be int16 of shape (", s.B, ", ", s.H, ", ", s.Lq,
              ", capacity), got ", columns->scalar_type(), " ", columns->sizes());
  TORCH_CHECK(scores->sizes() == columns->sizes() && scores->scalar_type() == ct,
              "entmax_attention_backward (cpu): support_scores must be ", ct, " of shape ", columns->sizes(), ", got ",
              scores->scalar_type(), " ", scores->sizes());
  const int64_t rows = capacity > 0 ? s.Lq : 0;
  TORCH_CHECK(ends->dim() == 3 && ends->size(0) == s.B && ends->size(1) == s.H && ends->size(2) == rows &&
                  ends->scalar_type() == at::kInt,
              "entmax_attention_backward (cpu): support_ends must be int32 of shape (", s.B, ", ", s.H, ", ", rows,
              "), got ", ends->scalar_type(), " ", ends->sizes());
  return {columns->contiguous(), scores->contiguous(), ends->contiguous()};
}

// What saved_general_probs leaves besides p: the factor P^(alpha-2) that makes the p/q it
// wrote into w the row's Jacobian weights p^(2-alpha) (the backward folds it into dz rather
// than making another pass), and how many of the row's keys have p > 0.
template <typename T>
struct SavedGeneralRow {
  T weight_scale = T(1);
  int64_t support = 0;
};

// The p of a General-kind row from its saved (max, mu), written over the row's scores z (the
// sink's entry included, after its `keys` keys): the forward's kernel at the saved mu (the
// root general_mu returns), renormalised as the forward did, gives the forward's p to within
// its rounding (general_mu says where not); scalar pow per entry here cost more than the rest
// of the backward. Where w is not null, p/q goes there from the same pass (general_probs): a
// power per entry less than computing the weights from p.
template <typename T>
SavedGeneralRow<T> saved_general_probs(T* z, T* w, int64_t n, int64_t keys, T zmax, double mu,
                                       const EntmaxParams<T>& prm) {
  const double p_total = general_probs(z, w, n, static_cast<double>(zmax), prm.law(), mu);
  SavedGeneralRow<T> row;
  if (p_total > 0) {
    int64_t support = scale_and_count(z, n, static_cast<T>(1.0 / p_total));
    // The sink's entry is no key.
    if (n > keys && z[keys] > T(0)) --support;
    row.weight_scale = static_cast<T>(std::pow(p_total, prm.alpha - 2.0));
    row.support = support;
  }
  return row;
}

// The support of row i of a tile the forward kept, as closed_form_support finds it in the
// recomputed scores: the kept columns, and p and weights from the kept scores at (max, mu).
template <typename T>
int64_t kept_support(const SupportLists<T>& kept, int64_t row0, const int32_t* tile_ends, int64_t i, T zmax,
                     double mu, const EntmaxParams<T>& prm, int32_t* index, T* p, T* w) {
  const auto [first, last] = kept_row(tile_ends, i);
  const int16_t* columns = kept.columns + row0 * kept.capacity + first;
  const T* z = kept.scores + row0 * kept.capacity + first;
  for (int64_t a = 0; a < last - first; ++a) {
    index[a] = columns[a];
    p[a] = prm.prob(z[a], zmax, mu);
    w[a] = prm.jacobian_weight(z[a], zmax, mu, p[a]);
  }
  return last - first;
}

template <typename T>
void attention_backward_impl(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const std::optional<at::Tensor>& mask, const at::Tensor& stats,
                             const double* alpha, double scale_d, bool is_causal, bool need_alpha_grad,
                             const ScoreOptionTensors& option_tensors, const AttentionShape& s, at::Tensor& dq,
                             at::Tensor& dk, at::Tensor& dv, double* dalpha_part, double* dsinks_part,
                             const SupportLists<T>& kept) {
  at::Tensor mask_holder;
  const MaskView<T> mask_view = make_mask_view<T>(mask, s, mask_holder);
  const ScoreOptions<T> opts(option_tensors);
  const bool capped = opts.softcap > T(0);
  const T scale = static_cast<T>(scale_d);
  const double* stats_ptr = stats.const_data_ptr<double>();
  const Rows<T> query_rows(q), key_rows(k), value_rows(v), grad_out_rows(grad_out);
  T* dq_ptr = dq.data_ptr<T>();
  T* dk_ptr = dk.data_ptr<T>();
  T* dv_ptr = dv.data_ptr<T>();
  const int64_t row_capacity = widest_tile_span(s, is_causal, opts) + opts.sink_columns();
  // How a row of a tile enters its gradients.
  enum class RowState : uint8_t { kNormal, kEmpty, kNaN };
  // One task per (batch, key/value head): the query heads of a GQA group accumulate into
  // the same dK/dV, so they stay in one task and no two tasks write the same memory.
  at::parallel_for(0, s.B * s.Hk, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
    at::Tensor query_buffer = at::empty({kQueryTile, s.E}, q.options());
    // Tile-wide buffers (kQueryTile x row_capacity each): the recomputed scores or p, dP, the
    // cap's slopes and the rows' Jacobian weights p^(2-alpha). Only a tile whose scores are
    // recomputed, or that takes the dense path, uses them: allocated at the first such tile, so
    // that a backward over tiles the forward kept holds none of them.
    at::Tensor prob_buffer, grad_buffer, cap_slope_buffer;
    std::vector<T> weight_tile;
    T* cap_slopes = nullptr;
    auto tile_buffers = [&]() {
      if (prob_buffer.defined()) return;
      prob_buffer = at::empty({kQueryTile * row_capacity}, q.options());
      grad_buffer = at::empty({kQueryTile * row_capacity}, q.options());
      if (capped) {
        cap_slope_buffer = at::empty({kQueryTile * row_capacity}, q.options());
        cap_slopes = cap_slope_buffer.data_ptr<T>();
      }
      weight_tile.resize(static_cast<size_t>(kQueryTile * row_capacity));
    };
    // Per row of the tile: its support, compact (columns from the tile's first key, p, and the
    // closed forms' weights) from list_at[i] on, and its size; for sparsemax and 1.5-entmax
    // rows, which go from (max, mu) straight to the compact support, the sink's p and weight.
    // A kept tile's rows lie as in its pool; the others' at row_capacity apart.
    std::vector<int32_t> support_index;
    std::vector<T> support_p, support_w;
    int64_t list_at[kQueryTile];
    int64_t support_count[kQueryTile];
    T sink_p[kQueryTile], sink_w[kQueryTile];
    // Per row: the factor of its weights (saved_general_probs; 1 for the closed forms).
    T weight_scale[kQueryTile];
    RowState state[kQueryTile];
    // One row's support's p, g (then its dz) and weights (sparse path), the sink last.
    std::vector<T> sp(row_capacity), sg(row_capacity), sw(row_capacity);
    RowWorkspace work(row_capacity);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.Hk;
      const int64_t hk = task % s.Hk;
      const at::Tensor k_bh = k.select(0, b).select(0, hk);
      const at::Tensor v_bh = v.select(0, b).select(0, hk);
      at::Tensor dk_bh = dk.select(0, b).select(0, hk);
      at::Tensor dv_bh = dv.select(0, b).select(0, hk);
      for (int64_t h = hk * s.group; h < (hk + 1) * s.group; ++h) {
        const EntmaxParams<T> prm(alpha[h]);
        const bool closed_form = prm.kind != AlphaKind::kGeneral;
        const bool compact = prm.kind == AlphaKind::kSparsemax || prm.kind == AlphaKind::kEntmax15;
        const at::Tensor q_bh = q.select(0, b).select(0, h);
        const at::Tensor do_bh = grad_out.select(0, b).select(0, h);
        at::Tensor dq_bh = dq.select(0, b).select(0, h);
        double dalpha_acc = 0, dsinks_acc = 0;
        for (int64_t tile_index = 0; tile_index < s.n_tiles; ++tile_index) {
          const QueryTile tile = query_tile(tile_index, s, is_causal, opts);
          if (tile.kn == 0) continue;
          const int64_t row0 = (b * s.H + h) * s.Lq + tile.q0;
          const double* st = stats_ptr + row0 * 2;
          // The tile's row ends in its pool where the forward kept its supports: then no scores.
          const int32_t* kept_ends = compact && kept.capacity > 0 && kept.ends[row0] >= 0 ? kept.ends + row0 : nullptr;
          at::Tensor probs;
          T* pz = nullptr;
          if (kept_ends == nullptr) {
            tile_buffers();
            probs = tile_scores<T>(prob_buffer, query_buffer, cap_slopes, q_bh, k_bh, tile, scale, opts, mask_view, s,
                                   is_causal, b, h);
            pz = probs.data_ptr<T>();
          }
          const int64_t lists = kept_ends != nullptr ? kept_ends[tile.tq - 1] : tile.tq * row_capacity;
          if (static_cast<int64_t>(support_index.size()) < lists) {
            support_index.resize(lists);
            support_p.resize(lists);
            support_w.resize(lists);
          }
          for (int64_t i = 0; i < tile.tq; ++i) list_at[i] = kept_ends != nullptr ? kept_row(kept_ends, i).first
                                                                                  : i * row_capacity;
          // p of each row (and the closed forms' weights) from the saved (max, mu), over the
          // row's span and its sink's entry right after; the support's columns.
          bool dense = prm.kind == AlphaKind::kSoftmax;
          int64_t support = 0;
          for (int64_t i = 0; i < tile.tq; ++i) {
            const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
            const T zmax = static_cast<T>(st[2 * i]);
            const double mu = st[2 * i + 1];
            support_count[i] = 0;
            if (std::isnan(zmax)) {
              state[i] = RowState::kNaN;
              dense = true;
              continue;
            }
            if (span.len == 0 || !(zmax > -std::numeric_limits<T>::infinity())) {
              // No key, or every key masked: zero weights (with a sink, a one-hot row on it,
              // whose Jacobian term is zero).
              state[i] = RowState::kEmpty;
              continue;
            }
            state[i] = RowState::kNormal;
            weight_scale[i] = T(1);
            int32_t* index = &support_index[list_at[i]];
            if (compact) {
              support_count[i] =
                  kept_ends != nullptr
                      ? kept_support(kept, row0, kept_ends, i, zmax, mu, prm, index, &support_p[list_at[i]],
                                     &support_w[list_at[i]])
                      : closed_form_support(pz + i * tile.ld + span.start, span.len, zmax, mu, prm, span.start,
                                            index, &support_p[list_at[i]], &support_w[list_at[i]], work);
              if (opts.has_sink()) {
                const T z_sink = opts.sinks[h];
                sink_p[i] = prm.prob(z_sink, zmax, mu);
                sink_w[i] = prm.jacobian_weight(z_sink, zmax, mu, sink_p[i]);
              }
              support += support_count[i];
              continue;
            }
            T* p = pz + i * tile.ld + span.start;
            int64_t n = span.len;
            if (opts.has_sink()) p[n++] = opts.sinks[h];
            if (closed_form) {
              // Softmax: its tiles are dense.
              closed_form_probs(p, &weight_tile[i * tile.ld + span.start], n, zmax, mu, prm);
              continue;
            }
            const SavedGeneralRow<T> row =
                saved_general_probs(p, &weight_tile[i * tile.ld + span.start], n, span.len, zmax, mu, prm);
            weight_scale[i] = row.weight_scale;
            // Counted only: the lists are made once the tile is known to be sparse.
            support_count[i] = row.support;
            support += support_count[i];
          }
          const bool sparse = !dense && sparse_tile(support, tile.tq, tile.kn);
          for (int64_t i = 0; sparse && !compact && i < tile.tq; ++i) {
            if (state[i] != RowState::kNormal || support_count[i] == 0) continue;
            const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
            int32_t* index = &support_index[list_at[i]];
            support_count[i] = support_columns(pz + i * tile.ld + span.start, span.len, span.start, index);
            T* p_compact = &support_p[list_at[i]];
            for (int64_t a = 0; a < support_count[i]; ++a) p_compact[a] = pz[i * tile.ld + index[a]];
          }
          if (!sparse) {
            // Dense: the compact rows' p and weights over the tile (zeros elsewhere, the sink's
            // right after the span), dP = dO.V^T over the tile, dz row by row, three GEMMs.
            if (!probs.defined()) {
              tile_buffers();
              probs = tile_view(prob_buffer, tile);
              pz = probs.data_ptr<T>();
            }
            for (int64_t i = 0; compact && i < tile.tq; ++i) {
              if (state[i] != RowState::kNormal) continue;
              T* p_row = pz + i * tile.ld;
              T* w_row = &weight_tile[i * tile.ld];
              std::fill(p_row, p_row + tile.ld, T(0));
              std::fill(w_row, w_row + tile.ld, T(0));
              const int32_t* index = &support_index[list_at[i]];
              for (int64_t a = 0; a < support_count[i]; ++a) {
                p_row[index[a]] = support_p[list_at[i] + a];
                w_row[index[a]] = support_w[list_at[i] + a];
              }
              if (opts.has_sink()) {
                const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
                p_row[span.start + span.len] = sink_p[i];
                w_row[span.start + span.len] = sink_w[i];
              }
            }
            at::Tensor dprobs = tile_view(grad_buffer, tile);
            const at::Tensor do_tile = do_bh.narrow(0, tile.q0, tile.tq);
            at::mm_out(dprobs, do_tile, v_bh.narrow(0, tile.k0, tile.kn).t());
            T* gz = dprobs.data_ptr<T>();
            for (int64_t i = 0; i < tile.tq; ++i) {
              T* p_row = pz + i * tile.ld;
              T* g_row = gz + i * tile.ld;
              if (state[i] == RowState::kNaN) {
                // A NaN row of the forward (NaN or +inf score) passes NaN on to every gradient
                // it touches, as softmax attention's backward does.
                std::fill(p_row, p_row + tile.kn, std::numeric_limits<T>::quiet_NaN());
                std::fill(g_row, g_row + tile.kn, std::numeric_limits<T>::quiet_NaN());
                if (need_alpha_grad) dalpha_acc = std::numeric_limits<double>::quiet_NaN();
                if (opts.has_sink()) dsinks_acc = std::numeric_limits<double>::quiet_NaN();
                continue;
              }
              if (state[i] == RowState::kEmpty) {
                std::fill(p_row, p_row + tile.kn, T(0));
                std::fill(g_row, g_row + tile.kn, T(0));
                continue;
              }
              const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
              T* p = p_row + span.start;
              T* g = g_row + span.start;
              int64_t n = span.len;
              // The sink's value is zero, so is its g.
              if (opts.has_sink()) g[n++] = T(0);
              const T* w = &weight_tile[i * tile.ld + span.start];
              const auto [s_total, sg_total] = weight_sums(w, g, n);
              if (need_alpha_grad) dalpha_acc += row_alpha_grad(p, g, n, prm.alpha);
              const double delta_d = s_total > 0 ? sg_total / s_total : 0.0;
              const T delta = static_cast<T>(delta_d);
              // The sink's dz = s_sink (g_sink - delta) with g_sink = 0.
              if (opts.has_sink()) dsinks_acc -= weight_scale[i] * static_cast<double>(w[span.len]) * delta_d;
              // dZ (docs/attention.md, "Backward"), with the score scale and the weights' scale
              // folded in for dQ and dK, and the cap's slope where the scores were capped.
              const T dz_scale = scale * weight_scale[i];
              if (capped) {
                const T* slope = cap_slopes + i * tile.ld + span.start;
                for (int64_t j = 0; j < span.len; ++j) g[j] = dz_scale * slope[j] * w[j] * (g[j] - delta);
              } else {
                row_dz(g, w, span.len, dz_scale, delta);
              }
              // Outside the span, the sink's entry included where it lies inside the view.
              std::fill(p_row, p, T(0));
              std::fill(p + span.len, p_row + tile.kn, T(0));
              std::fill(g_row, g, T(0));
              std::fill(g + span.len, g_row + tile.kn, T(0));
            }
            dv_bh.narrow(0, tile.k0, tile.kn).addmm_(probs.t(), do_tile);
            at::Tensor dq_tile = dq_bh.narrow(0, tile.q0, tile.tq);
            at::mm_out(dq_tile, dprobs, k_bh.narrow(0, tile.k0, tile.kn));
            dk_bh.narrow(0, tile.k0, tile.kn).addmm_(dprobs.t(), q_bh.narrow(0, tile.q0, tile.tq));
            continue;
          }
          // Sparse: dP only on the support (dO_i . v_j), dz there, and the products from it.
          const int64_t kv_row0 = (b * s.Hk + hk) * s.Lk + tile.k0;
          const T* keys = key_rows.row(b, hk, tile.k0);
          const T* values = value_rows.row(b, hk, tile.k0);
          T* dk_tile = dk_ptr + kv_row0 * s.E;
          T* dv_tile = dv_ptr + kv_row0 * s.Ev;
          for (int64_t i = 0; i < tile.tq; ++i) {
            const int64_t row = (b * s.H + h) * s.Lq + tile.q0 + i;
            T* dq_i = dq_ptr + row * s.E;
            if (state[i] == RowState::kEmpty) {
              std::fill(dq_i, dq_i + s.E, T(0));
              continue;
            }
            const RowSpan span = row_span(tile, i, s, is_causal, opts.window_left, opts.window_right);
            const int32_t* index = &support_index[list_at[i]];
            const int64_t count = support_count[i];
            const T* do_i = grad_out_rows.row(b, h, tile.q0 + i);
            support_dots(do_i, index, count, values, value_rows.row_stride, s.Ev, sg.data());
            std::copy(&support_p[list_at[i]], &support_p[list_at[i]] + count, sp.begin());
            int64_t n = count;
            if (opts.has_sink()) {
              sp[n] = compact ? sink_p[i] : pz[i * tile.ld + span.start + span.len];
              sg[n] = T(0);
              ++n;
            }
            // Softmax tiles are dense: the rows here are sparsemax and 1.5-entmax (compact) or
            // General, whose weights saved_general_probs left over the tile.
            if (compact) {
              std::copy(&support_w[list_at[i]], &support_w[list_at[i]] + count, sw.begin());
              if (opts.has_sink()) sw[count] = sink_w[i];
            } else {
              const T* w_row = &weight_tile[i * tile.ld];
              for (int64_t a = 0; a < count; ++a) sw[a] = w_row[index[a]];
              if (opts.has_sink()) sw[count] = w_row[span.start + span.len];
            }
            const auto [s_total, sg_total] = weight_sums(sw.data(), sg.data(), n);
            if (need_alpha_grad) dalpha_acc += row_alpha_grad(sp.data(), sg.data(), n, prm.alpha);
            const double delta_d = s_total > 0 ? sg_total / s_total : 0.0;
            const T delta = static_cast<T>(delta_d);
            if (opts.has_sink()) dsinks_acc -= weight_scale[i] * static_cast<double>(sw[count]) * delta_d;
            const T dz_scale = scale * weight_scale[i];
            // dz over g, as the dense rows' (row_dz).
            if (capped) {
              const T* slope = cap_slopes + i * tile.ld;
              for (int64_t a = 0; a < count; ++a) sg[a] = dz_scale * slope[index[a]] * sw[a] * (sg[a] - delta);
            } else {
              row_dz(sg.data(), sw.data(), count, dz_scale, delta);
            }
            support_grads(index, count, sg.data(), sp.data(), query_rows.row(b, h, tile.q0 + i), do_i, keys,
                          key_rows.row_stride, dk_tile, dv_tile, s.E, s.Ev, dq_i);
          }
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
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, bool need_sinks_grad,
    const std::optional<at::Tensor>& support_columns, const std::optional<at::Tensor>& support_scores,
    const std::optional<at::Tensor>& support_ends) {
  const AttentionShape s = entmax_fast_cpu::check_attention_args(query, key, value, attn_mask, alpha_in);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == s.B && grad_out.size(1) == s.H && grad_out.size(2) == s.Lq &&
                  grad_out.size(3) == s.Ev,
              "entmax_attention_backward (cpu): grad_out must have shape (", s.B, ", ", s.H, ", ", s.Lq, ", ", s.Ev,
              "), got ", grad_out.sizes());
  const at::Tensor stats = checked_stats(stats_in, s, "entmax_attention_backward");
  const at::ScalarType ct = compute_type(query.scalar_type());
  const ScoreOptionTensors options = check_score_options("entmax_attention", s.B, s.H, ct, window_size, softcap,
                                                         alibi_slopes, sinks);
  const at::Tensor q = with_contiguous_rows(query.detach().to(ct));
  const at::Tensor k = with_contiguous_rows(key.detach().to(ct));
  const at::Tensor v = with_contiguous_rows(value.detach().to(ct));
  const at::Tensor g = with_contiguous_rows(grad_out.detach().to(ct));
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  const KeptTensors kept = checked_kept_support(support_columns, support_scores, support_ends, s, ct);
  // Contiguous whatever the inputs' strides: the sparse products index their rows so.
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  at::Tensor dalpha_part = at::zeros({s.B, s.H}, q.options().dtype(at::kDouble));
  at::Tensor dsinks_part = at::zeros({s.B, s.H}, q.options().dtype(at::kDouble));
  if (s.Lk > 0 && s.Lq > 0 && s.B > 0) {
    AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_bwd", [&] {
      attention_backward_impl<scalar_t>(g, q, k, v, attn_mask, stats, alpha.const_data_ptr<double>(), scale,
                                        is_causal, need_alpha_grad, options, s, dq, dk, dv,
                                        dalpha_part.data_ptr<double>(), dsinks_part.data_ptr<double>(),
                                        kept.lists<scalar_t>());
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
    at::Tensor query_buffer = at::empty({kQueryTile, s.E}, q.options());
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
      at::Tensor scores = tile_scores<T>(buffer, query_buffer, nullptr, q.select(0, b).select(0, h),
                                         k.select(0, b).select(0, hk),
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
          support += saved_general_probs(p, static_cast<T*>(nullptr), n, span.len, zmax, mu, prm).support;
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
  const ScoreOptionTensors options = check_score_options("entmax_attention", s.B, s.H, ct, window_size, softcap,
                                                         alibi_slopes, sinks);
  const at::Tensor q = with_contiguous_rows(query.detach().to(ct));
  const at::Tensor k = with_contiguous_rows(key.detach().to(ct));
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

// Returns (B, H, number of query tiles) bool: whether each tile of a call of these shapes
// takes the sparse path (sparse_tile()) given counts (B, H, Lq), the supported keys of each
// query row (entmax_attention_support's result). Tiles of softmax (alpha 1) attention and
// tiles holding a row of NaN weights are dense whatever this says.
at::Tensor entmax_attention_sparse_tiles_cpu(const at::Tensor& counts, int64_t key_length, bool is_causal,
                                             at::IntArrayRef window_size) {
  TORCH_CHECK(counts.dim() == 3 && counts.scalar_type() == at::kLong && counts.device().is_cpu(),
              "entmax_attention_sparse_tiles (cpu): counts must be a (B, H, Lq) int64 CPU tensor, got ",
              counts.scalar_type(), " of shape ", counts.sizes());
  TORCH_CHECK(key_length >= 0, "entmax_attention_sparse_tiles (cpu): key_length must be >= 0, got ", key_length);
  AttentionShape s{};
  s.B = counts.size(0);
  s.H = counts.size(1);
  s.Lq = counts.size(2);
  s.Lk = key_length;
  s.n_tiles = (s.Lq + kQueryTile - 1) / kQueryTile;
  const ScoreOptionTensors option_tensors = check_score_options("entmax_attention_sparse_tiles", s.B, s.H, at::kFloat,
                                                                window_size, 0.0, std::nullopt, std::nullopt);
  const ScoreOptions<float> opts(option_tensors);
  const at::Tensor c = counts.contiguous();
  const int64_t* count_ptr = c.const_data_ptr<int64_t>();
  at::Tensor sparse = at::zeros({s.B, s.H, s.n_tiles}, counts.options().dtype(at::kBool));
  bool* sparse_ptr = sparse.data_ptr<bool>();
  for (int64_t bh = 0; bh < s.B * s.H; ++bh) {
    for (int64_t t = 0; t < s.n_tiles; ++t) {
      const QueryTile tile = query_tile(t, s, is_causal, opts);
      int64_t support = 0;
      for (int64_t i = 0; i < tile.tq; ++i) support += count_ptr[bh * s.Lq + tile.q0 + i];
      sparse_ptr[bh * s.n_tiles + t] = tile.kn > 0 && sparse_tile(support, tile.tq, tile.kn);
    }
  }
  return sparse;
}

}  // namespace
}  // namespace entmax_fast_cpu

// The score options (window_size, softcap, alibi_slopes, sinks) come last and default to
// none: a call without them passes only the plain arguments.
TORCH_LIBRARY_FRAGMENT(entmax_fast, m) {
  m.def(
      "entmax_attention_fwd(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor alpha, float scale, "
      "bool is_causal, int[2] window_size=[-1, -1], float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? sinks=None, int support_capacity=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "entmax_attention_bwd(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
      "Tensor stats, Tensor alpha, float scale, bool is_causal, bool need_alpha_grad, "
      "int[2] window_size=[-1, -1], float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None, "
      "bool need_sinks_grad=False, Tensor? support_columns=None, Tensor? support_scores=None, "
      "Tensor? support_ends=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "entmax_attention_support(Tensor query, Tensor key, Tensor? attn_mask, Tensor stats, Tensor alpha, "
      "float scale, bool is_causal, int[2] window_size=[-1, -1], float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? sinks=None) -> Tensor");
  m.def(
      "entmax_attention_sparse_tiles(Tensor counts, int key_length, bool is_causal, int[2] window_size=[-1, -1]) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(entmax_fast, CPU, m) {
  m.impl("entmax_attention_fwd", &entmax_fast_cpu::entmax_attention_fwd_cpu);
  m.impl("entmax_attention_bwd", &entmax_fast_cpu::entmax_attention_bwd_cpu);
  m.impl("entmax_attention_support", &entmax_fast_cpu::entmax_attention_support_cpu);
  m.impl("entmax_attention_sparse_tiles", &entmax_fast_cpu::entmax_attention_sparse_tiles_cpu);
}
