"""Qwen3.5 (the text model): Gated DeltaNet layers with a gated full-attention layer between.

Chapter 7 (the forward pass of a hybrid model); chapter 6 (``load_weights``).
vLLM 0.32 counterpart: ``vllm/model_executor/models/qwen3_5.py``
(``Qwen3_5DecoderLayer``, ``Qwen3_5Model``, ``Qwen3_5ForCausalLM``), built on
``qwen3_next.py`` (``Qwen3NextAttention``) and
``layers/mamba/gdn/qwen_gdn_linear_attn.py`` (``QwenGatedDeltaNetAttention``
on ``GatedDeltaNetAttention`` of ``layers/mamba/gdn/base.py``; here
``layers/mamba/gdn.py``).

The decoder is Llama's pre-norm block (``llama.py``) with its token mixer
chosen per layer by ``config.layer_types``:

* ``"linear_attention"``: ``GatedDeltaNetAttention``, which keeps a fixed-size
  state per request (three of every four layers in the released models);
* ``"full_attention"``: ``Qwen3NextAttention``, softmax attention over the
  paged KV cache, plus three changes from Qwen3: each query head comes with an
  output gate (sigmoid, applied to the attention output), RoPE turns only the
  first ``partial_rotary_factor`` of each head (0.25), and the q/k norms are
  zero-centred like every norm here.

Zero-centred RMSNorm (``GemmaRMSNorm``) stores w and scales by 1 + w, so a
freshly initialised norm (w = 0) is the identity. HF's Qwen3.5 rotary is
"mrope", three position streams (time, height, width) for images; for text
the three are equal and it reduces to ordinary RoPE on the rotated dims,
which is what runs here.

The released checkpoints (``Qwen/Qwen3.5-*``) are
``Qwen3_5ForConditionalGeneration``: the text model's config under
``text_config``, its weights under ``model.language_model.``, beside a vision
tower (``model.visual.``) and a multi-token-prediction head (``mtp.``). This
class runs the text model of either layout and skips the other two.
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
from nanoengine.model_executor.layers.layernorm import GemmaRMSNorm
from nanoengine.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
)
from nanoengine.model_executor.layers.mamba.gdn import GatedDeltaNetAttention
from nanoengine.model_executor.layers.rotary_embedding import get_rope
from nanoengine.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from nanoengine.model_executor.models.llama import STACKED_PARAMS as LLAMA_STACKED_PARAMS
from nanoengine.model_executor.models.llama import DecoderVariant, LlamaMLP, head_dim_of, num_kv_heads_of
from nanoengine.model_executor.models.utils import load_weight, name_list

LAYER_TYPES = ("linear_attention", "full_attention")

# LlamaMLP reads only mlp_bias: Qwen3.5's MLP is Llama's, without biases.
_MLP_VARIANT = DecoderVariant(qkv_bias=False, o_proj_bias=False, mlp_bias=False, qk_norm=False)


class Qwen3NextAttention(nn.Module):
    """qkv (+ gate) projection -> q/k norm -> partial RoPE -> paged attention -> gate -> o_proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        # The checkpoint's q_proj is twice as tall as the heads: per head, D query
        # rows then D gate rows. It loads unchanged into the "q" shard (and a
        # rank's block of those rows is whole heads, each with its gate).
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, 2 * config.num_attention_heads, num_kv_heads_of(config), bias
        )
        self.num_heads = self.qkv_proj.num_heads // 2  # this rank's query heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, config)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata | None
    ) -> torch.Tensor:
        # q_gate [T, Hq * 2D]; k and v [T, Hkv * D]
        q_gate, k, v = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)  # [T, Hq, D]
        q = self.q_norm(q).flatten(-2)
        k = self.k_norm(k.unflatten(-1, (self.num_kv_heads, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, attn_metadata)  # [T, Hq * D]
        # The gate lets each head switch its output off per token (0 .. 1).
        return self.o_proj(out * torch.sigmoid(gate.flatten(-2)))


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm block whose token mixer is ``linear_attn`` or ``self_attn`` (by ``layer_type``)."""

    def __init__(self, config: PretrainedConfig, layer_type: str) -> None:
        super().__init__()
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"Unknown Qwen3.5 layer type {layer_type!r}; expected one of {LAYER_TYPES}.")
        self.layer_type = layer_type
        # Only one of the two exists; the attribute names are the checkpoint's.
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNetAttention(config)
        else:
            self.self_attn = Qwen3NextAttention(config)
        self.mlp = LlamaMLP(config, _MLP_VARIANT)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this block's MLP output, residual stream before adding it), as
        ``LlamaDecoderLayer`` does."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.forward_with_residual(hidden, residual)
        if self.layer_type == "linear_attention":
            hidden = self.linear_attn(hidden, attn_metadata)  # positions unused: order is in the state
        else:
            hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm.forward_with_residual(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5Model(nn.Module):
    """Embedding, the hybrid decoder stack and the final norm: token ids -> hidden states."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        layer_types = list(config.layer_types)
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {config.num_hidden_layers}."
            )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(config, kind) for kind in layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

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
# (fused name, checkpoint name, shard id inside the fused weight): Llama's
# attention and MLP fusions, plus the Gated DeltaNet input projections.
STACKED_PARAMS: tuple[tuple[str, str, ShardId], ...] = (
    *LLAMA_STACKED_PARAMS,
    ("in_proj_qkvz", "in_proj_qkv", "qkv"),
    ("in_proj_qkvz", "in_proj_z", "z"),
    ("in_proj_ba", "in_proj_b", "b"),
    ("in_proj_ba", "in_proj_a", "a"),
)
# The multimodal checkpoint's text weights, and what else it holds: the vision
# tower and the multi-token-prediction head (a speculative-decoding drafter),
# neither of which a text-only engine runs.
MULTIMODAL_TEXT_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


def to_model_name(checkpoint_name: str) -> tuple[str, ShardId | None] | None:
    """A checkpoint name -> (parameter name, shard id or None); None for a weight to skip.

    ``model.language_model.layers.0.linear_attn.in_proj_z.weight`` ->
    (``model.layers.0.linear_attn.in_proj_qkvz.weight``, "z").
    """
    if checkpoint_name.startswith(SKIPPED_PREFIXES) or "rotary_emb.inv_freq" in checkpoint_name:
        return None
    name = checkpoint_name
    if name.startswith(MULTIMODAL_TEXT_PREFIX):
        name = "model." + name.removeprefix(MULTIMODAL_TEXT_PREFIX)
    for fused, part, shard_id in STACKED_PARAMS:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


class Qwen3_5ForCausalLM(nn.Module):
    """The whole text model: ``forward`` gives hidden states, ``compute_logits`` logits.

    Built from either config: a ``Qwen3_5TextConfig``, or the multimodal
    ``Qwen3_5Config``, whose ``text_config`` then describes this model.
    GDN layers and attention layers are enumerated in layer order by
    ``model.modules()`` (see ``bind_mamba_state`` and ``bind_kv_cache``);
    ``config.layer_types[i]`` says which kind layer i is.
    """

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = hf_config.get_text_config()
        # Refuses any tensor-parallel size but 1: the Gated DeltaNet layers are not sharded.
        check_tensor_parallel_size(self.config, get_tensor_model_parallel_world_size())
        self.model = Qwen3_5Model(self.config)
        # HF ties according to the config it was built from (the outer one of a
        # multimodal checkpoint).
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            self.config.vocab_size, self.config.hidden_size, tied_to=self.model.embed_tokens if tied else None
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
        """Copy HF-named checkpoint tensors (either layout) into this model; returns
        the parameter names filled.

        Raises ValueError naming any checkpoint tensor with no home, or any
        parameter (or shard of a fused one) the checkpoint did not provide. A
        checkpoint without ``lm_head.weight`` gets the head tied to the embedding.
        """
        # A tied head's weight is listed once, as model.embed_tokens.weight.
        params = dict(self.named_parameters())
        loaded: set[tuple[str, ShardId | None]] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            target = to_model_name(name)
            if target is None:
                continue
            model_name, shard_id = target
            if model_name not in params:
                if model_name != "lm_head.weight":  # a redundant copy of a tied head is fine
                    unknown.append(name)
                continue
            load_weight(self, model_name, params[model_name], tensor, shard_id, name)
            loaded.add((model_name, shard_id))
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has no parameter for checkpoint weights {name_list(unknown)}."
            )

        missing = {part for name in params for part in self._parts_of(name)} - loaded
        if ("lm_head.weight", None) in missing and ("model.embed_tokens.weight", None) in loaded:
            # No separate head in the checkpoint: the model was saved with tied weights.
            self.lm_head.tie_to(self.model.embed_tokens)
            missing.discard(("lm_head.weight", None))
        if missing:
            named = (f"{n} [{s}]" if s is not None else n for n, s in missing)
            raise ValueError(f"The checkpoint lacks weights {name_list(named)} for {type(self).__name__}.")
        return {model_name for model_name, _ in loaded}

    def _parts_of(self, param_name: str) -> list[tuple[str, ShardId | None]]:
        """What must be loaded into one parameter: each shard of a fused weight, else itself."""
        owner = self.get_submodule(param_name.rpartition(".")[0])
        if isinstance(owner, MergedColumnParallelLinear):
            return [(param_name, shard_id) for shard_id in owner.shard_ranges]
        return [(param_name, None)]
