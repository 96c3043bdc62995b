// Linear layers over GGML blocks (Q8_0, Q4_0, Q4_1): a GEMV for decode whose
// activations stay float32, and a dequantizer for everything larger.
//
// Chapter 2 (the bytes a decode step reads) and chapter 7 (the fast paths).
// vLLM 0.32 counterpart: none for GGUF blocks (see layers/quantization/gguf.py).
// The block formats, and the torch reference every function here is tested
// against, are in nanoengine/model_executor/layers/quantization/gguf_blocks.py;
// what this GEMV shares with gguf_q8.cpp (llama.cpp's scheme, x in 8 bits) is
// in gguf_common.h.
//
// A decode step multiplies a few activation rows by a weight read once from
// memory, so its cost is the weight's bytes: 5 bits a number for Q4_1 instead
// of fp32's 32. This GEMV dequantizes each weight block into registers,
//
//   Q8_0: w_j = d q_j      Q4_0: w_j = d (q_j - 8)      Q4_1: w_j = d q_j + m
//
// and multiplies it into every activation row while it is there. Its products
// are the reference's (the dequantized weight times x) in another order, so
// its greedy tokens are the reference's: 1600 of 1600 over SmolLM2's 50
// English prompts of chapter 2's benchmark, where rounding x to 8 bits as
// llama.cpp does (gguf_q8.cpp) changed 33 of the 50.
//
// What it costs, measured on a 2-core Xeon (AVX-512), a decode step's 30
// layers of SmolLM2's Q4_1 matmuls: batch 1, 5.7 ms against the Q8 GEMV's
// 4.1 ms (a block dequantized for one row is ~17 vector instructions; the Q8
// dot product ~10); batch 8, 14.7 ms against 16.0 ms (the dequantized block
// serves eight rows, and a float multiply-add is one instruction per row).
#include "gguf_common.h"

using namespace gguf;

namespace {

constexpr int kVecsPerBlock = kBlock / kLanes;  // 2 with AVX-512, 4 with AVX2, 8 with 128-bit vectors

#ifdef __AVX2__
// 16 integers, one a byte (signed for Q8_0), -> floats in 16 / kLanes vectors.
// Spelled with intrinsics: GCC lowered the portable __builtin_convertvector of
// a byte vector one lane at a time, and the GEMV ran 15x slower.
template <bool SIGNED>
inline void widen_16_bytes(__m128i bytes, FloatVec* out) {
#ifdef __AVX512F__
  const __m512 floats = _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
  std::memcpy(out, &floats, sizeof(floats));
#else
  for (int part = 0; part < 2; ++part) {  // bytes 0..7, then 8..15
    const __m128i eight = part == 0 ? bytes : _mm_srli_si128(bytes, 8);
    const __m256 floats = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight));
    std::memcpy(out + part, &floats, sizeof(floats));
  }
#endif
}

inline __m128i load_16_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// One weight block -> w[kVecsPerBlock], the block's numbers 0..31 in order.
template <int64_t QTYPE>
inline void dequantize_block(const uint8_t* block, FloatVec* w) {
  constexpr int half = kVecsPerBlock / 2;  // vectors per 16 numbers
  const float d = half_to_float(block);
  if constexpr (QTYPE == kQ8_0) {
    widen_16_bytes<true>(load_16_bytes(block + 2), w);
    widen_16_bytes<true>(load_16_bytes(block + 18), w + half);
    for (int k = 0; k < kVecsPerBlock; ++k) w[k] *= d;
  } else {
    // Byte j holds number j (low nibble) and number j + 16 (high nibble).
    const __m128i bytes = load_16_bytes(block + (QTYPE == kQ4_1 ? 4 : 2));
    widen_16_bytes<false>(_mm_and_si128(bytes, _mm_set1_epi8(0x0F)), w);
    widen_16_bytes<false>(_mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F)), w + half);
    const float shift = QTYPE == kQ4_1 ? half_to_float(block + 2) : -8.f * d;
    for (int k = 0; k < kVecsPerBlock; ++k) w[k] = d * w[k] + shift;
  }
}
#else
// The generic variant: the block dequantized into memory, then loaded.
template <int64_t QTYPE>
inline void dequantize_block(const uint8_t* block, FloatVec* w) {
  float numbers[kBlock];
  const float d = half_to_float(block);
  for (int j = 0; j < kBlock; ++j) {
    if constexpr (QTYPE == kQ8_0) {
      numbers[j] = d * static_cast<int8_t>(block[2 + j]);
    } else {
      const int q = (block[(QTYPE == kQ4_1 ? 4 : 2) + j % 16] >> (j < 16 ? 0 : 4)) & 0x0F;
      numbers[j] = d * q + (QTYPE == kQ4_1 ? half_to_float(block + 2) : -8.f * d);
    }
  }
  for (int k = 0; k < kVecsPerBlock; ++k) w[k] = load_vec(numbers + k * kLanes);
}
#endif

