// Entmax attention of new queries against a key/value cache on CPU, forward only (decoding,
// speculative decoding, chunked prefill): the backend contract's attention_kvcache
// (entmax_fast/backends/__init__.py), computing what entmax_fast/reference/kvcache.py computes.
//
// Query i of sequence b sits at key position pos = seqlens_k[b] - Lq + i and sees keys
// max(0, pos - left) <= j <= pos (lower-right causal, `left` the window's left bound, -1
// unbounded); ALiBi subtracts slope * (pos - j). The caches are read where they are:
// contiguous (B, Hkv, Lmax, E) or paged (num_blocks, Hkv, block_size, E) through the block
// table, in their own dtype, converted to the compute type (float64 for float64, float32
// otherwise) as each key is read. Nothing is copied, and only the blocks a sequence uses are
// read.
//
// Work: the rows of one (b, kv head) — its group's heads times Lq queries, consecutive in q —
// read each key once: a register-blocked kernel forms a key's dot products with every row of
// a tile while the key is in cache, rather than at::mm, which for a decoding step's few rows
// is a matrix-vector product (torch.matmul alone took 25 ms, this whole operator 20 ms, at 16k
// keys, B 1, H 32, Hkv 8, E 128, float32, 2-core x86-64, commit 7103f80; docs/performance.md,
// "CPU attention", has the trade-off for chunked prefill). Each row's threshold is then found
// by the row-wise solvers (row_solvers.h), and P.V reads only the keys some row of the tile
// gives a non-zero weight.
// Buffers are sized by shapes (the cache's capacity, or the window), never by seqlens_k's
// values.
//
// Score options in the order of docs/attention.md: scale, softcap, ALiBi, the causal limit and
// the window (the row's key range), the sink (one more entry of the row, whose value is zero).
//
// Tasks run under the caller's thread-local state (at::wrapPropagateTLSState), as in
// entmax_attention.cpp, so that the ATen calls a task makes (here only its buffers'
// allocation; the outputs are written through pointers) see the caller's inference or grad
// mode rather than the pool thread's.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "attention_common.h"
#include "row_solvers.h"

namespace entmax_fast_cpu {
namespace {

// Rows (query head x query) of one task: a decoding step's group of heads (Lq = 1) is one
// tile; a chunked prefill's rows are cut into tiles, so that the score buffer holds at most
// this many rows of keys.
constexpr int64_t kRowTile = 64;
// Keys whose dot products a tile forms together: 32 keys of E = 128 in float32 are 16 KiB,
// which stay in L1 while every row of the tile reads them.
constexpr int64_t kKeyChunk = 32;

// Keys the dot products' loop asks the memory for ahead of reading them, two per pair of keys
// read, crossing into the next paged block, whose keys the hardware prefetcher cannot foresee:
// with blocks of 16 the paged cache took 1.11-1.25x the contiguous one's time without these
// requests, 0.95-1.13x with them (2-core x86-64 AVX2, E 128, 4k-16k keys, commit 7103f80;
// docs/performance.md, "CPU attention").
constexpr int64_t kPrefetchKeys = 8;

// Asks for the E elements of `count` keys from `key` on (key_stride apart) to be brought
// into cache; a hint that never faults, so it may point past a run's end.
template <typename C>
ENTMAX_FAST_ALWAYS_INLINE void prefetch_keys(const C* key, int64_t key_stride, int64_t count, int64_t E) {
#if defined(__GNUC__)
  constexpr int64_t kCacheLine = 64;
  for (int64_t j = 0; j < count; ++j) {
    const char* row = reinterpret_cast<const char*>(key + j * key_stride);
    for (int64_t offset = 0; offset < E * static_cast<int64_t>(sizeof(C)); offset += kCacheLine)
      __builtin_prefetch(row + offset);
  }
#endif
}

struct KvcacheShape {
  int64_t B, H, Hkv, Lq, E, Ev, group, rows, n_row_tiles, capacity, block_size, max_blocks;
  bool paged;
};

// Keys [begin, end) that query i of a sequence with n keys sees: lower-right causal, and the
// window's left bound.
inline KeyRange row_keys(int64_t n, int64_t lq, int64_t i, int64_t window_left) {
  const int64_t pos = n - lq + i;
  return key_range(pos, n, pos + 1, window_left, -1);
}

// A cache read as (b, kv head, key position) -> E contiguous elements, contiguous or through
// the block table.
template <typename C>
struct CacheReader {
  const C* base;
  int64_t stride0, stride1, stride2;  // (batch or block, head, position)
  const int32_t* table;               // null for a contiguous cache
  int64_t table_stride, block_size;

