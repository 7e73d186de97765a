// fusedmax and oscarmax, CUDA kernels (docs/maths.md, "fusedmax and oscarmax"). The row
// algorithms (Condat's TV scan, pool-adjacent-violators, Michelot's threshold, the
// large-score transform) are the ones of csrc/common/structured_algos.h, shared with the CPU
// operators; the host side of the CUDA operators is csrc/cuda/structured_ops.cpp. No torch
// header here: nvcc stays fast.
//
// One block per row, its size chosen by the row length (a single warp up to 512 entries for
// the TV forward, up to 256 otherwise; 1024 threads from 16k / 8k entries on):
//   forward: a coalesced load of the valid entries (packed by ballots only where they are not
//   a prefix of the row, pack_members); the scaling
//   pass, the OSCAR sort (bitonic network on (|v| key, index)), the projection's max and
//   Michelot passes (block reductions) and the stores run on every thread; so do Condat's
//   scan, in chunks whose scans are joined where they meet (block_tv_prox), and PAV, in
//   chunks whose blocks are joined in a tree (block_oscar_pav), which restores the order and
//   signs as it writes the levels.
//   backward: the support's mean of g (block reduction); the groups (TV: runs of equal y over
//   the valid entries; OSCAR: equal |y| != 0, after the same bitonic sort) are averaged by a
//   block-wide segmented scan.
// Where a row's arrays fit in 48 KiB of shared memory they live there (fp32: TV forward up to
// ~3.7k entries, OSCAR forward ~2.0k, backward ~2.4k / ~1.6k); longer rows keep them in a global
// scratch, one slice per block, with a grid of at most 2 blocks per SM looping over the rows.
//
// Differences from the CPU operators, both to avoid a host sync: lengths are clamped to
// [0, n] instead of checked. NaN/+inf rows give NaN, as on the CPU.
//
// ENTMAX_FAST_HOST_EMULATION: tests/test_structured.py compiles this file with g++, defines
// the CUDA built-ins it uses (threads of a block are contexts on one host thread, __syncthreads a barrier,
// warp intrinsics exchanges through memory) and runs the kernels on the host.
#ifndef ENTMAX_FAST_HOST_EMULATION
#include <cuda_runtime.h>
#endif

#include <cstddef>
#include <cstdint>

#include "../common/structured_algos.h"
#include "structured_cuda.h"

