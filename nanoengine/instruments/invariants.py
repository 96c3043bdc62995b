"""Invariants of the KV cache and the scheduler, checked from the outside.

Chapters 3 (scheduler) and 4 (KV cache manager). Every bug in a paged KV cache
ends the same way: two requests write the same block, or a block leaks and the
cache slowly fills with nobody's data. Both are silent -- the model keeps
producing plausible tokens. So these checks restate, as executable facts, what
the bookkeeping must guarantee after every step:

* every block is exactly one of: the null block, free (uncached), free but
  still cached (evictable), or in use -- and the counts add up to the pool;
* a block's ``ref_cnt`` equals the number of block tables holding it; a block
  with ``ref_cnt == 0`` is in the free queue, once, and a held one is not;
* no block appears twice in one request's table, and the null block only as
  the leading run of a sliding-window table, standing for blocks of tokens
  that left the window (chapter 4);
* a sliding-window table holds no more real blocks than one window plus one
  step's tokens need (``SlidingWindowSpec.max_num_blocks``), and none of the
  tokens every later query skips;
* with several KV cache groups (a hybrid model), a block is held by one group
  at a time: the groups share the pool, and the layers of different groups
  share its tensors, so a block in two groups would be written twice;
* the prefix cache map and the blocks agree (``map[h].block_hash == h``, and
  every hashed block is in the map under its hash), and a cached block in a
  table carries that request's own hash for that position;
* running requests hold blocks for all their computed tokens in every group
  (a state group: its one block); waiting and finished ones hold none, except
  a producer's finished prefills held for a decode engine (chapter 10); an
  idle engine holds no block at all;
* async scheduling's output placeholders (chapter 7) are never negative, and a
  waiting request has none left once a step's output is in: a request is only
  preempted while at most the step before is in flight, and that step's update
  delivers its token before the next ``schedule()`` could re-admit it.

``check_invariants(scheduler)`` runs them all; with ``check_invariants=True``
(or ``NANOENGINE_CHECK_INVARIANTS=1``) the instruments' engine core plugin
(``plugin.py``) attaches ``check_invariants_after_each_update``, which runs
them after each step and each abort, and every engine test turns that on. Cost: O(blocks referenced) plus, for pools up
to ``FULL_WALK_MAX_BLOCKS``, one pass over the whole pool.

vLLM 0.32 counterpart: none; vLLM's tests assert pieces of this
(``tests/v1/core/test_prefix_caching.py``), nanoengine keeps them in one place.
"""

from __future__ import annotations

from collections import Counter

from nanoengine.core.block_pool import BlockPool
from nanoengine.core.kv_cache_coordinator import KVCacheCoordinator
from nanoengine.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from nanoengine.instruments.method_taps import tap
from nanoengine.request import Request, RequestStatus


