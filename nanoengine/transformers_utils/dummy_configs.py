"""Configs nanoengine ships, so ``load_format="dummy"`` runs a model that is not on disk.

Chapter 6 (``LLM(...)`` construction). The study notes run
``LLM(model="Qwen/Qwen3.5-0.8B")``; where neither the model hub nor the
checkpoint can be reached, dummy weights still give the real shapes, memory
and speed, but the model's ``config.json`` is needed to build it. This module
holds that config as a dict and writes it, ``config.json`` alone, into a
folder of the nanoengine cache, which then serves as the model path
(``resolve_model_path`` in ``config.py`` decides when).
vLLM 0.32 counterpart: none. vLLM fetches ``config.json`` from the hub even for
``load_format="dummy"``; shipping configs is nanoengine's stand-in for that
download.

Qwen3.5-0.8B. Values *stated* by two public model pages:

* https://apxml.com/models/qwen35-08b : hidden size 1,024, 24 layers in a
  6 x (3 Gated DeltaNet + 1 gated attention) pattern, 8 attention heads over 2
  KV heads of dimension 256, FFN intermediate size 3,584, vocabulary 248,320,
  RoPE theta 10,000,000, 262K context, RMSNorm, SwiGLU;
* https://www.fitmygpu.com/models/qwen-3.5-0.8b : 24 layers, hidden size 1,024,
  8 attention heads, 2 KV heads, 6 KV-bearing layers, context 262,144.

Values *assumed* (neither page states them; they are listed in ``assumed`` and
logged as a warning whenever the config is used): the Gated DeltaNet shapes
(16 key heads and 16 value heads of 128, convolution kernel 4), the rotated
share of each attention head (0.25, Qwen3.5's published default in
transformers' ``Qwen3_5TextConfig``), ``rms_norm_eps``, tied embeddings, and
the special token ids (those other public Qwen3.5 configs give for
``<|endoftext|>`` and ``<|im_end|>``). The Gated DeltaNet guesses set the
size of those layers' projections and states, so the parameter count, and
the memory, are only as exact as they are.

Qwen3-0.6B (chapter 6's tensor-parallelism walkthrough: its 16 heads over 8
KV heads split evenly over 2, 4 or 8 ranks, where the default SmolLM2's 9
over 3 do not). Values *stated* by public pages:

* https://thedailyscout.com/s/Bn0oGKeDIJU : 28 layers, hidden size 1,024,
  16 attention heads, 8 KV heads, 40,960 positions, vocabulary 151,936,
  ``Qwen3ForCausalLM``;
* https://www.fitmyllm.com/model/qwen3-0.6b : 28 layers, 8 KV heads, head
  dimension 128;
* https://kiraa-blog.vercel.app/post/learning-qwen3-0.6b/ : the printed
  ``Qwen3Config``: no attention bias, head dimension 128, SiLU, tied
  embeddings, bos 151643, eos 151645.

Assumed: the FFN size (3,072), RoPE theta and ``rms_norm_eps``.

Gemma 3 270M (chapter 4: local sliding-window layers beside global ones; the
smallest Gemma 3, its text model only). Values *stated* by public pages:

* https://ollama.com/sam860/gemma3:270m/blobs/29005e200100 (the GGUF's
  metadata): 18 blocks, embedding length 640, feed-forward length 2,048,
  4 attention heads over 1 KV head, key and value length 256, sliding window
  512, context 32,768, RMSNorm epsilon 1e-6, RoPE base 1,000,000, bos 2, eos
  1, padding 0, and a token embedding of 640 x 262,144;
* https://huggingface-mirror.yottacloud.host/Mayank022/Gemma_3_270M_SLM_from_scratch :
  15 sliding-window layers of 512 tokens and 3 full-attention layers, at
  positions 6, 12 and 18 (Gemma 3's five local layers to one global).

Assumed: ``query_pre_attn_scalar`` (256, the head size, as the published
Gemma 3 4B config has it), the local layers' RoPE base (10,000, the 4B's),
the GELU-tanh gate and tied embeddings (as every Gemma 3).

The architecture of Qwen3.5 is the text-only ``Qwen3_5ForCausalLM`` (``model_type``
``qwen3_5_text``): the released checkpoint also carries a vision tower, which
nanoengine never runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# A sub-folder of the nanoengine cache (``default_cache_dir()``), beside models/.
DUMMY_CONFIG_SUBDIR = "dummy-configs"


@dataclass(frozen=True)
class BuiltinConfig:
    """One model's config.json as shipped, and which of its keys are guesses."""

    folder: str  # the folder name under <cache>/dummy-configs
    config: dict[str, Any]
    # Dotted keys ("rope_parameters.partial_rotary_factor") no public source states.
    assumed: tuple[str, ...]

    def assumed_values(self) -> str:
        """"key=value, ..." for the assumed keys, read from ``config`` (one source of truth)."""
        return ", ".join(f"{key}={_lookup(self.config, key)!r}" for key in self.assumed)


