"""``quantization="gguf"``: linear layers and the embedding keep llama.cpp's blocks in memory.

Chapter 2 (decode reads every weight once per step: 5 bits a weight instead
of 32 is the speed-up) and chapter 6 (the memory it saves). vLLM 0.32
counterpart: none for GGUF -- its CPU wheel reads no GGUF file (earlier
releases had a ``GGUFConfig`` with ``GGUFLinearMethod`` and
``GGUFEmbeddingMethod``, the names used here). Its CPU path for 4-bit weights
is compressed-tensors' wNa16 scheme
(``vllm/model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py``),
which likewise keeps the weights packed and multiplies them as they are.

``GGUFConfig`` is read off the file: the GGML type of every weight. A layer
whose weight is a block format (``gguf_blocks.FORMATS``) gets a method; its
parameter becomes the uint8 tensor of blocks, [rows, row_bytes], which the
layer's own ``weight_loader`` fills row by row exactly as it fills a float
matrix -- a fused ``qkv_proj`` takes the rows of q, k and v, whose types must
then agree. The norms, in float32 in every GGUF, stay float.

``GGUFLinearMethod.apply`` multiplies in one of two ways, by the number of
rows (tokens) in the step:

* up to ``GEMV_MAX_ROWS`` (decode, small batches): a GEMV of
  ``csrc/cpu/gguf.cpp``, which reads each weight block once and multiplies it
  into every row while it is in registers. By default the activations stay
  float32 (``gguf_linear``): the products are the reference's, in another
  order, and so are the greedy tokens. ``NANOENGINE_GGUF_ACTIVATIONS=q8``
  rounds them to 8 bits per block first, as llama.cpp does
  (``gguf_linear_q8``, written for Q8_0, Q4_0 and Q4_1): faster at batch 1
  with AVX-512 (slower with AVX2, and at batch 8), and it flips near-tie
  tokens (chapter 2 has the figures);
* more rows (prefill): the weight dequantized to float32 for this call and an
  ordinary matmul; prefill is compute-bound, and a float product is the
  fastest there is.

Without the C++ kernels, both are the torch reference: ``gguf_blocks.
dequantize_blocks`` and ``F.linear``, exact to float32 rounding.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine._custom_ops import cpu_ops_available, load_cpu_ops
from nanoengine.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from nanoengine.model_executor.layers.quantization.gguf_blocks import (
    FORMATS,
    GGMLType,
    dequantize_blocks,
    row_bytes,
)

# Steps with at most this many rows take the quantized GEMV; more rows dequantize.
GEMV_MAX_ROWS = 8
# The formats llama.cpp's 8-bit-activation GEMV is written for here; the others always take the float one.
Q8_GEMV_FORMATS = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1)
# What the GEMV does with the activations: "float32" (the default) or "q8" (llama.cpp's way).
ACTIVATIONS_ENV = "NANOENGINE_GGUF_ACTIVATIONS"
GEMV_ACTIVATIONS = ("float32", "q8")


# False inside torch_reference_only(): every GGUF layer then takes the torch reference path.
_kernels_allowed = True


@contextlib.contextmanager
def torch_reference_only() -> Iterator[None]:
    """Inside, GGUF layers multiply as the torch reference does (``dequantize_blocks``, then ``F.linear``),
    built kernels or not: the path every kernel is tested against. Chapter 2's benchmark compares
    the kernels' tokens with it, and exercise 2.1's end-to-end check runs on it."""
    global _kernels_allowed
    _kernels_allowed = False
    try:
        yield
    finally:
        _kernels_allowed = True


def use_kernels(qweight: torch.Tensor) -> bool:
    """Whether a GGUF weight on this device is multiplied by the C++ kernels."""
    return _kernels_allowed and qweight.device.type == "cpu" and cpu_ops_available()


def gemv_activations() -> str:
    """The GEMV's activations this process asks for, checked."""
    value = os.environ.get(ACTIVATIONS_ENV, "float32")
    if value not in GEMV_ACTIVATIONS:
        raise ValueError(f"{ACTIVATIONS_ENV}={value!r}: expected one of {', '.join(GEMV_ACTIVATIONS)}.")
    return value


def gguf_dequantize(qweight: torch.Tensor, qtype: GGMLType, cols: int) -> torch.Tensor:
    """uint8 blocks [rows, row_bytes] -> float32 [rows, cols]: the C++ kernel, else the torch reference."""
    if use_kernels(qweight):
        out: torch.Tensor = load_cpu_ops().gguf_dequantize(qweight, int(qtype), cols)
        return out
    return dequantize_blocks(qweight, qtype)


def gemv_kernel(qtype: GGMLType, activations: str) -> Callable[..., torch.Tensor]:
    """The C++ GEMV for ``qtype``: llama.cpp's 8-bit one when asked for and written for the format."""
    ops = load_cpu_ops()
    return ops.gguf_linear_q8 if activations == "q8" and qtype in Q8_GEMV_FORMATS else ops.gguf_linear


