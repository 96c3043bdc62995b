"""Qwen3 (dense): Llama plus a per-head RMSNorm on q and k before RoPE.

Chapter 7. vLLM 0.32 counterpart: ``vllm/model_executor/models/qwen3.py``
(``Qwen3ForCausalLM``).

Qwen3 also decouples ``head_dim`` from ``hidden_size / num_heads`` (it is read
from the config, see ``llama.head_dim_of``) and drops Qwen2's q/k/v bias in
favour of the config's ``attention_bias`` (False for released checkpoints).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from nanoengine.model_executor.models.llama import DecoderVariant, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(qkv_bias=bias, o_proj_bias=bias, mlp_bias=False, qk_norm=True)