  CacheReader(const at::Tensor& cache, const at::Tensor& block_table, const KvcacheShape& s)
      : base(cache.const_data_ptr<C>()),
        stride0(cache.stride(0)),
        stride1(cache.stride(1)),
        stride2(cache.stride(2)),
        table(s.paged ? block_table.const_data_ptr<int32_t>() : nullptr),
        table_stride(s.paged ? block_table.stride(0) : 0),
        block_size(s.block_size) {}

  // fn(first key, count, pointer to the first key's row, the next run's first key or null)
  // over the runs of keys [begin, end) of (b, hk) that lie at stride stride2 from each other:
  // the whole range in a contiguous cache, one run per block in a paged one.
  template <typename F>
  void for_each_run(int64_t b, int64_t hk, int64_t begin, int64_t end, F&& fn) const {
    if (table == nullptr) {
      if (end > begin) fn(begin, end - begin, base + b * stride0 + hk * stride1 + begin * stride2, nullptr);
      return;
    }
    const int32_t* blocks = table + b * table_stride;
    for (int64_t j = begin; j < end;) {
      const int64_t block = j / block_size, offset = j % block_size;
      const int64_t count = std::min(block_size - offset, end - j);
      const C* next = j + count < end ? base + blocks[block + 1] * stride0 + hk * stride1 : nullptr;
      fn(j, count, base + blocks[block] * stride0 + hk * stride1 + offset * stride2, next);
      j += count;
    }
  }
};

// z[r * ld + j] = q_r . key_j for rows r < rows (q row-major, E per row) and keys j < count
// (key j at keys + j * key_stride). Four rows by two keys at a time: eight independent sums,
// so that the adds' latency does not bound the loop, and each key is converted once per
// four rows. Each pair of keys asks for the pair kPrefetchKeys ahead, in this run or, past
// its end, in the next one (next_keys, null for none).
template <typename A, typename C>
ENTMAX_FAST_ALWAYS_INLINE void dot_rows_body(const A* q, int64_t rows, int64_t E, const C* keys, int64_t key_stride,
                                             int64_t count, const C* next_keys, A* z, int64_t ld) {
  for (int64_t j0 = 0; j0 < count; j0 += kKeyChunk) {
    const int64_t j1 = std::min(count, j0 + kKeyChunk);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      const A* q0 = q + r * E;
      const A* q1 = q0 + E;
      const A* q2 = q1 + E;
      const A* q3 = q2 + E;
      A* z0 = z + r * ld;
      int64_t j = j0;
      for (; j + 2 <= j1; j += 2) {
        // Once per key: the first block of rows reads it from memory, the others from cache.
        if (r == 0) {
          const int64_t ahead = j + kPrefetchKeys;
          if (ahead + 2 <= count) {
            prefetch_keys(keys + ahead * key_stride, key_stride, 2, E);
          } else if (next_keys != nullptr) {
            prefetch_keys(next_keys + (ahead - count) * key_stride, key_stride, 2, E);
          }
        }
        const C* ka = keys + j * key_stride;
        const C* kb = ka + key_stride;
        A s0a = 0, s1a = 0, s2a = 0, s3a = 0, s0b = 0, s1b = 0, s2b = 0, s3b = 0;
#pragma omp simd reduction(+ : s0a, s1a, s2a, s3a, s0b, s1b, s2b, s3b)
        for (int64_t e = 0; e < E; ++e) {
          const A a = static_cast<A>(ka[e]), b = static_cast<A>(kb[e]);
          s0a += q0[e] * a;
          s1a += q1[e] * a;
          s2a += q2[e] * a;
          s3a += q3[e] * a;
          s0b += q0[e] * b;
          s1b += q1[e] * b;
          s2b += q2[e] * b;
          s3b += q3[e] * b;
        }
        z0[j] = s0a;
        z0[ld + j] = s1a;
        z0[2 * ld + j] = s2a;
        z0[3 * ld + j] = s3a;
        z0[j + 1] = s0b;
        z0[ld + j + 1] = s1b;
        z0[2 * ld + j + 1] = s2b;
        z0[3 * ld + j + 1] = s3b;
      }
      for (; j < j1; ++j) {
        const C* ka = keys + j * key_stride;
        A s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t e = 0; e < E; ++e) {
          const A a = static_cast<A>(ka[e]);
          s0 += q0[e] * a;
          s1 += q1[e] * a;
          s2 += q2[e] * a;
          s3 += q3[e] * a;
        }
        z0[j] = s0;
        z0[ld + j] = s1;
        z0[2 * ld + j] = s2;
        z0[3 * ld + j] = s3;
      }
    }
    for (; r < rows; ++r) {
      const A* qr = q + r * E;
      for (int64_t j = j0; j < j1; ++j) {
        const C* ka = keys + j * key_stride;
        A s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t e = 0; e < E; ++e) s += qr[e] * static_cast<A>(ka[e]);
        z[r * ld + j] = s;
      }
    }
  }
}

