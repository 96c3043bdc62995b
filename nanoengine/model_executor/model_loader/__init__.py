"""Loading a checkpoint into a nanoengine model (chapter 6).

vLLM 0.32 counterpart: ``vllm/model_executor/model_loader/``.
"""

from nanoengine.model_executor.model_loader.loader import get_model

__all__ = ["get_model"]
