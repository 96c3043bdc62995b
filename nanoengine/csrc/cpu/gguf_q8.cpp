// The GEMV of llama.cpp's CPU backend over GGML blocks (Q8_0, Q4_0, Q4_1),
// with the activations rounded to 8 bits: NANOENGINE_GGUF_ACTIVATIONS=q8.
// The default GEMV, on float activations, is in gguf.cpp.
//
// Chapter 2 (the bytes a decode step reads) and chapter 7 (the fast paths).
// vLLM 0.32 counterpart: none for GGUF blocks (see layers/quantization/gguf.py);
// the scheme is llama.cpp's CPU backend (ggml-cpu: quantize the activations,
// then ggml_vec_dot_q4_1_q8_1 and its siblings). The block formats, and the
// torch reference every function here is tested against, are in
// nanoengine/model_executor/layers/quantization/gguf_blocks.py; what both
// GEMVs share is in gguf_common.h.
//
// The GEMV works as llama.cpp's CPU backend does. A decode step multiplies a
// few activation rows by a weight that is read once from memory, so the cost
// is the weight's bytes: 5 bits a number for Q4_1 instead of fp32's 32. To
// spend as few instructions as possible per weight byte, the activations are
// quantized too, once per call, to 8-bit integers with one float scale per
// block of 32 ("Q8" rows: x ~= dx * qx); then each block pair is one integer
// dot product of 32 multiply-adds:
//
//   Q8_0:  sum_j (dw qw_j)(dx qx_j)         = dw dx * sum_j qw_j qx_j
//   Q4_0:  sum_j (dw (qw_j - 8))(dx qx_j)   = dw dx * (sum_j qw_j qx_j - 8 sum_j qx_j)
//   Q4_1:  sum_j (dw qw_j + m)(dx qx_j)     = dw dx * sum_j qw_j qx_j + m dx sum_j qx_j
//
// sum_j qx_j is computed once per activation block. Rounding the activations
// to 8 bits costs accuracy llama.cpp also pays: with it, SmolLM2's greedy
// tokens left the float reference's in 33 of 50 prompts within 32 tokens
// (always at a near tie), which is why float activations are the default.
// It is the faster GEMV at batch 1 with AVX-512 (see gguf.cpp for the figures).
#include "gguf_common.h"

#include <cmath>
#include <vector>

using namespace gguf;

namespace {

// One activation row in Q8: 32 int8 per block, its scale, and the sum of its integers.
struct Q8Row {
  const int8_t* q;   // [cols]
  const float* d;    // [cols / 32]
  const int32_t* s;  // [cols / 32]: sum_j q_j of each block
};

// x [cols] -> q, d, s: d = max|x| / 127, q = round(x / d), as ggml's quantize_row_q8_0.
void quantize_row_q8(const float* x, int64_t cols, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < cols / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float scale = amax / 127.f;
    const float inverse = scale != 0.f ? 1.f / scale : 0.f;
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int v = static_cast<int>(std::nearbyint(xb[j] * inverse));
      q[b * kBlock + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = sum;
  }
}

#ifdef __AVX2__
// The 32 integers of a weight block as unsigned or signed bytes in one register.
inline __m256i q4_block(const uint8_t* qs) {  // 16 bytes -> numbers 0..15 (low nibbles), 16..31 (high)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(high, low);
}

// sum_j u_j * s_j over 32 unsigned bytes u and signed bytes s, as 8 int32 partial sums.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);  // one instruction, no 16-bit step
#else
  // Pairs of products as int16 (at most 2 * 255 * 127 fits only for weights
  // below 129: true of every format here), then pairs of those as int32.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}
#endif

#ifdef __AVX2__
// The integers of one weight block as unsigned bytes, and the sign to move onto
// the activations: |w| * (sign(w) x) = w x keeps the dot product unsigned x signed.
template <int64_t QTYPE>
inline void load_block(const uint8_t* block, __m256i& weights, __m256i& sign) {
  if constexpr (QTYPE == kQ8_0) {
    const __m256i signed_w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    weights = _mm256_sign_epi8(signed_w, signed_w);
    sign = signed_w;
  } else {
    weights = q4_block(block + (QTYPE == kQ4_1 ? 4 : 2));
    sign = weights;  // unused: Q4 integers need no sign moved
  }
}

// One block of a weight row against one block of ROWS activation rows: each
// row's integer dot product, scaled by dw * dx, added to that row's accumulator.
template <int64_t QTYPE, int ROWS>
inline void block_times_x(const uint8_t* block, int64_t b, const Q8Row* x, __m256* acc, float* offset) {
  __m256i weights, sign;
  load_block<QTYPE>(block, weights, sign);
  const float dw = half_to_float(block);
  const float minimum = QTYPE == kQ4_1 ? half_to_float(block + 2) : 0.f;
  for (int m = 0; m < ROWS; ++m) {
    __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[m].q + b * kBlock));
    if constexpr (QTYPE == kQ8_0) xq = _mm256_sign_epi8(xq, sign);  // Q4 integers are unsigned already
    const __m256i products = dot_u8_s8(weights, xq);  // 8 int32 partial sums
    const float dx = x[m].d[b];
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(dw * dx), acc[m]);
    if constexpr (QTYPE == kQ4_0) offset[m] -= 8.f * dw * dx * static_cast<float>(x[m].s[b]);
    if constexpr (QTYPE == kQ4_1) offset[m] += minimum * dx * static_cast<float>(x[m].s[b]);
  }
}

