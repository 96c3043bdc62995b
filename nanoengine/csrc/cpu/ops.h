// The CPU kernels nanoengine compiles on first use, and two helpers they share.
//
// Chapter 7. vLLM 0.32 counterpart: csrc/cpu/ (cpu_types.hpp and the *_ops
// declarations in csrc/ops.h). Python reaches these through
// nanoengine/_custom_ops.py, which builds attention.cpp, prefill_attention.cpp,
// gemm.cpp, gemm_bf16.cpp, gguf.cpp, gguf_q8.cpp, layers.cpp and bindings.cpp into one extension
// module per instruction-set variant (AVX-512, AVX2, generic): the widths and
// tile sizes below follow the variant's __AVX512F__.
#pragma once

// ATen's tensor type and the three tensor functions the kernels call, not
// <torch/extension.h>: that header (all of libtorch's C++ API and Python
// bindings) took ~30 s to compile per file, most of a variant's build.
// bindings.cpp alone needs Python, and includes only pybind11's conversions
// of at::Tensor (<torch/csrc/utils/pybind.h>).
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <cstring>
#include <string>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// Paged attention (attention.cpp).
void reshape_and_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache,
                       at::Tensor value_cache, at::Tensor slot_mapping);
void paged_decode_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                            at::Tensor value_cache, at::Tensor block_table,
                            at::Tensor seq_lens, double scale, int64_t sliding_window);
// Causal attention of a step's prefill requests (prefill_attention.cpp).
bool paged_prefill_supports(int64_t head_dim);
void paged_prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key_cache,
                             at::Tensor value_cache, at::Tensor block_table, at::Tensor query_start_loc,
                             at::Tensor seq_lens, int64_t first_req, double scale, int64_t sliding_window);

// Linear layers (gemm.cpp, and gemm_bf16.cpp for bf16 weights): pack a
// [out, in] weight once, then multiply by it.
at::Tensor pack_linear_weight(at::Tensor weight);
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                         int64_t out_features);
at::Tensor pack_linear_weight_bf16(at::Tensor weight);
at::Tensor packed_linear_bf16(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                              int64_t out_features, const std::string& kernel);
std::vector<std::string> bf16_gemm_kernels();

// Linear layers over GGML blocks (gguf.cpp, gguf_q8.cpp): a weight kept as uint8
// [rows, row_bytes] of Q8_0 (8), Q4_0 (2) or Q4_1 (3) blocks. gguf_linear keeps x
// in float32; gguf_linear_q8 rounds it to 8 bits per block, as llama.cpp does.
at::Tensor gguf_dequantize(at::Tensor qweight, int64_t qtype, int64_t cols);
at::Tensor gguf_linear(at::Tensor x, at::Tensor qweight, int64_t qtype, c10::optional<at::Tensor> bias,
                       int64_t cols);
at::Tensor gguf_linear_q8(at::Tensor x, at::Tensor qweight, int64_t qtype, c10::optional<at::Tensor> bias,
                          int64_t cols);

// Decoder-layer pieces (layers.cpp).
void rms_norm(at::Tensor out, at::Tensor input, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor input, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor positions, at::Tensor query, at::Tensor key,
                      at::Tensor cos_sin_cache, int64_t head_dim);
void silu_and_mul(at::Tensor out, at::Tensor input);

// Shared helpers.

// [anchor: float-vec]
// A float vector of one register: 16 lanes with AVX-512, 8 with AVX2 (or
// AVX), 4 on a CPU whose registers hold 128 bits (ARM's NEON, x86 without
// AVX: the generic variant there). GCC/Clang vector extensions keep the kernels portable
// while making register blocking explicit: a local FloatVec lives in a
// register, so accumulators never round-trip through memory. aligned(4):
// tensor rows are only float-aligned, so loads through it are unaligned loads.
// The width must be the machine's: an earlier version used 16 lanes
// everywhere, and GCC lowers a vector twice the register's width on AVX2
// through the stack, one lane at a time -- its prefill attention then ran at
// 5 GFLOP/s, 20x slower than the torch reference.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kVectorRegisters = 32;
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kVectorRegisters = 16;
#elif defined(__aarch64__)
constexpr int kLanes = 4;
constexpr int kVectorRegisters = 32;
#else
constexpr int kLanes = 4;
constexpr int kVectorRegisters = 16;
#endif
typedef float FloatVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
// [/anchor: float-vec]

