"""Qwen2 (and Qwen2.5): Llama with a bias on the q/k/v projections.

Chapter 7. vLLM 0.32 counterpart: ``vllm/model_executor/models/qwen2.py``
(``Qwen2ForCausalLM``).

Everything else (RMSNorm, RoPE, SwiGLU MLP, GQA, weight names) is Llama's, so the
class only picks the switches; see ``llama.py`` for the model itself.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from nanoengine.model_executor.models.llama import DecoderVariant, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        # Qwen2 hard-codes the q/k/v bias (its config has no attention_bias field);
        # o_proj and the MLP never have one.
        return DecoderVariant(qkv_bias=True, o_proj_bias=False, mlp_bias=False, qk_norm=False)