// out[r] += sum_j p[r * ld + j] * value_j over keys j < count (value j at values + j *
// value_stride), skipping the zero weights: a key no row supports is never read.
template <typename A, typename C>
ENTMAX_FAST_ALWAYS_INLINE void accumulate_values_body(const A* p, int64_t rows, int64_t ld, const C* values,
                                                      int64_t value_stride, int64_t count, int64_t Ev, A* out) {
  for (int64_t j = 0; j < count; ++j) {
    const C* v = values + j * value_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const A w = p[r * ld + j];
      if (w == A(0)) continue;
      A* o = out + r * Ev;
#pragma omp simd
      for (int64_t e = 0; e < Ev; ++e) o[e] += w * static_cast<A>(v[e]);
    }
  }
}

#if ENTMAX_FAST_AVX2_KERNELS
template <typename A, typename C>
ENTMAX_FAST_TARGET_AVX2 void dot_rows_avx2(const A* q, int64_t rows, int64_t E, const C* keys, int64_t key_stride,
                                           int64_t count, const C* next_keys, A* z, int64_t ld) {
  dot_rows_body(q, rows, E, keys, key_stride, count, next_keys, z, ld);
}

template <typename A, typename C>
ENTMAX_FAST_TARGET_AVX2 void accumulate_values_avx2(const A* p, int64_t rows, int64_t ld, const C* values,
                                                    int64_t value_stride, int64_t count, int64_t Ev, A* out) {
  accumulate_values_body(p, rows, ld, values, value_stride, count, Ev, out);
}
#endif

template <typename A, typename C>
void dot_rows(const A* q, int64_t rows, int64_t E, const C* keys, int64_t key_stride, int64_t count,
              const C* next_keys, A* z, int64_t ld) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return dot_rows_avx2(q, rows, E, keys, key_stride, count, next_keys, z, ld);
#endif
  dot_rows_body(q, rows, E, keys, key_stride, count, next_keys, z, ld);
}

template <typename A, typename C>
void accumulate_values(const A* p, int64_t rows, int64_t ld, const C* values, int64_t value_stride, int64_t count,
                       int64_t Ev, A* out) {
#if ENTMAX_FAST_AVX2_KERNELS
  if (use_avx2_kernels()) return accumulate_values_avx2(p, rows, ld, values, value_stride, count, Ev, out);
#endif
  accumulate_values_body(p, rows, ld, values, value_stride, count, Ev, out);
}

// The score options in the compute type A, with the scale and alpha (H,).
template <typename A>
struct KvcacheOptions {
  ScoreOptions<A> score;
  A scale;
  const double* alpha;
};