// out[m] = row . x[m] for one weight row and ROWS Q8 activation rows (ROWS
// a template argument: see with_row_count in gguf_common.h). Even and odd blocks go to separate accumulators: a
// multiply-add waits ~4 cycles for the one before it into the same register,
// and at batch 1 that chain, not memory, was the limit.
template <int64_t QTYPE, int ROWS>
void dot_row(const uint8_t* w, int64_t blocks, const Q8Row* x, float* out) {
  constexpr int64_t bytes = kBlockBytes<QTYPE>;
  __m256 even[ROWS], odd[ROWS];
  // The Q4_0 and Q4_1 terms of sum_j qx_j, in scalars: two of them, for the same reason.
  float even_offset[ROWS] = {}, odd_offset[ROWS] = {};
  for (int m = 0; m < ROWS; ++m) even[m] = odd[m] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    block_times_x<QTYPE, ROWS>(w + b * bytes, b, x, even, even_offset);
    block_times_x<QTYPE, ROWS>(w + (b + 1) * bytes, b + 1, x, odd, odd_offset);
  }
  if (b < blocks) block_times_x<QTYPE, ROWS>(w + b * bytes, b, x, even, even_offset);
  for (int m = 0; m < ROWS; ++m) out[m] = hsum(_mm256_add_ps(even[m], odd[m])) + even_offset[m] + odd_offset[m];
}
#else
// The plain loop of the formulas at the top of this file (the generic variant: no AVX2).
template <int64_t QTYPE, int ROWS>
void dot_row(const uint8_t* w, int64_t blocks, const Q8Row* x, float* out) {
  constexpr int64_t bytes = kBlockBytes<QTYPE>;
  constexpr int64_t rows = ROWS;
  for (int64_t m = 0; m < rows; ++m) out[m] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    const float dw = half_to_float(block);
    for (int64_t m = 0; m < rows; ++m) {
      const int8_t* xq = x[m].q + b * kBlock;
      int32_t sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        int qw;
        if constexpr (QTYPE == kQ8_0) qw = static_cast<int8_t>(block[2 + j]);
        else qw = (block[(QTYPE == kQ4_1 ? 4 : 2) + (j % 16)] >> (j < 16 ? 0 : 4)) & 0x0F;
        sum += qw * xq[j];
      }
      const float scale = dw * x[m].d[b];
      out[m] += scale * static_cast<float>(sum);
      if constexpr (QTYPE == kQ4_0) out[m] -= 8.f * scale * static_cast<float>(x[m].s[b]);
      if constexpr (QTYPE == kQ4_1) out[m] += half_to_float(block + 2) * x[m].d[b] * static_cast<float>(x[m].s[b]);
    }
  }
}
#endif

}  // namespace

at::Tensor gguf_linear_q8(at::Tensor x, at::Tensor qweight, int64_t qtype, c10::optional<at::Tensor> bias,
                          int64_t cols) {
  check_gemv(x, qweight, qtype, cols);
  TORCH_CHECK(qtype == kQ8_0 || qtype == kQ4_0 || qtype == kQ4_1, "the 8-bit-activation GEMV takes Q8_0 (8), "
              "Q4_0 (2) and Q4_1 (3); GGML type ", qtype, " goes through gguf_linear");
  const int64_t rows = x.size(0), blocks = cols / kBlock;

  // Every activation row in Q8, once (x [rows, cols] -> q [rows, cols], d and s [rows, blocks]).
  std::vector<int8_t> q(rows * cols);
  std::vector<float> d(rows * blocks);
  std::vector<int32_t> s(rows * blocks);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      quantize_row_q8(xp + m * cols, cols, &q[m * cols], &d[m * blocks], &s[m * blocks]);
  });
  std::vector<Q8Row> x8(rows);
  for (int64_t m = 0; m < rows; ++m) x8[m] = {&q[m * cols], &d[m * blocks], &s[m * blocks]};

  at::Tensor out;
  with_format(qtype, [&](auto format) {
    if constexpr (format() == kQ8_0 || format() == kQ4_0 || format() == kQ4_1) {  // checked above
      out = gemv_rows(x, qweight, bias, [&](const uint8_t* row, int64_t first, int64_t count, float* dots) {
        with_row_count(count, [&](auto rows_tag) { dot_row<format(), rows_tag()>(row, blocks, &x8[first], dots); });
      });
    }
  });
  return out;
}
