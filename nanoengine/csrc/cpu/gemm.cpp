// y = x @ W^T (+ b) for every Linear layer and the LM head: the fp32 matmul a
// CPU step spends most of its time in, with the weight packed once at load.
//
// Chapter 7 (where a CPU step spends its time); chapter 2 compares it with the
// machine's GEMM roofline. vLLM 0.32 counterpart: csrc/cpu/dnnl_helper.cpp and
// the oneDNN matmul behind dispatch_cpu_unquantized_gemm (vLLM leaves the GEMM
// to oneDNN; nanoengine can too, with linear_backend="onednn").
//
// Why write a GEMM at all? A decode step multiplies a few dozen rows (one per
// request) by each weight matrix. Each weight is then read from DRAM once per
// step and used by only that many rows, so the step needs the memory system
// and the FMA units busy *at the same time*. Library GEMMs are tuned for large
// square products, where the weight sits in cache; at 32 rows the one measured
// here streams a panel in, computes on it, then stalls for the next, and
// reaches ~270 GFLOP/s where the big product reaches ~470. This kernel does the
// one thing that case needs: it asks for the weight bytes a few KB before it
// reaches them (software prefetch), so the loads overlap the arithmetic.
//
// The weight layout ("packed"): [ceil(N / P), K, P] with P = kPanel, two
// vectors (32 columns with AVX-512, 16 with AVX2, 8 with 4-lane vectors). Panel p holds output
// columns P*p .. P*p+P-1, stored k-major, so the kernel walks one panel as a
// single sequential stream of rows: two vectors per k.
// Columns past N are zero padding. The torch reference is F.linear on the
// unpacked weight; tests/test_cpu_fast_paths.py compares the two.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace {

constexpr int64_t kPanel = 2 * kLanes;  // output columns per packed panel: two FloatVecs (32, 16 or 8)
// Rows per register tile: kTileRows (ops.h), 12 with AVX-512 (or NEON), 6 with AVX2.
// How far ahead of the current k the weight stream is prefetched, in k steps
// (48 x 128 bytes = 6 KB with AVX-512, 3 KB with AVX2's narrower panels): about
// one DRAM latency's worth of FMAs. Measured with AVX-512 on a 2-core EPYC:
// no prefetch ~330 GFLOP/s at 32 rows, 16 steps ~370, 48 ~420.
constexpr int64_t kPrefetchSteps = 48;
// Rows of x per outer block: its rows stay in L2 (<= ~256 KB) while every panel
// of the weight passes by. A decode batch is a single block.
constexpr int64_t kBlockBytes = 256 << 10;

// One register tile: out[ROWS][cols] = x[ROWS][K] @ panel (+ bias), where the
// panel is [K, 32] (k-major) and cols <= 32 are the columns that really exist.
template <int ROWS>
void gemm_tile(float* out, int64_t out_stride, const float* x, int64_t x_stride, const float* panel,
               int64_t k_size, int64_t cols, const float* bias) {
  FloatVec acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = FloatVec{};
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * kPanel;
    // Past the panel's end this points into the next panel (or just beyond the
    // tensor): prefetches are hints and never fault, so no bounds check.
    __builtin_prefetch(w + kPrefetchSteps * kPanel);
    __builtin_prefetch(w + kPrefetchSteps * kPanel + kLanes);
    const FloatVec w0 = load_vec(w), w1 = load_vec(w + kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const float xr = x[r * x_stride + k];  // broadcast to all lanes
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float row[kPanel];
    std::memcpy(row, &acc[r][0], sizeof(FloatVec));
    std::memcpy(row + kLanes, &acc[r][1], sizeof(FloatVec));
    if (bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) row[c] += bias[c];
    std::memcpy(out + r * out_stride, row, cols * sizeof(float));
  }
}

// gemm_tile<1> .. gemm_tile<kTileRows>, indexed by rows - 1: the last tile of
// a batch is usually shorter than kTileRows, and each size gets its own
// fully unrolled code.
using TileFn = void (*)(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, const float*);
template <int... Rows>
constexpr std::array<TileFn, sizeof...(Rows)> tiles_for(std::integer_sequence<int, Rows...>) {
  return {&gemm_tile<Rows + 1>...};
}
constexpr auto kTiles = tiles_for(std::make_integer_sequence<int, kTileRows>{});

}  // namespace

at::Tensor pack_linear_weight(at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be a 2-D float32 [out, in]");
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  auto padded = at::zeros({panels * kPanel, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [panels * 32, K] -> [panels, 32, K] -> [panels, K, 32]: k-major inside a panel.
  return padded.view({panels, kPanel, k}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                         int64_t out_features) {
  check_float_contiguous(x, "x");
  check_float_contiguous(packed, "packed weight");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1),
              "x [rows, K] and a packed weight [panels, K, 32] must share K; got x ", x.sizes(), " and weight ",
              packed.sizes());
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
              "out_features ", out_features, " does not match ", packed.size(0), " panels of ", kPanel);
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    check_float_contiguous(*bias, "bias");
    TORCH_CHECK(bias->numel() == out_features, "bias must have out_features elements");
    bias_data = bias->data_ptr<float>();
  }
  const int64_t rows = x.size(0), k_size = x.size(1), panels = packed.size(0);
  auto out = at::empty({rows, out_features}, x.options());
  const float* x_data = x.data_ptr<float>();
  const float* w_data = packed.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const int64_t block_rows = std::max<int64_t>(kTileRows, kBlockBytes / (k_size * 4) / kTileRows * kTileRows);
  for (int64_t first_row = 0; first_row < rows; first_row += block_rows) {
    const int64_t end_row = std::min(rows, first_row + block_rows);
    // The two cores split the panels (output columns); both read the same x rows.
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel, cols = std::min(kPanel, out_features - col);
        for (int64_t r = first_row; r < end_row; r += kTileRows) {
          const int64_t tile_rows = std::min<int64_t>(kTileRows, end_row - r);
          kTiles[tile_rows - 1](out_data + r * out_features + col, out_features, x_data + r * k_size, k_size,
                                w_data + p * k_size * kPanel, k_size, cols,
                                bias_data == nullptr ? nullptr : bias_data + col);
        }
      }
    });
  }
  return out;
}

