"""Tiny random-weight HF model directories for fast engine tests.

Each directory is what a user would download: config.json, model.safetensors,
a byte-level BPE tokenizer trained here on a few sentences, a chat template and
generation_config.json. Nothing comes from the network. The config and the
random weights come from ``chapters/grade_checks/tiny_model.py``; this module
adds the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# The configs and weights are the grader's too (its hybrid exercises run on a
# tiny Qwen3.5); re-exported here, where the tests have always found them.
from chapters.grade_checks.tiny_model import TINY_QWEN3_5_LAYERS, tiny_config, write_random_model

__all__ = ["TINY_QWEN3_5_LAYERS", "make_tiny_model_dir", "tiny_config", "train_tokenizer"]

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


def make_tiny_model_dir(path: Path, arch: str, tie: bool = True, seed: int = 0) -> Path:
    """Write a complete HF model directory (with a tokenizer) and return it."""
    tokenizer = train_tokenizer()
    config = tiny_config(arch, vocab_size=len(tokenizer), tie=tie)
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    write_random_model(path, config, seed)
    tokenizer.save_pretrained(path)
    return path
