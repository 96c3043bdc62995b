"""RMSNorm, with the fused "add the residual, then normalise" step vLLM models use.

Chapter 7 (the forward pass of a decoder layer).
vLLM 0.32 counterpart: ``vllm/model_executor/layers/layernorm.py`` (``RMSNorm``,
``GemmaRMSNorm``).

HF decoder layers keep the residual stream as an explicit ``residual + x`` after
each sub-block; vLLM instead hands the residual to the *next* norm, which adds and
normalises in one call (one fused kernel on GPU). The arithmetic is the same, so
logits match HF; only the bookkeeping moves.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoengine._custom_ops import load_cpu_ops
from nanoengine.model_executor.custom_op import CustomOp


class RMSNorm(CustomOp):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension.

    With ``use_cpu_kernels`` (see ``custom_op.py``) both methods run one C++
    kernel each (``csrc/cpu/layers.cpp``) instead of ~9 small torch ops.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., hidden] -> [..., hidden]. The statistics are taken in fp32 even for
        # bf16 activations (a bf16 mean of squares loses too many bits), and the
        # result is cast back *before* the weight multiply, exactly as HF does, so
        # bf16 runs round the same way as the reference.
        if self.use_cpu_kernels:
            rows = x.reshape(-1, x.shape[-1])  # [tokens (x heads), hidden]; copies only a strided view
            out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
            load_cpu_ops().rms_norm(out, rows, self.weight, self.variance_epsilon)
            return out.view(x.shape)
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(dim=-1, keepdim=True)
        normed = x32 * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * normed.to(input_dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``x`` into the residual stream, then normalise it.

        Returns ``(normed, new_residual)``; the caller feeds ``normed`` to the next
        sub-block and keeps ``new_residual`` for the norm after it.
        """
        if self.use_cpu_kernels:
            # vLLM's fused op: residual += x, then x = norm(residual), both in
            # place. Safe here: x is a fresh projection output and residual is
            # this stream's own tensor; nobody else reads either afterwards.
            load_cpu_ops().fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
            return x, residual
        new_residual = x + residual
        return self.forward(new_residual), new_residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class GemmaRMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``.

    vLLM's ``GemmaRMSNorm``; HF's ``Gemma3RMSNorm`` and ``Qwen3_5RMSNorm``
    (Gemma 3 and Qwen3.5 use it for every norm).
    Unlike ``RMSNorm`` it multiplies in fp32 and rounds once at the end (HF's
    order), so it is its own module rather than ``RMSNorm`` with 1 + w stored:
    that would round 1 + w to bf16 and the product twice. Plain torch only
    (not a ``CustomOp``): the C++ norm kernels scale by w itself.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., hidden] -> [..., hidden]; statistics and scale in fp32.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual hand-off of ``RMSNorm``."""
        new_residual = x + residual
        return self.forward(new_residual), new_residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
