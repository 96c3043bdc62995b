"""What a quantization method is: vLLM's two classes, ``QuantizationConfig`` and ``QuantizeMethodBase``.

Chapter 6 (what ``LLM(...)`` builds, and how many bytes the weights take).
vLLM 0.32 counterpart: ``vllm/model_executor/layers/quantization/base_config.py``
(``QuantizationConfig``, ``QuantizeMethodBase``) and ``LinearMethodBase`` in
``vllm/model_executor/layers/linear.py``.

A *config* knows the checkpoint (which format each layer's weight has) and
answers ``get_quant_method(layer, prefix)``: the *method* that layer uses,
or None to leave it unquantized. A method owns three moments of a layer's
life, in this order: ``create_weights`` (the parameters the checkpoint will
fill, e.g. a uint8 tensor of blocks instead of a float matrix),
``process_weights_after_loading`` (a last rearrangement, once the weights are
in), and ``apply`` (the forward pass: ``x @ W^T + b`` however ``W`` is stored).
A linear layer's ``forward`` calls ``apply`` and never needs to know the format.

vLLM hands the config to every layer's constructor; nanoengine's models are
built without one, and ``QuantizationConfig.quantize_layers`` gives each layer
its method right after the model is constructed and before any weight is
loaded (``model_loader/loader.py``): the same three moments, reached from
outside the model code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class QuantizeMethodBase(ABC):
    """How one layer stores and multiplies by its weight."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Replace the layer's parameters by the ones this format loads into."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """A last change once the checkpoint is in (nothing, unless a format needs it)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)``: x [num_tokens, in] -> [num_tokens, out], in x's dtype."""


class QuantizationConfig(ABC):
    """A checkpoint's quantization: which method each layer gets."""

    @abstractmethod
    def get_name(self) -> str:
        """The name ``quantization=`` takes (vLLM's: "gguf", "awq", ...)."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method of ``layer``, named ``prefix`` in the model; None: not quantized."""

    def quantize_layers(self, model: nn.Module) -> int:
        """Give every layer its method and let it create its weights; returns how many."""
        count = 0
        for prefix, layer in model.named_modules():
            method = self.get_quant_method(layer, prefix)
            if method is None:
                continue
            layer.quant_method = method
            method.create_weights(layer)
            count += 1
        return count
