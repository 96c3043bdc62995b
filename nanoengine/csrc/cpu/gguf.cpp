// Linear layers over GGML blocks (Q8_0, Q4_0, Q4_1, Q5_0 and the K-quants Q4_K,
// Q6_K): a GEMV for decode whose
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
//   Q5_0: w_j = d (q_j - 16)   Q4_K: w_j = (d sc) q_j - dmin m   Q6_K: w_j = (d sc) (q_j - 32)
//
// (a K-quant's 256-number block is taken 32 numbers, one "piece", at a time)
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

// The K-quants' small scales, shared by the vector and generic variants.
// Q4_K piece s's 6-bit scale and minimum, from the 12 packed bytes (gguf_blocks.py has the layout).
inline void q4_k_scale_and_minimum(const uint8_t* packed, int s, float* scale, float* minimum) {
  if (s < 4) {
    *scale = static_cast<float>(packed[s] & 63);
    *minimum = static_cast<float>(packed[s + 4] & 63);
  } else {
    *scale = static_cast<float>((packed[s + 4] & 0x0F) | ((packed[s - 4] >> 6) << 4));
    *minimum = static_cast<float>((packed[s + 4] >> 4) | ((packed[s] >> 6) << 4));
  }
}

// Q6_K: numbers 16 h .. 16 h + 15 of piece s (h in 0, 1) are multiplied by d * scale[2 s + h].
inline float q6_k_scale(const uint8_t* block, int s, int h) {
  return half_to_float(block + 208) * static_cast<float>(static_cast<int8_t>(block[192 + 2 * s + h]));
}

#ifdef __AVX2__
// 16 integers, one a byte (signed for Q8_0 and Q6_K), -> floats in 16 / kLanes vectors.
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
inline __m128i low_nibbles(__m128i bytes) { return _mm_and_si128(bytes, _mm_set1_epi8(0x0F)); }
inline __m128i high_nibbles(__m128i bytes) { return low_nibbles(_mm_srli_epi16(bytes, 4)); }

// Bits 0..15 of `bits` spread one to a byte: 0x10 where the bit is set, else 0
// (Q5_0's fifth bits, already in place). E.g. bits = 0b101 -> 0x10, 0, 0x10, 0, ...
inline __m128i fifth_bits(uint32_t bits) {
  // Byte j takes byte j / 8 of bits, then tests bit j % 8 of it.
  const __m128i spread =
      _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i bit_j = _mm_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, bit_j), bit_j);  // 0xFF where bit j is set
  return _mm_and_si128(set, _mm_set1_epi8(0x10));
}

// Q6_K: 16 bytes of 2-bit pairs -> the pair at bit `shift`, moved to bits 4..5.
inline __m128i high_two_bits(__m128i bytes, int shift) {
  return _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(3)), 4);
}

// w[k] = a * w[k] + b for k < count.
inline void scale_and_shift(FloatVec* w, int count, float a, float b) {
  for (int k = 0; k < count; ++k) w[k] = a * w[k] + b;
}

// Numbers 32 piece .. 32 piece + 31 of one stored block -> w[kVecsPerBlock], in
// order. Every format but the K-quants has one piece (piece = 0).
template <int64_t QTYPE>
inline void dequantize_block(const uint8_t* block, int piece, FloatVec* w) {
  constexpr int half = kVecsPerBlock / 2;  // vectors per 16 numbers
  if constexpr (QTYPE == kQ8_0) {
    const float d = half_to_float(block);
    widen_16_bytes<true>(load_16_bytes(block + 2), w);
    widen_16_bytes<true>(load_16_bytes(block + 18), w + half);
    for (int k = 0; k < kVecsPerBlock; ++k) w[k] *= d;
  } else if constexpr (QTYPE == kQ4_0 || QTYPE == kQ4_1) {
    // Byte j holds number j (low nibble) and number j + 16 (high nibble).
    const float d = half_to_float(block);
    const float shift = QTYPE == kQ4_1 ? half_to_float(block + 2) : -8.f * d;
    const __m128i bytes = load_16_bytes(block + (QTYPE == kQ4_1 ? 4 : 2));
#ifdef __AVX512F__
    // With 16 lanes a nibble's value is a table lookup: the block's 16 possible
    // values, d q + shift for q = 0..15 (each rounded once, as the reference
    // rounds it), are one vector, and each nibble picks its lane (vpermps): one
    // instruction where converting and scaling took two. Measured against the
    // old build in one process: a decode step's GEMVs 2-4% faster at batch 1.
    const __m512 values = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                             12, 13, 14, 15), _mm512_set1_ps(shift));
    const __m512 first = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(low_nibbles(bytes)), values);
    const __m512 second = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(high_nibbles(bytes)), values);
    std::memcpy(w, &first, sizeof(first));
    std::memcpy(w + half, &second, sizeof(second));
#else
    widen_16_bytes<false>(low_nibbles(bytes), w);
    widen_16_bytes<false>(high_nibbles(bytes), w + half);
    scale_and_shift(w, kVecsPerBlock, d, shift);
