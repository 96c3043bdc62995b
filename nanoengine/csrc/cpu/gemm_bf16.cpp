// y = x @ W^T (+ b) with bf16 x, W and y: gemm.cpp's job for a bf16 model,
// on the CPU's bf16 dot-product instructions, summing in fp32.
//
// Chapter 7 (where the bf16 step time goes); chapter 2 measures the bf16
// roofline beside the fp32 one. vLLM 0.32 counterpart: the oneDNN bf16 matmul
// behind dispatch_cpu_unquantized_gemm (csrc/cpu/dnnl_helper.cpp), which
// picks AMX or AVX-512 BF16 code itself; nanoengine can use it too with
// linear_backend="onednn".
//
// Why bf16 is faster: a decode step streams every weight from DRAM once, and
// bf16 weights are half the bytes of fp32 ones. The arithmetic gets cheaper
// too, on CPUs that have one of two instruction families:
//
// * AVX-512 BF16 (`avx512_bf16`; AMD Zen 4 and later, Intel Cooper Lake and
//   later): VDPBF16PS takes 16 *pairs* of bf16 numbers from each of two
//   registers and adds the 16 pairwise dot products into 16 fp32 sums: twice
//   the multiplies per instruction of an fp32 FMA. The kernel keeps gemm.cpp's
//   12 x 32 register tile; one broadcast now carries two x values, x[k] and
//   x[k+1].
// * AMX (`amx_bf16`; Intel Sapphire Rapids and later): eight 1 KB "tile"
//   registers and one instruction, TDPBF16PS, that multiplies a 16 x 32 bf16
//   tile by a 32 x 16 one into a 16 x 16 fp32 tile: 8,192 multiplies at once.
//   Four of them cover 32 rows x 32 output columns for 32 values of k.
//
// Both read one packed layout, made once at load: [ceil(N / 32), K2 / 2, 32, 2]
// with K2 = K rounded up to 32 (zero padding). Panel p holds output columns
// 32p .. 32p+31; for each pair of k (2i, 2i+1) it stores, column after
// column, the two weights that pair multiplies: the "VNNI" order both
// instructions expect, 128 bytes per pair of k. The torch reference is
// F.linear on the unpacked bf16 weight; tests/test_cpu_fast_paths.py compares.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>

#if defined(__AVX512BF16__) || (defined(__AMX_BF16__) && defined(__AMX_TILE__))
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanel = 32;     // output columns per panel
constexpr int64_t kKAlign = 32;    // K is padded to this: one AMX tile's depth
constexpr int64_t kPairElems = 2 * kPanel;  // elements per pair of k in a panel (128 bytes)
// As in gemm.cpp: the weight stream is prefetched 48 x 128 bytes = 6 KB ahead.
constexpr int64_t kPrefetchPairs = 48;
// Rows of x per outer block, so a block stays in L2 while every panel passes.
constexpr int64_t kBlockBytes = 256 << 10;

int64_t padded_k(int64_t k) { return (k + kKAlign - 1) / kKAlign * kKAlign; }

// out[r][c] = bf16(acc[r][c] + bias[c]) for the rows x cols that exist.
// acc: [rows][32] fp32, row stride acc_stride. A full panel (32 columns) is
// written kLanes lanes at a time; a prefill writes millions of
// outputs per layer, so a scalar loop here costs as much as the tile products.
void write_rows(BFloat16* out, int64_t out_stride, const float* acc, int64_t acc_stride, int64_t rows,
                int64_t cols, const BFloat16* bias) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * acc_stride;
    BFloat16* o = out + r * out_stride;
    if (cols == kPanel) {
      for (int64_t c = 0; c < kPanel; c += kLanes)
        store_vec(o + c, load_vec(a + c) + (bias != nullptr ? load_vec(bias + c) : FloatVec{}));
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) store_scalar(o + c, a[c] + (bias != nullptr ? to_float(bias[c]) : 0.f));
  }
}