namespace entmax_fast {
namespace structured_cuda {

using structured::Prox;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr size_t kSharedLimit = 48 * 1024;  // dynamic shared memory without an opt-in
constexpr int kTvMinChunk = 16;  // shorter chunks spend most of their steps meeting the next
// Entries per thread of the OSCAR sort held in registers; plan_launch gives OSCAR blocks (and
// the backward's) as many entries per thread, so rows up to 1024 x 8 entries sort in registers.
constexpr int kSortItems = 8;

#ifdef ENTMAX_FAST_HOST_EMULATION
unsigned char* dynamic_shared_memory();  // the harness's per-block buffer
#else
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
  extern __shared__ __align__(16) unsigned char structured_shared[];
  return structured_shared;
}
#endif

__host__ __device__ inline int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

template <typename T>
__host__ __device__ inline T max_of(T a, T b) {
  return a > b ? a : b;
}

template <typename T>
__host__ __device__ inline T min_of(T a, T b) {
  return a < b ? a : b;
}

template <typename T>
__host__ __device__ inline T abs_of(T v) {
  return v < T(0) ? -v : v;
}

// Hands out 16-byte aligned arrays from one buffer; with a null base it only counts bytes,
// which is how the host sizes exactly what the kernel will carve. Kernels always carve a
// buffer: there the null test goes, since an array chosen between the buffer and null loses
// the buffer's address space and every access to a shared array becomes a generic one
// (LD.E / ST.E instead of LDS / STS on sm_90).
struct Carver {
  unsigned char* base;
  size_t offset;
  template <typename U>
  __host__ __device__ U* take(int64_t count) {
    offset = (offset + 15) & ~size_t(15);
#ifdef __CUDA_ARCH__
    U* at = reinterpret_cast<U*>(base + offset);
#else
    U* at = base ? reinterpret_cast<U*>(base + offset) : nullptr;
#endif
    offset += static_cast<size_t>(count) * sizeof(U);
    return at;
  }
  __host__ __device__ size_t size() const { return (offset + 15) & ~size_t(15); }
};

template <typename T>
struct Reductions {  // one slot per warp
  T* a;
  T* b;
  int* i;
  int* j;
};

template <typename T>
__host__ __device__ Reductions<T> carve_reductions(Carver& c) {
  Reductions<T> r;
  r.a = c.take<T>(32);
  r.b = c.take<T>(32);
  r.i = c.take<int>(32);
  r.j = c.take<int>(32);
  return r;
}

// An entry of the OSCAR sort: the key of |v| (structured::descending_abs_key) and the entry's
// index, ordered by (key, index). fp32 packs both into one 64-bit word, so that a
// compare-exchange of the bitonic network loads, compares and stores one word per side.
template <typename T>
struct SortEntry;

template <>
struct SortEntry<float> {
  uint64_t bits;
  __host__ __device__ static SortEntry make(uint32_t key, int index) {
    return SortEntry{(uint64_t(key) << 32) | uint32_t(index)};
  }
  __host__ __device__ bool after(const SortEntry& other) const { return bits > other.bits; }
  __host__ __device__ uint32_t key() const { return uint32_t(bits >> 32); }
  __host__ __device__ int index() const { return int(uint32_t(bits)); }
};

template <>
struct SortEntry<double> {
  uint64_t key_bits;
  int position;
  __host__ __device__ static SortEntry make(uint64_t key, int index) { return SortEntry{key, index}; }
  // Without short-circuits, which would branch in every compare-exchange.
  __host__ __device__ bool after(const SortEntry& other) const {
    return (key_bits > other.key_bits) | ((key_bits == other.key_bits) & (position > other.position));
  }
  __host__ __device__ uint64_t key() const { return key_bits; }
  __host__ __device__ int index() const { return position; }
};

template <typename T>
struct ForwardRow {
  T* values;  // the packed valid entries (OSCAR: then the prox and the projection input in place)
  int* position;
  T* prox;  // TV only: the prox, then the projection input in place
  uint8_t* restart;
  structured::TvScan<T, int>* carried;
  int* order;  // OSCAR only: the entries' indices by decreasing |v| (the sort's result)
  SortEntry<T>* exchange;  // OSCAR only: the sort's entries, padded to a power of two
  structured::PavBlocks<T, int> blocks;  // OSCAR only: over the same bytes as `exchange`
};

template <typename T>
__host__ __device__ ForwardRow<T> carve_forward_row(Carver& c, Prox kind, int n) {
  ForwardRow<T> row{};
  row.values = c.take<T>(n);
  row.position = c.take<int>(n);
  if (kind == Prox::kTV) {
    row.prox = c.take<T>(n);
    row.restart = c.take<uint8_t>(n);
    row.carried = c.take<structured::TvScan<T, int>>(1);
  }
  if (kind == Prox::kOSCAR) {
    row.order = c.take<int>(n);
    // The sort is done with its entries (their indices are in `order`) before PAV starts:
    // the two share their bytes, which at 1024 fp32 entries gives an SM an eighth block.
    Carver exchange{c.base, c.offset};
    row.exchange = exchange.take<SortEntry<T>>(next_pow2(n));
    Carver pav{c.base, c.offset};
    row.blocks.sum = pav.take<T>(n);
    row.blocks.len = pav.take<int>(n);
    row.blocks.first = pav.take<int>(n);
    c.offset = exchange.offset > pav.offset ? exchange.offset : pav.offset;
  }
  return row;
}

template <typename T>
struct BackwardRow {
  T* y;  // the packed group members: y, J_sparsemax g, position
  T* u;
  int* position;
  int* group;  // group index of each member (in sorted order for OSCAR)
  T* group_mean;
  SortEntry<T>* sorted;  // OSCAR only
};

template <typename T>
__host__ __device__ BackwardRow<T> carve_backward_row(Carver& c, Prox kind, bool grouped, int n) {
  BackwardRow<T> row{};
  // Kernels never touch an ungrouped row's arrays: carving them all the same keeps each array
  // derived from the buffer alone (see Carver).
#ifndef __CUDA_ARCH__
  if (!grouped) return row;
#endif
  row.y = c.take<T>(n);
  row.u = c.take<T>(n);
  row.position = c.take<int>(n);
  row.group = c.take<int>(n);
  row.group_mean = c.take<T>(n);
  if (kind == Prox::kOSCAR) {
    row.sorted = c.take<SortEntry<T>>(next_pow2(n));
  }
  return row;
}

struct LaunchPlan {
  int threads;
  bool rows_in_shared;
  size_t row_bytes;
  size_t shared_bytes;
  int64_t blocks;
  size_t scratch_bytes;  // global scratch when the rows do not fit in shared memory
};

// Threads per block: about 16 (TV forward) or kSortItems entries per thread, a warp at least.
template <typename T>
LaunchPlan plan_launch(bool backward, Prox kind, bool grouped, int64_t rows, int64_t n, int sm_count,
                       size_t shared_limit) {
  LaunchPlan plan;
  const int64_t per_thread = (!backward && kind == Prox::kTV) ? 16 : kSortItems;
  const int64_t wanted = next_pow2((n + per_thread - 1) / per_thread);
  plan.threads = static_cast<int>(wanted < 32 ? 32 : (wanted > 1024 ? 1024 : wanted));
  Carver reductions{nullptr, 0};
  carve_reductions<T>(reductions);
  Carver row{nullptr, 0};
  if (backward) {
    carve_backward_row<T>(row, kind, grouped, static_cast<int>(n));
  } else {
    carve_forward_row<T>(row, kind, static_cast<int>(n));
  }
  plan.row_bytes = row.size();
  plan.rows_in_shared = reductions.size() + plan.row_bytes <= shared_limit;
  plan.shared_bytes = reductions.size() + (plan.rows_in_shared ? plan.row_bytes : 0);
  const int64_t max_blocks = plan.rows_in_shared ? int64_t(0x7fffffff) : int64_t(2) * (sm_count > 0 ? sm_count : 1);
  plan.blocks = rows < max_blocks ? rows : max_blocks;
  plan.scratch_bytes = plan.rows_in_shared ? 0 : static_cast<size_t>(plan.blocks) * plan.row_bytes;
  return plan;
}

// ---------------------------------------------------------------------------------------
// Block-wide primitives. Every thread of the block must call them (they synchronise).

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & 31; }
__device__ __forceinline__ int warp_id() { return static_cast<int>(threadIdx.x) >> 5; }
__device__ __forceinline__ int warp_count() { return static_cast<int>(blockDim.x) >> 5; }

struct MaxOp {
  template <typename U>
  __device__ U operator()(U a, U b) const {
    return a > b ? a : b;
  }
};
struct MinOp {
  template <typename U>
  __device__ U operator()(U a, U b) const {
    return a < b ? a : b;
  }
};
struct SumOp {
  template <typename U>
  __device__ U operator()(U a, U b) const {
    return a + b;
  }
};

// The halves of a block reduction: a warp's value to its slot, and the slots combined.
template <typename U, typename Op>
__device__ void reduce_warp_to_slot(U& value, Op op, U* slots) {
  for (int offset = 16; offset > 0; offset >>= 1) value = op(value, __shfl_xor_sync(kFullMask, value, offset));
  if (lane_id() == 0) slots[warp_id()] = value;
}

template <typename U, typename Op>
__device__ U combine_slots(Op op, const U* slots) {
  U value = slots[0];
  for (int w = 1; w < warp_count(); ++w) value = op(value, slots[w]);
  return value;
}