class InvariantViolation(AssertionError):
    """The engine's bookkeeping contradicts itself (always a bug, never bad input)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvariantViolation(message)


# Up to this many blocks the whole pool is walked after every step; above it
# (a tiny test model given gigabytes holds ~10^5 blocks) only the blocks that
# tables or the prefix cache reference are checked, plus the free-block count.
FULL_WALK_MAX_BLOCKS = 16_384


def check_kv_blocks(coordinator: KVCacheCoordinator) -> None:
    """Block tables, ref counts, the free queue and the prefix-cache map agree."""
    pool = coordinator.block_pool
    holders: Counter[int] = Counter()
    group_of_block: dict[int, int] = {}
    for manager in coordinator.single_type_managers:
        group = manager.kv_cache_group_id
        for request_id, blocks in manager.req_to_blocks.items():
            ids = [block.block_id for block in blocks]
            num_null = _leading_nulls(ids, pool.null_block.block_id)
            _require(
                pool.null_block.block_id not in ids[num_null:],
                f"request {request_id!r} holds the null block after a real one",
            )
            ids = ids[num_null:]
            _require(
                len(set(ids)) == len(ids), f"request {request_id!r} holds a block twice: {_duplicates(ids)}"
            )
            for block_id in ids:
                owner = group_of_block.setdefault(block_id, group)
                _require(owner == group, f"block {block_id} is held by KV cache groups {owner} and {group}")
            holders.update(ids)
    # Only referenced blocks can be wrong in a way the count below misses.
    referenced = {pool.blocks[block_id] for block_id in holders}
    referenced.update(pool.cached_block_hash_to_block.values())
    referenced.add(pool.null_block)
    for block in referenced:
        _check_block(pool, block, holders[block.block_id])
    for block_hash, block in pool.cached_block_hash_to_block.items():
        _require(
            block.block_hash == block_hash, f"prefix cache entry for block {block.block_id} has a stale hash"
        )
    # free + cached-free + in-use = usable, with "free" counted by the queue.
    num_free = pool.free_block_queue.num_free_blocks
    _require(
        num_free + len(holders) == pool.num_usable_blocks,
        f"{num_free} free + {len(holders)} in use != {pool.num_usable_blocks} usable blocks "
        "(a block leaked, or was freed twice)",
    )
    if pool.num_blocks <= FULL_WALK_MAX_BLOCKS:
        _walk_whole_pool(pool, holders)


def _check_block(pool: BlockPool, block: KVCacheBlock, num_holders: int) -> None:
    """One block: ref count = tables holding it; in the free queue iff nobody holds it."""
    in_queue = block.prev_free_block is not None and block.next_free_block is not None
    _require(
        block.ref_cnt == num_holders,
        f"block {block.block_id} has ref_cnt {block.ref_cnt} but {num_holders} tables hold it",
    )
    if block is pool.null_block:
        _require(not in_queue and block.ref_cnt == 0, "the null block is in use or in the free queue")
        return
    _require(
        in_queue == (block.ref_cnt == 0),
        f"block {block.block_id}: ref_cnt={block.ref_cnt} but in_free_queue={in_queue}",
    )
    if block.block_hash is not None:
        _require(
            pool.cached_block_hash_to_block.get(block.block_hash) is block,
            f"block {block.block_id} has a hash the prefix cache maps to another block (or none)",
        )


def _walk_whole_pool(pool: BlockPool, holders: Counter[int]) -> None:
    """The O(num_blocks) part: the free list itself, and every block."""
    free_ids = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
    _require(
        len(set(free_ids)) == len(free_ids), f"a block is twice in the free queue: {_duplicates(free_ids)}"
    )
    _require(
        pool.free_block_queue.num_free_blocks == len(free_ids),
        f"free queue counter says {pool.free_block_queue.num_free_blocks}, the list holds {len(free_ids)}",
    )
    for block in pool.blocks:
        _check_block(pool, block, holders[block.block_id])


def check_scheduler(scheduler: Scheduler) -> None:
    """Requests against their blocks, and the queues against each other."""
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    running_ids = {request.request_id for request in scheduler.running}
    _require(len(running_ids) == len(scheduler.running), "a request is twice in the running list")
    for request in scheduler.running:
        _require(
            request.status == RequestStatus.RUNNING, f"{request.request_id!r} in running is {request.status}"
        )
        _require(
            request.num_output_placeholders >= 0,
            f"running {request.request_id!r} has {request.num_output_placeholders} output placeholders",
        )
        for kv_manager in managers:
            _check_running_table(kv_manager, request, scheduler.max_model_len)
            _check_window(kv_manager, request, scheduler)
    for request in scheduler.waiting:
        _require(request.request_id not in running_ids, f"{request.request_id!r} is both waiting and running")
        _require(not request.is_finished(), f"finished {request.request_id!r} is still waiting")
        _require(
            request.num_output_placeholders == 0,
            f"waiting {request.request_id!r} expects {request.num_output_placeholders} token(s) in flight",
        )
        # Only a request that keeps KV while it waits (a parked stream, a remote
        # KV load; chapter 5) holds blocks in the waiting queue.
        holds_blocks = any(m.req_to_blocks.get(request.request_id) for m in managers)
        _require(
            request.num_computed_tokens > 0 or not holds_blocks, f"waiting {request.request_id!r} holds blocks"
        )
    keeping_kv = {r.request_id for r in scheduler.waiting if r.num_computed_tokens > 0}
    # Chapter 10: a producer's finished prefills keep their blocks for a decode engine.
    held = set(scheduler.held_for_remote)
    _require(not held & set(scheduler.requests), f"held-for-remote requests are still live: {held & set(scheduler.requests)}")
    holders_without_request = {
        rid for m in managers for rid, blocks in m.req_to_blocks.items() if blocks
    } - running_ids - keeping_kv - held
    _require(
        not holders_without_request, f"requests not running hold blocks: {sorted(holders_without_request)}"
    )
    _require(
        set(scheduler.requests) == running_ids | {r.request_id for r in scheduler.waiting},
        "scheduler.requests disagrees with the waiting and running queues",
    )
    kv_cache_manager = scheduler.kv_cache_manager
    if not scheduler.has_unfinished_requests() and not held:
        num_held = kv_cache_manager.num_usable_blocks - kv_cache_manager.num_free_blocks
        _require(num_held == 0, f"idle engine still holds {num_held} blocks")


def _check_running_table(manager: SingleTypeKVCacheManager, request: Request, max_model_len: int) -> None:
    """One group's table of a running request: enough blocks, and each cached
    block under the request's own hash for its position.
    """
    # Placeholders count as computed: their slots are covered here too.
    blocks = manager.get_blocks(request.request_id)
    needed = manager.kv_cache_spec.num_blocks_for(min(request.num_computed_tokens, max_model_len))
    _require(
        len(blocks) >= needed,
        f"running {request.request_id!r} computed {request.num_computed_tokens} tokens but holds only "
        f"{len(blocks)} blocks of {manager.block_size} in KV cache group {manager.kv_cache_group_id}",
    )
    for index, block in enumerate(blocks):
        if block.block_hash is not None:
            _require(
                index < len(request.block_hashes)
                and make_block_hash_with_group_id(request.block_hashes[index], manager.kv_cache_group_id)
                == block.block_hash,
                f"block {block.block_id} at position {index} of {request.request_id!r} is cached "
                "under a hash that is not the request's",
            )


def _check_window(manager: SingleTypeKVCacheManager, request: Request, scheduler: Scheduler) -> None:
    """A running request's table in one group holds real blocks only where a
    query may still read, and no more of them than the spec's bound.
    """
    blocks = manager.get_blocks(request.request_id)
    num_null = _leading_nulls([block.block_id for block in blocks], manager.block_pool.null_block.block_id)
    num_skipped = manager.get_num_skipped_tokens(request.num_computed_tokens) // manager.block_size
    _require(
        num_null <= num_skipped,
        f"{request.request_id!r} has {num_null} null blocks in KV cache group {manager.kv_cache_group_id}, "
        f"but only {num_skipped} blocks are out of the window at {request.num_computed_tokens} tokens",
    )
    step_tokens = scheduler.max_num_scheduled_tokens + scheduler.num_lookahead_tokens
    bound = manager.kv_cache_spec.max_num_blocks(scheduler.max_model_len, step_tokens)
    _require(
        len(blocks) - num_null <= bound,
        f"{request.request_id!r} holds {len(blocks) - num_null} blocks in KV cache group "
        f"{manager.kv_cache_group_id}, more than the {bound} its spec allows",
    )


def _leading_nulls(ids: list[int], null_block_id: int) -> int:
    """How many entries at the head of a table are the null block."""
    return next((i for i, block_id in enumerate(ids) if block_id != null_block_id), len(ids))


def check_invariants(scheduler: Scheduler) -> None:
    """Every check above; raises ``InvariantViolation`` naming the first broken one."""
    check_kv_blocks(scheduler.kv_cache_manager.coordinator)
    check_scheduler(scheduler)


def check_invariants_after_each_update(scheduler: Scheduler) -> None:
    """Run ``check_invariants`` whenever a step ends or requests are aborted.

    The checks watch from outside (``nanoengine/instruments/method_taps.py``): a
    step ends with ``update_from_output`` and an abort is ``finish_requests``,
    so the scheduler's own code has no checking in it.
    """

    def check(*_: object, **__: object) -> None:
        check_invariants(scheduler)

    tap(scheduler, "update_from_output", after=check)
    tap(scheduler, "finish_requests", after=check)


def _duplicates(ids: list[int]) -> list[int]:
    return sorted(block_id for block_id, count in Counter(ids).items() if count > 1)
