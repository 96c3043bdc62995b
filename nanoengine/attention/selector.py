"""Pick the attention backend for a device: Triton on CUDA, the torch reference on CPU.

Chapter 7 (the model runner asks once, after loading the model, and hands every
``Attention`` layer the chosen implementation; the model code never changes).
vLLM 0.32 counterpart: ``vllm/v1/attention/selector.py`` (``get_attn_backend``).
"""

from __future__ import annotations

from importlib.util import find_spec

import torch

from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl
from nanoengine.attention.layer import AttentionImpl

BACKEND_NAMES = ("auto", "torch", "triton")


def triton_available() -> bool:
    """Triton is importable (the ``triton`` extra, or the copy bundled with CUDA torch)."""
    return find_spec("triton") is not None


def resolve_backend_name(requested: str, device: torch.device) -> str:
    """"auto" becomes "triton" on CUDA when Triton is installed, else "torch"."""
    if requested not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {requested!r}.")
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if requested == "triton" and not triton_available():
        raise ValueError("attention_backend='triton' needs the triton package: pip install -e '.[triton]'.")
    return requested


def get_attention_impl(name: str) -> AttentionImpl:
    """A fresh implementation object for a resolved backend name."""
    if name == "triton":
        # Deferred: importing the kernels module imports Triton (and on a
        # machine without CUDA switches it to its interpreter).
        from nanoengine.attention.backends.triton_attn import TritonAttentionImpl

        return TritonAttentionImpl()
    return TorchRefAttentionImpl()