// Both values reduced over the block and returned to every thread, in a fixed order
// (deterministic results).
template <typename A, typename B, typename OpA, typename OpB>
__device__ void block_allreduce(A& a, B& b, OpA op_a, OpB op_b, A* slots_a, B* slots_b) {
  reduce_warp_to_slot(a, op_a, slots_a);
  reduce_warp_to_slot(b, op_b, slots_b);
  __syncthreads();
  a = combine_slots(op_a, slots_a);
  b = combine_slots(op_b, slots_b);
  __syncthreads();
}

// Three values at the price of one reduction's barriers.
template <typename A, typename B, typename C, typename OpA, typename OpB, typename OpC>
__device__ void block_allreduce(A& a, B& b, C& c, OpA op_a, OpB op_b, OpC op_c, A* slots_a, B* slots_b, C* slots_c) {
  reduce_warp_to_slot(a, op_a, slots_a);
  reduce_warp_to_slot(b, op_b, slots_b);
  reduce_warp_to_slot(c, op_c, slots_c);
  __syncthreads();
  a = combine_slots(op_a, slots_a);
  b = combine_slots(op_b, slots_b);
  c = combine_slots(op_c, slots_c);
  __syncthreads();
}

// Rank of this thread among the threads whose flag is set, and their number (a stream
// compaction step over one tile of blockDim.x positions).
__device__ int block_rank(bool flag, int* slots, int& total) {
  const unsigned ballot = __ballot_sync(kFullMask, flag);
  const int lane = lane_id();
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  if (lane == 0) slots[warp_id()] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < warp_count(); ++w) {
    const int count = slots[w];
    if (w < warp_id()) before += count;
    total += count;
  }
  __syncthreads();
  return before + in_warp;
}

// Packs the members among positions [0, n) in order: place(j, slot) for the member at j and
// its slot, returns their count. The caller's first pass placed every member where it is
// (slot j) and found the first position that is not one and the last that is (block-wide):
// where the members are a prefix of the row (no masks, trailing masks, lengths: attention
// rows, causal or not), that placement stands and this costs nothing; otherwise the members
// are packed tile by tile, each tile with two barriers.
template <typename IsMember, typename Place>
__device__ int pack_members(int n, int first_outside, int last_member, IsMember is_member, Place place, int* slots) {
  if (last_member < first_outside) return last_member + 1;
  const int threads = static_cast<int>(blockDim.x);
  int count = 0;
  for (int base = 0; base < n; base += threads) {
    const int j = base + static_cast<int>(threadIdx.x);
    const bool member = j < n && is_member(j);
    int tile_count;
    const int rank = block_rank(member, slots, tile_count);
    if (member) place(j, count + rank);
    count += tile_count;
  }
  __syncthreads();
  return count;
}

// Sorts entries by (key, index) ascending: a bitonic network over size (a power of two)
// entries. The index breaks ties, so padding (index >= the real count, key of |v| = 0)
// sorts after every real entry and the order is deterministic. A warp handles the pairs
// i of 32 consecutive indices, whose entries, at a distance j <= 32, lie in the 64 entries
// from 2 (i & ~31) on: such a stage touches no other warp's entries, and between two of
// them a warp barrier does instead of a block barrier (40 of the 55 at 1024 entries).
// The fallback of block_sort_by_magnitude for rows longer than the block's registers hold.
template <typename Entry>
__device__ void bitonic_sort(Entry* entries, int size) {
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = static_cast<int>(threadIdx.x); i < size / 2; i += static_cast<int>(blockDim.x)) {
        const int lo = ((i & ~(j - 1)) << 1) | (i & (j - 1));
        const int hi = lo + j;
        const Entry entry_lo = entries[lo], entry_hi = entries[hi];
        if (entry_lo.after(entry_hi) == ((lo & k) == 0)) {
          entries[lo] = entry_hi;
          entries[hi] = entry_lo;
        }
      }
      const int next_j = j > 1 ? j >> 1 : k;  // the next stage's distance
      if (j <= 32 && next_j <= 32) {
        __syncwarp();
      } else {
        __syncthreads();
      }
    }
  }
  __syncthreads();
}

// The entry of lane ^ lane_mask; a 64-bit shuffle is two 32-bit ones, the fp64 entry's
// index a third.
__device__ __forceinline__ SortEntry<float> shuffle_xor(const SortEntry<float>& entry, int lane_mask) {
  return SortEntry<float>{__shfl_xor_sync(kFullMask, entry.bits, lane_mask)};
}

__device__ __forceinline__ SortEntry<double> shuffle_xor(const SortEntry<double>& entry, int lane_mask) {
  return SortEntry<double>{__shfl_xor_sync(kFullMask, entry.key_bits, lane_mask),
                           __shfl_xor_sync(kFullMask, entry.position, lane_mask)};
}

// a or b, built from the fields: a whole copy of the fp64 entry would carry its 4 padding
// bytes, which the compiler then keeps, byte by byte, in registers or on the stack.
template <typename Entry>
__device__ __forceinline__ Entry either(bool take_a, const Entry& a, const Entry& b) {
  return Entry::make(take_a ? a.key() : b.key(), take_a ? a.index() : b.index());
}

// Of two entries at the positions a compare-exchange pairs, the one that ends at mine.
template <typename Entry>
__device__ __forceinline__ Entry kept_entry(const Entry& mine, const Entry& theirs, bool keep_smaller) {
  return either(mine.after(theirs) == keep_smaller, theirs, mine);
}

// The stages at distance j < kSortItems, within the thread's entries. Positions of slot 0 are
// multiples of kSortItems, so the direction of slot r's block of k is that of first | r.
template <typename Entry>
__device__ __forceinline__ void sort_stage_in_thread(Entry (&items)[kSortItems], int first, int k, int j) {
#pragma unroll
  for (int r = 0; r < kSortItems; ++r) {
    if ((r & j) != 0) continue;
    const bool ascending = ((first | r) & k) == 0;
    const bool swap = items[r].after(items[r + j]) == ascending;
    const Entry low = either(swap, items[r + j], items[r]), high = either(swap, items[r], items[r + j]);
    items[r] = low;
    items[r + j] = high;
  }
}

