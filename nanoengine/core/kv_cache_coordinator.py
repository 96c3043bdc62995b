"""KVCacheCoordinator: a request's block tables in every KV cache group, on one BlockPool.

Chapter 4 (KV cache manager). A model's layers form KV cache groups
(``core/kv_cache_groups.py``), each with a ``SingleTypeKVCacheManager`` keeping
its block tables. The coordinator speaks for all of them to ``KVCacheManager``:
it sums what a request needs over the groups, so that an allocation is all or
nothing for the whole model, hands each group its share, and frees every group
at once. ``KVCacheManager`` and the scheduler never see how many groups there
are; block ids travel as one list per group.

* ``UnitaryKVCacheCoordinator``: one group (Llama, Qwen2, Qwen3). A prefix-cache
  hit is that group's hit.
* ``HybridKVCacheCoordinator``: several groups (Qwen3.5: full attention and
  Gated DeltaNet; Gemma 3: full attention and sliding windows). A prefix counts
  as cached only if every group can restore it. State groups never can
  (``MambaManager``), so models with them run without prefix caching:
  ``EngineArgs`` turns it off (``resolve_prefix_caching``), and a lookup here
  would find nothing anyway. Sliding-window groups can, from fewer blocks.

Preemption frees every group: the attention blocks, and the state, which is
simply dropped; the request is recomputed from token 0, which rebuilds it.

vLLM 0.32 counterpart: ``vllm/v1/core/kv_cache_coordinator.py``
(``KVCacheCoordinator``, ``UnitaryKVCacheCoordinator``,
``HybridKVCacheCoordinator``, ``get_kv_cache_coordinator``). vLLM has a third
class, ``KVCacheCoordinatorNoPrefixCache``, for prefix caching off; here both
classes take ``enable_caching`` and look nothing up when it is off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from nanoengine.core.block_pool import BlockPool
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.request import BlockHash, Request


class KVCacheCoordinator(ABC):
    """One manager per KV cache group, all drawing on one ``BlockPool``."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(group, group_id, self.block_pool, max_model_len)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block table in each group (empty for an unknown request)."""
        return tuple(manager.get_blocks(request_id) for manager in self.single_type_managers)

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> int:
        """Free blocks the request would consume, over all groups, to hold ``num_tokens``.

        ``num_tokens`` counts from the request's first token; ``new_computed_blocks``
        holds each group's prefix-cache hits, in group order. One sum against one
        pool: that is what makes ``allocate_slots`` all or nothing across groups
        (no group gets blocks unless every group can).
        """
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, hit_blocks)
            for manager, hit_blocks in zip(self.single_type_managers, new_computed_blocks, strict=True)
        )

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        """Adopt each group's prefix-cache hits as the start of its block table.

        vLLM 0.32's takes the local and external computed-token counts too: a
        KV connector may bring in more tokens than the local cache hit.
        """
        for manager, hit_blocks in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(request_id, hit_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Grow every group's table to hold ``num_tokens`` tokens; the new blocks per group."""
        managers = self.single_type_managers
        return tuple(manager.allocate_new_blocks(request_id, num_tokens) for manager in managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the blocks that are full once ``num_computed_tokens`` are in."""
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def uncomputed_cached_blocks(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Every group's blocks hashed for a step that has not computed them yet."""
        return [
            block
            for manager in self.single_type_managers
            for block in manager.uncomputed_cached_blocks(request_id, num_computed_tokens)
        ]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """In every group, give back the blocks no query from ``num_computed_tokens``
        on will read (sliding windows; full attention and states skip nothing).
        """
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Give back the request's blocks in every group (each group's tail first)."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Each group's cached blocks for the longest prefix of at most
        ``max_length`` tokens that every group can serve, and its length.
        """


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """A model whose layers form one group: its hit is the model's hit."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_blocks, hit_length = self.single_type_managers[0].find_longest_cache_hit(block_hashes, max_length)
        return (hit_blocks,), hit_length


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """A model whose layers form several groups (full attention with sliding
    windows or recurrent states)."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix every group has cached, each group's blocks for it.

        A prefix is reusable only if *every* layer can restore it: full
        attention its K/V up to its end, a sliding window the K/V of the window
        before its end, a state group its state at its end. Each group in turn
        may shorten the bound. A full-attention hit is also a hit for every
        shorter prefix, but a sliding window's is not (a shorter prefix has
        another window, whose blocks may be gone), so the groups are asked
        again until no group shortens it: a fixed point, as in vLLM. With a
        state group the answer is 0 tokens: ``MambaManager`` never hits.
        """
        hit_length = max_length
        while True:
            bound = hit_length
            for manager in self.single_type_managers:
                _, hit_length = manager.find_longest_cache_hit(block_hashes, hit_length)
            if hit_length == bound:
                break
        managers = self.single_type_managers
        hit_blocks = tuple(manager.find_longest_cache_hit(block_hashes, hit_length)[0] for manager in managers)
        return hit_blocks, hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig, max_model_len: int, enable_caching: bool
) -> KVCacheCoordinator:
    """The coordinator for this many groups, as vLLM picks it."""
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, max_model_len, enable_caching)
    return HybridKVCacheCoordinator(kv_cache_config, max_model_len, enable_caching)
