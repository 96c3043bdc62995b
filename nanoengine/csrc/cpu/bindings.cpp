// Python bindings of the CPU kernels declared in ops.h.
//
// Chapter 7. vLLM 0.32 counterpart: csrc/cpu/torch_bindings.cpp (vLLM registers
// torch custom ops; a plain pybind11 module is enough here, as nothing is traced
// or compiled around these calls).
// pybind11 and its at::Tensor conversions alone, not <torch/extension.h>: that
// header adds libtorch's whole C++ frontend, and compiled in 22 s here where
// this one takes 10 s (the longest file of a variant's build, so its wall time).
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each call releases the GIL: the engine thread keeps running Python (the
  // next step's scheduling, output processing) while a kernel computes.
  auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("reshape_and_cache", &reshape_and_cache, "Write K/V rows into their cache slots", no_gil);
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache", no_gil);
  m.def("paged_prefill_supports", &paged_prefill_supports, "Whether paged_prefill_attention takes this head_dim");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal attention of requests first_req.. over a paged KV cache", no_gil);
  m.def("pack_linear_weight", &pack_linear_weight, "[out, in] -> [ceil(out/P), in, P] panels (P = 2 vectors)",
        no_gil);
  m.def("packed_linear", &packed_linear, "x @ W^T (+ bias) with a weight from pack_linear_weight", no_gil);
  m.def("pack_linear_weight_bf16", &pack_linear_weight_bf16,
        "bf16 [out, in] -> [ceil(out/32), K2/2, 32, 2] pairs of k (K2 = in rounded up to 32)", no_gil);
  m.def("packed_linear_bf16", &packed_linear_bf16,
        "bf16 x @ W^T (+ bias) with a weight from pack_linear_weight_bf16, on the named kernel", no_gil);
  m.def("bf16_gemm_kernels", &bf16_gemm_kernels,
        "The bf16 GEMM kernels this CPU runs, fastest first: 'amx', 'avx512_bf16' (may be empty)");
  m.def("vector_lanes", [] { return kLanes; },
        "Floats per vector in this build (ops.h): 16 with AVX-512, 8 with AVX2, 4 with 128-bit vectors; a "
        "packed_linear panel is two vectors wide");
  m.def("gguf_dequantize", &gguf_dequantize, "uint8 [rows, row_bytes] GGML blocks -> float32 [rows, cols]",
        no_gil);
  m.def("gguf_linear", &gguf_linear, "x @ W^T (+ bias) with W in GGML blocks dequantized in registers, x float32",
        no_gil);
  m.def("gguf_linear_q8", &gguf_linear_q8, "x @ W^T (+ bias) with W in GGML blocks, x rounded to 8 bits per block",
        no_gil);
  m.def("rms_norm", &rms_norm, "out = RMSNorm(input) * weight", no_gil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += input; input = RMSNorm(residual) * weight",
        no_gil);
  m.def("rotary_embedding", &rotary_embedding, "RoPE (rotate-half style) on query and key, in place", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "out = silu(input[:, :d]) * input[:, d:]", no_gil);
}
