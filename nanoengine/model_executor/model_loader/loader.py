"""get_model: build the model class for a config on a device and load its weights.

Chapter 6 (``Worker.load_model`` -> ``ModelRunner.load_model`` -> here).
vLLM 0.32 counterpart: ``vllm/model_executor/model_loader/__init__.py``
(``get_model``), ``default_loader.py`` (``DefaultModelLoader.load_model``) and
``dummy_loader.py`` (``DummyModelLoader``).

The sequence is vLLM's: pick the class from the registry, construct it directly
on the target device in the target dtype (no throw-away CPU fp32 copy of a big
model), then stream the checkpoint into it with the model's own
``load_weights``. No ``AutoModel``: the module that runs is the one defined in
``models/``. Last comes vLLM's ``process_weights_after_loading``: on a CPU the
linear layers may swap their weights for prepacked copies
(``layers/cpu_linear.py``).

``load_format`` says where the weights come from. ``"auto"`` reads the
checkpoint. ``"dummy"`` reads nothing: the model built from the config is
filled with seeded random values (``initialize_dummy_weights``), and even
safetensors files sitting in the folder are ignored. Dummy weights make
meaningless text, but everything else is real: the same shapes, the same bytes
of memory, the same KV cache size and the same speed per step. That is what a
study of the engine needs when the checkpoint cannot be had (chapter 6 builds
Qwen3.5-0.8B this way from a config nanoengine ships).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoengine.model_executor.layers.cpu_linear import process_weights_after_loading
from nanoengine.model_executor.model_loader.gguf_loader import GGUFCheckpoint, gguf_config
from nanoengine.model_executor.model_loader.weight_utils import (
    initialize_dummy_weights,
    safetensors_files,
    safetensors_weights_iterator,
)
from nanoengine.model_executor.models.registry import CausalLM, get_model_class

# Where the weights come from: the checkpoint, or seeded random values.
LOAD_FORMATS = ("auto", "dummy")


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` the dtype of newly created floating tensors."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def construct_model(
    model_cls: type[CausalLM], hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """``model_cls(hf_config)`` with empty parameters.

    Parameters are created as torch.empty in these contexts: already on the
    device, already in the dtype, waiting for the checkpoint to fill them. On
    the ``meta`` device they get shapes and no memory (``worker/kv_cache_spec.py``).
    Under tensor parallelism the parallel layers read this process's rank
    (``distributed/parallel_state.py``) and allocate only their slice; the
    worker joins the group before it gets here.
    """
    with default_dtype(dtype), torch.device(device):
        return model_cls(hf_config)


def get_model(
    model_path: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    linear_backend: str = "torch",
    load_format: str = "auto",
    seed: int = 0,
    gguf_file: str | None = None,
) -> CausalLM:
    """The ready-to-run model: weights loaded, in eval mode, gradients off.

    ``linear_backend`` is a resolved name ("torch", "onednn" or "cpu", see
    ``resolve_linear_backend``); "torch" leaves the plain weights in place.
    ``load_format`` is "auto" (the safetensors in ``model_path``) or "dummy"
    (random values drawn from ``seed``, the folder's weights unread).
    ``gguf_file``: read the weights from this GGUF instead, and keep its
    quantized ones as blocks (``quantization="gguf"``).

    Typed as the registry's ``CausalLM`` protocol (forward, compute_logits,
    load_weights): the Llama family and the hybrid Qwen3.5 share no base class.
    Every one is an ``nn.Module`` too; ``isinstance(model, nn.Module)`` tells mypy so.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"Model dtype must be a floating-point dtype, got {dtype}.")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}.")
    model_cls = get_model_class(hf_config)
    if load_format == "auto" and gguf_file is None:
        # Fail on a weightless directory before spending time building the model.
        safetensors_files(model_path)
    checkpoint = None if gguf_file is None else GGUFCheckpoint(gguf_file)  # a bad file fails here, named
    model = construct_model(model_cls, hf_config, dtype, device)
    # Narrows the protocol to "CausalLM and nn.Module" for the calls below.
    assert isinstance(model, nn.Module), f"{model_cls.__name__} must be an nn.Module"
    if load_format == "dummy":
        initialize_dummy_weights(model, seed)
    elif checkpoint is not None:
        # vLLM hands the quantization config to every layer's constructor; here each
        # layer gets its method (and its uint8 blocks) between construction and loading.
        quant_config = gguf_config(checkpoint, model, bool(getattr(hf_config, "tie_word_embeddings", False)))
        quant_config.quantize_layers(model)
        model.load_weights(checkpoint.weights(quant_config.to_q8))
    else:
        model.load_weights(safetensors_weights_iterator(model_path))
    model.eval()
    model.requires_grad_(False)
    # Dummy weights are prepacked too: the step then runs the kernels real weights would.
    process_weights_after_loading(model, linear_backend)
    return model
