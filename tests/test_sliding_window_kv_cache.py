"""Sliding-window KV cache groups (chapter 4): blocks that leave the window go back.

The core alone, with a fake model runner: the freeing, the hit search and its
hand-worked example (the one docs/chapters/ch04.md walks through), the hybrid
coordinator's fixed point, and the sizing of a window's bounded need.
"""

from __future__ import annotations

from test_kv_cache_manager import run_prefill
from test_scheduler import TOKEN, fake_model_runner

from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.kv_cache_coordinator import HybridKVCacheCoordinator
from nanoengine.core.kv_cache_groups import group_kv_cache_layers
from nanoengine.core.kv_cache_manager import KVCacheManager
from nanoengine.core.kv_cache_sizing import get_kv_cache_config, max_concurrency
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from nanoengine.instruments.invariants import check_invariants
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from nanoengine.request import Request
from nanoengine.sampling_params import SamplingParams

BLOCK_SIZE = 4
WINDOW = 8  # two blocks: a token reads itself and the 7 tokens before it


def sliding_spec(window: int = WINDOW) -> SlidingWindowSpec:
    return SlidingWindowSpec(BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1,
                             sliding_window=window)


def full_spec() -> FullAttentionSpec:
    return FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)


def interleaved_config(num_blocks: int) -> KVCacheConfig:
    """Four layers, local and global in turn (Gemma 3's pattern, shortened): groups (1, 3) full, (0, 2) sliding."""
    layout = group_kv_cache_layers({0: sliding_spec(), 1: full_spec(), 2: sliding_spec(), 3: full_spec()})
    return KVCacheConfig(num_blocks, layout.attention_spec, layout.kv_cache_groups)


def make_request(request_id: str, token_ids: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=None, block_hasher=get_request_block_hasher(BLOCK_SIZE))


def make_scheduler(kv_cache_config: KVCacheConfig, max_num_batched_tokens: int, max_model_len: int = 256) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=4, max_model_len=max_model_len),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_cache_config,
    )


def real_blocks(manager: KVCacheManager, request_id: str, group: int = 0) -> list[int]:
    """The request's block ids in one group, null blocks left out."""
    return [b for b in manager.get_block_ids(request_id)[group] if b != manager.block_pool.null_block.block_id]


def test_a_request_eight_windows_long_holds_one_window_of_blocks_and_others_reuse_the_rest() -> None:
    # 64 prompt tokens in chunks of one block, then 8 decodes: 72 = 9 windows.
    scheduler = make_scheduler(KVCacheConfig(num_blocks=12, spec=sliding_spec()), max_num_batched_tokens=BLOCK_SIZE)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager.coordinator.single_type_managers[0], SlidingWindowManager)
    scheduler.add_request(make_request("long", list(range(100, 164)), max_tokens=8))
    ids_used: set[int] = set()
    for _ in range(30):
        output = scheduler.schedule()
        if not output.num_scheduled_tokens:
            break
        held = real_blocks(manager, "long")
        ids_used.update(held)
        # window / block_size + 1: the window's two blocks and the one a step starts or straddles.
        assert len(held) <= WINDOW // BLOCK_SIZE + 1, (output.num_scheduled_tokens, held)
        scheduler.update_from_output(output, fake_model_runner(scheduler, output, lambda _: TOKEN))
        check_invariants(scheduler)
    assert not scheduler.has_requests() and manager.num_free_blocks == manager.num_usable_blocks
    # 72 tokens make 18 table entries, served by fewer distinct blocks: freed ones came back.
    assert len(ids_used) < 72 // BLOCK_SIZE


def test_a_freed_block_serves_another_request_while_the_long_one_still_runs() -> None:
    scheduler = make_scheduler(KVCacheConfig(num_blocks=8, spec=sliding_spec()), max_num_batched_tokens=16)
    manager = scheduler.kv_cache_manager
    scheduler.add_request(make_request("long", list(range(100, 124)), max_tokens=8))
    given_back: set[int] = set()
    for _ in range(3):  # a chunk of 16, one of 8, a decode: blocks 0-3 leave the window
        before = set(real_blocks(manager, "long"))
        output = scheduler.schedule()
        given_back |= before - set(real_blocks(manager, "long"))
        scheduler.update_from_output(output, fake_model_runner(scheduler, output, lambda _: TOKEN))
    assert given_back
    scheduler.add_request(make_request("other", list(range(500, 512)), max_tokens=1))
    output = scheduler.schedule()
    assert "other" in output.num_scheduled_tokens and "long" in scheduler.requests
    assert set(real_blocks(manager, "other")) & given_back
    check_invariants(scheduler)