// Everything one call multiplies: x [rows, K2 in memory] by the panels.
struct Problem {
  const BFloat16* x;
  int64_t x_stride;  // elements between rows of x (K2 when x was padded)
  const BFloat16* panels;
  int64_t k_pairs;  // K2 / 2
  int64_t rows, out_features;
  const BFloat16* bias;  // or nullptr
  BFloat16* out;
};

#if defined(__AVX512BF16__)
// ---- AVX-512 BF16 --------------------------------------------------------------

constexpr int kTileRows = 12;  // 12 rows x 2 vectors = 24 accumulators, as gemm.cpp

// [anchor: dpbf16-tile]
template <int ROWS>
void dpbf16_tile(const Problem& pb, int64_t first_row, int64_t panel) {
  const BFloat16* w_panel = pb.panels + panel * pb.k_pairs * kPairElems;
  const BFloat16* x = pb.x + first_row * pb.x_stride;
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < pb.k_pairs; ++kp) {
    const BFloat16* w = w_panel + kp * kPairElems;
    __builtin_prefetch(w + kPrefetchPairs * kPairElems);
    __builtin_prefetch(w + kPrefetchPairs * kPairElems + kPanel);
    // Columns 0-15 and 16-31, each as 16 (W[c][2kp], W[c][2kp+1]) pairs.
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + kPanel);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;  // x[r][2kp] and x[r][2kp+1], broadcast to all 16 lanes
      std::memcpy(&pair, x + r * pb.x_stride + 2 * kp, sizeof(pair));
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
    }
  }
  float rows_acc[ROWS][kPanel];
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(rows_acc[r], acc[r][0]);
    _mm512_storeu_ps(rows_acc[r] + kLanes, acc[r][1]);
  }
  const int64_t col = panel * kPanel, cols = std::min(kPanel, pb.out_features - col);
  write_rows(pb.out + first_row * pb.out_features + col, pb.out_features, &rows_acc[0][0], kPanel, ROWS, cols,
             pb.bias == nullptr ? nullptr : pb.bias + col);
}
// [/anchor: dpbf16-tile]

using DpTileFn = void (*)(const Problem&, int64_t, int64_t);
template <int... Rows>
constexpr std::array<DpTileFn, sizeof...(Rows)> dp_tiles_for(std::integer_sequence<int, Rows...>) {
  return {&dpbf16_tile<Rows + 1>...};
}
constexpr auto kDpTiles = dp_tiles_for(std::make_integer_sequence<int, kTileRows>{});

void run_avx512_bf16(const Problem& pb) {
  const int64_t panels = (pb.out_features + kPanel - 1) / kPanel;
  const int64_t block_rows =
      std::max<int64_t>(kTileRows, kBlockBytes / (pb.x_stride * 2) / kTileRows * kTileRows);
  for (int64_t first = 0; first < pb.rows; first += block_rows) {
    const int64_t end = std::min(pb.rows, first + block_rows);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t stop) {
      for (int64_t p = begin; p < stop; ++p)
        for (int64_t r = first; r < end; r += kTileRows)
          kDpTiles[std::min<int64_t>(kTileRows, end - r) - 1](pb, r, p);
    });
  }
}
#endif  // __AVX512BF16__

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// ---- AMX -------------------------------------------------------------------------

// Linux hands a process the 8 KB of AMX tile state only when asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the
// first tile instruction kills the process. Asked once, for all threads.
bool amx_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// The shape of each tile register, loaded per thread (tile state is per thread).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row
  uint8_t rows[16];
};

