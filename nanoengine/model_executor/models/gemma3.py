"""Gemma 3 (the text model): local sliding-window layers with a global layer between.

Chapter 4 (a model whose layers form KV cache groups of two kinds) and
chapter 7 (the forward pass). vLLM 0.32 counterpart:
``vllm/model_executor/models/gemma3.py`` (``Gemma3Attention``, ``Gemma3MLP``,
``Gemma3DecoderLayer``, ``Gemma3Model``, ``Gemma3ForCausalLM``).

Gemma 3 interleaves its layers five to one: five *local* layers, each reading
only the last ``sliding_window`` tokens (512 in the released models), then one
*global* layer reading every token (``config.layer_types`` lists which is
which). The local layers' K/V blocks go back to the pool as they leave the
window, so a long request costs little beyond its global layers' blocks:
``kv_cache_groups.py`` puts the two kinds in groups of their own, each with
its manager. Of the two interleaved families the issue offered (Gemma 3,
gpt-oss), Gemma 3 fits these layers: dense MLPs and plain softmax attention,
where gpt-oss adds mixture-of-experts MLPs and per-head attention sinks.

What differs from Llama (``llama.py``), each as HF's ``modeling_gemma3.py`` has it:

* every norm is zero-centred (``GemmaRMSNorm``: scale by 1 + w), and the
  block has four: before and after attention, before and after the MLP;
* q and k are normalised per head before RoPE (as in Qwen3), and the scores
  are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
* local and global layers rotate with different RoPE bases (10,000 and
  1,000,000), kept per layer kind in ``config.rope_parameters``;
* the MLP gates with GELU (tanh approximation), not SiLU;
* the embedding output is multiplied by ``sqrt(hidden_size)`` (rounded to the
  model's dtype first, as HF does), and the LM head is tied to it;
* ``final_logit_softcapping``, when a config sets it, squashes the logits
  into ``(-cap, cap)``. Attention-score soft-capping (Gemma 2) is refused:
  the paged kernels have no such step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.layer import Attention
from nanoengine.distributed.parallel_state import get_tensor_model_parallel_world_size
from nanoengine.distributed.utils import check_tensor_parallel_size
from nanoengine.model_executor.layers.activation import get_act_and_mul
from nanoengine.model_executor.layers.layernorm import GemmaRMSNorm
from nanoengine.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanoengine.model_executor.layers.rotary_embedding import get_rope
from nanoengine.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from nanoengine.model_executor.models.llama import (
    head_dim_of,
    layer_sliding_window,
    load_stacked_weights,
    num_kv_heads_of,
)
from nanoengine.transformers_utils.config import layer_types_of


class Gemma3Attention(nn.Module):
    """qkv projection -> per-head q/k norm -> RoPE of this layer's kind -> paged attention -> o_proj."""

    def __init__(self, config: PretrainedConfig, layer_index: int) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, num_kv_heads_of(config), bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        # Local layers rotate at their own base (rope_parameters["sliding_attention"]).
        self.rotary_emb = get_rope(self.head_dim, config, layer_types_of(config)[layer_index])
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            float(config.query_pre_attn_scalar) ** -0.5,
            self.num_kv_heads,
            sliding_window=layer_sliding_window(config, layer_index),
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        # q [T, Hq * D], k and v [T, Hkv * D] (this rank's heads)
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))  # [T, hidden]


class Gemma3MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden_size, intermediate = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate, intermediate], False)
        self.act_fn = get_act_and_mul(config.hidden_activation)
        self.down_proj = RowParallelLinear(intermediate, hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * I/N] -> [T, I/N] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """Four norms: each sub-block's output is normalised before it joins the residual stream."""

    def __init__(self, config: PretrainedConfig, layer_index: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_index)
        self.mlp = Gemma3MLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's normalised MLP output, residual stream before adding it),
        the hand-off of ``LlamaDecoderLayer``."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm.forward_with_residual(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    """Scaled embedding, the interleaved decoder stack and the final norm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        embedded = self.embed_tokens(input_ids)  # [T, hidden]
        # HF rounds the scale to the weights' dtype before multiplying (a bf16 sqrt(640) is 25.25).
        hidden = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        assert residual is not None, "a model has at least one decoder layer"
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden


class Gemma3ForCausalLM(nn.Module):
    """The whole model: ``forward`` gives hidden states, ``compute_logits`` the logits
    of the rows that sample (as ``LlamaForCausalLM``)."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                f"attn_logit_softcapping={hf_config.attn_logit_softcapping} (Gemma 2's attention "
                "soft-capping) is not supported: the paged attention kernels do not cap scores."
            )
        check_tensor_parallel_size(hf_config, get_tensor_model_parallel_world_size())
        self.config = hf_config
        self.model = Gemma3Model(hf_config)
        tied = bool(getattr(hf_config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(
            hf_config.vocab_size, hf_config.hidden_size, tied_to=self.model.embed_tokens if tied else None
        )
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcapping = None if cap is None else float(cap)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab_size], soft-capped if the config says so."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping is not None:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's checkpoint names, plus the extra norms (``llama.load_stacked_weights``)."""
        return load_stacked_weights(self, self.model.embed_tokens, self.lm_head, weights)
