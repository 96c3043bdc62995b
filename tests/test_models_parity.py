"""Our Llama/Qwen2/Qwen3 against HF transformers' own modeling code.

A tiny random-weight HF model is saved with save_pretrained (safetensors) and
loaded back through nanoengine's get_model. Several prompts then run as one
flattened prefill over a paged KV cache full of finite garbage, followed by decode steps
that feed HF's greedy tokens; every logit row must match HF's full forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_attention_ref import allocate_blocks, make_attn_metadata
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from nanoengine.attention.layer import bind_kv_cache
from nanoengine.model_executor.layers.rotary_embedding import get_rope
from nanoengine.model_executor.model_loader import get_model
from nanoengine.model_executor.models import SUPPORTED_ARCHITECTURES, get_model_class

BLOCK_SIZE = 4
NUM_BLOCKS = 32
NUM_DECODE_STEPS = 3
PROMPT_LENGTHS = (5, 8, 11)

_COMMON: dict[str, Any] = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny test positions really exercise all three bands.
    "original_max_position_embeddings": 16,
}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_COMMON, tie_word_embeddings=False),
    "llama-tied-llama3-bias": LlamaConfig(
        **_COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_parameters=_LLAMA3_ROPE
    ),
    "qwen2-tied": Qwen2Config(**_COMMON, tie_word_embeddings=True),
    "qwen2": Qwen2Config(**_COMMON, tie_word_embeddings=False),
    # head_dim 32 != hidden_size / num_heads (16): must be read from the config.
    "qwen3": Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False),
    "qwen3-tied": Qwen3Config(**_COMMON, head_dim=16, tie_word_embeddings=True),
}


@dataclass
class HFReference:
    model_dir: Path
    hf_config: PretrainedConfig
    prompts: list[list[int]]
    generated: list[list[int]]  # HF greedy continuation of each prompt
    logits: list[torch.Tensor]  # HF full-forward logits over prompt + generated


def save_random_hf_model(config: PretrainedConfig, model_dir: Path) -> Any:
    """An HF model with weights large enough that any mistake moves the logits."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + 0.15 * torch.randn_like(param))
    model.save_pretrained(model_dir)
    return model


@torch.no_grad()
def hf_reference(config: PretrainedConfig, model_dir: Path) -> HFReference:
    model = save_random_hf_model(config, model_dir)
    vocab = config.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in PROMPT_LENGTHS]
    generated: list[list[int]] = []
    logits: list[torch.Tensor] = []
    for prompt in prompts:
        tokens = list(prompt)
        for _ in range(NUM_DECODE_STEPS):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
        generated.append(tokens[len(prompt) :])
        logits.append(model(input_ids=torch.tensor([tokens])).logits[0].float())
    return HFReference(model_dir, AutoConfig.from_pretrained(model_dir), prompts, generated, logits)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_prefill_then_decode_matches_hf(name: str, tmp_path: Path) -> None:
    ref = hf_reference(CONFIGS[name], tmp_path)
    model = get_model(str(tmp_path), ref.hf_config, torch.float32, torch.device("cpu"))
    cfg = ref.hf_config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache_shape = (2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, head_dim)
    # Large finite garbage: a stale slot that reached any output would move it visibly.
    bind_kv_cache(model, [torch.randn(cache_shape) * 1e3 for _ in range(cfg.num_hidden_layers)])
    total = [len(p) + NUM_DECODE_STEPS for p in ref.prompts]
    blocks = allocate_blocks(total, BLOCK_SIZE, NUM_BLOCKS, seed=1)

    # Step 0: all prompts as one flattened prefill.
    lengths = [len(p) for p in ref.prompts]
    md = make_attn_metadata([0] * len(lengths), lengths, blocks, BLOCK_SIZE)
    input_ids = torch.tensor([t for p in ref.prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    logits = model.compute_logits(model(input_ids, positions, md))
    for i, (start, end) in enumerate(zip(md.query_start_loc_cpu, md.query_start_loc_cpu[1:])):
        torch.testing.assert_close(logits[start:end], ref.logits[i][: lengths[i]], atol=1e-4, rtol=1e-4)

    # Decode steps: every request feeds HF's greedy token at its next position.
    for step in range(NUM_DECODE_STEPS):
        computed = [n + step for n in lengths]
        md = make_attn_metadata(computed, [1] * len(lengths), blocks, BLOCK_SIZE)
        input_ids = torch.tensor([g[step] for g in ref.generated])
        logits = model.compute_logits(model(input_ids, torch.tensor(computed), md))
        for i, pos in enumerate(computed):
            torch.testing.assert_close(logits[i], ref.logits[i][pos], atol=1e-4, rtol=1e-4)
            if step + 1 < NUM_DECODE_STEPS:
                assert int(logits[i].argmax()) == ref.generated[i][step + 1]
    assert logits.dtype == torch.float32


def test_loaded_model_is_frozen_eval_and_in_dtype(tmp_path: Path) -> None:
    ref_model = save_random_hf_model(CONFIGS["qwen2-tied"], tmp_path)
    model = get_model(
        str(tmp_path), AutoConfig.from_pretrained(tmp_path), torch.bfloat16, torch.device("cpu")
    )
    assert not model.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in model.parameters())
    # The tied head shares the embedding's storage, loaded once.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(
        model.model.embed_tokens.weight.float(), ref_model.model.embed_tokens.weight.bfloat16().float()
    )


def test_unsupported_architecture_is_named() -> None:
    config = PretrainedConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as err:
        get_model_class(config)
    message = str(err.value)
    assert "Model architecture 'GPT2LMHeadModel' is not supported by nanoengine" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_missing_safetensors_names_the_directory(tmp_path: Path) -> None:
    config = CONFIGS["llama"]
    config.architectures = ["LlamaForCausalLM"]  # set by save_random_hf_model, which may not have run yet
    config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        get_model(str(tmp_path), AutoConfig.from_pretrained(tmp_path), torch.float32, torch.device("cpu"))


def _tensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def test_unknown_and_missing_weights_are_named(tmp_path: Path) -> None:
    save_random_hf_model(CONFIGS["llama"], tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    tensors = _tensors_of(tmp_path)
    extra = dict(tensors, **{"model.layers.0.mlp.surprise.weight": torch.zeros(2)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="surprise"):
        get_model(str(tmp_path), config, torch.float32, torch.device("cpu"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        get_model(str(tmp_path), config, torch.float32, torch.device("cpu"))


def test_absent_lm_head_is_tied_and_redundant_one_skipped(tmp_path: Path) -> None:
    save_random_hf_model(CONFIGS["llama"], tmp_path)  # untied: has its own lm_head.weight
    config = AutoConfig.from_pretrained(tmp_path)
    tensors = _tensors_of(tmp_path)
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = get_model(str(tmp_path), config, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # A tied config whose checkpoint still carries the head: the copy is ignored.
    config.tie_word_embeddings = True
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = get_model(str(tmp_path), config, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_unsupported_rope_type_is_named() -> None:
    config = LlamaConfig(**_COMMON, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        get_rope(16, config)
