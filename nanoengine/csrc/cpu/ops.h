// The CPU kernels nanoengine compiles on first use, and two helpers they share.
//
// Chapter 7. vLLM 0.32 counterpart: csrc/cpu/ (cpu_types.hpp and the *_ops
// declarations in csrc/ops.h). Python reaches these through
// nanoengine/_custom_ops.py, which builds attention.cpp, prefill_attention.cpp,
// gemm.cpp, layers.cpp and bindings.cpp into one extension module.
#pragma once

#include <torch/extension.h>

// Paged attention (attention.cpp).
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping);
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale);
// Causal attention of a step's prefill requests (prefill_attention.cpp).
bool paged_prefill_supports(int64_t head_dim);
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_start_loc,
                             torch::Tensor seq_lens, int64_t first_req, double scale);

// Linear layers (gemm.cpp): pack a [out, in] weight once, then multiply by it.
torch::Tensor pack_linear_weight(torch::Tensor weight);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features);
bool packed_linear_has_wide_vectors();

// Decoder-layer pieces (layers.cpp).
void rms_norm(torch::Tensor out, torch::Tensor input, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor input, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                      torch::Tensor cos_sin_cache, int64_t head_dim);
void silu_and_mul(torch::Tensor out, torch::Tensor input);

// Shared helpers.

// A float vector of 16 lanes: one AVX-512 register (two AVX2 or four NEON
// registers elsewhere). GCC/Clang vector extensions keep the kernels portable
// while making register blocking explicit: a local FloatVec lives in a
// register, so accumulators never round-trip through memory. aligned(4):
// tensor rows are only float-aligned, so loads through it are unaligned loads.
typedef float FloatVec __attribute__((vector_size(64), aligned(4)));
constexpr int kLanes = 16;

inline FloatVec load_vec(const float* p) { return *reinterpret_cast<const FloatVec*>(p); }

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void check_float_contiguous(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}
