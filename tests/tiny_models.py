"""Tiny random-weight HF model directories for fast engine tests.

Each directory is what a user would download: config.json, model.safetensors,
a byte-level BPE tokenizer trained here on a few sentences, a chat template and
generation_config.json. Nothing comes from the network.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Write a Python function that reverses a list.",
    "What is the capital of France? Paris is the capital of France.",
    "def reverse(xs): return xs[::-1]",
    "Hello world, hello engine, hello scheduler and KV cache.",
] * 20


def train_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A real byte-level BPE tokenizer, trained in milliseconds on a toy corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Qwen3.5's layers, by kind: "linear_attention" (Gated DeltaNet, a state per
# request) or "full_attention" (a paged KV cache). Two patterns keep the tests
# honest about which layer index is which kind.
TINY_QWEN3_5_LAYERS = {
    "qwen3_5": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "qwen3_5-alt": ["full_attention", "linear_attention", "full_attention", "linear_attention"],
}


def tiny_config(arch: str, vocab_size: int, tie: bool = True) -> PretrainedConfig:
    """2 layers, 4 query heads over 2 KV heads (GQA), head_dim 16; Qwen3.5: the 4
    layers of ``TINY_QWEN3_5_LAYERS``, head_dim 32 (8 rotated dims), linear
    attention with 2 key heads and 4 value heads of 16."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(**common, rms_norm_eps=1e-5)
    if arch == "qwen2":
        return Qwen2Config(**common, rms_norm_eps=1e-6)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16, rms_norm_eps=1e-6)
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


def make_tiny_model_dir(path: Path, arch: str, tie: bool = True, seed: int = 0) -> Path:
    """Write a complete HF model directory and return it."""
    tokenizer = train_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), tie=tie)
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; a larger scale makes greedy argmax
    # decisive, so the parity tests compare real decisions, not ties.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
            elif name.endswith("norm.weight") and ".linear_attn." not in name and arch in TINY_QWEN3_5_LAYERS:
                # Qwen3.5's norms scale by 1 + w and HF starts w at 0: draw it, so a
                # dropped "1 +" would show in the parity tests.
                param.normal_(0.0, 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=config.eos_token_id, bos_token_id=0).save_pretrained(path)
    return path
