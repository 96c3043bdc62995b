// The small per-layer operations of a Llama-style decoder, one kernel each:
// RMSNorm (alone, and fused with the residual add), RoPE, and SiLU-and-mul.
//
// Chapter 7 (why a decode step on a CPU pays per *operation*, not per FLOP: at
// a batch of 32 these tensors are a few KB, and the torch reference spends more
// time dispatching its ~40 small ops per layer than computing them).
// vLLM 0.32 counterpart: csrc/cpu/layernorm.cpp, csrc/cpu/pos_encoding.cpp,
// csrc/cpu/activation.cpp.
//
// Each kernel does what the forward_native method of its layer does in plain
// torch (layers/layernorm.py, rotary_embedding.py, activation.py), in one pass
// over the rows; tests/test_cpu_fast_paths.py compares the two. Every kernel
// takes fp32 or bf16 tensors (the model's dtype, see ops.h): it widens what it
// reads to fp32, computes in fp32, and rounds once when it writes, where the
// torch reference in bf16 rounds after every operation.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cmath>

namespace {

// Rows of a [rows, width] tensor whose last dimension is dense; rows may be
// strided (a slice of a wider projection output).
template <typename T>
struct RowView {
  T* data;
  int64_t rows, width, stride;
  T* row(int64_t r) const { return data + r * stride; }
};

template <typename T>
RowView<T> rows_of(at::Tensor t, const char* name) {
  TORCH_CHECK(t.scalar_type() == c10::CppTypeToScalarType<T>::value, name, " must be ",
              c10::CppTypeToScalarType<T>::value, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with a dense last dimension");
  return {t.data_ptr<T>(), t.size(0), t.size(1), t.stride(0)};
}

// out = x / sqrt(mean(x^2) + eps) * weight, for one row, in the order HF's
// LlamaRMSNorm uses: normalise first, then scale by the weight.
template <typename T>
inline void rms_norm_row(T* out, const T* x, const T* weight, int64_t width, float eps) {
  const float mean_square = dot(x, x, width) / static_cast<float>(width);
  const float inv_rms = 1.f / std::sqrt(mean_square + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) store_scalar(out + i, to_float(weight[i]) * (to_float(x[i]) * inv_rms));
}

}  // namespace

void rms_norm(at::Tensor out, at::Tensor input, at::Tensor weight, double eps) {
  dispatch_float_bf16(input.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto x = rows_of<scalar_t>(input, "input"), y = rows_of<scalar_t>(out, "out");
    check_contiguous_as(weight, input.scalar_type(), "weight");
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, x.rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(y.row(r), x.row(r), w, x.width, static_cast<float>(eps));
    });
  });
}

// residual += input; input = RMSNorm(residual) * weight. Both in place, as
// vLLM's fused op: the layer hands its residual stream to the next norm. In
// bf16 the new residual is rounded before it is normalised, as the reference
// (which adds two bf16 tensors) rounds it.
void fused_add_rms_norm(at::Tensor input, at::Tensor residual, at::Tensor weight, double eps) {
  dispatch_float_bf16(input.scalar_type(), "fused_add_rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto x = rows_of<scalar_t>(input, "input"), res = rows_of<scalar_t>(residual, "residual");
    check_contiguous_as(weight, input.scalar_type(), "weight");
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, x.rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = x.row(r);
        scalar_t* rr = res.row(r);
#pragma omp simd
        for (int64_t i = 0; i < x.width; ++i) store_scalar(rr + i, to_float(rr[i]) + to_float(xr[i]));
        rms_norm_row(xr, rr, w, x.width, static_cast<float>(eps));
      }
    });
  });
}

// Rotate-half RoPE, in place. query [T, Hq * D] and key [T, Hkv * D] (dense
// rows, possibly strided); cos_sin_cache [max_positions, D] fp32: cos of the
// D/2 angles, then their sin; positions [T] int64.
void rotary_embedding(at::Tensor positions, at::Tensor query, at::Tensor key,
                      at::Tensor cos_sin_cache, int64_t head_dim) {
  check_float_contiguous(cos_sin_cache, "cos_sin_cache");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  const int64_t half = head_dim / 2, max_positions = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* table = cos_sin_cache.data_ptr<float>();
  dispatch_float_bf16(query.scalar_type(), "rotary_embedding", [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto q = rows_of<scalar_t>(query, "query"), k = rows_of<scalar_t>(key, "key");
    auto rotate_heads = [&](scalar_t* row, int64_t num_heads, const float* cos, const float* sin) {
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* x1 = row + h * head_dim;  // the first half of the head ...
        scalar_t* x2 = x1 + half;           // ... is paired with the second
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(x1[i]), b = to_float(x2[i]);
          store_scalar(x1 + i, a * cos[i] - b * sin[i]);
          store_scalar(x2 + i, b * cos[i] + a * sin[i]);
        }
      }
    };
    at::parallel_for(0, q.rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        TORCH_CHECK(pos[t] >= 0 && pos[t] < max_positions, "position ", pos[t], " outside the RoPE table of ",
                    max_positions);
        const float* cos = table + pos[t] * head_dim;
        rotate_heads(q.row(t), q.width / head_dim, cos, cos + half);
        rotate_heads(k.row(t), k.width / head_dim, cos, cos + half);
      }
    });
  });
}

// out [T, d] = silu(input[:, :d]) * input[:, d:], silu(a) = a / (1 + e^-a).
void silu_and_mul(at::Tensor out, at::Tensor input) {
  dispatch_float_bf16(input.scalar_type(), "silu_and_mul", [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto x = rows_of<scalar_t>(input, "input"), y = rows_of<scalar_t>(out, "out");
    const int64_t d = y.width;
    TORCH_CHECK(x.width == 2 * d, "input must be twice as wide as out");
    at::parallel_for(0, x.rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = x.row(r);
        const scalar_t* up = gate + d;
        scalar_t* o = y.row(r);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) {
          const float g = to_float(gate[i]);
          store_scalar(o + i, g / (1.f + std::exp(-g)) * to_float(up[i]));
        }
      }
    });
  });
}
