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
// bytes once instead of three times. Built with the other CPU kernels by
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
// [num_blocks * block_size, Hkv, D]. A slot < 0 marks padding: nothing written.
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping) {
  check_float_contiguous(key_cache, "key_cache");
  check_float_contiguous(value_cache, "value_cache");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t row = key_cache.size(-2) * key_cache.size(-1);  // Hkv * D floats per slot
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  // The projections hand over strided views (k and v are slices of one qkv
  // row), so rows are read through their own strides, heads*dim contiguous.
  TORCH_CHECK(key.scalar_type() == torch::kFloat32 && value.scalar_type() == torch::kFloat32,
              "key and value must be float32");
  TORCH_CHECK(key.stride(-1) == 1 && key.stride(-2) == key.size(-1), "key rows must be dense per token");
  TORCH_CHECK(value.stride(-1) == 1 && value.stride(-2) == value.size(-1), "value rows must be dense per token");
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * row, k + t * key.stride(0), row * sizeof(float));
    std::memcpy(vc + slots[t] * row, v + t * value.stride(0), row * sizeof(float));
  }
}

// NH query heads that share one KV head (a GQA group, or a slice of one),
// head_dim = VECS * 16. Pass 1 reads each key row once for all NH heads and
// keeps one score per head and token; pass 2 reads each value row once and
// adds it into NH * VECS accumulator registers. Reading the K/V bytes is the
// cost that matters (they come from DRAM); everything else stays in registers.
// q/out: NH consecutive heads of VECS * 16 floats. scores: >= NH * len floats.
template <int VECS, int NH>
void attend_head_group(float* out, const float* q, const PagedRows& keys, const PagedRows& values, float scale,
                       float* scores) {
  constexpr int kDim = VECS * kLanes;
  const int64_t len = keys.len;
  FloatVec qv[NH][VECS];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < VECS; ++j) qv[h][j] = load_vec(q + h * kDim + j * kLanes);
  float max_score[NH];
  for (int h = 0; h < NH; ++h) max_score[h] = -INFINITY;
  for_each_row(keys, kDim, [&](int64_t t, const float* k) {
    FloatVec kv[VECS];
    for (int j = 0; j < VECS; ++j) kv[j] = load_vec(k + j * kLanes);
    for (int h = 0; h < NH; ++h) {
      FloatVec prod = qv[h][0] * kv[0];
      for (int j = 1; j < VECS; ++j) prod += qv[h][j] * kv[j];
      const float s = horizontal_sum(prod) * scale;
      scores[h * len + t] = s;
      max_score[h] = std::max(max_score[h], s);
    }
  });
  // Softmax numerators, subtracting each head's max so exp never overflows.
  float inv_sum[NH];
  for (int h = 0; h < NH; ++h) inv_sum[h] = 1.f / exp_and_sum(scores + h * len, len, max_score[h]);
  FloatVec acc[NH][VECS] = {};
  for_each_row(values, kDim, [&](int64_t t, const float* v) {
    FloatVec vv[VECS];
    for (int j = 0; j < VECS; ++j) vv[j] = load_vec(v + j * kLanes);
    for (int h = 0; h < NH; ++h) {
      const float w = scores[h * len + t];
      for (int j = 0; j < VECS; ++j) acc[h][j] += w * vv[j];
    }
  });
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < VECS; ++j) {
      const FloatVec result = acc[h][j] * inv_sum[h];
      std::memcpy(out + h * kDim + j * kLanes, &result, sizeof(result));
    }
}

// Any head_dim: one query head at a time, plain loops the compiler vectorises.
void attend_one_head(float* out, const float* q, const PagedRows& keys, const PagedRows& values, int64_t dim,
                     float scale, float* scores) {
  float max_score = -INFINITY;
  for_each_row(keys, dim, [&](int64_t t, const float* k) {
    scores[t] = dot(q, k, dim) * scale;
    max_score = std::max(max_score, scores[t]);
  });
  const float inv_sum = 1.f / exp_and_sum(scores, keys.len, max_score);
  std::fill(out, out + dim, 0.f);
  for_each_row(values, dim, [&](int64_t t, const float* v) {
    const float w = scores[t];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] += w * v[d];
  });
  for (int64_t d = 0; d < dim; ++d) out[d] *= inv_sum;
}