// One task: the rows [r0, r0 + tr) of sequence b's kv head hk (row r is head hk * group +
// r / Lq, query r % Lq), and the keys [k0, k0 + kn) any of them sees. The score buffer holds
// a row per task row, with stride ld = kn (+ 1 for the sink's entry).
struct RowTile {
  int64_t b, hk, r0, tr, n, k0, kn, ld;
};

template <typename A>
RowTile row_tile(int64_t task, const KvcacheShape& s, const int64_t* seqlens, const KvcacheOptions<A>& o) {
  RowTile t{};
  t.b = task / (s.Hkv * s.n_row_tiles);
  t.hk = (task / s.n_row_tiles) % s.Hkv;
  t.r0 = (task % s.n_row_tiles) * kRowTile;
  t.tr = std::min(kRowTile, s.rows - t.r0);
  t.n = seqlens[t.b];
  int64_t begin = t.n, end = 0;
  for (int64_t r = t.r0; r < t.r0 + t.tr; ++r) {
    const KeyRange keys = row_keys(t.n, s.Lq, r % s.Lq, o.score.window_left);
    if (keys.end > keys.begin) {
      begin = std::min(begin, keys.begin);
      end = std::max(end, keys.end);
    }
  }
  t.k0 = end > begin ? begin : 0;
  t.kn = std::max<int64_t>(0, end - begin);
  t.ld = t.kn + o.score.sink_columns();
  return t;
}

// Every task row's dot products with the keys [key_begin, key_end) of its tile.
template <typename A, typename C>
void tile_dots(const RowTile& t, int64_t key_begin, int64_t key_end, const A* q, const CacheReader<C>& keys,
               const KvcacheShape& s, A* z) {
  const A* q_rows = q + ((t.b * s.H + t.hk * s.group) * s.Lq + t.r0) * s.E;
  keys.for_each_run(t.b, t.hk, key_begin, key_end, [&](int64_t first, int64_t count, const C* run, const C* next) {
    dot_rows(q_rows, t.tr, s.E, run, keys.stride2, count, next, z + (first - t.k0), t.ld);
  });
}

// Turns task row r's dot products into its weights over [k0, k0 + kn), in place: the scores
// on the row's own keys, its sink, its threshold; zeros elsewhere.
template <typename A>
void row_weights(const RowTile& t, int64_t r, const KvcacheShape& s, const KvcacheOptions<A>& o, A* z,
                 RowWorkspace& work) {
  A* zr = z + (r - t.r0) * t.ld;
  const int64_t i = r % s.Lq;
  const int64_t h = t.hk * s.group + r / s.Lq;
  const KeyRange keys = row_keys(t.n, s.Lq, i, o.score.window_left);
  const int64_t start = keys.begin - t.k0, len = keys.end - keys.begin;
  if (len <= 0) {
    // No key: a zero row, whatever the sink (it would take the whole weight, and its value is zero).
    std::fill(zr, zr + t.kn, A(0));
    return;
  }
  A* row = zr + start;
  transform_scores(row, len, o.scale, o.score, o.score.alibi_slope(t.b, h), (t.n - s.Lq + i) - keys.begin,
                   static_cast<A*>(nullptr));
  int64_t n = len;
  // The sink's entry right after the row's keys: ld leaves room for it past the last key.
  if (o.score.has_sink()) row[n++] = o.score.sinks[h];
  entmax_row_inplace(row, n, EntmaxParams<A>(o.alpha[h]), work);
  std::fill(zr, row, A(0));
  // Also clears the sink's weight where it lies inside [0, kn).
  std::fill(row + len, zr + t.kn, A(0));
}

// out rows of the task += weights . values over the keys [key_begin, key_end).
template <typename A, typename C>
void tile_values(const RowTile& t, int64_t key_begin, int64_t key_end, const A* z, const CacheReader<C>& values,
                 const KvcacheShape& s, A* out_rows) {
  values.for_each_run(t.b, t.hk, key_begin, key_end, [&](int64_t first, int64_t count, const C* run, const C*) {
    accumulate_values(z + (first - t.k0), t.tr, t.ld, run, values.stride2, count, s.Ev, out_rows);
  });
}