// Which slot a thread reads or writes at step q of a pass over its kSortItems consecutive
// elements of `bytes` each: slot q ^ skew. A shared-memory wavefront serves 128 bytes, i.e.
// 128 / bytes lanes, among which the same slot q would fall on the same bank every
// 16 / bytes lanes, eight ways in conflict; skewed, they fall on distinct banks (the fp64
// entry, accessed as 8 + 4 bytes, two ways).
__device__ __forceinline__ int bank_skew(int bytes) {
  return (static_cast<int>(threadIdx.x) * bytes / 16) & (kSortItems - 1);
}

// items[q] <- items[q ^ skew], one conditional swap layer per bit of skew (constant slot
// indices keep the entries in registers).
template <typename Entry>
__device__ __forceinline__ void xor_permute(Entry (&items)[kSortItems], int skew) {
#pragma unroll
  for (int bit = 1; bit < kSortItems; bit <<= 1) {
    const bool swap = (skew & bit) != 0;
#pragma unroll
    for (int q = 0; q < kSortItems; ++q) {
      if ((q & bit) != 0) continue;
      const Entry low = either(swap, items[q | bit], items[q]), high = either(swap, items[q], items[q | bit]);
      items[q] = low;
      items[q | bit] = high;
    }
  }
}

// Where the sort leaves each rank's entry: whole (the backward reads the keys, to find the
// groups of equal |y|) or its index alone (the forward's PAV reads no key).
template <typename T>
struct SortedEntries {
  using Stored = SortEntry<T>;
  SortEntry<T>* at;
  __device__ void put(int rank, const SortEntry<T>& entry) const { at[rank] = entry; }
};

template <typename T>
struct SortedIndices {
  using Stored = int;
  int* at;
  __device__ void put(int rank, const SortEntry<T>& entry) const { at[rank] = entry.index(); }
};

// The same bitonic network with each thread's kSortItems consecutive positions held in
// registers (items[r] at position first + r), so that a stage at distance j costs:
//   j < kSortItems: compare-exchanges within the thread, no exchange;
//   j < 32 kSortItems: a shuffle with the lane holding the partner positions, each lane
//     keeping the smaller or the larger of each pair;
//   larger j (beyond a warp's 256 positions: rows over 256 entries): a trip through
//     `exchange` and two block barriers, 3 of the 55 stages at 1024 entries.
// The network spans `size` positions; threads past them (size < threads x kSortItems) hold
// padding, which their warp-local stages shuffle among themselves and which is never written.
// Entries pass through `exchange` striped (slot r of thread t at r x active + t): a warp's
// accesses are to consecutive entries, free of bank conflicts. The first `count` ranks go to
// `out` (SortedEntries or SortedIndices).
template <typename T, typename Out>
__device__ void register_sort_by_magnitude(const T* values, int count, int size, SortEntry<T>* exchange, Out out) {
  using Entry = SortEntry<T>;
  using Key = typename structured::AbsKey<T>::type;
  const int tid = static_cast<int>(threadIdx.x);
  const int first = tid * kSortItems;
  Entry items[kSortItems];
  // The first stages sort the thread's entries whatever their slots, so the loads are skewed.
  const int load_skew = bank_skew(sizeof(T));
#pragma unroll
  for (int q = 0; q < kSortItems; ++q) {
    const int i = first + (q ^ load_skew);
    items[q] = Entry::make(i < count ? structured::descending_abs_key(values[i]) : ~Key(0), i);
  }
  // Where size < kSortItems this also sorts padding past size, which leaves [0, size) as it is.
#pragma unroll
  for (int k = 2; k <= kSortItems; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) sort_stage_in_thread(items, first, k, j);
  }
  const int active = size / kSortItems;
  for (int k = 2 * kSortItems; k <= size; k <<= 1) {
    const bool ascending = (first & k) == 0;
    for (int j = k >> 1; j >= 32 * kSortItems; j >>= 1) {
      const int partner_mask = j / kSortItems;
      const bool keep_smaller = ascending == ((tid & partner_mask) == 0);
      if (tid < active) {
#pragma unroll
        for (int r = 0; r < kSortItems; ++r) exchange[r * active + tid] = items[r];
      }
      __syncthreads();
      if (tid < active) {
#pragma unroll
        for (int r = 0; r < kSortItems; ++r)
          items[r] = kept_entry(items[r], exchange[r * active + (tid ^ partner_mask)], keep_smaller);
      }
      __syncthreads();
    }
    for (int j = min(k >> 1, 16 * kSortItems); j >= kSortItems; j >>= 1) {
      const int lane_mask = j / kSortItems;
      const bool keep_smaller = ascending == ((tid & lane_mask) == 0);
#pragma unroll
      for (int r = 0; r < kSortItems; ++r) items[r] = kept_entry(items[r], shuffle_xor(items[r], lane_mask), keep_smaller);
    }
#pragma unroll
    for (int j = kSortItems / 2; j > 0; j >>= 1) sort_stage_in_thread(items, first, k, j);
  }
  const int store_skew = bank_skew(sizeof(typename Out::Stored));
  xor_permute(items, store_skew);
#pragma unroll
  for (int q = 0; q < kSortItems; ++q) {
    const int i = first + (q ^ store_skew);
    if (i < count) out.put(i, items[q]);
  }
  __syncthreads();
}

