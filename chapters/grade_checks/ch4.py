"""The grader's checks for exercises 4.1, 4.2 and 4.3 (chapter 4).

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from typing import Any

from chapters.grade_checks.common import (
    Check,
    block_ids,
    e2e_preemption,
    e2e_prefix_cache,
    kv_spec,
    make_request,
)
from nanoengine.core.kv_cache_manager import KVCacheManager
from nanoengine.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from nanoengine.kv_cache_interface import KVCacheConfig


# -------------------------------------------------- 4.1 allocate_slots
def allocation_sequence(model: str) -> list[Any]:
    manager = KVCacheManager(KVCacheConfig(num_blocks=9, spec=kv_spec()), max_model_len=64, enable_caching=True)
    trace: list[Any] = []
    first = make_request("first", 10, block_size=4)
    trace.append(block_ids(manager.allocate_slots(first, 10)))  # a 10-token prefill: 3 blocks
    first.num_computed_tokens = 10
    first.append_output_token_ids(99)
    trace.append(block_ids(manager.allocate_slots(first, 1)))  # the 11th token fits block 3
    first.num_computed_tokens = 11
    for token in (98, 97):
        first.append_output_token_ids(token)
    trace.append(block_ids(manager.allocate_slots(first, 2)))  # 13 tokens: a 4th block
    twin = make_request("twin", 10, block_size=4)  # same tokens: its first 2 blocks are cached
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    assert num_hit_tokens == 8, "the twin should find its first two blocks in the prefix cache"
    trace.append(block_ids(manager.allocate_slots(twin, 10 - num_hit_tokens, num_hit_tokens, hits)))
    trace.append(manager.get_block_ids("twin"))
    trace.append(block_ids(manager.allocate_slots(make_request("huge", 40), 40)))  # needs 10: all or nothing
    trace.append(manager.num_free_blocks)
    # A KV connector still loading these blocks: they must not be prefix-cache hits yet.
    loading = make_request("loading", 8, block_size=4, first_token=200)
    trace.append(block_ids(manager.allocate_slots(loading, 8, delay_cache_blocks=True)))
    trace.append(manager.get_computed_blocks(make_request("early", 8, block_size=4, first_token=200))[1])
    trace.append(manager.num_free_blocks)
    try:
        manager.allocate_slots(make_request("zero", 3), 0)
        trace.append("no error")
    except ValueError:
        trace.append("ValueError")
    return trace


# --------------------------------------------------- 4.2 hash_block_tokens
def chained_hashes(model: str) -> list[str]:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    second = hash_block_tokens(first, [5, 6, 7, 8])
    alone = hash_block_tokens(None, [5, 6, 7, 8])
    big = hash_block_tokens(second, [2**40, 0, 7, 2**31])
    assert isinstance(first, bytes) and second != alone, "the parent hash must change the result"
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first, "hashing must be deterministic"
    return [h.hex() for h in (first, second, alone, big)]


# ------------------------------------------ 4.3 FreeKVCacheBlockQueue.remove
def free_queue_removals(model: str) -> list[Any]:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    trace: list[Any] = []
    for block_id in (2, 0, 5):  # middle, head, tail
        queue.remove(blocks[block_id])
        trace.append(([b.block_id for b in queue.get_all_free_blocks()], queue.num_free_blocks))
        assert blocks[block_id].prev_free_block is None and blocks[block_id].next_free_block is None
    trace.append(queue.popleft().block_id)
    queue.append(blocks[2])
    trace.append(([b.block_id for b in queue.get_all_free_blocks()], queue.num_free_blocks))
    assert len(queue.get_all_free_blocks()) == queue.num_free_blocks
    try:
        queue.remove(blocks[0])
        trace.append("no error")
    except RuntimeError:
        trace.append("RuntimeError")
    return trace


CHECKS: dict[str, tuple[Check, ...]] = {
    "4.1": (Check("allocation, growth, cache hits, all-or-nothing", allocation_sequence),
            Check("end to end: prefix cache", e2e_prefix_cache),
            Check("end to end: preemption", e2e_preemption)),
    "4.2": (Check("chained, deterministic hashes", chained_hashes),
            Check("end to end: prefix cache", e2e_prefix_cache)),
    "4.3": (Check("unlink from middle, head and tail", free_queue_removals),
            Check("end to end: prefix cache", e2e_prefix_cache),
            Check("end to end: preemption", e2e_preemption)),
}
