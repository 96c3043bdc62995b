// What the two GGUF GEMVs (gguf.cpp: float activations; gguf_q8.cpp: 8-bit
// activations, llama.cpp's scheme) share: the block formats' sizes, the fp16
// scales, the checks, and the loop that splits weight rows over the threads.
//
// Chapter 2 (the bytes a decode step reads). The formats, and the torch
// reference every kernel is tested against, are in
// nanoengine/model_executor/layers/quantization/gguf_blocks.py.
#pragma once

#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace gguf {

constexpr int kBlock = 32;  // numbers per block (a K-quant's super-block holds 8 of them)
// ggml's type ids (GGMLType in gguf_blocks.py).
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
// Activation rows one pass over the weight serves; more rows go in several passes.
constexpr int64_t kMaxRowsPerPass = 8;
// The weight row this many rows on is asked for while this one is multiplied:
// the hardware prefetcher alone left a 2-core Xeon reading 8 GB/s at batch 1,
// waiting on every row; with this, 16 GB/s (a decode step's matmuls 8.7 -> 4 ms).
constexpr int64_t kPrefetchRows = 8;

// Bytes of one block as stored (for a K-quant, one super-block of 256 numbers):
// Q8_0 d + 32 bytes; Q4_0 d + 16; Q4_1 d, m + 16; Q5_0 d, 4 bytes of fifth
// bits + 16; Q4_K d, dmin, 12 bytes of scales + 128; Q6_K 128 + 64 + 16 scales + d.
template <int64_t QTYPE>
constexpr int64_t kBlockBytes = QTYPE == kQ8_0 ? 2 + 32
                                : QTYPE == kQ4_0 ? 2 + 16
                                : QTYPE == kQ4_1 ? 2 + 2 + 16
                                : QTYPE == kQ5_0 ? 2 + 4 + 16
                                : QTYPE == kQ4_K ? 2 + 2 + 12 + 128
                                                 : 128 + 64 + 16 + 2;
// Blocks of 32 numbers in one stored block: 8 in a K-quant's super-block, else 1.
template <int64_t QTYPE>
constexpr int64_t kPiecesPerBlock = QTYPE == kQ4_K || QTYPE == kQ6_K ? 8 : 1;

constexpr const char* kKeptTypes = "Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14";

// f(std::integral_constant<int64_t, QTYPE>{}): the format as a compile-time constant.
template <typename F>
void with_format(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
  }
  TORCH_CHECK(false, "GGML type ", qtype, " is not a block format kept here (", kKeptTypes, ")");
}

// Bytes of one row of cols numbers, cols a whole number of stored blocks (checked).
inline int64_t row_bytes(int64_t qtype, int64_t cols) {
  int64_t bytes = 0;
  with_format(qtype, [&](auto format) {
    constexpr int64_t numbers = kBlock * kPiecesPerBlock<format()>;
    TORCH_CHECK(cols % numbers == 0, "a row of GGML type ", qtype, " holds whole blocks of ", numbers,
                " numbers; cols = ", cols, " is not a multiple");
    bytes = cols / numbers * kBlockBytes<format()>;
  });
  return bytes;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable path takes a dozen
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline void check_blocks(const at::Tensor& qweight, int64_t qtype, int64_t cols) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be a contiguous uint8 [rows, row_bytes] tensor");
  TORCH_CHECK(qweight.size(1) == row_bytes(qtype, cols), "qweight rows hold ", qweight.size(1), " bytes; ", cols,
              " numbers of type ", qtype, " take ", row_bytes(qtype, cols));
}

// What both GEMVs take: x float32 [rows, cols] and the blocks of an [out_features, cols] weight.
inline void check_gemv(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype, int64_t cols) {
  check_float_contiguous(x, "x");
  check_blocks(qweight, qtype, cols);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == cols, "x must be [rows, ", cols, "], got ", x.sizes());
}

// f(std::integral_constant<int, ROWS>{}) for a row count of 1 to kMaxRowsPerPass.
// The kernels take ROWS as a template argument so that their per-row
// accumulators live in registers (an array indexed at run time lives in
// memory: every multiply-add then waits for a store and a load).
template <typename F>
void with_row_count(int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

inline void prefetch_row(const uint8_t* row, int64_t bytes) {
#if defined(__GNUC__)
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
#endif
}

// out [rows, out_features] = x . W^T + bias, the GEMV loop both kernels share.
// Weight rows are split over the threads; each weight row meets every x row
// (in passes of kMaxRowsPerPass) while it is in cache. dot(row, first, count,
// dots) writes dots[m] = row . x[first + m] for m < count.
template <typename Dot>
at::Tensor gemv_rows(const at::Tensor& x, const at::Tensor& qweight, const c10::optional<at::Tensor>& bias_tensor,
                     Dot dot) {
  const int64_t rows = x.size(0), out_features = qweight.size(0), bytes_per_row = qweight.size(1);
  at::Tensor out = at::empty({rows, out_features}, x.options());
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  const float* bias = bias_tensor.has_value() ? bias_tensor->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out_features, 32, [&](int64_t begin, int64_t end) {
    float dots[kMaxRowsPerPass];
    for (int64_t n = begin; n < end; ++n) {
      if (n + kPrefetchRows < end) prefetch_row(w + (n + kPrefetchRows) * bytes_per_row, bytes_per_row);
      for (int64_t first = 0; first < rows; first += kMaxRowsPerPass) {
        const int64_t count = std::min(kMaxRowsPerPass, rows - first);
        dot(w + n * bytes_per_row, first, count, dots);
        for (int64_t m = 0; m < count; ++m) o[(first + m) * out_features + n] = dots[m] + (bias ? bias[n] : 0.f);
      }
    }
  });
  return out;
}

}  // namespace gguf