// out gets, at ranks [0, count), the entries (or indices) of values[0, count) by decreasing
// |v| (ties by index); the sort runs over the next power of two, padded with keys that sort
// last. In registers where the block holds the padded row, kSortItems entries a thread
// (every row of up to 1024 x kSortItems entries, by plan_launch's block sizes, in shared
// memory or in the global scratch), with `exchange` for the stages between warps; in
// `exchange` otherwise, then copied to out (onto itself for SortedEntries on exchange).
template <typename T, typename Out>
__device__ void block_sort_by_magnitude(const T* values, int count, SortEntry<T>* exchange, Out out) {
  using Key = typename structured::AbsKey<T>::type;
  const int padded = next_pow2(count);
  if (padded <= static_cast<int>(blockDim.x) * kSortItems) {
    register_sort_by_magnitude(values, count, padded, exchange, out);
    return;
  }
  for (int i = static_cast<int>(threadIdx.x); i < padded; i += static_cast<int>(blockDim.x))
    exchange[i] = SortEntry<T>::make(i < count ? structured::descending_abs_key(values[i]) : ~Key(0), i);
  __syncthreads();
  bitonic_sort(exchange, padded);
  for (int i = static_cast<int>(threadIdx.x); i < count; i += static_cast<int>(blockDim.x)) out.put(i, exchange[i]);
  __syncthreads();
}

// Segments of a sequence: starts counted, sum and length since the last start. Combining
// is associative, so a block scan gives each entry its segment and running sum.
template <typename T>
struct Segment {
  int starts;
  T sum;
  int len;
};

template <typename T>
__device__ Segment<T> combine(const Segment<T>& a, const Segment<T>& b) {
  return Segment<T>{a.starts + b.starts, b.starts ? b.sum : a.sum + b.sum, b.starts ? b.len : a.len + b.len};
}

template <typename T>
__device__ Segment<T> shuffle_up(const Segment<T>& s, int delta) {
  return Segment<T>{__shfl_up_sync(kFullMask, s.starts, delta), __shfl_up_sync(kFullMask, s.sum, delta),
                    __shfl_up_sync(kFullMask, s.len, delta)};
}

// Length of the contiguous chunks that `threads` threads scan of m entries: odd, so that the
// threads' i-th entries, at that stride, fall in distinct shared-memory banks (4-byte
// entries; 8-byte ones in distinct bank pairs). An even chunk of 8 put 8 threads on each bank
// and made every access of a chunked loop 8 shared-memory passes (16 for 8-byte entries).
// The threads past (m + chunk - 1) / chunk get none.
__host__ __device__ inline int odd_chunk(int m, int threads) { return ((m + threads - 1) / threads) | 1; }

// For entries 0..count-1 split into segments (is_start(0) must hold): group[i] = the index
// of i's segment, group_mean[s] = the mean of value over segment s. Each thread scans a
// contiguous chunk (`odd_chunk`); the chunks' carries come from a block scan.
template <typename T, typename IsStart, typename Value>
__device__ void segment_means(int count, IsStart is_start, Value value, int* group, T* group_mean,
                              const Reductions<T>& slots) {
  const int chunk = odd_chunk(count, static_cast<int>(blockDim.x));
  const int begin = min(count, static_cast<int>(threadIdx.x) * chunk);
  const int end = min(count, begin + chunk);
  Segment<T> local{0, T(0), 0};
  for (int i = begin; i < end; ++i) local = combine(local, Segment<T>{is_start(i) ? 1 : 0, value(i), 1});
  Segment<T> inclusive = local;
  for (int delta = 1; delta < 32; delta <<= 1) {
    const Segment<T> earlier = shuffle_up(inclusive, delta);
    if (lane_id() >= delta) inclusive = combine(earlier, inclusive);
  }
  Segment<T> running = shuffle_up(inclusive, 1);
  if (lane_id() == 0) running = Segment<T>{0, T(0), 0};
  if (lane_id() == 31) {
    slots.i[warp_id()] = inclusive.starts;
    slots.a[warp_id()] = inclusive.sum;
    slots.j[warp_id()] = inclusive.len;
  }
  __syncthreads();
  Segment<T> carry{0, T(0), 0};
  for (int w = 0; w < warp_id(); ++w) carry = combine(carry, Segment<T>{slots.i[w], slots.a[w], slots.j[w]});
  __syncthreads();
  running = combine(carry, running);
  for (int i = begin; i < end; ++i) {
    running = combine(running, Segment<T>{is_start(i) ? 1 : 0, value(i), 1});
    group[i] = running.starts - 1;
    if (i == count - 1 || is_start(i + 1)) group_mean[running.starts - 1] = running.sum / T(running.len);
  }
  __syncthreads();
}

// prox_TV of in[0, m) into out, by every thread of the block: Condat's scan, which is
// sequential, split into chunks that the threads scan at once (docs/maths.md, "prox_TV on
// a GPU"). A round gives thread c the chunk [begin, end) and scans it from a fresh
// start at begin (thread 0 from the scan carried over from the last round, the row's own
// scan), recording where it restarted after a jump and with which sign (restart[]). Then
// thread c scans on into chunk c+1 until it restarts where thread c+1 restarted, with the
// same sign: from there the two scans perform the same operations, so by induction from
// thread 0 every scan is the row's own once it has met its predecessor's, and the later
// writes (thread c below the meeting point, over thread c+1's) leave the row's result. A
// thread that crosses chunk c+1 without meeting makes the first such thread's scan, as it
// stood at its chunk's end, the next round's carried scan, with chunks twice as long.
// Rows with short segments finish in one round of about chunk + a few steps per thread
// (lam 0.1 on randn rows, the benchmark's case); a row fused into a few segments takes
// about 1.4 times the steps of the sequential scan, in rounds (tools/model_structured.py).
// The result is the sequential scan's, bit for bit.
template <typename T>
__device__ void block_tv_prox(const T* in, T* out, uint8_t* restart, structured::TvScan<T, int>* carried, int m,
                              T lambda, const Reductions<T>& slots) {
  using structured::TvRestart;
  using structured::TvStop;
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  if (m <= 1 || lambda == T(0)) {
    for (int i = tid; i < m; i += threads) out[i] = in[i];
    __syncthreads();
    return;
  }
  structured::TvScan<T, int> scan;
  int round_begin = 0;
  int chunk = max(kTvMinChunk, (m + threads - 1) / threads);
  bool carry = false;
  for (;;) {
    const int left = m - round_begin;
    // The rest spread over at most every thread, in odd chunks (threads at the same offset
    // in theirs then read distinct shared-memory banks); counted again, so that every thread
    // below `lanes` has a non-empty chunk.
    const int spread = min(threads, (left + chunk - 1) / chunk);
    chunk = ((left + spread - 1) / spread) | 1;
    const int lanes = (left + chunk - 1) / chunk;
    const bool active = tid < lanes;
    const int begin = active ? round_begin + tid * chunk : m;
    const int end = min(m, begin + chunk);
    structured::TvScan<T, int> at_chunk_end;
    if (active) {
      for (int i = begin; i < end; ++i) restart[i] = uint8_t(TvRestart::kNone);
      if (tid == 0 && carry) {
        scan = *carried;
      } else {
        scan.start(in, begin, lambda);
      }
      scan.run(in, out, end, m, lambda, [&](int k0, TvRestart sign) {
        restart[k0] = uint8_t(sign);
        return false;
      });
      at_chunk_end = scan;
    }
    __syncthreads();
    int failed = threads, unused = 0;
    if (active && tid + 1 < lanes) {
      const TvStop stop = scan.run(in, out, min(m, end + chunk), m, lambda,
                                   [&](int k0, TvRestart sign) { return k0 >= end && restart[k0] == uint8_t(sign); });
      if (stop == TvStop::kPaused) failed = tid;
    }
    block_allreduce(failed, unused, MinOp{}, MaxOp{}, slots.i, slots.j);
    if (failed == threads) return;
    if (tid == failed) *carried = at_chunk_end;
    __syncthreads();
    round_begin += (failed + 1) * chunk;
    chunk *= 2;
    carry = true;
  }
}

