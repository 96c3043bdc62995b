"""Which model class runs which HF architecture name.

Chapter 6 (``load_model``: the config's ``architectures[0]`` picks the class).
vLLM 0.32 counterpart: ``vllm/model_executor/models/registry.py``
(``ModelRegistry``, ``_TEXT_GENERATION_MODELS``).

vLLM's registry maps several hundred names to lazily imported modules; a few small
files need no laziness, so this is a plain dict.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from transformers import PretrainedConfig

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.model_executor.models.gemma3 import Gemma3ForCausalLM
from nanoengine.model_executor.models.llama import LlamaForCausalLM
from nanoengine.model_executor.models.qwen2 import Qwen2ForCausalLM
from nanoengine.model_executor.models.qwen3 import Qwen3ForCausalLM
from nanoengine.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM


class CausalLM(Protocol):
    """What the loader and the model runner call on a model: vLLM's
    ``VllmModelForTextGeneration`` interface, reduced to three methods.

    Every class registered here is also an ``nn.Module`` built as
    ``cls(hf_config)``; a caller that needs the module side narrows with
    ``isinstance(model, nn.Module)`` (mypy then knows both).
    """

    def __init__(self, hf_config: PretrainedConfig) -> None: ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor: ...

    # What runs ``forward`` (nn.Module's call, with its hooks): callers call the model.
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


_MODEL_CLASSES: dict[str, type[CausalLM]] = {
    # Gemma 3's text model: five sliding-window layers to one global (chapter 4).
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral is Llama's architecture with different sizes; a config that sets
    # sliding_window (v0.1) gives every layer that window (chapter 4).
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    # The released Qwen3.5 checkpoints: vision + text. Only the text model runs
    # (its config is text_config, its weights model.language_model.*).
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODEL_CLASSES))


def get_model_class(hf_config: PretrainedConfig) -> type[CausalLM]:
    """The class for ``hf_config.architectures[0]``; ValueError naming it if unsupported."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(
            "The model config has no 'architectures' entry, so nanoengine cannot pick a model "
            f"class. Supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    arch = architectures[0]
    if arch not in _MODEL_CLASSES:
        raise ValueError(
            f"Model architecture '{arch}' is not supported by nanoengine. "
            f"Supported: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return _MODEL_CLASSES[arch]
