"""KVCacheManager (chapter 4): slots, block boundaries and the prefix cache."""

from __future__ import annotations

import random

import pytest

# The scheduler tests' fake model runner drives the random workload at the end.
from test_scheduler import EOS, TOKEN, fake_model_runner, make_scheduler
from test_scheduler import make_request as make_scheduler_request

from nanoengine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_manager(num_blocks: int, enable_caching: bool = True, max_model_len: int = 64) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, spec=spec), max_model_len, enable_caching)


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(
        request_id,
        token_ids,
        SamplingParams(max_tokens=16),
        eos_token_id=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE),
    )


def run_prefill(manager: KVCacheManager, request: Request) -> KVCacheBlocks:
    """What the scheduler does on a first schedule: look up, allocate, advance."""
    hit_blocks, num_cached = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_cached, num_cached, hit_blocks)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return new_blocks


def test_decode_allocates_only_at_block_boundaries() -> None:
    manager = make_manager(num_blocks=8)
    request = make_request("r", [1, 2, 3, 4])
    assert run_prefill(manager, request).get_block_ids() == ([1],)  # one group, one block

    request.append_output_token_ids(5)  # token 5 starts the second block
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([2],)
    request.num_computed_tokens += 1

    request.append_output_token_ids(6)  # still fits the second block
    assert manager.allocate_slots(request, 1) == KVCacheBlocks(([],))
    assert manager.get_block_ids("r") == ([1, 2],)
    assert manager.num_free_blocks == 8 - 1 - 2


def test_fully_cached_prompt_recomputes_its_last_token() -> None:
    manager = make_manager(num_blocks=8)
    first = make_request("a", list(range(8)))
    run_prefill(manager, first)
    manager.free(first)

    # Same 8-token prompt: both blocks are cached, but the last token must run
    # again for logits, and whole blocks only -> the second block is recomputed.
    hit_blocks, num_cached = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert (len(hit_blocks.blocks[0]), num_cached) == (1, 4)
    # One more token: both full blocks can be served, one token computed.
    hit_blocks, num_cached = manager.get_computed_blocks(make_request("c", list(range(9))))
    assert (len(hit_blocks.blocks[0]), num_cached) == (2, 8)


def test_prefix_hit_after_free_reuses_the_same_blocks() -> None:
    manager = make_manager(num_blocks=8)
    first = make_request("a", list(range(12)))
    run_prefill(manager, first)
    (first_ids,) = manager.get_block_ids("a")
    manager.free(first)
    assert manager.num_free_blocks == 7 and manager.usage == 0.0

    second = make_request("b", list(range(8)) + [100, 101, 102])
    hit_blocks, num_cached = manager.get_computed_blocks(second)
    assert num_cached == 8 and hit_blocks.get_block_ids() == (first_ids[:2],)
    run_prefill(manager, second)
    assert manager.get_block_ids("b")[0][:2] == first_ids[:2]
    # Two revived blocks plus one fresh block for tokens 8..10.
    assert manager.num_free_blocks == 7 - 3
    assert hit_blocks.blocks[0][0].ref_cnt == 1

    # Three lookups: "a" (all miss), then "b" twice (here and in run_prefill).
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (3, 12 + 11 + 11, 8 + 8)


def test_allocate_slots_returns_none_and_changes_nothing_when_full() -> None:
    manager = make_manager(num_blocks=5)  # 4 usable blocks
    run_prefill(manager, make_request("a", list(range(12))))  # 3 blocks
    big = make_request("b", list(range(50, 58)))  # needs 2 blocks, 1 is free
    assert manager.allocate_slots(big, 8) is None
    assert manager.get_block_ids("b") == ([],)
    assert manager.num_free_blocks == 1


def test_cache_hits_on_free_blocks_count_as_allocations() -> None:
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    first = make_request("a", list(range(8)))
    run_prefill(manager, first)
    manager.free(first)  # free queue: [never used, a's block 2, a's block 1]
    run_prefill(manager, make_request("c", [200, 201, 202, 203, 204]))  # evicts a's tail block

    # 12 tokens: one cached block (a's first), two new ones. The hit block is
    # free, so claiming it also costs a free block: 3 needed, only 1 free.
    late = make_request("d", list(range(8)) + [9, 9, 9, 9])
    hit_blocks, num_cached = manager.get_computed_blocks(late)
    assert num_cached == 4
    assert manager.allocate_slots(late, 8, num_cached, hit_blocks) is None
    (hit,) = hit_blocks.blocks[0]
    assert hit.ref_cnt == 0 and hit.block_hash is not None


