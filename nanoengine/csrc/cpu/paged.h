// What the paged-attention kernels share: walking one request's cached rows
// through its block table, the softmax's exp-and-sum, and a work queue that
// keeps both cores busy when requests differ in length.
//
// Chapter 7; chapter 4 explains block tables. vLLM 0.32 counterpart: the
// helpers of csrc/cpu/cpu_attn_impl.hpp.
#pragma once

#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

inline float horizontal_max(FloatVec v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// max(acc, v) in lanes 0 .. n-1; lanes from n on keep acc (they hold no key).
inline FloatVec max_first_lanes(FloatVec acc, FloatVec v, int n) {
  typedef int32_t Lanes __attribute__((vector_size(kLanes * 4)));
#if defined(__AVX512F__)
  constexpr Lanes kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif defined(__AVX__)
  constexpr Lanes kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7};
#else
  constexpr Lanes kLaneIndex = {0, 1, 2, 3};
#endif
  return (kLaneIndex < n && v > acc) ? v : acc;
}

// out[r] = v[r][0] + v[r][1] + ... + v[r][L-1] for r = 0..L-1 (L = kLanes):
// L horizontal sums at once. Each step pairs vectors and halves the lanes
// every row still spreads over (16 -> 8 -> 4 -> 2 -> 1 with AVX-512), with two
// shuffles and one add per pair: L - 1 pairs in all, where L separate sums
// take ~log2(L) + 4 operations each.
// [anchor: sum-lanes]
inline FloatVec sum_lanes(const FloatVec (&v)[kLanes]) {
  typedef int32_t Mask __attribute__((vector_size(kLanes * 4)));
  // Lanes of (a, b) as one list of 2L lanes: for each run of `width` lanes
  // that belongs to one row, `lo` takes its first half and `hi` its second half.
#if defined(__AVX512F__)
  constexpr Mask kLo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                           {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                           {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                           {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  constexpr Mask kHi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                           {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
                           {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
                           {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
#elif defined(__AVX__)
  constexpr Mask kLo[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
  constexpr Mask kHi[3] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 6, 7, 10, 11, 14, 15}, {1, 3, 5, 7, 9, 11, 13, 15}};
#else
  constexpr Mask kLo[2] = {{0, 1, 4, 5}, {0, 2, 4, 6}};
  constexpr Mask kHi[2] = {{2, 3, 6, 7}, {1, 3, 5, 7}};
#endif
  FloatVec level[kLanes];
  for (int r = 0; r < kLanes; ++r) level[r] = v[r];
  for (int step = 0, count = kLanes; count > 1; ++step, count /= 2)
    for (int i = 0; i < count / 2; ++i)
      level[i] = __builtin_shuffle(level[2 * i], level[2 * i + 1], kLo[step]) +
                 __builtin_shuffle(level[2 * i], level[2 * i + 1], kHi[step]);
  return level[0];
}
// [/anchor: sum-lanes]

// p[t] = exp(p[t] - max_score) for t < len; returns their sum (the softmax
// denominator). Subtracting the max keeps exp from overflowing.
inline float exp_and_sum(float* p, int64_t len, float max_score) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    p[t] = std::exp(p[t] - max_score);
    sum += p[t];
  }
  return sum;
}

// One KV head's rows of one request, seen through its block table: rows
// 0 .. len-1 are the tokens at positions first .. first+len-1. T is the
// cache's element type: float, or BFloat16 (half the bytes to read).
// block_stride is block_size * row_stride for a cache of its own; a hybrid
// model's attention layer shares its pages with state layers, and there K and
// V of one block lie side by side, so the next K block starts 2x further on.
// first > 0 for a sliding window (chapter 4): the table's entries before it
// may be the null block or a block another request holds now, never read.
template <typename T>
struct PagedRows {
  const T* base;  // this KV head's slice of token 0 of block 0
  const int32_t* blocks;
  int64_t block_size, row_stride, block_stride, len;
  int64_t first = 0;
};

// Row t's data: the token at position first + t, in block position /
// block_size of the table, row position % block_size of that block.
template <typename T>
inline const T* row_at(const PagedRows<T>& rows, int64_t t) {
  const int64_t position = rows.first + t;
  return rows.base + static_cast<int64_t>(rows.blocks[position / rows.block_size]) * rows.block_stride +
         (position % rows.block_size) * rows.row_stride;
}

// Calls visit_run(t, block_id, offset, count) for runs of rows that lie in one
// block: rows t .. t+count-1 are rows offset .. offset+count-1 of physical
// block block_id.
template <typename T, typename VisitRun>
inline void for_each_block_run(const PagedRows<T>& rows, VisitRun visit_run) {
  for (int64_t t = 0; t < rows.len;) {
    const int64_t position = rows.first + t, offset = position % rows.block_size;
    const int64_t count = std::min(rows.block_size - offset, rows.len - t);
    visit_run(t, static_cast<int64_t>(rows.blocks[position / rows.block_size]), offset, count);
    t += count;
  }
}

// Row `offset` of physical block block_id.
template <typename T>
inline const T* block_row(const PagedRows<T>& rows, int64_t block_id, int64_t offset) {
  return rows.base + block_id * rows.block_stride + offset * rows.row_stride;
}

// The decode query at position seq_len - 1 reads keys back to
// seq_len - sliding_window (sliding_window <= 0: every key): the first one.
inline int64_t first_key_in_window(int64_t seq_len, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
}

// The K (or V) half of a paged cache, [num_blocks, block_size, Hkv, D]: the
// rows of a block must be dense (Hkv * D elements apart), the blocks may lie
// any fixed distance apart (stride(0), see PagedRows).
inline void check_paged_cache(const at::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1 && t.stride(2) == t.size(3) && t.stride(1) == t.size(2) * t.size(3),
              name, " must be [num_blocks, block_size, heads, head_dim] with dense rows in each block");
}

// Calls visit(t, row) for t = 0 .. len-1 in order, where row points at row
// t's data, block by block.
template <typename T, typename Visit>
inline void for_each_row(const PagedRows<T>& rows, Visit visit) {
  for_each_block_run(rows, [&](int64_t t, int64_t block_id, int64_t offset, int64_t count) {
    for (int64_t i = 0; i < count; ++i) visit(t + i, block_row(rows, block_id, offset + i));
  });
}

// [anchor: load-request-blocks]
// Reads one word of every 64-byte cache line of a request's K and V blocks,
// whole rows (every KV head), so that the passes that compute then find them
// in this core's L2 (1 MiB on the Zen 4 we measured; a request's fp32 K and V
// at 250 tokens take 0.4 MiB; on a core with a smaller L2 the lines it evicts
// still wait in L3). keys.base and values.base point at KV head 0.
// Why a pass of its own: blocks lie anywhere in the cache, so the hardware
// prefetcher cannot follow them, and the compute passes wait on memory. A
// loop of loads that depend on nothing keeps many cache misses in flight, on
// two streams at once (K and V): on a 2-core EPYC a 30-layer decode step's
// attention at a batch of 32 took ~20-27% less time with it than with
// software prefetches two blocks ahead of the compute passes.
template <typename T>
inline void load_request_blocks(const PagedRows<T>& keys, const PagedRows<T>& values) {
  uint32_t sink = 0;  // an XOR of the words read: nothing waits on it, so the loads overlap
  auto word_at = [](const T* block, int64_t offset) {
    uint32_t word;
    std::memcpy(&word, reinterpret_cast<const char*>(block) + offset, sizeof(word));
    return word;
  };
  // K and V share the table and the layout, so one walk visits both.
  for_each_block_run(keys, [&](int64_t, int64_t block_id, int64_t offset, int64_t count) {
    const T* k = block_row(keys, block_id, offset);
    const T* v = block_row(values, block_id, offset);
    const int64_t bytes = count * keys.row_stride * static_cast<int64_t>(sizeof(T));
    for (int64_t at = 0; at < bytes; at += 64) sink ^= word_at(k, at) ^ word_at(v, at);
  });
  asm volatile("" : : "r"(sink));  // keeps the compiler from dropping the loads
}
// [/anchor: load-request-blocks]

// Calls visit(first, rows, n) for consecutive groups of up to kLanes rows:
// rows[0 .. n-1] point at tokens first .. first+n-1 (n < kLanes only at the end).
template <typename T, typename Visit>
inline void for_each_lane_group(const PagedRows<T>& rows, Visit visit) {
  const T* group[kLanes];
  int n = 0;
  int64_t first = 0;
  for_each_row(rows, [&](int64_t t, const T* row) {
    if (n == 0) first = t;
    group[n++] = row;
    if (n == kLanes) {
      visit(first, group, n);
      n = 0;
    }
  });
  if (n > 0) visit(first, group, n);
}

// Calls work(scratch, item) for every item, most costly first, on all of
// torch's threads: each thread takes the next item the moment it is free
// (greedy longest-first). Requests differ in length by up to 10x, so a fixed
// split of the items would leave one core idle while the other finishes.
// scratch is a per-thread buffer the work may resize and reuse.
template <typename Work>
void run_longest_first(const std::vector<int64_t>& cost, Work work) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(order.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i = next++; i < count; i = next++) work(scratch, order[i]);
  });
}
