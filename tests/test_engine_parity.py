"""Greedy parity: the engine's batched tokens equal HF transformers' one-by-one tokens.

Run on tiny random Llama / Qwen2 / Qwen3 models (tied and untied embeddings) and
on the real SmolLM2-135M-Instruct, with prefix caching on and off, with a small
token budget (chunked prefill) and with a KV cache so small that requests are
preempted and recomputed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from hf_reference import EXACT_DTYPE, HFGreedy
from transformers import AutoTokenizer

from nanoengine import LLM, SamplingParams

# Engine settings for each scenario; the tiny cache forces preemption.
SCENARIOS: dict[str, dict[str, Any]] = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "chunked_small_budget": dict(max_num_batched_tokens=32),
    "preemption": dict(num_gpu_blocks_override=25, block_size=4, max_model_len=96),
}


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # A shared prefix for half the prompts exercises prefix-cache hits.
    shared = [rng.randrange(3, vocab_size) for _ in range(12)]
    prompts = []
    for i, length in enumerate(lengths):
        body = [rng.randrange(3, vocab_size) for _ in range(length)]
        prompts.append((shared + body) if i % 2 else body)
    return prompts


def _run_engine(llm: LLM, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], int]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.get_engine_core().scheduler
    return [o.outputs[0].token_ids for o in outs], scheduler.make_stats().num_preemptions


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_tiny_model_greedy_parity(
    tiny_model_factory: Callable[..., str], arch: str, tie: bool, scenario: str
) -> None:
    path = tiny_model_factory(arch, tie=tie)
    reference = HFGreedy(path)
    prompts = _prompts(reference.model.config.vocab_size, [5, 17, 3, 30, 9, 24])
    num_tokens = 48
    expected = [reference.generate(p, num_tokens) for p in prompts]
    settings = {
        "kv_cache_memory_bytes": 1 << 24,
        "max_model_len": 256,
        "dtype": EXACT_DTYPE,
        **SCENARIOS[scenario],
    }
    llm = LLM(path, **settings)
    got, preemptions = _run_engine(llm, prompts, num_tokens)
    assert got == expected
    if scenario == "preemption":
        assert preemptions > 0, "the tiny KV cache was meant to force preemption"
    # Run again on the same engine: the prefix cache now holds these prompts.
    again, _ = _run_engine(llm, prompts, num_tokens)
    assert again == expected


SMOLLM2_TEXTS = [
    "Hello",
    "Write a Python function that reverses a list.",
    "What is the capital of France?",
    "Explain in one paragraph why the sky is blue, as if to a child who asks many questions.",
    "List three prime numbers.",
    "Translate to French: the cat sits on the mat.",
]
SMOLLM2_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2_reference(default_model_path: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, HF's greedy tokens), computed once for all scenarios."""
    reference = HFGreedy(default_model_path)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer.encode(t) for t in SMOLLM2_TEXTS]
    return prompts, [reference.generate(p, SMOLLM2_NEW_TOKENS) for p in prompts]


@pytest.mark.default_model
@pytest.mark.parametrize("scenario", ["prefix_caching", "no_prefix_caching", "preemption"])
def test_smollm2_greedy_parity(
    default_model_path: str, smollm2_reference: tuple[list[list[int]], list[list[int]]], scenario: str
) -> None:
    prompts, expected = smollm2_reference
    # A 256-token budget holds every prompt at once (as the default 2048 would) and
    # makes the start-up profiling pass 8x cheaper (9 s of SmolLM2 at 2048 tokens).
    settings = dict(SCENARIOS[scenario], max_model_len=256, max_num_batched_tokens=256, dtype=EXACT_DTYPE)
    if scenario == "preemption":
        settings.update(num_gpu_blocks_override=30, block_size=4, max_model_len=112)
    llm = LLM(default_model_path, **settings)
    got, preemptions = _run_engine(llm, prompts, SMOLLM2_NEW_TOKENS)
    assert got == expected
    if scenario == "preemption":
        assert preemptions > 0
