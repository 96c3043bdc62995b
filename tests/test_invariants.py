"""The KV cache / scheduler invariant checker (instruments/invariants.py) catches each kind of corruption."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_scheduler import make_request, make_scheduler, run_to_completion, step

from nanoengine import LLM, SamplingParams
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.instruments import invariants
from nanoengine.instruments.invariants import InvariantViolation, check_invariants


def busy_scheduler(num_blocks: int = 12) -> Scheduler:
    """Two running requests sharing a cached first block, one waiting."""
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_seqs=2)
    for name, first in (("a", 100), ("b", 200), ("c", 300)):
        scheduler.add_request(make_request(name, 9, first_token=first, prefix=(1, 2, 3, 4)))
    step(scheduler)
    step(scheduler)
    check_invariants(scheduler)  # healthy before each corruption below
    return scheduler


def tables(s: Scheduler) -> dict[str, list[KVCacheBlock]]:
    """The block tables of the scheduler's one KV cache group."""
    (manager,) = s.kv_cache_manager.coordinator.single_type_managers
    return manager.req_to_blocks


def _bump_ref_cnt(s: Scheduler) -> None:
    tables(s)["a"][1].ref_cnt += 1


def _duplicate_in_table(s: Scheduler) -> None:
    blocks = tables(s)["a"]
    blocks.append(blocks[-1])


def _held_block_in_free_queue(s: Scheduler) -> None:
    s.kv_cache_manager.block_pool.free_block_queue.append(tables(s)["a"][-1])


def _leak_a_block(s: Scheduler) -> None:
    s.kv_cache_manager.block_pool.get_new_blocks(1)  # taken, but in no table


def _stale_hash_entry(s: Scheduler) -> None:
    pool = s.kv_cache_manager.block_pool
    block = next(iter(pool.cached_block_hash_to_block.values()))
    block.block_hash = b"something else"


def _wrong_hash_for_position(s: Scheduler) -> None:
    pool = s.kv_cache_manager.block_pool
    block = tables(s)["a"][0]
    del pool.cached_block_hash_to_block[block.block_hash]  # type: ignore[arg-type]
    block.block_hash = b"x" * 32
    pool.cached_block_hash_to_block[block.block_hash] = block


def _computed_beyond_blocks(s: Scheduler) -> None:
    s.requests["a"].num_computed_tokens += 2 * s.block_size


def _waiting_holds_blocks(s: Scheduler) -> None:
    waiting = next(iter(s.waiting))
    tables(s)[waiting.request_id] = s.kv_cache_manager.block_pool.get_new_blocks(1)


def _waiting_with_a_token_in_flight(s: Scheduler) -> None:
    next(iter(s.waiting)).num_output_placeholders = 1


def _negative_placeholders(s: Scheduler) -> None:
    s.requests["a"].num_output_placeholders = -1


CORRUPTIONS: dict[str, tuple[Callable[[Scheduler], None], str]] = {
    "ref_cnt": (_bump_ref_cnt, "ref_cnt"),
    "duplicate": (_duplicate_in_table, "holds a block twice"),
    "free_queue": (_held_block_in_free_queue, "in_free_queue"),
    "leak": (_leak_a_block, "leaked"),
    "stale_hash": (_stale_hash_entry, "hash"),
    "wrong_hash": (_wrong_hash_for_position, "not the request's"),
    "computed": (_computed_beyond_blocks, "holds only"),
    "waiting": (_waiting_holds_blocks, "waiting"),
    "placeholder_waiting": (_waiting_with_a_token_in_flight, "in flight"),
    "placeholder_negative": (_negative_placeholders, "output placeholders"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
@pytest.mark.parametrize("full_walk", [True, False])
def test_each_corruption_is_caught(name: str, full_walk: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not full_walk:  # the cheap path used for huge pools must catch them too
        monkeypatch.setattr(invariants, "FULL_WALK_MAX_BLOCKS", 0)
    scheduler = busy_scheduler()
    corrupt, message = CORRUPTIONS[name]
    corrupt(scheduler)
    with pytest.raises(InvariantViolation, match=message):
        check_invariants(scheduler)


def test_a_block_twice_in_the_free_queue_is_caught_by_the_full_walk() -> None:
    scheduler = make_scheduler(num_blocks=8)
    pool = scheduler.kv_cache_manager.block_pool
    pool.free_block_queue.append(pool.blocks[5])  # already in the queue
    with pytest.raises(InvariantViolation):
        check_invariants(scheduler)


def test_invariants_hold_through_preemption_and_idle() -> None:
    scheduler = make_scheduler(num_blocks=9, max_num_batched_tokens=8, max_num_seqs=4)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 5 + i, first_token=100 * (i + 1), prefix=(1, 2, 3, 4)))
    while scheduler.has_requests():
        step(scheduler)
        check_invariants(scheduler)
    assert scheduler.num_preemptions > 0
    run_to_completion(scheduler)
    check_invariants(scheduler)


def test_every_test_engine_checks_invariants_after_each_step(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=1 << 22)
    core = llm.llm_engine.engine_core.get_engine_core()
    assert core.engine_config.observability_config.check_invariants  # the autouse fixture in conftest.py
    calls: list[int] = []
    monkeypatch.setattr("nanoengine.instruments.invariants.check_invariants", lambda s: calls.append(1))
    llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(calls) == 3
