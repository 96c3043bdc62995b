"""BlockPool: every KV cache block, who holds it, and which ones are cached.

Chapter 4 (KV cache manager). The pool is the only owner of ``KVCacheBlock``
objects; everything above it (coordinator, manager, scheduler) borrows blocks by
reference count. It keeps three structures in step:

* ``blocks``: all ``num_blocks`` block objects, indexed by block id;
* ``free_block_queue``: blocks with ``ref_cnt == 0``, least recently freed first;
* ``cached_block_hash_to_block``: the prefix cache, (full-block hash, KV cache
  group) -> block.

A free block may still be in the prefix cache. That is the whole trick of
prefix caching without a separate cache memory: freeing only makes a block
*evictable*; its KV stays valid until ``get_new_blocks`` hands it to someone else.

Block 0 is reserved as the **null block**, as in vLLM: it is taken out of the
free queue at start-up and never given to a request. vLLM uses it as the
placeholder for blocks a sliding-window layer skips; here it mainly guarantees
that the model runner's zero padding of block tables (and any padding token
whose slot falls in block 0) can never touch a live request's KV. The cost is
one block, so ``num_blocks - 1`` blocks are usable.

vLLM 0.32 counterpart: ``vllm/v1/core/block_pool.py`` (``BlockPool``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nanoengine.core.kv_cache_utils import (
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    make_block_hash_with_group_id,
)
from nanoengine.request import BlockHash, Request


class BlockPool:
    """Hands out, takes back and caches KV cache blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        # Two is the minimum: the null block plus one block a request can use.
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        # Initially every block is free, in id order, so fresh blocks go out
        # lowest id first (handy when reading block tables in a debugger).
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # One entry per cached hash. If two requests fill identical blocks, the
        # first one registered wins and the duplicate stays uncached (vLLM keeps
        # both under the same hash; one is enough to serve future hits).
        self.cached_block_hash_to_block: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever get: all of them but the null block."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached or not: an evictable cached block counts as free."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by some request (0.0 = idle, 1.0 = full)."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    # ---- allocation and release ---------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks from the head of the free queue.

        A block taken from the head may still carry the hash of old contents;
        those contents are about to be overwritten, so its hash must leave the
        prefix cache now, or a later lookup would return stale KV.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"Cannot get {num_blocks} free blocks: only {self.get_num_free_blocks()} are free."
            )
        new_blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in new_blocks:
            self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
        return new_blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Forget ``block``'s cached contents; True if it had any (vLLM's answers the same)."""
        if block.block_hash is None:
            return False
        self.uncache_block(block)
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Remove ``block`` from the prefix cache (its KV stays where it is)."""
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference to each of ``blocks`` (prefix-cache hits).

        A hit may land on a block whose owner already finished (``ref_cnt == 0``):
        it is in the free queue, one step from eviction. Pulling it out of the
        queue -- the O(1) ``remove`` -- is what saves it.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds go to the tail.

        The order given is the order they become evictable: the first block
        freed will be the first one evicted (see ``KVCacheCoordinator.free``
        for why a request's blocks arrive here in reverse).
        """
        now_unused: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"free of block {block.block_id}, which no request holds.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                now_unused.append(block)
        self.free_block_queue.append_n(now_unused)

    # ---- the prefix cache ----------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_id: int) -> KVCacheBlock | None:
        """Group ``kv_cache_group_id``'s block whose contents hash to ``block_hash``, if still cached."""
        return self.cached_block_hash_to_block.get(make_block_hash_with_group_id(block_hash, kv_cache_group_id))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` of group
        ``kv_cache_group_id`` in the prefix cache.

        ``blocks`` is the request's whole block table; the first
        ``num_cached_blocks`` were registered earlier (or came from a cache hit),
        and only the blocks that became full since then are new. Their hashes were
        already computed by the request's block hasher as its tokens arrived.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(
                f"Request {request.request_id!r} has {len(request.block_hashes)} block hashes, "
                f"cannot cache {num_full_blocks} full blocks (was it built with a block_hasher?)."
            )
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            block_hash = make_block_hash_with_group_id(request.block_hashes[index], kv_cache_group_id)
            if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
                continue  # already registered, or an identical block got there first
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed while no request holds a block.

        Returns False (and changes nothing) when blocks are in use, because a
        running request's blocks must keep their hashes consistent with the map.
        """
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
