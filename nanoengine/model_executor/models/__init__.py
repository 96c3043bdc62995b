"""Model definitions (Llama, Qwen2, Qwen3) and the architecture registry (chapters 6-7).

vLLM 0.32 counterpart: ``vllm/model_executor/models/``.
"""

from nanoengine.model_executor.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]