template <typename A, typename C>
void kvcache_forward_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_table, const int64_t* seqlens, const KvcacheOptions<A>& o,
                          const KvcacheShape& s, at::Tensor& out) {
  const CacheReader<C> keys(k_cache, block_table, s);
  const CacheReader<C> values(v_cache, block_table, s);
  const A* q_ptr = q.const_data_ptr<A>();
  A* out_ptr = out.data_ptr<A>();
  // A tile's keys: every key of the cache, or, with a window, the window plus the tile's span
  // of positions (at most Lq).
  const int64_t widest =
      o.score.window_left >= 0 ? std::min(s.capacity, o.score.window_left + s.Lq) : s.capacity;
  const int64_t row_capacity = widest + 1;
  const int64_t buffer_rows = std::min(kRowTile, s.rows);
  const int64_t n_tasks = s.B * s.Hkv * s.n_row_tiles;
  const int64_t threads = at::get_num_threads();
  auto out_rows_of = [&](const RowTile& t) { return out_ptr + ((t.b * s.H + t.hk * s.group) * s.Lq + t.r0) * s.Ev; };

  if (n_tasks >= threads) {
    // One task per (b, kv head, row tile), each on one thread: no synchronisation inside a
    // task, and with at least as many tasks as threads every thread has work. (Tasks are
    // handed out in equal counts, so very ragged seqlens_k leave some threads idle sooner.)
    at::parallel_for(0, n_tasks, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
      at::Tensor buffer = at::empty({buffer_rows * row_capacity}, q.options());
      A* z = buffer.data_ptr<A>();
      RowWorkspace work(row_capacity);
      for (int64_t task = begin; task < end; ++task) {
        const RowTile t = row_tile(task, s, seqlens, o);
        A* out_rows = out_rows_of(t);
        std::fill(out_rows, out_rows + t.tr * s.Ev, A(0));
        if (t.kn == 0) continue;
        tile_dots(t, t.k0, t.k0 + t.kn, q_ptr, keys, s, z);
        for (int64_t r = t.r0; r < t.r0 + t.tr; ++r) row_weights(t, r, s, o, z, work);
        tile_values(t, t.k0, t.k0 + t.kn, z, values, s, out_rows);
      }
    }));
    return;
  }

  // Fewer tasks than threads (a decoding step of one or two sequences with few kv heads on a
  // many-core machine): task parallelism would leave threads idle for the whole call, so each
  // task's keys are split across the threads instead, in three phases: the dot products (each
  // thread a slice of the keys), the rows' thresholds (each thread some rows), and P.V (each
  // thread a slice of the keys into its own partial output, summed after). The slices are
  // fixed by the thread count, not by scheduling, so the result does not vary from call to call.
  at::Tensor buffer = at::empty({buffer_rows * row_capacity}, q.options());
  A* z = buffer.data_ptr<A>();
  at::Tensor partial = at::empty({threads, buffer_rows, s.Ev}, q.options());
  A* partial_ptr = partial.data_ptr<A>();
  std::vector<RowWorkspace> workspaces;
  workspaces.reserve(static_cast<size_t>(threads));
  for (int64_t thread = 0; thread < threads; ++thread) workspaces.emplace_back(row_capacity);
  for (int64_t task = 0; task < n_tasks; ++task) {
    const RowTile t = row_tile(task, s, seqlens, o);
    A* out_rows = out_rows_of(t);
    std::fill(out_rows, out_rows + t.tr * s.Ev, A(0));
    if (t.kn == 0) continue;
    auto slice = [&](int64_t part) { return t.k0 + t.kn * part / threads; };
    at::parallel_for(0, threads, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) tile_dots(t, slice(part), slice(part + 1), q_ptr, keys, s, z);
    }));
    at::parallel_for(0, t.tr, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
      // The rows [begin, end) of one call run on one thread: one workspace for all of them.
      RowWorkspace& work = workspaces[static_cast<size_t>(at::get_thread_num() % threads)];
      for (int64_t r = t.r0 + begin; r < t.r0 + end; ++r) row_weights(t, r, s, o, z, work);
    }));
    at::parallel_for(0, threads, 1, at::wrapPropagateTLSState([&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) {
        A* part_rows = partial_ptr + part * buffer_rows * s.Ev;
        std::fill(part_rows, part_rows + t.tr * s.Ev, A(0));
        tile_values(t, slice(part), slice(part + 1), z, values, s, part_rows);
      }
    }));
    for (int64_t part = 0; part < threads; ++part) {
      const A* part_rows = partial_ptr + part * buffer_rows * s.Ev;
      for (int64_t e = 0; e < t.tr * s.Ev; ++e) out_rows[e] += part_rows[e];
    }
  }
}

