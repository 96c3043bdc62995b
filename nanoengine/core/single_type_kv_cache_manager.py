"""SingleTypeKVCacheManager: the block tables of one KV cache group.

Chapter 4 (KV cache manager). A model's layers form one or more KV cache groups
(``core/kv_cache_groups.py``); for every request, each group keeps a block table
of its own, drawn from the one ``BlockPool`` all groups share. Two things depend
on the kind of layer in the group, and each kind has its manager:

* ``FullAttentionManager``: K and V of every token, so one block per
  ``block_size`` tokens, growing with the request; a full block's contents are
  fixed by the tokens up to its end, so it is hashed into the prefix cache and
  later requests with the same prefix reuse it.
* ``SlidingWindowManager``: full attention's blocks, but a token only sees the
  last ``sliding_window`` tokens. Blocks wholly before the window of the next
  token to compute are *skipped*: ``remove_skipped_blocks`` gives them back to
  the pool and puts the null block in their place in the table, so a request
  holds about a window's worth of blocks however long it grows. A prefix hit
  needs only the blocks of the window before the hit's end.
* ``MambaManager``: a recurrent state of fixed size (Mamba, Gated DeltaNet), so
  one block per request, however long it grows; the model overwrites it at
  every step, and it is never shared.

The bookkeeping itself (tables, ref counts through the pool, freeing, and
swapping skipped blocks for the null block) is the same for all and lives in
the base class; a kind only says how many leading tokens it skips
(``get_num_skipped_tokens``) and how it finds a prefix hit.

vLLM 0.32 counterpart: ``vllm/v1/core/single_type_kv_cache_manager.py``
(``SingleTypeKVCacheManager``, ``FullAttentionManager``, ``SlidingWindowManager``,
``MambaManager``, ``get_manager_for_kv_cache_spec``). vLLM's ``MambaManager`` also has an "align"
mode that keeps a state per block boundary so that prefixes can be cached;
nanoengine implements its other mode only, the one vLLM uses without prefix
caching.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from nanoengine.core.block_pool import BlockPool
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.kv_cache_interface import KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from nanoengine.request import BlockHash, Request
from nanoengine.utils.math_utils import cdiv


class SingleTypeKVCacheManager(ABC):
    """Block tables of one group, backed by the pool every group shares."""

    def __init__(
        self, kv_cache_group: KVCacheGroupSpec, kv_cache_group_id: int, block_pool: BlockPool
    ) -> None:
        self.kv_cache_spec = kv_cache_group.kv_cache_spec
        self.num_layers = len(kv_cache_group.layer_indices)
        self.kv_cache_group_id = kv_cache_group_id
        self.block_size = self.kv_cache_spec.block_size
        self.block_pool = block_pool
        # request id -> its block table in this group: for full attention, block
        # i holds tokens [i * block_size, (i + 1) * block_size) of the request.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many leading blocks of its table are already in the
        # prefix cache, so each step only registers the blocks that just filled up.
        self.num_cached_block: dict[str, int] = {}

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table in this group (empty for an unknown request)."""
        return self.req_to_blocks.get(request_id, [])

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks the request would consume to hold ``num_tokens`` tokens.

        Besides the brand-new blocks, a cache hit on a block with ``ref_cnt == 0``
        also consumes a free block: touching it takes it out of the free queue.
        Forgetting this term would let the scheduler over-commit the pool. The
        null block (a sliding window's hit starts with it) is nobody's, so it
        consumes nothing.
        """
        num_held = len(self.get_blocks(request_id)) + len(new_computed_blocks)
        num_new_blocks = max(self.kv_cache_spec.num_blocks_for(num_tokens) - num_held, 0)
        null_block = self.block_pool.null_block
        num_evictable_hits = sum(block.ref_cnt == 0 and block is not null_block for block in new_computed_blocks)
        return num_new_blocks + num_evictable_hits

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Adopt prefix-cache hits as the start of the request's block table."""
        if not new_computed_blocks:
            return
        # Cache hits can only form the head of a table: they come from the first lookup.
        assert request_id not in self.req_to_blocks, f"{request_id} already has blocks"
        null_block = self.block_pool.null_block
        self.block_pool.touch([block for block in new_computed_blocks if block is not null_block])
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        # These blocks are in the cache already; never register them twice.
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the request's table until it can hold ``num_tokens`` tokens."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = self.kv_cache_spec.num_blocks_for(num_tokens) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every block that is full once ``num_computed_tokens`` are in."""
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_computed_tokens // self.block_size
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request.request_id], num_cached_blocks, num_full_blocks, self.kv_cache_group_id
        )
        self.num_cached_block[request.request_id] = num_full_blocks

    def uncomputed_cached_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Blocks this request registered in the prefix cache whose tokens are not
        computed yet: the ones allocated (and hashed) for the step being planned.
        """
        first_uncomputed = num_computed_tokens // self.block_size
        num_cached = self.num_cached_block.get(request_id, 0)
        return self.req_to_blocks.get(request_id, [])[first_uncomputed:num_cached]

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """How many leading tokens no query from ``num_computed_tokens`` on will
        read again. Full attention reads them all: none.
        """
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks that hold only skipped tokens; the null block takes their place.

        The table keeps its length, so entry ``i`` still stands for tokens
        ``[i * block_size, (i + 1) * block_size)`` and the worker's slot
        arithmetic is unchanged. Walking back from the last skipped block stops
        at the first null one: earlier calls already swapped everything before it.
        """
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped_blocks == 0:  # full attention, or a window not yet outgrown: every step, cheaply
            return
        blocks = self.req_to_blocks.get(request_id, [])
        null_block = self.block_pool.null_block
        removed: list[KVCacheBlock] = []
        for index in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):
            if blocks[index] is null_block:
                break
            removed.append(blocks[index])
            blocks[index] = null_block
        self.block_pool.free_blocks(removed)

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
        null_block = self.block_pool.null_block
        self.block_pool.free_blocks(block for block in reversed(blocks) if block is not null_block)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks this group can reuse for the longest prefix of at
        most ``max_length`` tokens, and how many tokens they cover.
        """


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full-attention layers: a block per ``block_size`` tokens, full blocks cached."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks matching the longest prefix of ``block_hashes``.

        At most ``max_length`` tokens' worth of whole blocks are returned. The
        scan stops at the first miss: a hash is chained on all earlier ones, so
        nothing after a miss could be a usable hit.
        """
        max_num_blocks = max_length // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            cached_block = self.block_pool.get_cached_block(block_hash, self.kv_cache_group_id)
            if cached_block is None:
                break
            hit_blocks.append(cached_block)
        return hit_blocks, len(hit_blocks) * self.block_size


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window layers: full attention's blocks, minus those that left the window."""

    def __init__(self, kv_cache_group: KVCacheGroupSpec, kv_cache_group_id: int, block_pool: BlockPool) -> None:
        super().__init__(kv_cache_group, kv_cache_group_id, block_pool)
        assert isinstance(self.kv_cache_spec, SlidingWindowSpec), type(self.kv_cache_spec)
        self.sliding_window = self.kv_cache_spec.sliding_window
        # A hit of L tokens lets the next token (position L) run; it reads keys
        # L - sliding_window + 1 .. L, of which the last is itself: so the hit
        # must bring the sliding_window - 1 tokens before L, that is, this
        # many whole blocks before the hit's end (L is a whole number of blocks).
        self.sliding_window_contiguous_blocks = cdiv(self.sliding_window - 1, self.block_size)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """The next token to compute sits at position ``num_computed_tokens``
        and reads back to ``num_computed_tokens - sliding_window + 1``; every
        token before that is out of its window, and out of every later one.
        """
        return max(num_computed_tokens - self.sliding_window + 1, 0)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix of at most ``max_length`` tokens whose *window* is cached.

        A hit of ``n`` blocks needs only its last ``sliding_window_contiguous_blocks``
        blocks in the cache: the blocks before them are null in the answer.
        The scan runs from the longest candidate backwards and stops at the
        first run of that many cached blocks in a row. A run that reaches back
        to block 0 is a hit even if shorter: no token before it exists.

        Unlike full attention, a hit of ``n`` blocks says nothing about shorter
        prefixes (their windows are other blocks): the hybrid coordinator must
        ask again with a smaller bound (``HybridKVCacheCoordinator``).
        """
        null_block = self.block_pool.null_block
        max_num_blocks = min(max_length // self.block_size, len(block_hashes))
        hit_blocks = [null_block] * max_num_blocks
        run = 0  # cached blocks in a row, from the one just scanned upwards
        for index in range(max_num_blocks - 1, -1, -1):
            cached_block = self.block_pool.get_cached_block(block_hashes[index], self.kv_cache_group_id)
            if cached_block is None:
                run = 0
                continue
            hit_blocks[index] = cached_block
            run += 1
            if run >= self.sliding_window_contiguous_blocks:
                # Blocks index .. index + run - 1 are the window; drop what follows.
                del hit_blocks[index + run :]
                return hit_blocks, len(hit_blocks) * self.block_size
        # No full window anywhere: only a run from block 0 (run blocks) is usable.
        del hit_blocks[run:]
        return hit_blocks, len(hit_blocks) * self.block_size


class MambaManager(SingleTypeKVCacheManager):
    """Recurrent-state layers: one block per request, never cached.

    The block holds the request's state after its last computed token; every
    step overwrites it in place, so its size and count never change while the
    request grows (the spec's ``block_size`` covers ``max_model_len`` tokens,
    so ``num_blocks_for`` is 1 for any request). A preempted request simply
    loses it: recomputing from token 0 rebuilds the state.
    """

    def __init__(
        self,
        kv_cache_group: KVCacheGroupSpec,
        kv_cache_group_id: int,
        block_pool: BlockPool,
        max_model_len: int,
    ) -> None:
        super().__init__(kv_cache_group, kv_cache_group_id, block_pool)
        if self.block_size < max_model_len:
            raise ValueError(
                f"A state block must stand for a whole request: MambaSpec.block_size={self.block_size} "
                f"is smaller than max_model_len={max_model_len} (set it to max_model_len, as vLLM does)."
            )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Nothing to register: the state after the whole request is no prefix's state."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[list[KVCacheBlock], int]:
        """Never a hit: reusing a prefix needs the state at the prefix's end, and
        only vLLM's "align" mode keeps states at block boundaries.
        """
        return [], 0


def get_manager_for_kv_cache_spec(
    kv_cache_group: KVCacheGroupSpec, kv_cache_group_id: int, block_pool: BlockPool, max_model_len: int
) -> SingleTypeKVCacheManager:
    """The manager for one group, chosen by the kind of its layers."""
    if isinstance(kv_cache_group.kv_cache_spec, MambaSpec):
        return MambaManager(kv_cache_group, kv_cache_group_id, block_pool, max_model_len)
    # Before full attention: a SlidingWindowSpec is a FullAttentionSpec too.
    if isinstance(kv_cache_group.kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(kv_cache_group, kv_cache_group_id, block_pool)
    return FullAttentionManager(kv_cache_group, kv_cache_group_id, block_pool)