// The largest value among the earlier threads' (identity for thread 0).
__device__ int block_exclusive_max(int value, int identity, int* slots) {
  const int lane = lane_id();
  int inclusive = value;
  for (int delta = 1; delta < 32; delta <<= 1) {
    const int earlier = __shfl_up_sync(kFullMask, inclusive, delta);
    if (lane >= delta) inclusive = max(inclusive, earlier);
  }
  int exclusive = __shfl_up_sync(kFullMask, inclusive, 1);
  if (lane == 0) exclusive = identity;
  if (lane == 31) slots[warp_id()] = inclusive;
  __syncthreads();
  for (int w = 0; w < warp_id(); ++w) exclusive = max(exclusive, slots[w]);
  __syncthreads();
  return exclusive;
}

// OSCAR prox magnitudes (structured::oscar_pav_inplace's result) by every thread of the
// block, from magnitude_at(rank), the rank-th largest |v|, to emit(rank, level): each thread
// pools the ranks of its chunk (`odd_chunk`), then neighbouring ranges are joined in a tree
// (log2 of the threads levels, each join pooling the blocks near its boundary), then every
// rank takes its block's level, its block found by a scan over the block starts. Through
// the two functions the caller reads and writes its rows where they are (the forward: the
// entries through the sort), without an array of magnitudes in rank order. Pooling in another
// order than the one-thread PAV's rounds the block sums differently.
template <typename T, typename MagnitudeAt, typename Emit>
__device__ void block_oscar_pav(int m, T beta, const structured::PavBlocks<T, int>& blocks,
                                MagnitudeAt magnitude_at, Emit emit, int* slots) {
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int chunk = odd_chunk(m, threads);
  const int lanes = (m + chunk - 1) / chunk;
  const int begin = tid < lanes ? tid * chunk : m;
  const int end = min(m, begin + chunk);
  for (int r = begin; r < end; ++r) blocks.append(r, structured::oscar_pav_value(magnitude_at(r), r, m, beta), begin);
  __syncthreads();
  for (int width = 1; width < lanes; width <<= 1) {
    if (tid % (2 * width) == 0 && tid + width < lanes)
      blocks.join(begin, (tid + width) * chunk, min(m, (tid + 2 * width) * chunk));
    __syncthreads();
  }
  int last_start = -1;
  for (int r = begin; r < end; ++r)
    if (blocks.starts(r)) last_start = r;
  int start = block_exclusive_max(last_start, -1, slots);
  T level = start >= 0 ? blocks.level(start) : T(0);
  for (int r = begin; r < end; ++r) {
    if (blocks.starts(r)) {
      start = r;
      level = blocks.level(r);
    }
    emit(r, level);
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------
// Kernels.

template <typename T>
struct ForwardParams {
  const T* x;
  const int64_t* lengths;
  T* p;  // null when only the prox is wanted
  T* y;
  int64_t rows;
  int n;
  double reg;
  Prox kind;
  bool rows_in_shared;
  unsigned char* scratch;
  size_t row_bytes;
};

// The row arrays of one block: after the reduction slots in shared memory, or its slice of
// the global scratch. A compile-time choice, so that in the shared instantiation every row
// array derives from the shared buffer alone and the compiler emits shared-memory loads and
// stores (LDS/STS) instead of generic ones that resolve the address space at run time.
template <bool kRowsInShared>
__device__ __forceinline__ unsigned char* row_arrays(const Carver& shared, unsigned char* scratch,
                                                     size_t row_bytes) {
  if (kRowsInShared) return shared.base + shared.size();
  return scratch + static_cast<size_t>(blockIdx.x) * row_bytes;
}

template <typename T, bool kRowsInShared>
__device__ __forceinline__ void forward_rows(const ForwardParams<T>& params) {
  const T inf = structured::positive_infinity<T>();
  const int n = params.n;
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  Carver shared{dynamic_shared_memory(), 0};
  const Reductions<T> slots = carve_reductions<T>(shared);
  Carver row_memory{row_arrays<kRowsInShared>(shared, params.scratch, params.row_bytes), 0};
  const ForwardRow<T> row = carve_forward_row<T>(row_memory, params.kind, n);

  for (int64_t r = blockIdx.x; r < params.rows; r += gridDim.x) {
    const T* x = params.x + r * n;
    T* y = params.y + r * n;
    T* p = params.p ? params.p + r * n : nullptr;
    int64_t length = params.lengths ? params.lengths[r] : n;
    length = length < 0 ? 0 : (length > n ? n : length);

    // Coalesced load, the valid entries placed where they are (see pack_members).
    T max_value = -inf, max_abs = T(0);  // max_abs = inf flags NaN / +inf
    int first_invalid = n, last_valid = -1;
    for (int j = tid; j < n; j += threads) {
      const T v = x[j];
      if (j < length && !structured::is_masked(v)) {
        row.values[j] = v;
        row.position[j] = j;
        last_valid = j;
        max_value = max_of(max_value, v);
        max_abs = structured::poisons_row(v) ? inf : max_of(max_abs, abs_of(v));
      } else {
        first_invalid = min(first_invalid, j);
        y[j] = -inf;
        if (p) p[j] = T(0);
      }
    }
    // the four reductions behind one pair of barriers
    reduce_warp_to_slot(max_value, MaxOp{}, slots.a);
    reduce_warp_to_slot(max_abs, MaxOp{}, slots.b);
    reduce_warp_to_slot(first_invalid, MinOp{}, slots.i);
    reduce_warp_to_slot(last_valid, MaxOp{}, slots.j);
    __syncthreads();
    max_value = combine_slots(MaxOp{}, slots.a);
    max_abs = combine_slots(MaxOp{}, slots.b);
    first_invalid = combine_slots(MinOp{}, slots.i);
    last_valid = combine_slots(MaxOp{}, slots.j);
    __syncthreads();
    if (max_abs == inf) {
      const T nan = static_cast<T>(NAN);
      for (int j = tid; j < n; j += threads) {
        y[j] = nan;
        if (p) p[j] = nan;
      }
      continue;
    }

    const int m = pack_members(
        n, first_invalid, last_valid, [&](int j) { return j < length && !structured::is_masked(x[j]); },
        [&](int j, int slot) {
          row.values[slot] = x[j];
          row.position[slot] = j;
        },
        slots.i);

    const auto transform = structured::make_row_transform(params.kind, max_value, max_abs);
    const T work_reg = static_cast<T>(structured::work_regularisation(params.kind, params.reg, transform.exponent, m));
    for (int i = tid; i < m; i += threads) row.values[i] = transform.to_work(row.values[i]);
    __syncthreads();
    T* const result = params.kind == Prox::kTV ? row.prox : row.values;
    if (params.kind == Prox::kTV) {
      block_tv_prox(row.values, row.prox, row.restart, row.carried, m, work_reg, slots);
    } else if (work_reg > T(0) && m > 1) {
      block_sort_by_magnitude(row.values, m, row.exchange, SortedIndices<T>{row.order});
      // no entry is written before the last of them is read: PAV's barriers lie between
      block_oscar_pav(
          m, work_reg, row.blocks, [&](int rank) { return abs_of(row.values[row.order[rank]]); },
          [&](int rank, T level) {
            const int i = row.order[rank];
            row.values[i] = structured::with_sign_of(row.values[i], level);
          },
          slots.i);
    }

    T work_max = -inf, unused = T(0);
    for (int i = tid; i < m; i += threads) work_max = max_of(work_max, result[i]);
    block_allreduce(work_max, unused, MaxOp{}, MaxOp{}, slots.a, slots.b);
    for (int i = tid; i < m; i += threads) {
      const T w = result[i];
      y[row.position[i]] = transform.to_prox_output(w);
      result[i] = transform.to_projection_input(w, work_max);
    }
    if (!p) continue;
    __syncthreads();
    const T tau = structured::sparsemax_threshold<T, int>([&](T threshold, T& sum, int& count, T& smallest) {
      T local_sum = T(0), local_smallest = inf;
      int local_count = 0;
      for (int i = tid; i < m; i += threads) {
        if (result[i] > threshold) {
          local_sum += result[i];
          ++local_count;
          local_smallest = min_of(local_smallest, result[i]);
        }
      }
      block_allreduce(local_sum, local_count, local_smallest, SumOp{}, SumOp{}, MinOp{}, slots.a, slots.i, slots.b);
      sum = local_sum;
      count = local_count;
      smallest = local_smallest;
    });
    for (int i = tid; i < m; i += threads) p[row.position[i]] = max_of(result[i] - tau, T(0));
  }
}

template <typename T>
__global__ void __launch_bounds__(1024) forward_kernel(ForwardParams<T> params) {
  if (params.rows_in_shared) {
    forward_rows<T, true>(params);
  } else {
    forward_rows<T, false>(params);
  }
}

template <typename T>
struct BackwardParams {
  const T* g;
  const T* p;
  const T* y;
  T* dz;
  int64_t rows;
  int n;
  Prox kind;
  bool grouped;
  bool rows_in_shared;
  unsigned char* scratch;
  size_t row_bytes;
};

// dz = J_prox (J_sparsemax g), both Jacobians symmetric: J_sparsemax g = s (g - mean_S g)
// on the support S; J_prox averages over the prox's groups (signed for OSCAR).
template <typename T, bool kRowsInShared>
__device__ __forceinline__ void backward_rows(const BackwardParams<T>& params) {
  const int n = params.n;
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const bool tv = params.kind == Prox::kTV;
  Carver shared{dynamic_shared_memory(), 0};
  const Reductions<T> slots = carve_reductions<T>(shared);
  Carver row_memory{row_arrays<kRowsInShared>(shared, params.scratch, params.row_bytes), 0};
  const BackwardRow<T> row = carve_backward_row<T>(row_memory, params.kind, params.grouped, n);

  for (int64_t r = blockIdx.x; r < params.rows; r += gridDim.x) {
    const T* g = params.g + r * n;
    const T* p = params.p + r * n;
    const T* y = params.y + r * n;
    T* dz = params.dz + r * n;

    T g_sum = T(0);
    int support = 0, poisoned = 0;
    for (int j = tid; j < n; j += threads) {
      const T pj = p[j];
      poisoned |= pj != pj;
      if (pj > T(0)) {
        g_sum += g[j];
        ++support;
      }
    }
    block_allreduce(g_sum, support, poisoned, SumOp{}, SumOp{}, MaxOp{}, slots.a, slots.i, slots.j);
    if (poisoned) {  // the forward's NaN row: NaN gradient, as softmax
      for (int j = tid; j < n; j += threads) dz[j] = static_cast<T>(NAN);
      continue;
    }
    const T g_mean = support > 0 ? g_sum / T(support) : T(0);
    if (!params.grouped) {
      for (int j = tid; j < n; j += threads) dz[j] = p[j] > T(0) ? g[j] - g_mean : T(0);
      continue;
    }

    // The group members: valid entries (TV), valid entries with y != 0 (OSCAR).
    const auto is_member = [&](T yj) { return !structured::is_masked(yj) && (tv || yj != T(0)); };
    const auto place = [&](int j, int slot) {
      row.y[slot] = y[j];
      row.u[slot] = p[j] > T(0) ? g[j] - g_mean : T(0);
      row.position[slot] = j;
    };
    int first_outside = n, last_member = -1;
    for (int j = tid; j < n; j += threads) {
      if (is_member(y[j])) {
        place(j, j);
        last_member = j;
      } else {
        first_outside = min(first_outside, j);
        dz[j] = T(0);
      }
    }
    block_allreduce(first_outside, last_member, MinOp{}, MaxOp{}, slots.i, slots.j);
    const int count = pack_members(n, first_outside, last_member, [&](int j) { return is_member(y[j]); }, place, slots.i);
    if (tv) {
      segment_means<T>(
          count, [&](int i) { return i == 0 || row.y[i] != row.y[i - 1]; }, [&](int i) { return row.u[i]; },
          row.group, row.group_mean, slots);
      for (int i = tid; i < count; i += threads) dz[row.position[i]] = row.group_mean[row.group[i]];
      continue;
    }
    block_sort_by_magnitude(row.y, count, row.sorted, SortedEntries<T>{row.sorted});
    segment_means<T>(
        count, [&](int rank) { return rank == 0 || row.sorted[rank].key() != row.sorted[rank - 1].key(); },
        [&](int rank) {
          const int i = row.sorted[rank].index();
          return row.y[i] > T(0) ? row.u[i] : -row.u[i];
        },
        row.group, row.group_mean, slots);
    for (int rank = tid; rank < count; rank += threads) {
      const int i = row.sorted[rank].index();
      const T mean = row.group_mean[row.group[rank]];
      dz[row.position[i]] = row.y[i] > T(0) ? mean : -mean;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(1024) backward_kernel(BackwardParams<T> params) {
  if (params.rows_in_shared) {
    backward_rows<T, true>(params);
  } else {
    backward_rows<T, false>(params);
  }
}

#ifndef ENTMAX_FAST_HOST_EMULATION
// ---------------------------------------------------------------------------------------
// Launchers (called from structured_ops.cpp).

int current_sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 1;
  return count;
}

template <typename T>
size_t forward_scratch_bytes(int kind, int64_t rows, int64_t n) {
  if (rows == 0 || n == 0) return 0;
  return plan_launch<T>(false, static_cast<Prox>(kind), true, rows, n, current_sm_count(), kSharedLimit).scratch_bytes;
}

template <typename T>
size_t backward_scratch_bytes(int kind, bool grouped, int64_t rows, int64_t n) {
  if (rows == 0 || n == 0) return 0;
  return plan_launch<T>(true, static_cast<Prox>(kind), grouped, rows, n, current_sm_count(), kSharedLimit)
      .scratch_bytes;
}

template <typename T>
cudaError_t launch_forward(int kind, bool project, const T* x, const int64_t* lengths, T* p, T* y, int64_t rows,
                           int64_t n, double reg, void* scratch, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const Prox prox = static_cast<Prox>(kind);
  const LaunchPlan plan = plan_launch<T>(false, prox, true, rows, n, current_sm_count(), kSharedLimit);
  const ForwardParams<T> params{x,    lengths, project ? p : nullptr, y, rows, static_cast<int>(n), reg, prox,
                                plan.rows_in_shared, static_cast<unsigned char*>(scratch), plan.row_bytes};
  forward_kernel<T><<<static_cast<unsigned>(plan.blocks), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_backward(int kind, bool grouped, const T* g, const T* p, const T* y, T* dz, int64_t rows,
                            int64_t n, void* scratch, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const Prox prox = static_cast<Prox>(kind);
  const LaunchPlan plan = plan_launch<T>(true, prox, grouped, rows, n, current_sm_count(), kSharedLimit);
  const BackwardParams<T> params{g,       p,    y, dz, rows, static_cast<int>(n), prox, grouped, plan.rows_in_shared,
                                 static_cast<unsigned char*>(scratch), plan.row_bytes};
  backward_kernel<T><<<static_cast<unsigned>(plan.blocks), plan.threads, plan.shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template size_t forward_scratch_bytes<float>(int, int64_t, int64_t);
template size_t forward_scratch_bytes<double>(int, int64_t, int64_t);
template size_t backward_scratch_bytes<float>(int, bool, int64_t, int64_t);
template size_t backward_scratch_bytes<double>(int, bool, int64_t, int64_t);
template cudaError_t launch_forward<float>(int, bool, const float*, const int64_t*, float*, float*, int64_t, int64_t,
                                           double, void*, cudaStream_t);
template cudaError_t launch_forward<double>(int, bool, const double*, const int64_t*, double*, double*, int64_t,
                                            int64_t, double, void*, cudaStream_t);
template cudaError_t launch_backward<float>(int, bool, const float*, const float*, const float*, float*, int64_t,
                                            int64_t, void*, cudaStream_t);
template cudaError_t launch_backward<double>(int, bool, const double*, const double*, const double*, double*,
                                             int64_t, int64_t, void*, cudaStream_t);
#endif  // ENTMAX_FAST_HOST_EMULATION

}  // namespace structured_cuda
}  // namespace entmax_fast
