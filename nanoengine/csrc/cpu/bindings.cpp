// Python bindings of the CPU kernels declared in ops.h.
//
// Chapter 7. vLLM 0.32 counterpart: csrc/cpu/torch_bindings.cpp (vLLM registers
// torch custom ops; a plain pybind11 module is enough here, as nothing is traced
// or compiled around these calls).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each call releases the GIL: the engine thread keeps running Python (the
  // next step's scheduling, output processing) while a kernel computes.
  auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("reshape_and_cache", &reshape_and_cache, "Write K/V rows into their cache slots", no_gil);
  m.def("paged_decode_attention", &paged_decode_attention, "Decode attention over a paged KV cache", no_gil);
  m.def("rms_norm", &rms_norm, "out = RMSNorm(input) * weight", no_gil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += input; input = RMSNorm(residual) * weight",
        no_gil);
  m.def("rotary_embedding", &rotary_embedding, "RoPE (rotate-half style) on query and key, in place", no_gil);
  m.def("silu_and_mul", &silu_and_mul, "out = silu(input[:, :d]) * input[:, d:]", no_gil);
}
