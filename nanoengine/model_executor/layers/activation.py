"""SiluAndMul and GeluAndMul: the gated activations of MLPs on a fused gate/up output.

Chapter 7. vLLM 0.32 counterpart: ``vllm/model_executor/layers/activation.py``
(``SiluAndMul``, ``GeluAndMul``). Llama-style models gate with SiLU; Gemma
with GELU in its tanh approximation (``gelu_pytorch_tanh``), in plain torch.

The MLP computes ``down(silu(gate(x)) * up(x))``. Because ``gate_proj`` and
``up_proj`` are fused into one ``gate_up_proj`` matmul, the activation receives
both halves side by side and splits them itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine._custom_ops import load_cpu_ops
from nanoengine.model_executor.custom_op import CustomOp

# The activations the supported families use; anything else is refused by
# name instead of silently computing a different network.
SUPPORTED_HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


class SiluAndMul(CustomOp):
    """``silu(x[..., :d]) * x[..., d:]`` where ``d = x.shape[-1] // 2``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        if self.use_cpu_kernels:
            rows = x.reshape(-1, x.shape[-1])
            out = torch.empty(rows.shape[0], rows.shape[1] // 2, dtype=x.dtype, device=x.device)
            load_cpu_ops().silu_and_mul(out, rows)
            return out.view(*x.shape[:-1], out.shape[-1])
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]``: Gemma's gate, GELU's tanh approximation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def get_act_and_mul(hidden_act: str) -> SiluAndMul | GeluAndMul:
    """The gated activation for a config's ``hidden_act``; ValueError if unsupported."""
    if hidden_act not in SUPPORTED_HIDDEN_ACTS:
        raise ValueError(
            f"hidden_act '{hidden_act}' is not supported; nanoengine implements only "
            f"{list(SUPPORTED_HIDDEN_ACTS)}."
        )
    return SiluAndMul() if hidden_act == "silu" else GeluAndMul()
