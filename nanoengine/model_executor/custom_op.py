"""CustomOp: a layer with plain torch code and, beside it, a C++ kernel for the CPU.

Chapter 7 (the CPU fast paths). vLLM 0.32 counterpart:
``vllm/model_executor/custom_op.py`` (``CustomOp``: every such layer has a
``forward_native`` in plain torch plus ``forward_cuda`` / ``forward_cpu`` / ...
variants, and one of them is chosen once, for the platform, when the layer is
built).

nanoengine keeps the idea and drops the machinery: a layer's plain torch code
is always there (and is what runs by default, on every device); after the
model is loaded, the model runner may call ``enable_cpu_kernels(model)``, which
flips ``use_cpu_kernels`` on every ``CustomOp`` and lets each one prepare what
its kernel needs (RoPE builds its cos/sin table). The layers' forwards check
the flag; the torch code stays the reference the tests compare against.
"""

from __future__ import annotations

from torch import nn


class CustomOp(nn.Module):
    """Base of the layers with a CPU kernel (RMSNorm, RotaryEmbedding, SiluAndMul)."""

    use_cpu_kernels: bool = False

    def prepare_cpu_kernels(self) -> None:
        """Build whatever the kernel reads besides the inputs (default: nothing)."""


def enable_cpu_kernels(model: nn.Module) -> int:
    """Switch every ``CustomOp`` of ``model`` to its C++ kernel; returns how many."""
    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    for op in ops:
        op.prepare_cpu_kernels()
        op.use_cpu_kernels = True
    return len(ops)