KvcacheShape check_kvcache_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& seqlens_k, const std::optional<at::Tensor>& block_table,
                                const at::Tensor& alpha) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "entmax_attention_kvcache (cpu): query and the caches must be 4-D, got ", q.dim(), "-D, ",
              k_cache.dim(), "-D, ", v_cache.dim(), "-D");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  seqlens_k.device().is_cpu(),
              "entmax_attention_kvcache (cpu): query, caches and seqlens_k must be CPU tensors");
  TORCH_CHECK(at::isFloatingType(q.scalar_type()) && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "entmax_attention_kvcache (cpu): query and the caches must share one floating dtype, got ",
              q.scalar_type(), ", ", k_cache.scalar_type(), ", ", v_cache.scalar_type());
  KvcacheShape s{};
  s.B = q.size(0);
  s.H = q.size(1);
  s.Lq = q.size(2);
  s.E = q.size(3);
  s.Hkv = k_cache.size(1);
  s.Ev = v_cache.size(3);
  s.paged = block_table.has_value();
  TORCH_CHECK(k_cache.size(3) == s.E, "entmax_attention_kvcache (cpu): k_cache must have query's last dim ", s.E,
              ", got ", k_cache.size(3));
  TORCH_CHECK(v_cache.sizes().slice(0, 3) == k_cache.sizes().slice(0, 3),
              "entmax_attention_kvcache (cpu): v_cache must match k_cache in all but the last dim, got ",
              v_cache.sizes(), " and ", k_cache.sizes());
  TORCH_CHECK(s.Hkv > 0 && s.H % s.Hkv == 0, "entmax_attention_kvcache (cpu): query heads (", s.H,
              ") must be a multiple of the caches' heads (", s.Hkv, ")");
  TORCH_CHECK(seqlens_k.dim() == 1 && seqlens_k.size(0) == s.B && !at::isFloatingType(seqlens_k.scalar_type()),
              "entmax_attention_kvcache (cpu): seqlens_k must be an integer tensor of shape (", s.B, ",), got ",
              seqlens_k.sizes());
  TORCH_CHECK(alpha.dim() == 1 && alpha.size(0) == s.H, "entmax_attention_kvcache (cpu): alpha must have shape (",
              s.H, ",), got ", alpha.sizes());
  if (s.paged) {
    const at::Tensor& table = *block_table;
    TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.size(0) == s.B && table.device().is_cpu(),
                "entmax_attention_kvcache (cpu): block_table must be an int32 CPU tensor of shape (", s.B,
                ", max_blocks), got ", table.scalar_type(), " of shape ", table.sizes());
    s.block_size = k_cache.size(2);
    s.max_blocks = table.size(1);
    TORCH_CHECK(s.block_size > 0, "entmax_attention_kvcache (cpu): a paged cache's block_size must be positive");
    s.capacity = s.max_blocks * s.block_size;
  } else {
    TORCH_CHECK(k_cache.size(0) == s.B, "entmax_attention_kvcache (cpu): a contiguous cache must have query's batch ",
                "size ", s.B, " along dim 0, got ", k_cache.size(0));
    s.block_size = 0;
    s.max_blocks = 0;
    s.capacity = k_cache.size(2);
  }
  s.group = s.H / s.Hkv;
  s.rows = s.group * s.Lq;
  s.n_row_tiles = (s.rows + kRowTile - 1) / kRowTile;
  return s;
}

