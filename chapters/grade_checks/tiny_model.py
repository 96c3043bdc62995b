"""Tiny random-weight models, written in about a second and with no network.

The grader's hybrid exercises (4.4, 4.5; chapter 4) run the engine end to end
on ``tiny_hybrid_model_dir()``: a four-layer Qwen3.5 (three Gated DeltaNet
layers, then one full-attention layer), so one attention group and three state
groups share the block pool. Chapter 4's sliding-window experiment and
exercise 4.6 use ``tiny_gemma3_model_dir()``: three local layers with a
16-token window and one global layer. Exercise 6.2 (chapter 6) splits
``tiny_llama_model_dir(num_kv_heads)`` over two tensor-parallel ranks.
``tests/tiny_models.py`` builds every test model with ``tiny_config`` and
``write_random_model`` and adds a tokenizer; the grader needs none, since its
prompts are token ids (``skip_tokenizer_init``).

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
)
from transformers.utils import logging as hf_logging

# Qwen3.5's layers, by kind: "linear_attention" (Gated DeltaNet, a state per
# request) or "full_attention" (a paged KV cache). Two patterns keep the tests
# honest about which layer index is which kind.
TINY_QWEN3_5_LAYERS = {
    "qwen3_5": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "qwen3_5-alt": ["full_attention", "linear_attention", "full_attention", "linear_attention"],
}
# Sliding windows (chapter 4): small enough that the test prompts, and far
# more the generated tokens, outgrow them many times over.
TINY_SLIDING_WINDOW = 16
# The grader's prompts use ids below this (chapters/grade_checks/common.py);
# the test models' tokenizers have about as many tokens.
TINY_VOCAB_SIZE = 320


def tiny_config(arch: str, vocab_size: int, tie: bool = True) -> PretrainedConfig:
    """2 layers, 4 query heads over 2 KV heads (GQA), head_dim 16; Qwen3.5: the 4
    layers of ``TINY_QWEN3_5_LAYERS``, head_dim 32 (8 rotated dims), linear
    attention with 2 key heads and 4 value heads of 16."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if arch == "llama":
        return LlamaConfig(**common, rms_norm_eps=1e-5)
    if arch == "qwen2":
        return Qwen2Config(**common, rms_norm_eps=1e-6)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16, rms_norm_eps=1e-6)
    if arch == "mistral-sliding":
        # Mistral v0.1's shape of config: one window for every layer, no layer_types.
        return MistralConfig(**common, sliding_window=TINY_SLIDING_WINDOW, rms_norm_eps=1e-5)
    if arch == "qwen3-sliding":
        # Qwen3's own interleave: layers from max_window_layers on are sliding.
        return Qwen3Config(**common, head_dim=16, rms_norm_eps=1e-6, use_sliding_window=True,
                           sliding_window=TINY_SLIDING_WINDOW, max_window_layers=1)
    if arch == "gemma3":
        # Three local layers to one global (the released models: five to one).
        gemma = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 4},
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            sliding_window=TINY_SLIDING_WINDOW,
            head_dim=16,
            query_pre_attn_scalar=16,
            rms_norm_eps=1e-6,
        )
        gemma.architectures = ["Gemma3ForCausalLM"]
        return gemma
    if arch in TINY_QWEN3_5_LAYERS:
        layers = TINY_QWEN3_5_LAYERS[arch]
        config = Qwen3_5TextConfig(
            **{**common, "num_hidden_layers": len(layers)},
            layer_types=layers,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
        )
        config.architectures = ["Qwen3_5ForCausalLM"]
        return config
    raise ValueError(f"unknown tiny architecture {arch!r}")


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Hugging Face's progress bars off inside: a one-file tiny model needs none in the grader's output."""
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def write_random_model(path: Path, config: PretrainedConfig, seed: int = 0) -> Path:
    """Write config.json, seeded random weights and generation_config.json into ``path``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    zero_centred_norms = config.model_type in ("qwen3_5_text", "gemma3_text")
    # Random init gives near-uniform logits; a larger scale makes greedy argmax
    # decisive, so the parity tests compare real decisions, not ties.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
            elif zero_centred_norms and name.endswith("norm.weight") and ".linear_attn." not in name:
                # Qwen3.5's and Gemma 3's norms scale by 1 + w and HF starts w at 0: draw it, so a
                # dropped "1 +" would show in the parity tests.
                param.normal_(0.0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    with no_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(eos_token_id=config.eos_token_id, bos_token_id=0).save_pretrained(path)
    return path


def _written_once(name: str, config: PretrainedConfig) -> str:
    """A random model of ``config`` in a temporary folder removed when the process exits."""
    folder = tempfile.mkdtemp(prefix=f"nanoengine-tiny-{name}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    write_random_model(Path(folder), config)
    return folder


@functools.cache
def tiny_hybrid_model_dir() -> str:
    """The tiny Qwen3.5 ("qwen3_5": linear, linear, linear, full), written once per
    process into a temporary folder that is removed when the process exits."""
    return _written_once("qwen3_5", tiny_config("qwen3_5", TINY_VOCAB_SIZE))


@functools.cache
def tiny_gemma3_model_dir() -> str:
    """The tiny Gemma 3 (three sliding-window layers of ``TINY_SLIDING_WINDOW``
    tokens, then a global one), written once per process like ``tiny_hybrid_model_dir``.
    Chapter 4's sliding-window experiment and exercise 4.6 run on it."""
    return _written_once("gemma3", tiny_config("gemma3", TINY_VOCAB_SIZE))


@functools.cache
def tiny_llama_model_dir(num_kv_heads: int) -> str:
    """The tiny Llama (4 query heads of 16, two layers) with ``num_kv_heads`` KV
    heads, written once per process like ``tiny_hybrid_model_dir``. Exercise
    6.2 splits it over two ranks: 2 KV heads split (one a rank), 1 replicated."""
    config = tiny_config("llama", TINY_VOCAB_SIZE)
    config.num_key_value_heads = num_kv_heads
    return _written_once(f"llama-{num_kv_heads}kv", config)