// Tiles 0-3: C, 16 x 16 fp32 (rows 0-15 / 16-31 x columns 0-15 / 16-31);
// 4, 5: A, 16 rows of x x 32 values of k; 6, 7: B, 16 pairs of k x 16 columns.
// Every tile is 16 rows of 64 bytes.
void configure_tiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// acc [16 * A_TILES][32] fp32 (+)= 16 or 32 rows of x (from `x`, stride
// x_stride) times pairs of k [first_pair, end_pair) of one panel. With
// `accumulate` the tiles start from acc (an earlier chunk of k), else from zero.
// [anchor: amx-block]
template <int A_TILES>
void amx_block(float* acc, bool accumulate, const BFloat16* x, int64_t x_stride, const BFloat16* panel,
               int64_t first_pair, int64_t end_pair) {
  const int64_t x_bytes = x_stride * 2;
  constexpr int64_t kAccBytes = kPanel * 4;       // one row of acc
  constexpr int64_t kPairsPerTile = kKAlign / 2;  // 16 pairs of k: one B tile's rows
  if (accumulate) {
    _tile_loadd(0, acc, kAccBytes);
    _tile_loadd(1, acc + 16, kAccBytes);
    if (A_TILES == 2) {
      _tile_loadd(2, acc + 16 * kPanel, kAccBytes);
      _tile_loadd(3, acc + 16 * kPanel + 16, kAccBytes);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if (A_TILES == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t kp = first_pair; kp < end_pair; kp += kPairsPerTile) {
    const BFloat16* b = panel + kp * kPairElems;
    // The weight stream is prefetched two B tiles (4 KB) ahead, as in the other kernels.
    for (int64_t line = 0; line < kPairsPerTile * kPairElems; line += 32)
      __builtin_prefetch(b + 2 * kPairsPerTile * kPairElems + line);
    _tile_loadd(6, b, kPairElems * 2);           // columns 0-15
    _tile_loadd(7, b + kPanel, kPairElems * 2);  // columns 16-31
    _tile_loadd(4, x + 2 * kp, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (A_TILES == 2) {
      _tile_loadd(5, x + 16 * x_stride + 2 * kp, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, kAccBytes);
  _tile_stored(1, acc + 16, kAccBytes);
  if (A_TILES == 2) {
    _tile_stored(2, acc + 16 * kPanel, kAccBytes);
    _tile_stored(3, acc + 16 * kPanel + 16, kAccBytes);
  }
}
// [/anchor: amx-block]

// Pairs of k per chunk: 128 pairs x 128 bytes = 16 KB of a panel. A chunk is
// read from memory once and then stays in L1 (48 KB) while every row group of
// the block passes by; without chunks a prefill reloaded the whole panel from
// L2 for every 32 rows, and the tile products waited on L2.
constexpr int64_t kChunkPairs = 128;
// Rows of x per outer block. Every block streams the whole weight once, so a
// big block means fewer passes over a weight larger than L2; CPUs with AMX
// have 2 MB of L2 per core, and half of it holds the block. (At 256 KB a
// [2048 x 576] x [576 x 3072] prefill product streamed its 3.5 MB weight 11
// times and ran ~35% below oneDNN.)
constexpr int64_t kAmxBlockBytes = 1 << 20;

void run_amx(const Problem& pb) {
  TORCH_CHECK(amx_permitted(), "the kernel refused this process the AMX tile state (arch_prctl)");
  const int64_t panels = (pb.out_features + kPanel - 1) / kPanel;
  // A tile always reads 16 rows: the last rows % 16 rows are copied into a
  // zero-padded 16-row buffer, so no tile reads past the end of x.
  const int64_t full_rows = pb.rows / 16 * 16, tail_rows = pb.rows - full_rows;
  std::vector<BFloat16> tail(tail_rows > 0 ? 16 * pb.x_stride : 0, BFloat16(0.f));
  for (int64_t r = 0; r < tail_rows; ++r)
    std::memcpy(tail.data() + r * pb.x_stride, pb.x + (full_rows + r) * pb.x_stride, pb.x_stride * 2);
  const int64_t block_rows = std::max<int64_t>(32, kAmxBlockBytes / (pb.x_stride * 2) / 32 * 32);
  for (int64_t first = 0; first < pb.rows; first += block_rows) {
    const int64_t end = std::min(pb.rows, first + block_rows);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t stop) {
      configure_tiles();
      // acc: the fp32 sums of every row of the block for one panel, [rows][32].
      std::vector<float> acc((end - first + 16) * kPanel);
      for (int64_t p = begin; p < stop; ++p) {
        const BFloat16* panel = pb.panels + p * pb.k_pairs * kPairElems;
        for (int64_t chunk = 0; chunk < pb.k_pairs; chunk += kChunkPairs) {
          const int64_t chunk_end = std::min(pb.k_pairs, chunk + kChunkPairs);
          for (int64_t r = first; r < end;) {
            const int64_t rows = std::min<int64_t>(end - r, r + 32 <= full_rows ? 32 : 16);
            const BFloat16* x = r < full_rows ? pb.x + r * pb.x_stride : tail.data();
            float* group_acc = acc.data() + (r - first) * kPanel;
            if (rows > 16)
              amx_block<2>(group_acc, chunk > 0, x, pb.x_stride, panel, chunk, chunk_end);
            else
              amx_block<1>(group_acc, chunk > 0, x, pb.x_stride, panel, chunk, chunk_end);
            r += rows;
          }
        }
        const int64_t col = p * kPanel, cols = std::min(kPanel, pb.out_features - col);
        write_rows(pb.out + first * pb.out_features + col, pb.out_features, acc.data(), kPanel, end - first, cols,
                   pb.bias == nullptr ? nullptr : pb.bias + col);
      }
      _tile_release();
    });
  }
}
#endif  // AMX

}  // namespace

at::Tensor pack_linear_weight_bf16(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "weight must be a 2-D bfloat16 [out, in]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel, k2 = padded_k(k);
  auto padded = at::zeros({panels * kPanel, k2}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [panels * 32, K2] -> [panels, 32, K2 / 2, 2] -> [panels, K2 / 2, 32, 2]: pairs of k, column-interleaved.
  return padded.view({panels, kPanel, k2 / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

std::vector<std::string> bf16_gemm_kernels() {
  std::vector<std::string> kernels;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (amx_permitted()) kernels.push_back("amx");
#endif
#if defined(__AVX512BF16__)
  kernels.push_back("avx512_bf16");
#endif
  return kernels;
}

at::Tensor packed_linear_bf16(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                              int64_t out_features, const std::string& kernel) {
  check_contiguous_as(x, at::kBFloat16, "x");
  check_contiguous_as(packed, at::kBFloat16, "packed weight");
  const int64_t rows = x.size(0), k = x.size(1), k2 = padded_k(k);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == kPanel && packed.size(1) * 2 == k2,
              "x [rows, K] and a packed weight [panels, K2/2, 32, 2] (K2 = K rounded up to ", kKAlign,
              ") do not match: x ", x.sizes(), ", weight ", packed.sizes());
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
              "out_features ", out_features, " does not match ", packed.size(0), " panels of ", kPanel);
  const BFloat16* bias_data = nullptr;
  if (bias.has_value()) {
    check_contiguous_as(*bias, at::kBFloat16, "bias");
    TORCH_CHECK(bias->numel() == out_features, "bias must have out_features elements");
    bias_data = bias->data_ptr<BFloat16>();
  }
  // Both kernels read x in steps of 32 values of k: pad K with zeros if needed.
  const at::Tensor x_k2 = k2 == k ? x : at::constant_pad_nd(x, {0, k2 - k});
  auto out = at::empty({rows, out_features}, x.options());
  const Problem pb{x_k2.data_ptr<BFloat16>(), k2, packed.data_ptr<BFloat16>(), k2 / 2, rows,
                   out_features, bias_data, out.data_ptr<BFloat16>()};
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (kernel == "amx") {
    run_amx(pb);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  if (kernel == "avx512_bf16") {
    run_avx512_bf16(pb);
    return out;
  }
#endif
  TORCH_CHECK(false, "bf16 GEMM kernel '", kernel, "' is not available on this CPU; available: ",
              c10::Join(", ", bf16_gemm_kernels()));
}
