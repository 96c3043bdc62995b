"""Which model class runs which HF architecture name.

Chapter 6 (``load_model``: the config's ``architectures[0]`` picks the class).
vLLM 0.32 counterpart: ``vllm/model_executor/models/registry.py``
(``ModelRegistry``, ``_TEXT_GENERATION_MODELS``).

vLLM's registry maps several hundred names to lazily imported modules; three small
files need no laziness, so this is a plain dict.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from nanoengine.model_executor.models.llama import LlamaForCausalLM
from nanoengine.model_executor.models.qwen2 import Qwen2ForCausalLM
from nanoengine.model_executor.models.qwen3 import Qwen3ForCausalLM

# Every supported family is a LlamaForCausalLM (sub)class; a new family would
# widen this to a protocol with forward / compute_logits / load_weights.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral is Llama's architecture with different sizes; configs that still
    # enable its sliding window (v0.1) are refused by check_full_attention.
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODEL_CLASSES))


def get_model_class(hf_config: PretrainedConfig) -> type[LlamaForCausalLM]:
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