def test_caching_disabled_never_hits() -> None:
    manager = make_manager(num_blocks=8, enable_caching=False)
    first = make_request("a", list(range(8)))
    run_prefill(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == (KVCacheBlocks(([],)), 0)
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_allocation_never_exceeds_max_model_len() -> None:
    manager = make_manager(num_blocks=8, max_model_len=6)
    request = make_request("r", list(range(6)))
    new_blocks = manager.allocate_slots(request, 8)  # asks past max_model_len
    assert new_blocks is not None and len(new_blocks.blocks[0]) == 2


def test_reset_prefix_cache_and_bad_arguments() -> None:
    manager = make_manager(num_blocks=8)
    request = make_request("r", list(range(8)))
    run_prefill(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("s", list(range(9))))[1] == 0
    with pytest.raises(ValueError, match="num_new_tokens must be at least 1, got 0"):
        manager.allocate_slots(request, 0)
    with pytest.raises(ValueError, match="max_model_len must be at least 1"):
        make_manager(num_blocks=8, max_model_len=0)


# ---- invariants under a random scheduler workload ----------------------------------


def assert_block_accounting(scheduler: Scheduler) -> None:
    """Ref counts, the free queue and the hash map agree with the block tables."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    holders: dict[int, int] = {}
    (group_manager,) = manager.coordinator.single_type_managers  # one KV cache group
    for request_id, blocks in group_manager.req_to_blocks.items():
        assert request_id in scheduler.requests
        for block in blocks:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    usable = pool.blocks[1:]
    assert all(block.ref_cnt == holders.get(block.block_id, 0) for block in usable)
    free_ids = {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}
    assert free_ids == {block.block_id for block in usable if block.ref_cnt == 0}
    assert manager.num_free_blocks == len(free_ids)
    assert all(block.block_hash == h for h, block in pool.cached_block_hash_to_block.items())
    for request in scheduler.running:
        (block_ids,) = manager.get_block_ids(request.request_id)
        assert len(block_ids) * BLOCK_SIZE >= request.num_computed_tokens
    assert all(manager.get_block_ids(request.request_id) == ([],) for request in scheduler.waiting)


@pytest.mark.parametrize("seed", range(20))
def test_block_accounting_survives_a_random_workload(seed: int) -> None:
    rng = random.Random(seed)
    chunked = seed % 4 != 0
    scheduler = make_scheduler(
        num_blocks=rng.randint(6, 20),
        max_num_batched_tokens=rng.choice([8, 16, 64]) if chunked else 64,
        max_num_seqs=rng.randint(1, 6),
        enable_chunked_prefill=chunked,
        policy=rng.choice(["fcfs", "priority"]),
    )
    for step_index in range(400):
        if step_index < 60 and rng.random() < 0.4:  # shared prefixes make cache hits
            prefix = rng.choice([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8)])
            num_prompt_tokens = rng.randint(len(prefix) + 1, 30)
            request = make_scheduler_request(
                f"r{step_index}", num_prompt_tokens, first_token=1000 * step_index, prefix=prefix,
                priority=rng.randint(0, 2), arrival_time=float(step_index), max_tokens=rng.randint(1, 20),
            )  # fmt: skip
            scheduler.add_request(request)
        output = scheduler.schedule()
        runner_output = fake_model_runner(scheduler, output, lambda _: EOS if rng.random() < 0.05 else TOKEN)
        if rng.random() < 0.05 and scheduler.requests:
            scheduler.finish_requests(rng.choice(list(scheduler.requests)), RequestStatus.FINISHED_ABORTED)
        scheduler.update_from_output(output, runner_output)
        assert_block_accounting(scheduler)
        if step_index >= 60 and not scheduler.has_requests():
            break
    assert not scheduler.has_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_usable_blocks