def gguf_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLType, cols: int,
                bias: torch.Tensor | None, activations: str = "float32") -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` in blocks: x [..., cols] -> [..., rows], in x's dtype.

    ``activations`` ("float32" or "q8") picks the GEMV of a decode-sized step.
    """
    rows = x.reshape(-1, cols)  # [num_tokens, cols]
    if rows.shape[0] <= GEMV_MAX_ROWS and use_kernels(qweight):
        float_bias = None if bias is None else bias.float()
        out = gemv_kernel(qtype, activations)(rows.float().contiguous(), qweight, int(qtype), float_bias, cols)
    else:
        weight = gguf_dequantize(qweight, qtype, cols).to(x.dtype)  # [rows, cols], this call only
        out = F.linear(rows, weight, bias)
    return out.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])


class GGUFConfig(QuantizationConfig):
    """The GGML type of each checkpoint weight, by its Hugging Face name."""

    def __init__(self, weight_types: dict[str, GGMLType], checkpoint_names: dict[str, list[str]],
                 to_q8: frozenset[str] = frozenset()) -> None:
        # weight_types: e.g. "model.layers.0.self_attn.q_proj.weight" -> GGMLType.Q4_1.
        # checkpoint_names: a model parameter -> the checkpoint weights that fill it
        # ("...qkv_proj.weight" -> the q, k and v weights).
        # to_q8: the checkpoint weights converted to Q8_0 at load (weight_types already
        # says Q8_0 for them): the parts of a fused parameter whose file types differ.
        self.weight_types = weight_types
        self.checkpoint_names = checkpoint_names
        self.to_q8 = to_q8

    def get_name(self) -> str:
        return "gguf"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from nanoengine.model_executor.layers.cpu_linear import PackableLinear
        from nanoengine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        if not isinstance(layer, (PackableLinear, VocabParallelEmbedding)):
            return None
        qtype = self.type_of(f"{prefix}.weight")
        if qtype is None:
            return None
        return GGUFEmbeddingMethod(qtype) if isinstance(layer, VocabParallelEmbedding) else GGUFLinearMethod(qtype)

    def type_of(self, param_name: str) -> GGMLType | None:
        """The block format of a model parameter; None if it is float. The checkpoint
        weights a fused parameter is made of share one format: ``gguf_config`` made
        any that differed in the file Q8_0 (``to_q8``)."""
        sources = self.checkpoint_names.get(param_name, [param_name])
        types = {self.weight_types[name] for name in sources if name in self.weight_types}
        assert len(types) <= 1, f"{param_name} fuses weights of different GGUF types: {sorted(types)}"
        qtype = types.pop() if types else None
        return qtype if qtype in FORMATS else None


class GGUFLinearMethod(QuantizeMethodBase):
    """A linear layer (or the LM head) whose weight is a matrix of GGML blocks."""

    def __init__(self, qtype: GGMLType) -> None:
        self.qtype = qtype
        self.cols = 0  # the float matrix's columns (set by create_weights)
        self.activations = gemv_activations()  # read once, at load: a bad value fails LLM(...)
        # The C++ GEMV this layer's decode steps call directly; None: no kernels for this weight.
        self.gemv: Callable[..., torch.Tensor] | None = None

    def __repr__(self) -> str:
        return f"gguf {self.qtype.name}"

    def create_weights(self, layer: nn.Module) -> None:
        self.cols = replace_by_blocks(layer, self.qtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if use_kernels(layer_weight(layer)):
            self.gemv = gemv_kernel(self.qtype, self.activations)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # A float32 decode step goes straight to the kernel: at batch 1 a decode step makes
        # 121 of these calls (SmolLM2), and gguf_matmul's reshapes and checks cost each ~10 us.
        if (self.gemv is not None and _kernels_allowed and x.dtype == torch.float32 and x.dim() == 2
                and x.shape[0] <= GEMV_MAX_ROWS and x.is_contiguous()):
            return self.gemv(x, layer.weight, int(self.qtype), bias, self.cols)
        return gguf_matmul(x, layer_weight(layer), self.qtype, self.cols, bias, self.activations)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token embedding in GGML blocks: a lookup dequantizes only the rows it reads."""

    def __init__(self, qtype: GGMLType) -> None:
        self.qtype = qtype
        self.cols = 0
        self.dtype = torch.float32  # the model's float dtype, for the rows looked up

    def __repr__(self) -> str:
        return f"gguf {self.qtype.name}"

    def create_weights(self, layer: nn.Module) -> None:
        self.dtype = layer_weight(layer).dtype
        self.cols = replace_by_blocks(layer, self.qtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: token ids [num_tokens] -> their rows [num_tokens, hidden], in the model's dtype."""
        return gguf_dequantize(layer_weight(layer)[x].contiguous(), self.qtype, self.cols).to(self.dtype)


def layer_weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight
    assert isinstance(weight, torch.Tensor), type(weight)
    return weight


def replace_by_blocks(layer: nn.Module, qtype: GGMLType) -> int:
    """Swap the layer's float [rows, cols] ``weight`` for an empty uint8 [rows, row_bytes] one; returns cols.

    The float one was never filled (torch.empty): nothing is lost, and its
    pages were never touched, so it cost no memory either.
    """
    rows, cols = (int(size) for size in layer_weight(layer).shape)
    layer.weight = nn.Parameter(torch.empty(rows, row_bytes(qtype, cols), dtype=torch.uint8), requires_grad=False)
    return cols
