"""Wrong answers to the chapter-4 exercises (see ``__init__.py``).

One mutant per promise of each exercise page, each caught first by the check
named after that promise (``chapters/grade_checks/ch4.py``).
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# Lines of the references as they stand in their (dedented) source.
# 4.1 claims the cache hits, then takes new blocks:
_SAVE_HITS = "self.coordinator.allocate_new_computed_blocks(request.request_id, hit_blocks)"
_ALLOCATE = "new_blocks = self.coordinator.allocate_new_blocks(request.request_id, num_tokens_need_slot)"
# The guard clauses of 4.1 and 4.3, whole, so a mutant can drop one.
_VALUE_ERROR = (
    "    if num_new_tokens < 1:\n"
    '        raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}.")\n'
)
_RUNTIME_ERROR = (
    "    if prev_block is None or next_block is None:\n"
    '        raise RuntimeError(f"remove() of block {block.block_id}, which is not in the free queue.")\n'
)

MUTANTS: list[Mutant] = [
    # ------------------------------------------------ 4.1 allocate_slots
    Mutant(
        "4.1",
        "returns the request's whole block table, not just the new blocks",
        mutate("4.1", ("return KVCacheBlocks(new_blocks)",
                       "return KVCacheBlocks(self.coordinator.get_blocks(request.request_id))")),
        caught_by="returns only the new blocks, as a request grows",
    ),
    Mutant(
        "4.1",
        "allocates the new blocks before claiming the cache hits",
        mutate("4.1", (f"{_SAVE_HITS}\n    {_ALLOCATE}", f"{_ALLOCATE}\n    {_SAVE_HITS}")),
        caught_by="cache hits are claimed before new blocks are taken, so none is evicted",
    ),
    Mutant(
        "4.1",
        "claims the cache hits before checking that the pool has room",
        mutate("4.1", (f"    {_SAVE_HITS}\n", ""), ("    # 1. Check", f"    {_SAVE_HITS}\n    # 1. Check")),
        caught_by="all or nothing: no room changes nothing (cache hits included), an exact fit is admitted",
    ),
    Mutant(
        "4.1",
        "refuses a request that needs exactly the free blocks (>= instead of >)",
        mutate("4.1", ("if num_blocks_to_allocate > self", "if num_blocks_to_allocate >= self")),
        caught_by="all or nothing: no room changes nothing (cache hits included), an exact fit is admitted",
    ),
    Mutant(
        "4.1",
        "slots past max_model_len (no min with max_model_len)",
        mutate("4.1", ("min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)",
                       "num_computed_tokens + num_new_tokens + num_lookahead_tokens")),
        caught_by="never more slots than max_model_len",
    ),
    Mutant(
        "4.1",
        "caches blocks of tokens that do not exist yet (no min with request.num_tokens)",
        mutate("4.1", ("min(num_computed_tokens + num_new_tokens, request.num_tokens)",
                       "num_computed_tokens + num_new_tokens")),
        caught_by="only tokens that exist are hashed into the prefix cache",
    ),
    Mutant(
        "4.1",
        "ignores delay_cache_blocks",
        mutate("4.1", ("if self.enable_caching and not delay_cache_blocks:", "if self.enable_caching:")),
        caught_by="delay_cache_blocks keeps new blocks out of the prefix cache",
    ),
    Mutant(
        "4.1",
        "caches blocks even with prefix caching off",
        mutate("4.1", ("if self.enable_caching and not delay_cache_blocks:", "if not delay_cache_blocks:")),
        caught_by="with prefix caching off, nothing is cached",
    ),
    Mutant(
        "4.1",
        "no ValueError for num_new_tokens < 1",
        mutate("4.1", (_VALUE_ERROR, "")),
        caught_by="num_new_tokens < 1 is a ValueError",
    ),
    # --------------------------------------------- 4.2 hash_block_tokens
    Mutant(
        "4.2",
        "returns the hex digest (a str) instead of the bytes",
        mutate("4.2", (".digest()", ".hexdigest()")),
        caught_by="returns the SHA-256 digest as 32 bytes",
    ),
    Mutant(
        "4.2",
        "no chaining: the parent's hash is ignored",
        mutate("4.2", ("parent = NONE_HASH if parent_block_hash is None else parent_block_hash",
                       "parent = NONE_HASH")),
        caught_by="chained: the parent's hash changes the result",
    ),
    Mutant(
        "4.2",
        "a first block hashes its tokens alone, without NONE_HASH",
        mutate("4.2", ("NONE_HASH if parent_block_hash is None", 'b"" if parent_block_hash is None')),
        caught_by="the first block (parent None) is chained on NONE_HASH",
    ),
    Mutant(
        "4.2",
        "token ids packed big-endian ('>')",
        mutate("4.2", ('f"<{len(', 'f">{len(')),
        caught_by="exact values: token ids packed as signed 64-bit little-endian",
    ),
    Mutant(
        "4.2",
        "token ids packed as 32-bit ints ('i')",
        mutate("4.2", ('}q", *curr', '}i", *curr')),
        caught_by="exact values: token ids packed as signed 64-bit little-endian",
    ),
    # ---------------------------------------- 4.3 FreeKVCacheBlockQueue.remove
    Mutant(
        "4.3",
        "relinks only the forward direction (next_block.prev_free_block left stale)",
        mutate("4.3", ("\n    next_block.prev_free_block = prev_block", "")),
        caught_by="unlinks from the middle, the head and the tail, both directions",
    ),
    Mutant(
        "4.3",
        "num_free_blocks not decremented",
        mutate("4.3", ("\n    self.num_free_blocks -= 1", "")),
        caught_by="keeps num_free_blocks right",
    ),
    Mutant(
        "4.3",
        "the removed block keeps its pointers",
        mutate("4.3", ("\n    block.prev_free_block = block.next_free_block = None", "")),
        caught_by="clears the removed block's pointers",
    ),
    Mutant(
        "4.3",
        "no RuntimeError for a block that is not in the queue",
        mutate("4.3", (_RUNTIME_ERROR, "")),
        caught_by="a block not in the queue is a RuntimeError, and nothing changes",
    ),
]
