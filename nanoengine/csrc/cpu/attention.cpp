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

#include <ATen/Parallel.h>

#include <algorithm>
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

// The keys one query head sees, visited block by block in place: pass 1 turns
// them into softmax weights, pass 2 sums the matching value rows.
// HEAD_DIM is a compile-time constant for the common sizes, so the dot product
// and the [HEAD_DIM] accumulator unroll into a few vector registers; 0 means
// "read head_dim at run time" (any other size).
template <int HEAD_DIM>
void attend_one_head(float* out, const float* q, const float* kc, const float* vc, const int32_t* blocks,
                     int64_t len, int64_t block_size, int64_t row_stride, int64_t runtime_dim, float scale,
                     std::vector<float>& probs, std::vector<float>& acc) {
  const int64_t dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_dim;
  probs.resize(len);
  float max_score = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
    const float s = dot(q, kc + slot * row_stride, dim) * scale;
    probs[t] = s;
    max_score = std::max(max_score, s);
  }
  // Softmax, subtracting the max so exp never overflows.
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    probs[t] = std::exp(probs[t] - max_score);
    sum += probs[t];
  }
  acc.assign(dim, 0.f);
  float* a = acc.data();
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
    const float* v = vc + slot * row_stride;
    const float w = probs[t];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) a[d] += w * v[d];
  }
  const float inv_sum = 1.f / sum;
  for (int64_t d = 0; d < dim; ++d) out[d] = a[d] * inv_sum;
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
  auto attend = head_dim == 64    ? attend_one_head<64>
                : head_dim == 128 ? attend_one_head<128>
                                  : attend_one_head<0>;

  // One work item = one request, all its heads. A request's K/V (a few hundred
  // KB) stays in this core's L2 while its heads take turns reading it, so the
  // G query heads of a GQA group re-read their shared KV head from cache, not DRAM.
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs, acc;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lens[b];
      for (int64_t h = 0; h < num_heads; ++h) {
        float* o = o_all + (b * num_heads + h) * head_dim;
        if (len <= 0) {
          std::fill(o, o + head_dim, 0.f);
          continue;
        }
        const int64_t kv_offset = (h / group) * head_dim;  // this head's slice of a token row
        attend(o, q_all + (b * num_heads + h) * head_dim, kc + kv_offset, vc + kv_offset, table + b * table_stride,
               len, block_size, row_stride, head_dim, fscale, probs, acc);
      }
    }
  });
}
