// The CPU kernels nanoengine compiles on first use, and two helpers they share.
//
// Chapter 7. vLLM 0.32 counterpart: csrc/cpu/ (cpu_types.hpp and the *_ops
// declarations in csrc/ops.h). Python reaches these through
// nanoengine/_custom_ops.py, which builds attention.cpp, layers.cpp and
// bindings.cpp into one extension module.
#pragma once

#include <torch/extension.h>

// Paged attention (attention.cpp).
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping);
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale);

// Decoder-layer pieces (layers.cpp).
void rms_norm(torch::Tensor out, torch::Tensor input, torch::Tensor weight, double eps);
void fused_add_rms_norm(torch::Tensor input, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                      torch::Tensor cos_sin_cache, int64_t head_dim);
void silu_and_mul(torch::Tensor out, torch::Tensor input);

// Shared helpers.
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
