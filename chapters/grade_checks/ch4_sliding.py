"""The grader's checks for exercise 4.6 (chapter 4, sliding windows).

4.6 (``SingleTypeKVCacheManager.remove_skipped_blocks``) is called on a
hand-built sliding-window manager: blocks of 4 tokens, a window of 8, one
request whose table holds 10 blocks (40 tokens), over a pool of 16 blocks.
Table entries are printed as block ids, the null block as 0. The free queue's
tail is the order blocks were given back (the last one is evicted last).

The end-to-end run builds an engine on the grader's own tiny Gemma 3
(``tiny_model.py``: three sliding-window layers of 16 tokens, one global
layer), whatever model the grader was given: only such a model has
sliding-window groups.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from chapters.grade_checks.common import PROMPTS, Check, greedy_run
from chapters.grade_checks.tiny_model import tiny_gemma3_model_dir
from nanoengine.core.block_pool import BlockPool
from nanoengine.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

BLOCK_SIZE = 4
WINDOW = 8
NUM_BLOCKS = 16
TABLE_TOKENS = 40  # 10 blocks
# The tiny Gemma 3 in 4-token blocks: a request of 7 + 40 tokens holds 12 full-attention
# blocks, and at most 5 in each of its 3 sliding groups (9 while a 16-token chunk runs).
SLIDING_ENGINE: dict[str, Any] = {"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 16,
                                  "dtype": "float32", "num_gpu_blocks_override": 64, "skip_tokenizer_init": True}


def _spec(window: int | None) -> FullAttentionSpec:
    full = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)
    return full if window is None else SlidingWindowSpec(**vars(full), sliding_window=window)


def _manager(window: int | None = WINDOW) -> SingleTypeKVCacheManager:
    """A manager of one group whose request ``r`` holds 10 blocks (ids 1 .. 10)."""
    spec = _spec(window)
    pool = BlockPool(NUM_BLOCKS, enable_caching=True)
    group = KVCacheGroupSpec((0,), spec)
    manager: SingleTypeKVCacheManager = (
        FullAttentionManager(group, 0, pool) if window is None else SlidingWindowManager(group, 0, pool)
    )
    manager.allocate_new_blocks("r", TABLE_TOKENS)
    return manager


def _table(manager: SingleTypeKVCacheManager) -> list[int]:
    return [block.block_id for block in manager.get_blocks("r")]


def _after(manager: SingleTypeKVCacheManager, num_computed_tokens: int, request_id: str = "r") -> str:
    """Call remove_skipped_blocks; what it raised, if it did."""
    try:
        manager.remove_skipped_blocks(request_id, num_computed_tokens)
    except Exception as error:  # noqa: BLE001 - a wrong answer may raise anything; say what
        return f"raised {type(error).__name__}: {error}"
    return "returned"


def keeps_the_table_length(model: str) -> dict[str, Any]:
    """Window 8, blocks of 4: remove_skipped_blocks("r", 19), 12 tokens skipped (3
    whole blocks), on a table of 10 blocks; the table afterwards.
    """
    manager = _manager()
    outcome = _after(manager, 19)
    return {"remove_skipped_blocks(r, 19)": outcome, "the table afterwards (0: the null block)": _table(manager)}


def gives_blocks_back_latest_first(model: str) -> dict[str, Any]:
    """The same call at 19 tokens: free blocks in the pool, and the free queue's last
    three entries (the order the blocks were given back in).
    """
    manager = _manager()
    before = manager.block_pool.get_num_free_blocks()
    outcome = _after(manager, 19)
    queue = [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]
    return {"remove_skipped_blocks(r, 19)": outcome, "free blocks before": before,
            "free blocks after": manager.block_pool.get_num_free_blocks(),
            "the free queue's tail, last given back last": queue[-3:]}


def keeps_the_window_first_key(model: str) -> dict[str, Any]:
    """Fresh tables of 10 blocks, one call each at 22, 23 and 24 tokens: 15, 16 and
    17 tokens skipped, so the first key the next token reads is 15, 16 and 17.
    """
    result: dict[str, Any] = {}
    for num_computed in (22, 23, 24):
        manager = _manager()
        outcome = _after(manager, num_computed)
        result[f"remove_skipped_blocks(r, {num_computed}): outcome, then the table"] = (outcome, _table(manager))
    return result


def later_calls_give_back_only_new_blocks(model: str) -> dict[str, Any]:
    """Calls at 19, 19 again, 27 and 30 tokens on one table (the request grows), then
    one for a request "x" that holds no block yet: the table and free count after each.
    """
    manager = _manager()
    result: dict[str, Any] = {}
    for num_computed in (19, 19, 27, 30):
        outcome = _after(manager, num_computed)
        result[f"remove_skipped_blocks(r, {num_computed})"] = (outcome, _table(manager),
                                                               manager.block_pool.get_num_free_blocks())
    result["remove_skipped_blocks(x, 30), no blocks"] = _after(manager, 30, request_id="x")
    return result


def full_attention_skips_nothing(model: str) -> dict[str, Any]:
    """A full-attention manager (no window) with the same table: calls at 19 and 40
    tokens; the table and free blocks afterwards.
    """
    manager = _manager(window=None)
    outcomes = [_after(manager, 19), _after(manager, 40)]
    return {"calls at 19 and 40": outcomes, "the table afterwards": _table(manager),
            "free blocks": manager.block_pool.get_num_free_blocks()}


def e2e_sliding_generation(model: str) -> dict[str, Any]:
    """The grader's tiny Gemma 3 (three local layers of 16 tokens, one global layer),
    whatever model the grader is given: four 7-token prompts, 40 greedy tokens each,
    63 usable blocks of 4 tokens. Sliding groups that never give blocks back hold
    more, and the scheduler must preempt more often.
    """
    return asdict(greedy_run(tiny_gemma3_model_dir(), PROMPTS, max_tokens=40, **SLIDING_ENGINE))


CHECKS: dict[str, tuple[Check, ...]] = {
    "4.6": (
        Check("the table keeps its length: the null block in place of each given-back block",
              keeps_the_table_length),
        Check("the given-back blocks go to the pool, the latest in the table first", gives_blocks_back_latest_first),
        Check("keeps the block that holds the window's first key", keeps_the_window_first_key),
        Check("a later call gives back only the newly skipped blocks; no blocks, no change",
              later_calls_give_back_only_new_blocks),
        Check("full attention skips nothing: get_num_skipped_tokens decides", full_attention_skips_nothing),
        Check("end to end: greedy tokens and preemptions on a tiny sliding-window model", e2e_sliding_generation,
              own_model="the grader's tiny Gemma 3"),
    ),
}
