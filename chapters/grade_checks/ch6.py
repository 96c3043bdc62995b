"""The grader's checks for exercise 6.1 (chapter 6).

Each promise on the exercise page has a check of its own, named in a
student's words. The unit checks call ``num_blocks_from_budget`` directly and
return labeled tables: each key names the budget and the spec, each value is
the block count that came back. The end-to-end run comes last.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from chapters.grade_checks.common import PROMPTS, Check, greedy_run, kv_spec
from nanoengine.core.kv_cache_sizing import num_blocks_from_budget
from nanoengine.kv_cache_interface import FullAttentionSpec

# Specs whose page sizes differ in every factor: tokens per block, layers, KV heads, head size, bytes.
SPECS = [
    kv_spec(4),
    kv_spec(16),
    # SmolLM2-135M in bf16: 30 layers, 3 KV heads of 64.
    FullAttentionSpec(block_size=16, num_kv_heads=3, head_dim=64, dtype_size=2, num_layers=30),
]


def describe(spec: FullAttentionSpec) -> str:
    return (f"{spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim} x {spec.dtype_size} bytes, "
            f"{spec.block_size}-token blocks")


def blocks_for(budgets_in_pages: list[float | int], extra_bytes: int = 0) -> dict[str, Any]:
    """``num_blocks_from_budget`` for each budget (in pages, plus ``extra_bytes``) and spec."""
    table: dict[str, Any] = {}
    for spec in SPECS:
        page = spec.page_size_bytes
        for pages in budgets_in_pages:
            budget = int(pages * page) + extra_bytes
            table[f"{budget} bytes, {describe(spec)} (page_size_bytes={page})"] = num_blocks_from_budget(budget, spec)
    return table


# --------------------------------------------------- 6.1 num_blocks_from_budget
def whole_pages(model: str) -> dict[str, Any]:
    """Budgets of exactly 1, 3 and 1000 blocks' `page_size_bytes`, for three specs that differ in
    block size, layers, KV heads, head size and element size.
    """
    return blocks_for([1, 3, 1000])


def partial_block_dropped(model: str) -> dict[str, Any]:
    """Budgets one byte short of 1 and of 3 blocks, and 2.5 and 10 blocks plus 7 bytes, for the
    same three specs.
    """
    table = blocks_for([1, 3], extra_bytes=-1)
    table.update(blocks_for([2.5]))
    table.update(blocks_for([10], extra_bytes=7))
    return table


def nothing_fits_no_budget(model: str) -> dict[str, Any]:
    """Budgets of 0, -1 and -5 bytes, and minus 3 blocks' worth, for the same three specs."""
    table = blocks_for([0])
    table.update(blocks_for([0], extra_bytes=-1))
    table.update(blocks_for([0], extra_bytes=-5))
    table.update(blocks_for([-3]))
    return table


def e2e_memory_budget(model: str) -> dict[str, Any]:
    """An engine built with `kv_cache_memory_bytes=6_000_000`, `max_model_len=64`, 4-token blocks
    (thousands of blocks on the tiny test model, 32 on SmolLM2), then 8 greedy tokens for four
    prompts.
    """
    run = greedy_run(model, PROMPTS, max_tokens=8, kv_cache_memory_bytes=6_000_000, max_model_len=64,
                     block_size=4)
    return asdict(run)


CHECKS: dict[str, tuple[Check, ...]] = {
    # The first name is the one tests/test_exercises.py looks for in the CLI's output.
    "6.1": (Check("blocks from a byte budget: one block is spec.page_size_bytes (K and V, every layer)",
                  whole_pages),
            Check("a partial block does not count (floor, not ceil)", partial_block_dropped),
            Check("a zero or negative budget fits no block (0, not negative)", nothing_fits_no_budget),
            Check("end to end: KV cache sized from a byte budget", e2e_memory_budget)),
}