// seqlens_k within the capacity, and the block table's entries a sequence uses within the
// pool: the kernels read the caches through them without further checks.
void check_lengths(const KvcacheShape& s, const int64_t* seqlens, const at::Tensor& table, int64_t n_blocks) {
  for (int64_t b = 0; b < s.B; ++b) {
    TORCH_CHECK(seqlens[b] >= 0 && seqlens[b] <= s.capacity, "entmax_attention_kvcache (cpu): seqlens_k[", b,
                "] = ", seqlens[b], " is outside [0, the cache's capacity ", s.capacity, "]");
    if (!s.paged) continue;
    const int32_t* row = table.const_data_ptr<int32_t>() + b * table.stride(0);
    for (int64_t block = 0; block * s.block_size < seqlens[b]; ++block) {
      TORCH_CHECK(row[block] >= 0 && row[block] < n_blocks, "entmax_attention_kvcache (cpu): block_table[", b, ", ",
                  block, "] = ", row[block], " is outside [0, num_blocks = ", n_blocks, ")");
    }
  }
}

// Returns (B, H, Lq, Ev) in query's dtype.
at::Tensor entmax_attention_kvcache_fwd_cpu(const at::Tensor& query, const at::Tensor& k_cache_in,
                                            const at::Tensor& v_cache_in, const at::Tensor& seqlens_k,
                                            const std::optional<at::Tensor>& block_table, const at::Tensor& alpha_in,
                                            double scale, at::IntArrayRef window_size, double softcap,
                                            const std::optional<at::Tensor>& alibi_slopes,
                                            const std::optional<at::Tensor>& sinks) {
  const KvcacheShape s = check_kvcache_args(query, k_cache_in, v_cache_in, seqlens_k, block_table, alpha_in);
  const at::ScalarType ct = compute_type(query.scalar_type());
  const ScoreOptionTensors options = check_score_options("entmax_attention_kvcache", s.B, s.H, ct, window_size,
                                                         softcap, alibi_slopes, sinks);
  // detach: nothing here is recorded by autograd (the op is forward-only).
  const at::Tensor q = query.detach().to(ct).contiguous();
  // The kernels read a key's E elements at unit stride; any other layout is copied (the
  // public layer's caches are contiguous, and then nothing is).
  const at::Tensor k_cache = k_cache_in.stride(3) == 1 ? k_cache_in.detach() : k_cache_in.detach().contiguous();
  const at::Tensor v_cache = v_cache_in.stride(3) == 1 ? v_cache_in.detach() : v_cache_in.detach().contiguous();
  const at::Tensor seqlens = seqlens_k.to(at::kLong).contiguous();
  const at::Tensor table = s.paged ? block_table->contiguous() : at::Tensor();
  const at::Tensor alpha = alpha_in.detach().to(at::kDouble).contiguous();
  const int64_t* seqlens_ptr = seqlens.const_data_ptr<int64_t>();
  check_lengths(s, seqlens_ptr, table, k_cache.size(0));
  at::Tensor out = at::empty({s.B, s.H, s.Lq, s.Ev}, q.options());
  if (out.numel() == 0) return out.to(query.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(ct, "entmax_attention_kvcache_fwd", [&] {
    using A = scalar_t;
    const KvcacheOptions<A> o{ScoreOptions<A>(options), static_cast<A>(scale), alpha.const_data_ptr<double>()};
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "entmax_attention_kvcache_cache",
                                    [&] {
                                      kvcache_forward_impl<A, scalar_t>(q, k_cache, v_cache, table, seqlens_ptr, o, s,
                                                                        out);
                                    });
  });
  return out.to(query.scalar_type());
}

}  // namespace
}  // namespace entmax_fast_cpu

TORCH_LIBRARY_FRAGMENT(entmax_fast, m) {
  m.def(
      "entmax_attention_kvcache_fwd(Tensor query, Tensor k_cache, Tensor v_cache, Tensor seqlens_k, "
      "Tensor? block_table, Tensor alpha, float scale, int[2] window_size=[-1, -1], float softcap=0., "
      "Tensor? alibi_slopes=None, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(entmax_fast, CPU, m) {
  m.impl("entmax_attention_kvcache_fwd", &entmax_fast_cpu::entmax_attention_kvcache_fwd_cpu);
}
