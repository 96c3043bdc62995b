// Paged-attention kernels for the CPU: write K/V into their slots, and decode
// attention that reads the cached blocks where they lie.
//
// Chapter 7 (why a decode step on a CPU is limited by how many bytes of K/V it
// reads); chapter 4 explains block tables and slot mapping.
// vLLM 0.32 counterpart: csrc/cpu/ (the CPU attention and cache kernels behind
// vllm/v1/attention/backends/cpu_attn.py).
//
// The torch reference (torch_ref.py) answers the same question in three passes
// over memory: index_select copies every block of every request into a padded
// [batch, max_len, heads, dim] tensor, and scaled_dot_product_attention then
// reads that copy. Here each request's blocks are visited in place, once for the
// scores (K) and once for the weighted sum (V), so a decode step reads its K/V
// bytes once instead of three times. In bf16 (the cache then holds bf16
// rows) the kernels read half the bytes and widen each row to fp32 in
// registers; scores, softmax and sums stay fp32. Built with the other CPU kernels by
// nanoengine/_custom_ops.py; bindings.cpp exposes them to Python.
#include "ops.h"
#include "paged.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

// key/value [num_tokens, Hkv, D] -> rows slot_mapping[t] of the caches
// [num_blocks, block_size, Hkv, D]: block slot / block_size, row slot %
// block_size. A slot < 0 marks padding: nothing written. The cache has the
// model's dtype (fp32 or bf16), so a row is copied as bytes.
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping) {
  check_paged_cache(key_cache, key_cache.scalar_type(), "key_cache");
  check_paged_cache(value_cache, key_cache.scalar_type(), "value_cache");
  TORCH_CHECK(key_cache.strides() == value_cache.strides(), "key_cache and value_cache must share one layout");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t item = key_cache.element_size();
  const int64_t block_size = key_cache.size(1);
  const int64_t row_bytes = key_cache.stride(1) * item;  // one slot: Hkv * D elements
  const int64_t block_bytes = key_cache.stride(0) * item;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  // The projections hand over strided views (k and v are slices of one qkv
  // row), so rows are read through their own strides, heads*dim contiguous.
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type(),
              "key, value and the caches must share one dtype; got ", key.scalar_type(), " and ",
              key_cache.scalar_type());
  TORCH_CHECK(key.stride(-1) == 1 && key.stride(-2) == key.size(-1), "key rows must be dense per token");
  TORCH_CHECK(value.stride(-1) == 1 && value.stride(-2) == value.size(-1), "value rows must be dense per token");
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    const int64_t offset = slots[t] / block_size * block_bytes + slots[t] % block_size * row_bytes;
    std::memcpy(kc + offset, k + t * key.stride(0) * item, row_bytes);
    std::memcpy(vc + offset, v + t * value.stride(0) * item, row_bytes);
  }
}