def _lookup(config: dict[str, Any], dotted_key: str) -> Any:
    """``config["a"]["b"]`` for the dotted key ``"a.b"``."""
    value: Any = config
    for part in dotted_key.split("."):
        value = value[part]
    return value


# [anchor: qwen3_5-0.8b-config]
# Qwen3.5's layout, stated: six times three Gated DeltaNet layers, then one
# gated full-attention layer (so only 6 of the 24 layers hold a KV cache).
_QWEN3_5_0_8B_LAYERS = (["linear_attention"] * 3 + ["full_attention"]) * 6

_QWEN3_5_0_8B = BuiltinConfig(
    folder="Qwen3.5-0.8B",
    config={
        # The text model alone (the released checkpoint adds a vision tower).
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        # Stated by the sources in the module docstring.
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "layer_types": _QWEN3_5_0_8B_LAYERS,
        "full_attention_interval": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 3584,
        "hidden_act": "silu",  # SwiGLU: the gate goes through SiLU
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,  # assumed
        },
        # Assumed (listed in ``assumed`` below).
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 248044,
        "eos_token_id": [248046, 248044],
    },
    assumed=(
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "rope_parameters.partial_rotary_factor",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ),
)
# [/anchor: qwen3_5-0.8b-config]

_QWEN3_0_6B = BuiltinConfig(
    folder="Qwen3-0.6B",
    config={
        # Stated by the sources in the module docstring.
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": False,
        "hidden_act": "silu",
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        # Assumed (listed in ``assumed`` below).
        "intermediate_size": 3072,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "rms_norm_eps": 1e-6,
    },
    assumed=("intermediate_size", "rope_parameters.rope_theta", "rms_norm_eps"),
)

# Gemma 3's pattern, stated: five local layers, then a global one, three times.
_GEMMA_3_270M_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3

_GEMMA_3_270M = BuiltinConfig(
    folder="gemma-3-270m",
    config={
        # The text model (Gemma 3 270M has no vision tower).
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        # Stated by the sources in the module docstring.
        "hidden_size": 640,
        "num_hidden_layers": 18,
        "layer_types": _GEMMA_3_270M_LAYERS,
        "intermediate_size": 2048,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "vocab_size": 262144,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        # Assumed (listed in ``assumed`` below), but the global theta, stated.
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    assumed=(
        "rope_parameters.sliding_attention.rope_theta",
        "query_pre_attn_scalar",
        "hidden_activation",
        "tie_word_embeddings",
    ),
)

# Model name (as a user writes it) -> its shipped config.
BUILTIN_CONFIGS: dict[str, BuiltinConfig] = {
    "Qwen/Qwen3.5-0.8B": _QWEN3_5_0_8B,
    "Qwen/Qwen3-0.6B": _QWEN3_0_6B,
    "google/gemma-3-270m": _GEMMA_3_270M,
}


def has_builtin_config(model: str) -> bool:
    return model in BUILTIN_CONFIGS


def builtin_config_names() -> str:
    """The names with a shipped config, for error messages."""
    return ", ".join(sorted(BUILTIN_CONFIGS))


def write_builtin_config(model: str, cache_dir: Path) -> Path:
    """Write ``model``'s shipped config.json under ``cache_dir`` and return its folder.

    Written on every call, so the file always matches this module. Written to
    a temporary name and renamed, so a reader in another process never sees
    half a file. Logs which values are assumed.
    """
    builtin = BUILTIN_CONFIGS[model]
    folder = cache_dir / DUMMY_CONFIG_SUBDIR / builtin.folder
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"config.json.{os.getpid()}.tmp"
    partial.write_text(json.dumps(builtin.config, indent=2) + "\n", encoding="utf-8")
    partial.replace(folder / "config.json")
    logger.warning(
        "%s: using nanoengine's built-in config (load_format='dummy': random weights, meaningless "
        "text). Assumed values, not stated by public sources: %s.",
        model,
        builtin.assumed_values(),
    )
    return folder
