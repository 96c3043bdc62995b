"""KVCacheManager: the scheduler's one question, "can this request get its slots?".

Chapter 4 (KV cache manager). The scheduler creates this object in its own
``__init__`` and talks to nothing else about memory: it asks for prefix-cache
hits when a request is first scheduled (``get_computed_blocks``), for room for
the tokens it wants to run (``allocate_slots``, where ``None`` means "preempt
someone"), and gives everything back when a request ends (``free``).
Underneath, a ``KVCacheCoordinator`` keeps the block tables, one
``SingleTypeKVCacheManager`` per KV cache group (one group for a plain model,
several for a hybrid one), and ``BlockPool`` the blocks themselves. Blocks and
block ids cross this API as one list per group, in group order.

vLLM 0.32 counterpart: ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``,
``KVCacheBlocks``); the counters it keeps are ``PrefixCacheStats``
(``nanoengine/metrics/stats.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoengine.core.kv_cache_coordinator import get_kv_cache_coordinator
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.metrics.stats import PrefixCacheStats
from nanoengine.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks handed across the manager's API: one list per KV cache group.

    ``blocks[g]`` belongs to group ``g`` (chapter 4: a hybrid model keeps a
    block table per group; a plain model has one group, so one list). The
    wrapper keeps ``KVCacheBlock`` objects out of the scheduler, which only
    ever needs the ids.
    """

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """The ids, in the same shape: one list per group, in group order."""
        return tuple([block.block_id for block in group] for group in self.blocks)


class KVCacheManager:
    """Slots for the scheduler's requests, with automatic prefix caching."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}.")
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, max_model_len, enable_caching)
        self.block_pool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of the usable KV cache held by requests (0.0 to 1.0)."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def empty_kv_cache_blocks(self) -> KVCacheBlocks:
        """No blocks: one empty list per group (a fresh object every time, as
        the lists may be extended).
        """
        return KVCacheBlocks(tuple([] for _ in range(self.num_kv_cache_groups)))

    @property
    def num_usable_blocks(self) -> int:
        """The most blocks one request could ever hold: the whole pool."""
        return self.block_pool.num_usable_blocks

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Prefix-cache hits for a request about to be (re)scheduled.

        Returns the hit blocks and the number of tokens they cover. The blocks
        are *not* claimed yet; ``allocate_slots`` takes them along with the new
        ones, so a request that cannot be admitted leaves the cache untouched.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        # Even a fully cached prompt must run at least its last token through the
        # model: the logits that sample the next token come from that forward
        # pass. So at most num_tokens - 1 tokens may come from the cache; with
        # whole blocks only, that recomputes the last block when the prompt ends
        # exactly on a block boundary.
        max_cache_hit_length = request.num_tokens - 1
        hit_blocks, num_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        self.prefix_cache_stats.record(request.num_tokens, num_computed_tokens)
        return KVCacheBlocks(hit_blocks), num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        delay_cache_blocks: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        The request's table must cover, after this call, three runs of tokens:

            | already computed | new cache hits          | to compute now  |
            | num_computed     | num_new_computed_tokens | num_new_tokens  |

        The first run already has blocks; hits bring their own blocks; only the
        third run may need fresh ones. All or nothing: if the pool cannot supply
        every block needed, nothing changes and ``None`` tells the scheduler to
        preempt a request (or to stop admitting new ones). On success, returns
        just the newly allocated blocks (the worker appends them to its table).

        ``num_lookahead_tokens`` adds slots beyond the third run, for a draft
        model's own guesses (chapter 9); they are never cached.

        ``delay_cache_blocks`` keeps the new blocks out of the prefix cache: a KV
        connector is still loading their contents (chapter 5), and another
        request must not hit them before the load completes.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be at least 1, got {num_new_tokens}.")
        if new_computed_blocks is None:
            new_computed_blocks = self.empty_kv_cache_blocks
        hit_blocks = new_computed_blocks.blocks
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        # A request never needs KV beyond max_model_len positions.
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)

        # 0. Sliding windows (chapter 4): blocks wholly before the window of the
        #    first token to compute now go back to the pool, the null block in
        #    their place. Safe even if the request is not scheduled after all:
        #    no later step of it reads them. vLLM 0.32 does this first too.
        self.coordinator.remove_skipped_blocks(request.request_id, num_computed_tokens)

        # 1. Check, before touching anything, that the pool can cover it all.
        num_blocks_to_allocate = self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, hit_blocks
        )
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        # 2. Claim the cache hits first, so evicting for the new blocks cannot
        #    pick one of them (claimed blocks leave the free queue).
        self.coordinator.allocate_new_computed_blocks(request.request_id, hit_blocks)
        new_blocks = self.coordinator.allocate_new_blocks(request.request_id, num_tokens_need_slot)

        # 3. Register blocks that will be full once this step has run. They are
        #    cached before the forward pass fills them, so a request admitted
        #    later in this same step may already hit them. That is safe because
        #    the model runner writes each layer's new K/V for the whole batch
        #    before that layer's attention reads the cache (as vLLM's backends
        #    do). Only tokens that exist can be hashed, hence the min: drafts
        #    (chapter 9) are not in ``request.num_tokens``, so a block holding a
        #    draft is never cached, and a rejected one never reaches the cache.
        if self.enable_caching and not delay_cache_blocks:
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request) -> None:
        """Release every block of a finished or preempted request.

        Blocks are hashed into the prefix cache when allocated, before the step
        that fills them runs. A request preempted while planning that step never
        computes them, so their hashes are dropped first: a later hit must never
        read KV that was not written.
        """
        for block in self.coordinator.uncomputed_cached_blocks(request.request_id, request.num_computed_tokens):
            self.block_pool.uncache_block(block)
        self.coordinator.free(request.request_id)

    def has_uncomputed_cached_blocks(self, request: Request) -> bool:
        """True when this request hashed blocks this step will only now fill: a
        newcomer's prefix-cache lookup may already count on them.
        """
        return bool(self.coordinator.uncomputed_cached_blocks(request.request_id, request.num_computed_tokens))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block tables as ids, one list per group (what
        ``NewRequestData`` carries).
        """
        return KVCacheBlocks(self.coordinator.get_blocks(request_id)).get_block_ids()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False if requests still hold blocks."""
        return self.block_pool.reset_prefix_cache()