// NH query heads that share one KV head (a GQA group, or a slice of one),
// head_dim = VECS * kLanes. Pass 1 reads each key row once for all NH heads and
// keeps one score per head and token; pass 2 reads each value row once and
// adds it into NH * VECS accumulator registers. Reading the K/V bytes is the
// cost that matters (load_request_blocks has brought them in from DRAM just
// before); everything else stays in registers.
// q/out: NH consecutive heads of VECS * kLanes elements. scores: >= NH * len floats.
// T (float or BFloat16) is the element type of q, out and the cache; the
// scores, the softmax and the accumulators are fp32 either way.
template <int VECS, int NH, typename T>
void attend_head_group(T* out, const T* q, const PagedRows<T>& keys, const PagedRows<T>& values, float scale,
                       float* scores) {
  constexpr int kDim = VECS * kLanes;
  const int64_t len = keys.len;
  FloatVec qv[NH][VECS];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < VECS; ++j) qv[h][j] = load_vec(q + h * kDim + j * kLanes);
  // Pass 1, kLanes keys at a time: widen their rows once, then for each head
  // form the kLanes products q . k as vectors of partial sums and fold them
  // into one vector holding the kLanes scores (sum_lanes). Summing each
  // product on its own took most of a step's attention time: a horizontal sum
  // is a chain of shuffles, and one per head per key added up to ~50 cycles a key.
  FloatVec max_vec[NH];
  for (int h = 0; h < NH; ++h) max_vec[h] = FloatVec{} - INFINITY;
  for_each_lane_group(keys, [&](int64_t first, const T* const* rows, int n) {
    FloatVec kv[kLanes][VECS];
    for (int r = 0; r < kLanes; ++r)
      for (int j = 0; j < VECS; ++j) kv[r][j] = r < n ? load_vec(rows[r] + j * kLanes) : FloatVec{};
    for (int h = 0; h < NH; ++h) {
      FloatVec prod[kLanes];
      for (int r = 0; r < kLanes; ++r) {
        prod[r] = qv[h][0] * kv[r][0];
        for (int j = 1; j < VECS; ++j) prod[r] += qv[h][j] * kv[r][j];
      }
      const FloatVec s = sum_lanes(prod) * scale;  // lane r: key first + r
      std::memcpy(scores + h * len + first, &s, n * sizeof(float));
      max_vec[h] = max_first_lanes(max_vec[h], s, n);
    }
  });
  float max_score[NH];
  for (int h = 0; h < NH; ++h) max_score[h] = horizontal_max(max_vec[h]);
  // Softmax numerators, subtracting each head's max so exp never overflows.
  float inv_sum[NH];
  for (int h = 0; h < NH; ++h) inv_sum[h] = 1.f / exp_and_sum(scores + h * len, len, max_score[h]);
  FloatVec acc[NH][VECS] = {};
  for_each_row(values, [&](int64_t t, const T* v) {
    FloatVec vv[VECS];
    for (int j = 0; j < VECS; ++j) vv[j] = load_vec(v + j * kLanes);
    for (int h = 0; h < NH; ++h) {
      const float w = scores[h * len + t];
      for (int j = 0; j < VECS; ++j) acc[h][j] += w * vv[j];
    }
  });
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < VECS; ++j) store_vec(out + h * kDim + j * kLanes, acc[h][j] * inv_sum[h]);
}

// Any head_dim: one query head at a time, plain loops the compiler vectorises.
// acc: dim floats of scratch for the weighted sum.
template <typename T>
void attend_one_head(T* out, const T* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t dim,
                     float scale, float* scores, float* acc) {
  float max_score = -INFINITY;
  for_each_row(keys, [&](int64_t t, const T* k) {
    scores[t] = dot(q, k, dim) * scale;
    max_score = std::max(max_score, scores[t]);
  });
  const float inv_sum = 1.f / exp_and_sum(scores, keys.len, max_score);
  std::fill(acc, acc + dim, 0.f);
  for_each_row(values, [&](int64_t t, const T* v) {
    const float w = scores[t];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += w * to_float(v[d]);
  });
  for (int64_t d = 0; d < dim; ++d) store_scalar(out + d, acc[d] * inv_sum);
}

// Up to four heads of VECS vectors each through attend_head_group, the head
// count a template argument so that each count gets fully unrolled code.
template <int VECS, typename T>
void attend_head_chunk(int64_t n, T* out, const T* q, const PagedRows<T>& keys, const PagedRows<T>& values,
                       float scale, float* scores) {
  switch (n) {
    case 4: return attend_head_group<VECS, 4>(out, q, keys, values, scale, scores);
    case 3: return attend_head_group<VECS, 3>(out, q, keys, values, scale, scores);
    case 2: return attend_head_group<VECS, 2>(out, q, keys, values, scale, scores);
    default: return attend_head_group<VECS, 1>(out, q, keys, values, scale, scores);
  }
}

