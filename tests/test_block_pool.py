"""Block pool, free queue and block hashing (chapter 4): pure bookkeeping, no torch."""

from __future__ import annotations

import pytest

from nanoengine.core.block_pool import BlockPool
from nanoengine.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
)
from nanoengine.request import Request
from nanoengine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id,
        token_ids,
        SamplingParams(max_tokens=8),
        eos_token_id=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE),
    )


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


# ---- FreeKVCacheBlockQueue ---------------------------------------------------


def test_free_queue_pops_in_order_and_appends_at_tail() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert ids(queue.popleft_n(2)) == [0, 1]
    queue.append(blocks[0])
    assert ids(queue.get_all_free_blocks()) == [2, 3, 4, 0]
    queue.append_n([blocks[1]])
    assert queue.popleft() is blocks[2]
    assert queue.num_free_blocks == 4


def test_free_queue_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    # O(1): the neighbours point at each other, the removed block points nowhere.
    assert blocks[1].next_free_block is blocks[3]
    assert blocks[3].prev_free_block is blocks[1]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    # Head and tail removals need no special case thanks to the sentinels.
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    assert queue.num_free_blocks == 2


def test_free_queue_rejects_bad_operations() -> None:
    blocks = [KVCacheBlock(0)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.popleft()
    with pytest.raises(RuntimeError, match="block 0"):
        queue.remove(blocks[0])
    with pytest.raises(ValueError, match="empty"):
        queue.popleft()
    with pytest.raises(ValueError, match="only 0 are free"):
        queue.popleft_n(1)


# ---- BlockPool ------------------------------------------------------------------


def test_pool_reserves_null_block_zero() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.num_usable_blocks == 4
    assert pool.get_num_free_blocks() == 4
    assert pool.get_usage() == 0.0
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="Cannot get 1 free blocks: only 0"):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_ref_counts_touch_and_free() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    block_a, block_b = pool.get_new_blocks(2)
    assert (block_a.ref_cnt, block_b.ref_cnt) == (1, 1)
    pool.touch([block_a])  # a second request shares block_a
    assert block_a.ref_cnt == 2
    pool.free_blocks([block_a, block_b])
    # block_a is still held by one request, so only block_b became free.
    assert block_a.ref_cnt == 1 and block_b.ref_cnt == 0
    assert pool.get_num_free_blocks() == 3
    assert ids(pool.free_block_queue.get_all_free_blocks())[-1] == block_b.block_id
    # Touching a free block revives it: out of the queue, ref_cnt back to 1.
    pool.touch([block_b])
    assert block_b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([block_a, block_b])
    with pytest.raises(RuntimeError, match="no request holds"):
        pool.free_blocks([block_a])


def test_cache_full_blocks_fills_the_hash_map() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    request = make_request("r", list(range(10)))  # 2 full blocks + 2 tokens
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, num_cached_blocks=0, num_full_blocks=2, kv_cache_group_id=0)
    assert pool.get_cached_block(request.block_hashes[0], 0) is blocks[0]
    assert pool.get_cached_block(request.block_hashes[1], 0) is blocks[1]
    assert blocks[2].block_hash is None  # the partial block is never cached
    assert len(pool.cached_block_hash_to_block) == 2
    with pytest.raises(ValueError, match="has 2 block hashes"):
        pool.cache_full_blocks(request, blocks, num_cached_blocks=2, num_full_blocks=3, kv_cache_group_id=0)


def test_identical_block_of_second_request_is_not_cached_twice() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    first, second = make_request("a", [1, 2, 3, 4]), make_request("b", [1, 2, 3, 4])
    block_a, block_b = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [block_a], 0, 1, 0)
    pool.cache_full_blocks(second, [block_b], 0, 1, 0)
    assert pool.get_cached_block(first.block_hashes[0], 0) is block_a
    assert block_b.block_hash is None


def test_reusing_a_cached_free_block_evicts_its_hash_in_lru_order() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    request = make_request("r", list(range(12)))  # exactly 3 full blocks
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3, 0)
    # Freed in reverse, as KVCacheCoordinator.free does: the last block first.
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 2, 1]

    # The never-used block 4 goes out first; then the cached tail block 3.
    assert ids(pool.get_new_blocks(2)) == [4, 3]
    assert pool.get_cached_block(request.block_hashes[2], 0) is None
    assert blocks[2].block_hash is None
    # The prefix blocks 1 and 2 are still cached (and still free).
    assert pool.get_cached_block(request.block_hashes[0], 0) is blocks[0]
    assert pool.get_cached_block(request.block_hashes[1], 0) is blocks[1]


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    request = make_request("r", list(range(4)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1, 0)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(request.block_hashes[0], 0) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert blocks[0].block_hash is None


# ---- block hashes --------------------------------------------------------------


def test_hash_block_tokens_is_deterministic_and_chained() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 32
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    # Same tokens after a different history: a different hash.
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])


def test_request_block_hasher_hashes_only_new_full_blocks() -> None:
    request = make_request("r", list(range(10)))
    assert len(request.block_hashes) == 2
    expected_first = hash_block_tokens(None, [0, 1, 2, 3])
    assert request.block_hashes[0] == expected_first
    assert request.block_hashes[1] == hash_block_tokens(expected_first, [4, 5, 6, 7])

    request.append_output_token_ids(10)  # 11 tokens: still 2 full blocks
    assert len(request.block_hashes) == 2
    request.append_output_token_ids(11)  # 12 tokens: the third block is full
    assert len(request.block_hashes) == 3
    # Incremental hashing agrees with hashing the same tokens from scratch.
    assert request.block_hashes == make_request("fresh", list(range(12))).block_hashes
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        get_request_block_hasher(0)