inline float sum_lanes(FloatVec v) {
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// out[m] = row . x[m] for one weight row and ROWS float rows of x (x[m] = x + m * cols).
// Each dequantized block meets every row while it is in registers. Where
// ROWS x kVecsPerBlock accumulators fit the registers (AVX-512: 8 x 2 of 32),
// each multiply-add goes straight into one; otherwise (AVX2 from 3 rows: 4
// vectors a block) a row's products are summed first, then added to one
// accumulator per row -- a fifth more instructions, but no spill to memory.
template <int64_t QTYPE, int ROWS>
void dot_row_float(const uint8_t* w, int64_t blocks, const float* x, int64_t cols, float* out) {
  constexpr int64_t bytes = kBlockBytes<QTYPE>;
  constexpr bool direct = (ROWS + 1) * kVecsPerBlock + 2 <= kVectorRegisters;
  constexpr int per_row = direct ? kVecsPerBlock : 1;
  FloatVec acc[ROWS][per_row] = {};
  FloatVec wv[kVecsPerBlock];
  for (int64_t b = 0; b < blocks; ++b) {
    dequantize_block<QTYPE>(w + b * bytes, wv);
    for (int m = 0; m < ROWS; ++m) {
      const float* xb = x + m * cols + b * kBlock;
      if constexpr (direct) {
        for (int k = 0; k < kVecsPerBlock; ++k) acc[m][k] += wv[k] * load_vec(xb + k * kLanes);
      } else {
        FloatVec product = wv[0] * load_vec(xb);
        for (int k = 1; k < kVecsPerBlock; ++k) product += wv[k] * load_vec(xb + k * kLanes);
        acc[m][0] += product;
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    FloatVec total = acc[m][0];
    for (int k = 1; k < per_row; ++k) total += acc[m][k];
    out[m] = sum_lanes(total);
  }
}

}  // namespace

at::Tensor gguf_dequantize(at::Tensor qweight, int64_t qtype, int64_t cols) {
  check_blocks(qweight, qtype, cols);
  const int64_t rows = qweight.size(0), blocks = cols / kBlock, bytes_per_row = qweight.size(1);
  at::Tensor out = at::empty({rows, cols}, qweight.options().dtype(at::kFloat));
  const uint8_t* w = qweight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  // Exactly the reference's numbers (the tests compare with torch.equal): d,
  // 11 significant bits, times an integer of at most 8 bits is exact in
  // float32, so a fused multiply-add rounds where the reference rounds.
  with_format(qtype, [&](auto format) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      FloatVec numbers[kVecsPerBlock];
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t b = 0; b < blocks; ++b) {
          dequantize_block<format()>(w + r * bytes_per_row + b * kBlockBytes<format()>, numbers);
          std::memcpy(o + r * cols + b * kBlock, numbers, sizeof(numbers));
        }
      }
    });
  });
  return out;
}

at::Tensor gguf_linear(at::Tensor x, at::Tensor qweight, int64_t qtype, c10::optional<at::Tensor> bias,
                       int64_t cols) {
  check_gemv(x, qweight, qtype, cols);
  const int64_t blocks = cols / kBlock;
  const float* xp = x.data_ptr<float>();
  at::Tensor out;
  with_format(qtype, [&](auto format) {
    out = gemv_rows(x, qweight, bias, [&](const uint8_t* row, int64_t first, int64_t count, float* dots) {
      with_row_count(count, [&](auto rows_tag) {
        dot_row_float<format(), rows_tag()>(row, blocks, xp + first * cols, cols, dots);
      });
    });
  });
  return out;
}
