"""The grader's checks for exercise 6.1 (chapter 6).

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from chapters.grade_checks.common import PROMPTS, Check, greedy_run, kv_spec
from nanoengine.core.kv_cache_sizing import num_blocks_from_budget


# --------------------------------------------------- 6.1 num_blocks_from_budget
def budget_to_blocks(model: str) -> list[int]:
    counts = []
    for spec in (kv_spec(4), kv_spec(16)):
        page = spec.page_size_bytes
        for budget in (0, page - 1, page, 10 * page + 7, 2**34, -5):
            counts.append(num_blocks_from_budget(budget, spec))
    assert counts[:4] == [0, 0, 1, 10]
    return counts


def e2e_memory_budget(model: str) -> dict[str, Any]:
    # 6 MB: thousands of blocks on the tiny test model, 32 on SmolLM2.
    run = greedy_run(model, PROMPTS, max_tokens=8, kv_cache_memory_bytes=6_000_000, max_model_len=64,
                     block_size=4)
    return asdict(run)


CHECKS: dict[str, tuple[Check, ...]] = {
    "6.1": (Check("blocks from a byte budget", budget_to_blocks),
            Check("end to end: KV cache sized from a byte budget", e2e_memory_budget)),
}
