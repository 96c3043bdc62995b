"""get_model: build the model class for a config on a device and load its weights.

Chapter 6 (``Worker.load_model`` -> ``ModelRunner.load_model`` -> here).
vLLM 0.32 counterpart: ``vllm/model_executor/model_loader/__init__.py``
(``get_model``) and ``default_loader.py`` (``DefaultModelLoader.load_model``).

The sequence is vLLM's: pick the class from the registry, construct it directly
on the target device in the target dtype (no throw-away CPU fp32 copy of a big
model), then stream the checkpoint into it with the model's own
``load_weights``. No ``AutoModel``: the module that runs is the one defined in
``models/``. Last comes vLLM's ``process_weights_after_loading``: on a CPU the
linear layers may swap their weights for prepacked copies
(``layers/cpu_linear.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoengine.model_executor.layers.cpu_linear import process_weights_after_loading
from nanoengine.model_executor.model_loader.weight_utils import (
    safetensors_files,
    safetensors_weights_iterator,
)
from nanoengine.model_executor.models.registry import CausalLM, get_model_class


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` the dtype of newly created floating tensors."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model(
    model_path: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    linear_backend: str = "torch",
) -> CausalLM:
    """The ready-to-run model: weights loaded, in eval mode, gradients off.

    ``linear_backend`` is a resolved name ("torch", "onednn" or "cpu", see
    ``resolve_linear_backend``); "torch" leaves the plain weights in place.

    Typed as the registry's ``CausalLM`` protocol (forward, compute_logits,
    load_weights): the Llama family and the hybrid Qwen3.5 share no base class.
    Every one is an ``nn.Module`` too; ``isinstance(model, nn.Module)`` tells mypy so.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"Model dtype must be a floating-point dtype, got {dtype}.")
    model_cls = get_model_class(hf_config)
    # Fail on a weightless directory before spending time building the model.
    safetensors_files(model_path)
    # Parameters are created as torch.empty in these contexts: already on the
    # device, already in the dtype, waiting for the checkpoint to fill them.
    with default_dtype(dtype), torch.device(device):
        model = model_cls(hf_config)
    # Narrows the protocol to "CausalLM and nn.Module" for the calls below.
    assert isinstance(model, nn.Module), f"{model_cls.__name__} must be an nn.Module"
    model.load_weights(safetensors_weights_iterator(model_path))
    model.eval()
    model.requires_grad_(False)
    process_weights_after_loading(model, linear_backend)
    return model
