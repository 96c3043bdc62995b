"""KVCacheCoordinator: per-request block tables on top of the shared BlockPool.

Chapter 4 (KV cache manager). nanoengine serves decoder-only models whose layers
all use full attention, so there is exactly one *KV cache group* and this class
manages it directly.

Why the layer exists at all: vLLM's hybrid models mix layer types (full
attention, sliding window, Mamba state, ...) that need different block tables
and different cache-hit rules. There, ``KVCacheCoordinator`` owns one
``SingleTypeKVCacheManager`` per group and ``HybridKVCacheCoordinator`` finds a
prefix that every group can serve. nanoengine folds the single full-attention
manager into the coordinator; a hybrid model would plug in right here, without
``KVCacheManager`` or the scheduler noticing.

vLLM 0.32 counterpart: ``vllm/v1/core/kv_cache_coordinator.py``
(``KVCacheCoordinator``, ``UnitaryKVCacheCoordinator``) together with
``vllm/v1/core/single_type_kv_cache_manager.py`` (``FullAttentionManager``).
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoengine.core.block_pool import BlockPool
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.request import BlockHash, Request
from nanoengine.utils.component_tree import TreeNode
from nanoengine.utils.math_utils import cdiv


class KVCacheCoordinator(TreeNode):
    """Block tables for one full-attention group, backed by one ``BlockPool``."""

    tree_children = ("block_pool",)

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool) -> None:
        self.block_size = kv_cache_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        # request id -> its block table: block i holds tokens
        # [i * block_size, (i + 1) * block_size) of the request.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading blocks of its table are already in the
        # prefix cache, so each step only registers the blocks that just filled up.
        self.num_cached_block: dict[str, int] = {}

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block table, one per group (empty for an unknown request)."""
        return (self.req_to_blocks.get(request_id, []),)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> int:
        """Free blocks the request would consume to hold ``num_tokens`` tokens.

        Besides the brand-new blocks, a cache hit on a block with ``ref_cnt == 0``
        also consumes a free block: touching it takes it out of the free queue.
        Forgetting this term would let the scheduler over-commit the pool.
        """
        (hit_blocks,) = new_computed_blocks
        num_held = len(self.req_to_blocks.get(request_id, [])) + len(hit_blocks)
        num_new_blocks = max(cdiv(num_tokens, self.block_size) - num_held, 0)
        num_evictable_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        return num_new_blocks + num_evictable_hits

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        """Adopt prefix-cache hits as the start of the request's block table."""
        (hit_blocks,) = new_computed_blocks
        if not hit_blocks:
            return
        # Cache hits can only form the head of a table: they come from the first lookup.
        assert request_id not in self.req_to_blocks, f"{request_id} already has blocks"
        self.block_pool.touch(hit_blocks)
        self.req_to_blocks[request_id] = list(hit_blocks)
        # These blocks are in the cache already; never register them twice.
        self.num_cached_block[request_id] = len(hit_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Grow the request's table until it can hold ``num_tokens`` tokens."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return ([],)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return (new_blocks,)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every block that is full once ``num_computed_tokens`` are in."""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_computed_tokens // self.block_size
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request.request_id], num_cached_blocks, num_full_blocks
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def uncomputed_cached_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Blocks this request registered in the prefix cache whose tokens are not
        computed yet: the ones allocated (and hashed) for the step being planned.
        """
        first_uncomputed = num_computed_tokens // self.block_size
        num_cached = self.num_cached_block.get(request_id, 0)
        return self.req_to_blocks.get(request_id, [])[first_uncomputed:num_cached]

    def free(self, request_id: str) -> None:
        """Give the request's blocks back to the pool, last block first.

        The free queue evicts from its head, so whatever we free first is
        evicted first. Freeing in reverse puts a sequence's *tail* blocks ahead
        of its head blocks: under memory pressure the cache loses the long,
        request-specific suffix before the short prefix (system prompt, few-shot
        examples) that other requests are most likely to share. Since a chained
        hash needs every earlier block, losing block 0 would make all later
        blocks useless anyway -- evicting from the end never wastes a block.
        """
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The cached blocks matching the longest prefix of ``block_hashes``, and
        the number of tokens they cover.

        At most ``max_length`` tokens' worth of whole blocks are returned. The
        scan stops at the first miss: a hash is chained on all earlier ones, so
        nothing after a miss could be a usable hit.
        """
        max_num_blocks = max_length // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            cached_block = self.block_pool.get_cached_block(block_hash)
            if cached_block is None:
                break
            hit_blocks.append(cached_block)
        return (hit_blocks,), len(hit_blocks) * self.block_size