// Query heads [first_head, first_head + num_heads) of one request, all reading
// the same KV head. Picks the register-blocked kernel when head_dim is 64 or
// 128: up to half the vector registers hold accumulators (4 heads of 64 or 2
// of 128 with AVX-512's 32; 1 head with AVX2's 16), the rest the K/V row and
// the query.
// scores: >= num_heads * len floats, then head_dim more.
template <typename T>
void attend_heads(T* out, const T* q, int64_t head_dim, int64_t num_heads, const PagedRows<T>& keys,
                  const PagedRows<T>& values, float scale, float* scores) {
  if (head_dim != 64 && head_dim != 128) {
    for (int64_t h = 0; h < num_heads; ++h)
      attend_one_head(out + h * head_dim, q + h * head_dim, keys, values, head_dim, scale, scores,
                      scores + num_heads * keys.len);
    return;
  }
  const int64_t vecs = head_dim / kLanes;
  const int64_t chunk = std::max<int64_t>(1, kVectorRegisters / 2 / vecs);
  for (int64_t h = 0; h < num_heads; h += chunk) {
    const int64_t n = std::min(chunk, num_heads - h);
    if (head_dim == 128)
      attend_head_chunk<128 / kLanes>(n, out + h * head_dim, q + h * head_dim, keys, values, scale, scores);
    else
      attend_head_chunk<64 / kLanes>(n, out + h * head_dim, q + h * head_dim, keys, values, scale, scores);
  }
}

// One query token per request. query/out [B, Hq, D]; caches
// [num_blocks, block_size, Hkv, D] (dense rows, see check_paged_cache), all
// fp32 or all bf16; block_table
// [>=B, max_blocks] int32; seq_lens [B] int32 (keys each query sees, its own
// included). sliding_window > 0: each query reads only its last
// sliding_window keys (chapter 4), and the blocks before them are not touched.
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_table,
                            at::Tensor seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table must be int32 with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32");
  dispatch_float_bf16(query.scalar_type(), "paged_decode_attention", [&](auto zero) {
    using scalar_t = decltype(zero);
    check_contiguous_as(out, query.scalar_type(), "out");
    check_contiguous_as(query, query.scalar_type(), "query");
    check_paged_cache(key_cache, query.scalar_type(), "key_cache");
    check_paged_cache(value_cache, query.scalar_type(), "value_cache");
    const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
    const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
    const int64_t group = num_heads / num_kv_heads;  // query heads sharing one KV head (GQA)
    const int64_t row_stride = num_kv_heads * head_dim;  // elements from one token's row to the next
    const int64_t block_stride = key_cache.stride(0);     // ... and from one block to the next
    const int64_t table_stride = block_table.stride(0);
    const int32_t* table = block_table.data_ptr<int32_t>();
    const int32_t* lens = seq_lens.data_ptr<int32_t>();
    const scalar_t* q_all = query.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    scalar_t* o_all = out.data_ptr<scalar_t>();
    const float fscale = static_cast<float>(scale);

    // One work item = one request: its K and V rows are first read into this
    // core's caches whole (load_request_blocks), then its heads are computed
    // KV head by KV head, the G query heads of a group reading that head's
    // slice of each row.
    // Keys each query reads: all of them, or its window's.
    std::vector<int64_t> cost(batch);
    for (int64_t b = 0; b < batch; ++b) cost[b] = lens[b] - first_key_in_window(lens[b], sliding_window);
    run_longest_first(cost, [&](std::vector<float>& scores, int64_t b) {
      const int64_t first = first_key_in_window(lens[b], sliding_window), len = cost[b];
      scalar_t* o = o_all + b * num_heads * head_dim;
      if (len <= 0) {
        std::fill(o, o + num_heads * head_dim, scalar_t(0.f));
        return;
      }
      scores.resize(len * group + head_dim);  // longest first: the first item sizes it once
      const int32_t* blocks = table + b * table_stride;
      load_request_blocks(PagedRows<scalar_t>{kc, blocks, block_size, row_stride, block_stride, len, first},
                          PagedRows<scalar_t>{vc, blocks, block_size, row_stride, block_stride, len, first});
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        const int64_t offset = (b * num_heads + kv_head * group) * head_dim;
        const scalar_t* k_head = kc + kv_head * head_dim;
        const scalar_t* v_head = vc + kv_head * head_dim;
        const PagedRows<scalar_t> keys{k_head, blocks, block_size, row_stride, block_stride, len, first};
        const PagedRows<scalar_t> values{v_head, blocks, block_size, row_stride, block_stride, len, first};
        attend_heads(o_all + offset, q_all + offset, head_dim, group, keys, values, fscale, scores.data());
      }
    });
  });
}