#endif
  } else if constexpr (QTYPE == kQ5_0) {
    // As Q4_0, each nibble with its fifth bit from qh: bit j for number j.
    const float d = half_to_float(block);
    uint32_t qh;
    std::memcpy(&qh, block + 2, 4);
    const __m128i bytes = load_16_bytes(block + 6);
    widen_16_bytes<false>(_mm_or_si128(low_nibbles(bytes), fifth_bits(qh & 0xFFFF)), w);
    widen_16_bytes<false>(_mm_or_si128(high_nibbles(bytes), fifth_bits(qh >> 16)), w + half);
    scale_and_shift(w, kVecsPerBlock, d, -16.f * d);
  } else if constexpr (QTYPE == kQ4_K) {
    // Piece s: the low (s even) or high (s odd) nibbles of run s / 2 of 32 bytes.
    float scale, minimum;
    q4_k_scale_and_minimum(block + 4, piece, &scale, &minimum);
    const uint8_t* run = block + 16 + 32 * (piece / 2);
    const __m128i first = load_16_bytes(run), second = load_16_bytes(run + 16);
    widen_16_bytes<false>(piece % 2 ? high_nibbles(first) : low_nibbles(first), w);
    widen_16_bytes<false>(piece % 2 ? high_nibbles(second) : low_nibbles(second), w + half);
    scale_and_shift(w, kVecsPerBlock, half_to_float(block) * scale, -(half_to_float(block + 2) * minimum));
  } else {  // Q6_K: piece s = 4 h + k is run k of half h (gguf_blocks.py has the layout)
    const int h = piece / 4, k = piece % 4;
    const uint8_t* nibbles = block + 64 * h + 32 * (k % 2);
    const uint8_t* pairs = block + 128 + 32 * h;
    for (int part = 0; part < 2; ++part) {  // numbers 0..15, then 16..31
      const __m128i low = load_16_bytes(nibbles + 16 * part);
      const __m128i q = _mm_or_si128(k < 2 ? low_nibbles(low) : high_nibbles(low),
                                     high_two_bits(load_16_bytes(pairs + 16 * part), 2 * k));
      widen_16_bytes<true>(_mm_sub_epi8(q, _mm_set1_epi8(32)), w + part * half);  // q - 32 in [-32, 31]
      for (int v = part * half; v < (part + 1) * half; ++v) w[v] *= q6_k_scale(block, piece, part);
    }
  }
}
#else
// Number j of piece `piece` of one stored block, one at a time (the generic variant's way).
template <int64_t QTYPE>
inline float block_number(const uint8_t* block, int piece, int j) {
  if constexpr (QTYPE == kQ8_0) {
    return half_to_float(block) * static_cast<int8_t>(block[2 + j]);
  } else if constexpr (QTYPE == kQ4_0 || QTYPE == kQ4_1 || QTYPE == kQ5_0) {
    const float d = half_to_float(block);
    int q = (block[(QTYPE == kQ4_0 ? 2 : QTYPE == kQ4_1 ? 4 : 6) + j % 16] >> (j < 16 ? 0 : 4)) & 0x0F;
    if constexpr (QTYPE == kQ5_0) {
      uint32_t qh;
      std::memcpy(&qh, block + 2, 4);
      q |= ((qh >> j) & 1) << 4;
    }
    return d * q + (QTYPE == kQ4_1 ? half_to_float(block + 2) : QTYPE == kQ4_0 ? -8.f * d : -16.f * d);
  } else if constexpr (QTYPE == kQ4_K) {
    float scale, minimum;
    q4_k_scale_and_minimum(block + 4, piece, &scale, &minimum);
    const int q = (block[16 + 32 * (piece / 2) + j] >> (piece % 2 ? 4 : 0)) & 0x0F;
    return half_to_float(block) * scale * q - half_to_float(block + 2) * minimum;
  } else {
    const int h = piece / 4, k = piece % 4;
    const int low = (block[64 * h + 32 * (k % 2) + j] >> (k < 2 ? 0 : 4)) & 0x0F;
    const int high = (block[128 + 32 * h + j] >> (2 * k)) & 3;
    return q6_k_scale(block, piece, j / 16) * static_cast<float>((low | high << 4) - 32);
  }
}

// The generic variant: the piece dequantized into memory, then loaded.
template <int64_t QTYPE>
inline void dequantize_block(const uint8_t* block, int piece, FloatVec* w) {
  float numbers[kBlock];
  for (int j = 0; j < kBlock; ++j) numbers[j] = block_number<QTYPE>(block, piece, j);
  for (int k = 0; k < kVecsPerBlock; ++k) w[k] = load_vec(numbers + k * kLanes);
}
#endif

// Numbers 32 b .. 32 b + 31 of a row of blocks -> w[kVecsPerBlock] (b counts
// pieces of 32 along the row: a K-quant row's piece 9 is block 1's piece 1).
template <int64_t QTYPE>
inline void dequantize_piece(const uint8_t* row, int64_t b, FloatVec* w) {
  constexpr int64_t per_block = kPiecesPerBlock<QTYPE>;
  dequantize_block<QTYPE>(row + b / per_block * kBlockBytes<QTYPE>, static_cast<int>(b % per_block), w);
}

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
void dot_row_float(const uint8_t* w, int64_t pieces, const float* x, int64_t cols, float* out) {
  constexpr bool direct = (ROWS + 1) * kVecsPerBlock + 2 <= kVectorRegisters;
  constexpr int per_row = direct ? kVecsPerBlock : 1;
  FloatVec acc[ROWS][per_row] = {};
  FloatVec wv[kVecsPerBlock];
  for (int64_t b = 0; b < pieces; ++b) {
    dequantize_piece<QTYPE>(w, b, wv);
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
  const int64_t rows = qweight.size(0), pieces = cols / kBlock, bytes_per_row = qweight.size(1);
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
        for (int64_t b = 0; b < pieces; ++b) {
          dequantize_piece<format()>(w + r * bytes_per_row, b, numbers);
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
  const int64_t pieces = cols / kBlock;
  const float* xp = x.data_ptr<float>();
  at::Tensor out;
  with_format(qtype, [&](auto format) {
    out = gemv_rows(x, qweight, bias, [&](const uint8_t* row, int64_t first, int64_t count, float* dots) {
      with_row_count(count, [&](auto rows_tag) {
        dot_row_float<format(), rows_tag()>(row, pieces, xp + first * cols, cols, dots);
      });
    });
  });
  return out;
}
