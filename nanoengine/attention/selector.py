"""Pick the attention backend for a device: Triton on CUDA, C++ kernels on a CPU.

Chapter 7 (the model runner asks once, after loading the model, and hands every
``Attention`` layer the chosen implementation; the model code never changes).
vLLM 0.32 counterpart: ``vllm/v1/attention/selector.py`` (``get_attn_backend``).
"""

from __future__ import annotations

from importlib.util import find_spec

import torch

from nanoengine._custom_ops import cpu_ops_available
from nanoengine.attention.backends.cpu_attn import CPUAttentionImpl
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl
from nanoengine.attention.layer import AttentionImpl

BACKEND_NAMES = ("auto", "torch", "triton", "cpu")
# The C++ attention, norm, RoPE and activation kernels read and write these
# (bf16 widened to fp32 in registers; see csrc/cpu/ops.h).
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def triton_available() -> bool:
    """Triton is importable (the ``triton`` extra, or the copy bundled with CUDA torch)."""
    return find_spec("triton") is not None


def resolve_backend_name(requested: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """"auto" becomes "triton" on CUDA when Triton is installed, "cpu" on a CPU
    when the C++ kernels build (fp32 or bf16), else the "torch" reference.
    """
    if requested not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {requested!r}.")
    if requested == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        use_cpu_kernels = device.type == "cpu" and dtype in CPU_KERNEL_DTYPES and cpu_ops_available()
        return "cpu" if use_cpu_kernels else "torch"
    if requested == "triton" and not triton_available():
        raise ValueError("attention_backend='triton' needs the triton package: pip install -e '.[triton]'.")
    if requested == "cpu" and (device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES):
        raise ValueError(
            f"attention_backend='cpu' runs on a CPU in float32 or bfloat16; got device={device.type}, dtype={dtype}."
        )
    if requested == "cpu" and not cpu_ops_available():
        raise ValueError("attention_backend='cpu' needs the C++ kernels, which failed to build (see the warning).")
    return requested


def get_attention_impl(name: str) -> AttentionImpl:
    """A fresh implementation object for a resolved backend name."""
    if name == "triton":
        # Deferred: importing the kernels module imports Triton (and on a
        # machine without CUDA switches it to its interpreter).
        from nanoengine.attention.backends.triton_attn import TritonAttentionImpl

        return TritonAttentionImpl()
    if name == "cpu":
        return CPUAttentionImpl()
    return TorchRefAttentionImpl()