def test_the_hand_worked_hit_example() -> None:
    """docs/chapters/ch04.md's example: block size 4, window 8, a 28-token prompt.

    Cached (from earlier requests) are blocks 0, 1, 3 and 4 of its 7 full
    blocks; block 2 was evicted, and nobody ever computed blocks 5 and 6.
    The next token after a hit of L tokens reads the 7 tokens before it: with
    L on a block boundary, the last cdiv(7, 4) = 2 blocks. Scanning back from
    the longest candidate: 6, 5 missing, 4 and 3 cached -- two in a row, so
    the hit is 5 blocks (20 tokens): null, null, null, block 3, block 4.
    Full attention would stop at block 2's miss: 8 tokens.
    """
    for spec, want_length in ((sliding_spec(), 20), (full_spec(), 8)):
        manager = KVCacheManager(KVCacheConfig(num_blocks=16, spec=spec), max_model_len=64, enable_caching=True)
        tokens = list(range(1, 29))
        donor = make_request("donor", tokens[:20])
        run_prefill(manager, donor)
        manager.free(donor)
        # Evict block 2 by hand: take its hash out of the cache, as an eviction would.
        manager.block_pool.uncache_block(manager.block_pool.blocks[3])
        hits, num_tokens = manager.get_computed_blocks(make_request("next", tokens))
        ids = hits.get_block_ids()[0]
        assert num_tokens == want_length, spec
        if isinstance(spec, SlidingWindowSpec):
            assert ids == [0, 0, 0, 4, 5]  # the null block is block 0; donor's blocks were 1..5
        else:
            assert ids == [1, 2]


def test_a_short_prefix_needs_no_whole_window() -> None:
    # Only block 0 cached: a hit of one block, since no token comes before it.
    manager = KVCacheManager(KVCacheConfig(num_blocks=16, spec=sliding_spec()), max_model_len=64, enable_caching=True)
    donor = make_request("donor", list(range(1, 5)) + [99])
    run_prefill(manager, donor)
    manager.free(donor)
    hits, num_tokens = manager.get_computed_blocks(make_request("next", list(range(1, 13))))
    assert num_tokens == 4 and hits.get_block_ids() == ([1],)


def test_the_hybrid_coordinator_agrees_on_a_prefix_both_kinds_can_serve() -> None:
    manager = KVCacheManager(interleaved_config(num_blocks=32), max_model_len=64, enable_caching=True)
    coordinator = manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [type(m) for m in coordinator.single_type_managers] == [FullAttentionManager, SlidingWindowManager]
    tokens = list(range(1, 29))
    donor = make_request("donor", tokens[:24] + [99])
    run_prefill(manager, donor)
    manager.free(donor)
    # The sliding group loses its blocks 4 and 5; full attention keeps all six.
    sliding = coordinator.single_type_managers[1]
    for block_hash in donor.block_hashes[4:6]:
        cached = coordinator.block_pool.get_cached_block(block_hash, sliding.kv_cache_group_id)
        assert cached is not None
        coordinator.block_pool.uncache_block(cached)
    hits, num_tokens = manager.get_computed_blocks(make_request("next", tokens))
    # Full attention alone: 24 tokens. The window at 24 needs blocks 4, 5: gone. At 16 it
    # needs blocks 2, 3: cached. Asked again at 16, full attention agrees: 16 tokens.
    assert num_tokens == 16
    full_ids, sliding_ids = hits.get_block_ids()
    assert len(full_ids) == 4 and sliding_ids[:2] == [0, 0] and 0 not in sliding_ids[2:]
    # Admitting it claims the hits of both groups and the blocks past them.
    request = make_request("next", tokens)
    assert manager.allocate_slots(request, len(tokens) - 16, 16, hits) is not None


def test_sizing_counts_a_window_and_one_step_per_sliding_group() -> None:
    spec = sliding_spec()
    # A step of 16 tokens plus the 7 before it: cdiv(23, 4) + 1 = 7 blocks, not cdiv(1024, 4) = 256.
    assert spec.max_num_blocks(max_model_len=1024, max_num_batched_tokens=16) == 7
    assert spec.max_num_blocks(max_model_len=12, max_num_batched_tokens=16) == 3  # never more than full attention
    config = get_kv_cache_config(spec, 20 * spec.page_size_bytes, max_model_len=1024, max_num_batched_tokens=16)
    assert config.num_blocks == 20  # a budget full attention would refuse (257 blocks)
    assert max_concurrency(config, 1024, max_num_batched_tokens=16) == 19 / 7
    layout = group_kv_cache_layers({0: sliding_spec(), 1: full_spec(), 2: sliding_spec(), 3: full_spec()})
    assert layout.max_num_blocks(1024, 16) == 256 + 7