inline FloatVec load_vec(const float* p) { return *reinterpret_cast<const FloatVec*>(p); }

// [anchor: tile-rows]
// Rows of one register tile in the kernels shaped like a matrix product
// (gemm.cpp, prefill_attention.cpp): ROWS x 2 FloatVec accumulators, two
// vectors of the other operand and one broadcast value must all fit the
// kVectorRegisters registers at once, or the compiler spills accumulators to
// memory inside the innermost loop and every multiply-add gains a store and
// a load. AVX-512 (and NEON): 12 x 2 + 2 + 1 = 27 of 32. AVX2: 6 x 2 + 2 + 1
// = 15 of 16 (the classic 6 x 16 tile of BLAS libraries for AVX2).
constexpr int kTileRows = kVectorRegisters == 32 ? 12 : 6;
// [/anchor: tile-rows]

inline void check_float_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// ---- bf16 ----------------------------------------------------------------
// A bf16 number is the top 16 bits of an fp32 one: same sign and exponent,
// 7 mantissa bits instead of 23. Widening is a shift; narrowing rounds the
// dropped 16 bits to nearest, ties to even (what torch's .to(bfloat16) does).
// Every kernel reads bf16, computes in fp32 registers, and rounds once when it
// writes: bf16 halves the bytes streamed from memory, not the precision of the
// arithmetic.
using BFloat16 = c10::BFloat16;

typedef uint16_t Bf16Vec __attribute__((vector_size(kLanes * 2), aligned(2)));  // kLanes bf16 numbers
typedef uint32_t UIntVec __attribute__((vector_size(kLanes * 4)));               // kLanes x 32 bits

// [anchor: widen-bf16]
// The portable spelling below is what the kernels mean; with AVX-512, GCC
// (which prefers 256-bit vectors on Intel CPUs) split it into six
// instructions per 16 lanes, so there it is spelled with the two intrinsics a
// 512-bit zero-extend and shift take. The decode kernel widens every cached
// row it reads: this alone was a fifth of its instructions.
inline FloatVec widen(Bf16Vec h) {
#ifdef __AVX512F__
  __m256i half;
  std::memcpy(&half, &h, sizeof(half));
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
  FloatVec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#else
  return (FloatVec)(__builtin_convertvector(h, UIntVec) << 16);
#endif
}
// [/anchor: widen-bf16]

// Adding 0x7FFF, plus 1 when the kept part is odd, carries into bit 16
// exactly when the dropped half is above (or at, for an odd kept part) 0x8000.
// With AVX-512 spelled in intrinsics, for the reason given at widen().
inline Bf16Vec narrow(FloatVec v) {
#ifdef __AVX512F__
  __m512i bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
  Bf16Vec h;
  std::memcpy(&h, &half, sizeof(h));
  return h;
#else
  const UIntVec bits = (UIntVec)v;
  return __builtin_convertvector((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16, Bf16Vec);
#endif
}

// Loads and stores of kLanes lanes from either element type, so one kernel
// template serves fp32 and bf16 tensors.
inline FloatVec load_vec(const BFloat16* p) { return widen(*reinterpret_cast<const Bf16Vec*>(p)); }
inline void store_vec(float* p, FloatVec v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_vec(BFloat16* p, FloatVec v) {
  const Bf16Vec h = narrow(v);
  std::memcpy(p, &h, sizeof(h));
}

// The same, one number at a time (tails, scalars).
inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store_scalar(float* p, float v) { *p = v; }
inline void store_scalar(BFloat16* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  p->x = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += to_float(a[i]) * to_float(b[i]);
  return sum;
}

// Activation tensors are fp32 or bf16 (the model's dtype). Calls
// body(scalar_t{}) with scalar_t = float or BFloat16; the body is a generic
// lambda that names the type as `using scalar_t = decltype(zero);`.
template <typename Body>
auto dispatch_float_bf16(at::ScalarType type, const char* name, Body body) {
  if (type == at::kFloat) return body(float{});
  TORCH_CHECK(type == at::kBFloat16, name, ": float32 or bfloat16 expected, got ", type);
  return body(BFloat16{});
}

// A contiguous tensor of the dispatched element type (float or BFloat16).
inline void check_contiguous_as(const at::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}
