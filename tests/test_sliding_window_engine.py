"""Sliding-window models end to end (chapter 4): HF's greedy tokens, and a window's worth of blocks.

Three tiny random-weight models, window 16 tokens: a Mistral-style config
(every layer sliding, one KV cache group), Qwen3 with ``use_sliding_window``
(one full and one sliding layer) and Gemma 3 (three local layers to one
global: one full-attention group, three sliding-window groups). Prompts are
shorter and far longer than the window, and generation runs to about seven
windows. The invariants (``instruments/invariants.py``, on in every engine
test) check each sliding table after every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from engine_helpers import add, make_engine
from hf_reference import EXACT_DTYPE, HFGreedy

from chapters.grade_checks.tiny_model import TINY_SLIDING_WINDOW
from nanoengine import LLM, SamplingParams
from nanoengine.core.single_type_kv_cache_manager import SlidingWindowManager
from nanoengine.instruments.component_tree import tree_to_text

ARCHS = ["mistral-sliding", "qwen3-sliding", "gemma3"]
SCENARIOS: dict[str, dict[str, Any]] = {
    "prefix_caching": dict(enable_prefix_caching=True),
    "chunked_small_budget": dict(max_num_batched_tokens=24),
    # Blocks of 4 tokens, a pool a little above one longest request's need
    # (PREEMPTION_BLOCKS): requests are preempted and recomputed.
    "preemption": dict(block_size=4, max_model_len=144, max_num_batched_tokens=16),
}
# One request of 144 tokens in steps of 16 holds at most 9 blocks per sliding
# group (window 15 + 16 tokens, plus a straddled block) and 36 per full group.
PREEMPTION_BLOCKS = {"mistral-sliding": 13, "qwen3-sliding": 52, "gemma3": 72}
NUM_TOKENS = 48


def prompts(vocab_size: int) -> list[list[int]]:
    """Lengths 5 to 70 (under and over four windows); the odd ones share a 20-token prefix."""
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab_size) for _ in range(20)]
    out = []
    for i, length in enumerate([5, 40, 9, 70, 17, 33]):
        body = [rng.randrange(3, vocab_size) for _ in range(length)]
        out.append(shared + body if i % 2 else body)
    return out


@pytest.fixture(scope="module")
def references(tiny_model_factory: Callable[..., str]) -> dict[str, tuple[str, list[list[int]], list[list[int]]]]:
    """Each model's path, prompts and HF's greedy tokens (HF keeps its own sliding cache)."""
    made = {}
    for arch in ARCHS:
        path = tiny_model_factory(arch)
        reference = HFGreedy(path)
        cases = prompts(reference.model.config.vocab_size)
        made[arch] = (path, cases, [reference.generate(p, NUM_TOKENS) for p in cases])
    return made


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_equal_hf(
    references: dict[str, tuple[str, list[list[int]], list[list[int]]]], arch: str, scenario: str
) -> None:
    path, cases, expected = references[arch]
    settings = {"kv_cache_memory_bytes": 1 << 24, "max_model_len": 256, "block_size": 16, "dtype": EXACT_DTYPE,
                **SCENARIOS[scenario]}
    if scenario == "preemption":
        settings["num_gpu_blocks_override"] = PREEMPTION_BLOCKS[arch]
    llm = LLM(path, **settings)
    core = llm.llm_engine.engine_core.get_engine_core()
    managers = core.scheduler.kv_cache_manager.coordinator.single_type_managers
    assert any(isinstance(m, SlidingWindowManager) for m in managers)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    for _ in range(2):  # the second time, the prefix cache holds these prompts
        outs = llm.generate([{"prompt_token_ids": p} for p in cases], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    stats = core.scheduler.make_stats()
    if scenario == "preemption":
        assert stats.num_preemptions > 0, "the small KV cache was meant to force preemption"
    if scenario == "prefix_caching":
        assert core.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0


def test_the_window_changes_the_tokens(references: dict[str, tuple[str, list[list[int]], list[list[int]]]]) -> None:
    """The parity above means something: the same weights without a window answer otherwise."""
    path, cases, expected = references["mistral-sliding"]
    assert HFGreedy(path, sliding_window=None).generate(cases[3], NUM_TOKENS) != expected[3]


def test_a_request_eight_windows_long_holds_one_window_per_sliding_group(
    tiny_model_factory: Callable[..., str],
) -> None:
    """Gemma 3's three sliding groups each hold at most window / block_size + 1 blocks at
    every decode step of a 128-token request; its full-attention group holds them all."""
    engine = make_engine(tiny_model_factory("gemma3"), block_size=4, dtype=EXACT_DTYPE,
                         num_gpu_blocks_override=96, max_num_batched_tokens=TINY_SLIDING_WINDOW)
    core = engine.engine_core.get_engine_core()
    coordinator = core.scheduler.kv_cache_manager.coordinator
    request = add(engine, "long", [5 + i % 200 for i in range(8)],
                  SamplingParams(temperature=0.0, max_tokens=8 * TINY_SLIDING_WINDOW - 8, ignore_eos=True))
    null = coordinator.block_pool.null_block
    held_per_step: list[list[int]] = []
    while engine.has_unfinished_requests():
        engine.step()
        if request.is_finished():
            break
        held_per_step.append([sum(b is not null for b in m.get_blocks("long")) for m in coordinator.single_type_managers])
        if len(held_per_step) == 40:  # the component tree names each sliding group and what it gave back
            tree = tree_to_text(core.scheduler)
            assert tree.count(f"sliding_window={TINY_SLIDING_WINDOW} given_back=") == 3
            # Scheduled at n - 1 computed tokens, the step skipped (n - 1) - 16 + 1 of them: whole blocks given back.
            given_back = (request.num_computed_tokens - TINY_SLIDING_WINDOW) // 4
            assert f"sliding_window={TINY_SLIDING_WINDOW} given_back={given_back}" in tree
    bound = TINY_SLIDING_WINDOW // 4 + 1
    assert len(held_per_step) >= 8 * TINY_SLIDING_WINDOW - 9
    for held in held_per_step:
        full, *sliding = held
        assert all(n <= bound for n in sliding), held
    assert held_per_step[-1][0] >= (8 * TINY_SLIDING_WINDOW - 1) // 4  # full attention keeps every block
