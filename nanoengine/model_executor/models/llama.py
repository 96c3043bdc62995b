"""Llama, written the vLLM way: fused projections, flattened batch, paged attention.

Chapter 7 (the forward pass); chapter 6 (``load_weights``, called by the loader).
vLLM 0.32 counterpart: ``vllm/model_executor/models/llama.py`` (``LlamaAttention``,
``LlamaMLP``, ``LlamaDecoderLayer``, ``LlamaModel``, ``LlamaForCausalLM``).

Three things differ from the HF modeling code this must agree with token for token:

* **No batch dimension.** Every scheduled token of every request is one row of a
  [num_tokens, hidden] tensor. Per-token ``positions`` say where each token sits in
  its own sequence; ``AttentionMetadata`` says which rows belong to which request.
* **Fused projections.** ``qkv_proj`` and ``gate_up_proj`` replace three and two
  checkpoint matrices (see ``layers/linear.py``); ``load_weights`` maps the names.
* **Residual handed to the next norm** (see ``layers/layernorm.py``).

Under tensor parallelism (chapter 6) the same classes build one rank's slice
of the model: ``qkv_proj`` and ``gate_up_proj`` are column-parallel (this
rank's heads, this rank's MLP units), ``o_proj`` and ``down_proj``
row-parallel (their all-reduce makes the layer's output whole again), and the
``Attention`` layer runs this rank's heads over a KV cache of this rank's KV
heads. Nothing between the two all-reduces of a layer talks to other ranks.

Qwen2 and Qwen3 are Llama plus a few switches (``DecoderVariant``); their files
only choose the switches.

Sliding windows (chapter 4): a layer listed as "sliding_attention" in the
config's ``layer_types`` (Qwen2/3 with ``use_sliding_window``), or every layer
of a config that only sets ``sliding_window`` (Mistral), hands its window to
its ``Attention``; the layer code is otherwise the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.layer import Attention
from nanoengine.distributed.parallel_state import get_tensor_model_parallel_world_size
from nanoengine.distributed.utils import check_tensor_parallel_size
from nanoengine.model_executor.layers.activation import get_act_and_mul
from nanoengine.model_executor.layers.layernorm import RMSNorm
from nanoengine.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
)
from nanoengine.model_executor.layers.rotary_embedding import get_rope
from nanoengine.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from nanoengine.model_executor.models.utils import load_weight, name_list
from nanoengine.transformers_utils.config import layer_types_of, sliding_window_of


@dataclass(frozen=True)
class DecoderVariant:
    """The switches that separate the Llama-family architectures nanoengine runs."""

    qkv_bias: bool  # bias on q/k/v projections (always on in Qwen2)
    o_proj_bias: bool  # bias on the attention output projection
    mlp_bias: bool  # bias on gate/up/down projections
    qk_norm: bool  # Qwen3: RMSNorm over each q and k head before RoPE


def head_dim_of(config: PretrainedConfig) -> int:
    """An explicit ``head_dim`` (Qwen3 sets one) or hidden_size / num_heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def num_kv_heads_of(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def layer_sliding_window(config: PretrainedConfig, layer_index: int) -> int | None:
    """The window of layer ``layer_index`` (None: it attends to every key)."""
    if layer_types_of(config)[layer_index] != "sliding_attention":
        return None
    return sliding_window_of(config)


class LlamaAttention(nn.Module):
    """qkv projection -> (q/k norm) -> RoPE -> paged attention -> output projection."""

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant, layer_index: int) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size, self.head_dim, config.num_attention_heads, num_kv_heads_of(config), variant.qkv_bias
        )
        # This rank's heads (all of them at one rank): the projection decided.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, hidden_size, variant.o_proj_bias
        )
        # Qwen3 normalises each head's q and k (over head_dim) to keep attention
        # logits in range; the norm must come before RoPE, as in training.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if variant.qk_norm else None
        self.rotary_emb = get_rope(self.head_dim, config)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=layer_sliding_window(config, layer_index),
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        # q [T, Hq * D], k and v [T, Hkv * D] (this rank's heads)
        q, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, attn_metadata))  # [T, hidden]


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant) -> None:
        super().__init__()
        hidden_size, intermediate = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate, intermediate], variant.mlp_bias
        )
        self.act_fn = get_act_and_mul(config.hidden_act)
        self.down_proj = RowParallelLinear(intermediate, hidden_size, variant.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * I/N] -> [T, I/N] -> [T, hidden] (I: intermediate, N: TP ranks)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: norm -> attention -> norm -> MLP, residual around each."""

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant, layer_index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, variant, layer_index)
        self.mlp = LlamaMLP(config, variant)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's MLP output, residual stream before adding it).

        The caller's next norm adds the two; the first layer starts the stream.
        """
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, the decoder stack and the final norm: token ids -> hidden states."""

    def __init__(self, config: PretrainedConfig, variant: DecoderVariant) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        assert residual is not None, "a model has at least one decoder layer"
        hidden, _ = self.norm.forward_with_residual(hidden, residual)
        return hidden


# Checkpoint projections that live inside a fused layer here:
# (fused name, checkpoint name, shard id inside the fused weight).
STACKED_PARAMS: tuple[tuple[str, str, ShardId], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


def to_model_name(checkpoint_name: str) -> tuple[str, ShardId | None]:
    """``...self_attn.k_proj.weight`` -> (``...self_attn.qkv_proj.weight``, "k")."""
    for fused, part, shard_id in STACKED_PARAMS:
        if f".{part}." in checkpoint_name:
            return checkpoint_name.replace(f".{part}.", f".{fused}."), shard_id
    return checkpoint_name, None


def to_checkpoint_names(model_name: str) -> list[str]:
    """The checkpoint names that together fill one model parameter."""
    shards = [
        model_name.replace(f".{fused}.", f".{part}.")
        for fused, part, _ in STACKED_PARAMS
        if f".{fused}." in model_name
    ]
    return shards or [model_name]


class LlamaForCausalLM(nn.Module):
    """The whole model: ``forward`` gives hidden states, ``compute_logits`` turns the
    rows that need sampling into logits (vLLM keeps the two apart so the LM head,
    the biggest matmul for small models, runs only on those rows).
    """

    @classmethod
    def decoder_variant(cls, config: PretrainedConfig) -> DecoderVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderVariant(
            qkv_bias=bias, o_proj_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=False
        )

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        check_tensor_parallel_size(hf_config, get_tensor_model_parallel_world_size())
        self.config = hf_config
        self.model = LlamaModel(hf_config, self.decoder_variant(hf_config))
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            hf_config.vocab_size, hf_config.hidden_size, tied_to=self.model.embed_tokens if tied else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab_size]."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into this model (``load_stacked_weights``)."""
        return load_stacked_weights(self, self.model.embed_tokens, self.lm_head, weights)


