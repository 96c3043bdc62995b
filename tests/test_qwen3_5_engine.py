"""Qwen3.5 through the whole engine: hybrid KV cache groups, state slots, shared pages.

A tiny random Qwen3.5 (tests/tiny_models.py: two layer patterns, Gated DeltaNet
beside full attention) runs through ``LLM.generate`` and must give HF
transformers' greedy tokens for a batch of mixed lengths, with a prompt
prefilled in several chunks, and through preemption and recompute. The KV
cache config must hold one attention group and state groups over one pool;
prefix caching is turned off for the model, with a log line.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
from hf_reference import EXACT_DTYPE, HFGreedy

from nanoengine import LLM, SamplingParams
from nanoengine._custom_ops import cpu_ops_available
from nanoengine.kv_cache_interface import FullAttentionSpec, MambaSpec

NUM_TOKENS = 24
PROMPT_LENGTHS = [5, 37, 1, 18, 60, 9]
BACKENDS = ["torch"] + (["cpu"] if cpu_ops_available() else [])
SCENARIOS: dict[str, dict[str, Any]] = {
    "one_step_prefill": dict(max_num_batched_tokens=512),
    # 16 tokens a step: the 60-token prompt is prefilled in four chunks, its state
    # carried from chunk to chunk in its slot.
    "chunked_prefill": dict(max_num_batched_tokens=16),
    # So few blocks that running requests are preempted and recomputed from zero.
    "preemption": dict(block_size=16, num_gpu_blocks_override=14, max_num_batched_tokens=64),
}


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5-alt"])
def tiny_qwen3_5(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory(request.param)


@pytest.fixture(scope="module")
def hf_greedy(tiny_qwen3_5: str) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, HF's greedy continuation of each), computed once per model."""
    reference = HFGreedy(tiny_qwen3_5)
    prompts = _prompts(reference.model.config.vocab_size)
    return prompts, [reference.generate(p, NUM_TOKENS) for p in prompts]


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    scheduler = llm.llm_engine.engine_core.get_engine_core().scheduler
    return [list(o.outputs[0].token_ids) for o in outs], scheduler.make_stats().num_preemptions


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_hf(
    tiny_qwen3_5: str, hf_greedy: tuple[list[list[int]], list[list[int]]], backend: str, scenario: str
) -> None:
    prompts, expected = hf_greedy
    llm = LLM(
        tiny_qwen3_5,
        dtype=EXACT_DTYPE,
        attention_backend=backend,
        max_model_len=128,
        kv_cache_memory_bytes=1 << 22,
        **SCENARIOS[scenario],
    )
    got, preemptions = _generate(llm, prompts)
    assert got == expected
    if scenario == "preemption":
        assert preemptions > 0, "the small pool was meant to force preemption"
    # Once more on the same engine: every slot and block was freed and is reused.
    again, _ = _generate(llm, prompts)
    assert again == expected


def test_kv_cache_config_has_an_attention_group_and_state_groups(
    tiny_qwen3_5: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Groups cover every layer once, by kind; all pages have one size; a block size too
    small for an attention page to hold a state is raised (to 16 tokens here: 16 x 512
    bytes of K/V per layer >= a 5632-byte state) everywhere the engine reads it; prefix
    caching was asked for and turned off, with a log line that says why."""
    with caplog.at_level(logging.INFO):
        llm = LLM(
            tiny_qwen3_5, dtype=EXACT_DTYPE, max_model_len=128, kv_cache_memory_bytes=1 << 22, block_size=8
        )
    core = llm.llm_engine.engine_core.get_engine_core()
    config = core.kv_cache_config
    assert config.block_size == llm.llm_engine.engine_config.cache_config.block_size == 16
    assert any("block_size raised from 8 to 16" in r.getMessage() for r in caplog.records)
    layer_types = llm.llm_engine.engine_config.model_config.layer_types
    seen: list[int] = []
    for group in config.kv_cache_groups:
        kind = "full_attention" if isinstance(group.kv_cache_spec, FullAttentionSpec) else "linear_attention"
        assert isinstance(group.kv_cache_spec, (FullAttentionSpec, MambaSpec))
        assert all(layer_types[i] == kind for i in group.layer_indices)
        seen.extend(group.layer_indices)
    assert sorted(seen) == list(range(len(layer_types)))
    assert not core.scheduler.kv_cache_manager.enable_caching
    assert any("prefix caching" in r.getMessage().lower() for r in caplog.records)