// Query heads [first_head, first_head + num_heads) of one request, all reading
// the same KV head. Picks the register-blocked kernel when head_dim is 64 or
// 128: up to 16 accumulator vectors (4 heads of 64, or 2 of 128) fit in the
// 32 registers AVX-512 has, with room for the K/V row and the query.
void attend_heads(float* out, const float* q, int64_t head_dim, int64_t num_heads, const PagedRows& keys,
                  const PagedRows& values, float scale, float* scores) {
  if (head_dim != 64 && head_dim != 128) {
    for (int64_t h = 0; h < num_heads; ++h)
      attend_one_head(out + h * head_dim, q + h * head_dim, keys, values, head_dim, scale, scores);
    return;
  }
  const int64_t chunk = head_dim == 64 ? 4 : 2;
  for (int64_t h = 0; h < num_heads; h += chunk) {
    float* o = out + h * head_dim;
    const float* qh = q + h * head_dim;
    const int64_t n = std::min(chunk, num_heads - h);
    if (head_dim == 128) {
      if (n == 2) attend_head_group<8, 2>(o, qh, keys, values, scale, scores);
      else attend_head_group<8, 1>(o, qh, keys, values, scale, scores);
    } else if (n == 4) {
      attend_head_group<4, 4>(o, qh, keys, values, scale, scores);
    } else if (n == 3) {
      attend_head_group<4, 3>(o, qh, keys, values, scale, scores);
    } else if (n == 2) {
      attend_head_group<4, 2>(o, qh, keys, values, scale, scores);
    } else {
      attend_head_group<4, 1>(o, qh, keys, values, scale, scores);
    }
  }
}

// One query token per request. query/out [B, Hq, D]; caches
// [num_blocks, block_size, Hkv, D]; block_table [>=B, max_blocks] int32;
// seq_lens [B] int32 (keys each query sees, its own included).
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale) {
  check_float_contiguous(out, "out");
  check_float_contiguous(query, "query");
  check_float_contiguous(key_cache, "key_cache");
  check_float_contiguous(value_cache, "value_cache");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.stride(1) == 1,
              "block_table must be int32 with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32, "seq_lens must be int32");
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;  // query heads sharing one KV head (GQA)
  const int64_t row_stride = num_kv_heads * head_dim;  // floats from one token's row to the next
  const int64_t table_stride = block_table.stride(0);
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float* q_all = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  float* o_all = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One work item = one request, all its heads, KV head by KV head: the G
  // query heads of a group read only that head's slice of each cached row, and
  // the slices of the other heads (neighbours in the same rows) are then still
  // in this core's L2, fetched by the hardware prefetcher along with the first.
  const std::vector<int64_t> cost(lens, lens + batch);
  run_longest_first(cost, [&](std::vector<float>& scores, int64_t b) {
    const int64_t len = lens[b];
    float* o = o_all + b * num_heads * head_dim;
    if (len <= 0) {
      std::fill(o, o + num_heads * head_dim, 0.f);
      return;
    }
    scores.resize(len * group);  // longest first: the first item sizes it once
    const int32_t* blocks = table + b * table_stride;
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      const int64_t offset = (b * num_heads + kv_head * group) * head_dim;
      const PagedRows keys{kc + kv_head * head_dim, blocks, block_size, row_stride, len};
      const PagedRows values{vc + kv_head * head_dim, blocks, block_size, row_stride, len};
      attend_heads(o_all + offset, q_all + offset, head_dim, group, keys, values, fscale, scores.data());
    }
  });
}