def load_stacked_weights(
    model: nn.Module,
    embed_tokens: VocabParallelEmbedding,
    lm_head: ParallelLMHead,
    weights: Iterable[tuple[str, torch.Tensor]],
) -> set[str]:
    """Copy HF-named checkpoint tensors into ``model``; returns the parameter names filled.

    Fused layers receive each projection as a shard (``STACKED_PARAMS``);
    parallel layers copy this rank's slice of each tensor
    (``models/utils.load_weight``). A tied LM head shares the embedding's
    parameter, so a checkpoint ``lm_head.weight`` is then redundant; a
    checkpoint *without* one (tied weights saved once) gets the head tied here.
    Raises ValueError naming any checkpoint tensor with no home, or any
    parameter the checkpoint did not provide. Llama, Qwen2/3 and Gemma 3 name
    their checkpoints this way.
    """
    # Shared parameters appear once, under their first name: a tied head's
    # weight is listed as model.embed_tokens.weight only.
    params = dict(model.named_parameters())
    seen: set[str] = set()  # checkpoint names consumed
    unknown: list[str] = []
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue  # recomputed from the config, see rotary_embedding.py
        model_name, shard_id = to_model_name(name)
        if model_name not in params:
            if name != "lm_head.weight":  # a redundant copy of a tied head is fine
                unknown.append(name)
            continue
        load_weight(model, model_name, params[model_name], tensor, shard_id, name)
        seen.add(name)
    if unknown:
        raise ValueError(f"{type(model).__name__} has no parameter for checkpoint weights {name_list(unknown)}.")

    missing = {ckpt for model_name in params for ckpt in to_checkpoint_names(model_name)} - seen
    if "lm_head.weight" in missing and "model.embed_tokens.weight" in seen:
        # No separate head in the checkpoint: the model was saved with tied weights.
        lm_head.tie_to(embed_tokens)
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"The checkpoint lacks weights {name_list(missing)} for {type(model).__name__}.")
    return {to_model_name(name)[0] for name in seen}
