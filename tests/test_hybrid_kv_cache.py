"""Hybrid models in the core (chapter 4): groups, shared pages, one coordinator over several managers.

Pure Python, no torch: the per-layer specs are written by hand (or from a
transformers config, for Qwen3.5's real shape), and the scheduler runs with the
fake model runner of test_scheduler.py.
"""

from __future__ import annotations

import logging

import pytest
from test_scheduler import make_request, run_to_completion, step
from transformers import LlamaConfig, Qwen3_5TextConfig

from nanoengine.config import CacheConfig, ModelConfig, SchedulerConfig
from nanoengine.core.kv_cache_coordinator import HybridKVCacheCoordinator, UnitaryKVCacheCoordinator
from nanoengine.core.kv_cache_groups import KVCacheLayout, align_hybrid_block_size, group_kv_cache_layers
from nanoengine.core.kv_cache_manager import KVCacheManager
from nanoengine.core.kv_cache_sizing import check_enough_kv_cache_memory, get_kv_cache_config, max_concurrency
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from nanoengine.engine.arg_utils import resolve_prefix_caching
from nanoengine.instruments.component_tree import tree_to_text
from nanoengine.instruments.invariants import InvariantViolation, check_invariants
from nanoengine.kv_cache_interface import (
    FULL_ATTENTION_GROUP,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
)
from nanoengine.request import Request
from nanoengine.sampling_params import SamplingParams

# ---- Qwen3.5's real shape -------------------------------------------------------


def qwen35_layer_specs(config: Qwen3_5TextConfig, block_size: int, dtype_size: int, max_model_len: int
                       ) -> dict[int, KVCacheSpec]:
    """Per-layer specs as a worker would build them from the HF config."""
    attention = FullAttentionSpec(block_size, config.num_key_value_heads, config.head_dim, dtype_size, num_layers=1)
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim  # q, k and v go through the convolution
    state = MambaSpec(
        shapes=(
            (conv_dim, config.linear_conv_kernel_dim - 1),
            (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim),
        ),
        dtype_size=dtype_size,
        block_size=max_model_len,
    )
    return {
        index: attention if kind == "full_attention" else state for index, kind in enumerate(config.layer_types)
    }


def qwen35_08b(num_hidden_layers: int = 24) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        hidden_size=1024, num_hidden_layers=num_hidden_layers, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
    )


def test_qwen35_08b_pages_are_unified_in_bf16() -> None:
    layout = group_kv_cache_layers(qwen35_layer_specs(qwen35_08b(), 16, dtype_size=2, max_model_len=4096))
    # K and V of one token in one attention layer: 2 x 2 heads x 256 x 2 bytes.
    assert layout.attention_bytes_per_token == 2048
    # conv (6144, 3) + recurrent (16, 128, 128), 2 bytes each.
    assert layout.state_bytes == (6144 * 3 + 16 * 128 * 128) * 2 == 561_152
    # 16 tokens of K/V are 32 KiB; a state needs 18 such steps: 288 tokens per block.
    assert (layout.requested_block_size, layout.block_size) == (16, 288)
    assert layout.page_size_per_layer == 288 * 2048 == 589_824
    assert layout.state_padding_bytes == 589_824 - 561_152
    # 6 full-attention + 18 DeltaNet layers: groups of 6, one of attention first.
    assert layout.num_shared_tensors == 6 and layout.page_size_bytes == 6 * 589_824
    assert [group.layer_indices for group in layout.kv_cache_groups] == [
        (3, 7, 11, 15, 19, 23), (0, 4, 8, 12, 16, 20), (1, 5, 9, 13, 17, 21), (2, 6, 10, 14, 18, 22),
    ]
    assert isinstance(layout.kv_cache_groups[FULL_ATTENTION_GROUP].kv_cache_spec, FullAttentionSpec)
    state_spec = layout.kv_cache_groups[1].kv_cache_spec
    assert isinstance(state_spec, MambaSpec) and state_spec.page_size_bytes == 589_824
    assert layout.attention_spec == FullAttentionSpec(288, 2, 256, 2, num_layers=6)
    assert (layout.num_state_groups, layout.num_blocks_for(4096)) == (3, 15 + 3)  # cdiv(4096, 288) = 15


def test_a_larger_requested_block_size_is_kept_and_the_state_padded_more() -> None:
    layout = group_kv_cache_layers(qwen35_layer_specs(qwen35_08b(), 512, dtype_size=4, max_model_len=4096))
    assert (layout.block_size, layout.page_size_per_layer) == (512, 512 * 4096)
    assert layout.state_padding_bytes == 512 * 4096 - 1_122_304
    # In fp32 both sides double: the smallest block stays 288 tokens.
    assert align_hybrid_block_size(16, attention_bytes_per_token=4096, state_bytes=1_122_304) == 288
    assert align_hybrid_block_size(16, attention_bytes_per_token=4096, state_bytes=0) == 16


def test_uneven_layer_counts_group_as_vllm_does() -> None:
    # 26 layers: 6 full attention, 20 DeltaNet. Groups of 6: the state layers make
    # 4 groups of 5 (strided), so tensor 5 holds the last attention layer only.
    layout = group_kv_cache_layers(qwen35_layer_specs(qwen35_08b(26), 16, dtype_size=2, max_model_len=4096))
    groups = [group.layer_indices for group in layout.kv_cache_groups]
    assert layout.num_shared_tensors == 6 and len(groups) == 5
    assert groups[0] == (3, 7, 11, 15, 19, 23)
    assert groups[1:] == [(0, 5, 10, 16, 21), (1, 6, 12, 17, 22), (2, 8, 13, 18, 24), (4, 9, 14, 20, 25)]
    config = KVCacheConfig(10, layout.attention_spec, layout.kv_cache_groups)
    tensors = config.kv_cache_tensors
    assert tensors[0] == KVCacheTensor(10 * 589_824, (3, 0, 1, 2, 4))
    assert tensors[5] == KVCacheTensor(10 * 589_824, (23,))
    assert sorted(layer for tensor in tensors for layer in tensor.shared_by) == list(range(26))


def test_group_size_is_the_smaller_count_unless_nearly_even() -> None:
    attention = FullAttentionSpec(16, 1, 8, 4, num_layers=1)
    state = MambaSpec(((16, 3),), dtype_size=4, block_size=64)

    def groups(num_attention: int, num_state: int) -> list[tuple[int, ...]]:
        specs = {i: attention for i in range(num_attention)}
        specs.update({num_attention + i: state for i in range(num_state)})
        return [group.layer_indices for group in group_kv_cache_layers(specs).kv_cache_groups]

    # 7 and 9 are nearly even (9 < 1.5 x 7): one group each, of 9 layers.
    assert groups(7, 9) == [tuple(range(7)), tuple(range(7, 16))]
    # 13 attention layers in groups of 5: strided, 5 + 4 + 4.
    assert groups(13, 5)[:3] == [(0, 3, 6, 9, 12), (1, 4, 7, 10), (2, 5, 8, 11)]


def test_a_plain_model_is_one_group_of_every_layer() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_dim=64, dtype_size=2, num_layers=30)
    config = KVCacheConfig(num_blocks=100, spec=spec)
    per_layer = FullAttentionSpec(16, 3, 64, 2, num_layers=1)
    assert config.kv_cache_groups == (KVCacheGroupSpec(tuple(range(30)), per_layer),)
    assert config.bytes_per_block == spec.page_size_bytes and config.total_bytes == 100 * spec.page_size_bytes
    assert config.kv_cache_tensors[7] == KVCacheTensor(100 * per_layer.page_size_bytes, (7,))
    layout = group_kv_cache_layers(dict.fromkeys(range(30), per_layer))
    assert layout.kv_cache_groups == config.kv_cache_groups and layout.page_size_bytes == spec.page_size_bytes
    assert get_kv_cache_config(spec, 10 * spec.page_size_bytes, max_model_len=64) == KVCacheConfig(10, spec)


def test_specs_that_cannot_be_grouped_are_refused() -> None:
    small, large = FullAttentionSpec(16, 1, 8, 4, 1), FullAttentionSpec(16, 2, 8, 4, 1)
    with pytest.raises(ValueError, match="Every FullAttentionSpec layer must have the same spec"):
        group_kv_cache_layers({0: small, 1: large})
    with pytest.raises(ValueError, match="needs an attention layer"):
        group_kv_cache_layers({0: MambaSpec(((4,),), 4, 64)})
    with pytest.raises(ValueError, match="page size per layer"):
        KVCacheConfig(4, small, (KVCacheGroupSpec((0,), small), KVCacheGroupSpec((1,), large)))


# ---- a tiny hybrid model for the core ----------------------------------------------

BLOCK_SIZE = 16  # raised from 4 by the state: one state (320 bytes) fits 16 tokens of K/V
MAX_MODEL_LEN = 64


def tiny_layout() -> KVCacheLayout:
    """Six layers: state, attention, state, state, attention, state.

    Attention: 64 bytes per token (1 head of 8, fp32, K and V); a state: 320
    bytes. Groups of 2: attention (1, 4), states (0, 3) and (2, 5).
    """
    attention = FullAttentionSpec(4, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)
    state = MambaSpec(((16, 3), (2, 4, 4)), dtype_size=4, block_size=MAX_MODEL_LEN)
    return group_kv_cache_layers({0: state, 1: attention, 2: state, 3: state, 4: attention, 5: state})


def tiny_config(num_blocks: int) -> KVCacheConfig:
    """Any block count, even too few for one request of ``MAX_MODEL_LEN`` (sizing would refuse it)."""
    layout = tiny_layout()
    return KVCacheConfig(num_blocks, layout.attention_spec, layout.kv_cache_groups)


def tiny_manager(num_blocks: int, enable_caching: bool = False) -> KVCacheManager:
    return KVCacheManager(tiny_config(num_blocks), MAX_MODEL_LEN, enable_caching)


def tiny_request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=8), eos_token_id=None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE))


def test_the_tiny_layout() -> None:
    layout = tiny_layout()
    assert (layout.block_size, layout.page_size_per_layer, layout.num_shared_tensors) == (16, 1024, 2)
    assert [group.layer_indices for group in layout.kv_cache_groups] == [(1, 4), (0, 3), (2, 5)]
    config = tiny_config(num_blocks=12)
    assert (config.block_size, config.bytes_per_block, config.num_state_groups) == (16, 2048, 2)
    assert config.attention_group_ids == (FULL_ATTENTION_GROUP,)
    assert config.num_blocks_for(40) == 3 + 2  # 40 tokens: 3 attention blocks, a state block per state group


def test_hybrid_coordinator_allocates_grows_and_frees_every_group() -> None:
    manager = tiny_manager(num_blocks=12)  # 11 usable
    coordinator = manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [type(m) for m in coordinator.single_type_managers] == [FullAttentionManager, MambaManager, MambaManager]
    request = tiny_request("r", 20)
    new_blocks = manager.allocate_slots(request, 20)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([1, 2], [3], [4])
    assert manager.num_free_blocks == 11 - 4
    request.num_computed_tokens = 20
    # Thirteen more tokens (33) open a third attention block; the states stay one block each.
    request.append_output_token_ids(list(range(13)))
    new_blocks = manager.allocate_slots(request, 13)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([5], [], [])
    assert manager.get_block_ids("r") == ([1, 2, 5], [3], [4])
    manager.free(request)
    assert manager.get_block_ids("r") == ([], [], [])
    assert manager.num_free_blocks == 11 and manager.usage == 0.0


def test_allocation_is_all_or_nothing_across_groups() -> None:
    manager = tiny_manager(num_blocks=5)  # 4 usable: 40 tokens need 3 + 1 + 1
    request = tiny_request("r", 40)
    assert manager.allocate_slots(request, 40) is None
    assert manager.get_block_ids("r") == ([], [], []) and manager.num_free_blocks == 4
    assert manager.allocate_slots(request, 32) is not None  # 2 + 1 + 1: an exact fit
    assert manager.num_free_blocks == 0


def test_prefix_caching_on_a_hybrid_model_never_hits() -> None:
    # The state groups cannot restore a prefix, so neither can the model.
    manager = tiny_manager(num_blocks=12, enable_caching=True)
    first = tiny_request("a", 40)
    assert manager.allocate_slots(first, 40) is not None
    first.num_computed_tokens = 40
    manager.free(first)
    assert manager.block_pool.cached_block_hash_to_block  # the attention blocks were hashed
    hit_blocks, num_hit_tokens = manager.get_computed_blocks(tiny_request("b", 40))
    assert num_hit_tokens == 0 and hit_blocks.get_block_ids() == ([], [], [])


def test_a_state_block_must_stand_for_a_whole_request() -> None:
    config = tiny_config(num_blocks=12)
    with pytest.raises(ValueError, match="MambaSpec.block_size=64 is smaller than max_model_len=128"):
        KVCacheManager(config, max_model_len=128, enable_caching=False)


def test_sizing_counts_a_state_block_per_state_group() -> None:
    layout = tiny_layout()
    config = get_kv_cache_config(layout, available_bytes=20 * 2048 + 100, max_model_len=MAX_MODEL_LEN)
    assert config == tiny_config(num_blocks=20)
    assert get_kv_cache_config(layout, 0, MAX_MODEL_LEN, num_blocks_override=7) == tiny_config(num_blocks=7)
    # A 64-token request: 4 attention blocks + 2 state blocks.
    assert max_concurrency(config, MAX_MODEL_LEN) == pytest.approx(19 / 6)
    with pytest.raises(ValueError, match=r"needs 7 blocks \(cdiv\(64, block_size=16\) \+ 2 state block\(s\), "
                                         r"one per state group \+ the null block\) of 2048 bytes") as err:
        check_enough_kv_cache_memory(6 * 2048, layout, MAX_MODEL_LEN)
    assert "the longest context would be 48 tokens" in str(err.value)  # 5 blocks: null, 2 states, 2 x 16


# ---- the scheduler over a hybrid KVCacheConfig ----------------------------------------


def hybrid_scheduler(num_blocks: int, max_num_batched_tokens: int = 16, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=MAX_MODEL_LEN),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
        tiny_config(num_blocks),
    )


def test_scheduler_runs_a_hybrid_config_with_chunked_prefill() -> None:
    scheduler = hybrid_scheduler(num_blocks=24)
    scheduler.add_request(make_request("a", 40))
    first, _ = step(scheduler)  # a: tokens 0-15
    (new_a,) = first.scheduled_new_reqs
    assert new_a.block_ids == ([1], [2], [3])  # one attention block so far, each state its block
    scheduler.add_request(make_request("b", 20, first_token=500))
    second, _ = step(scheduler)  # a: 16-31, and nothing left for b
    assert second.scheduled_cached_reqs.new_block_ids == [([4], [], [])]
    assert second.num_scheduled_tokens == {"a": 16}
    third, _ = step(scheduler)  # a: its last 8 tokens; b: 8 tokens
    assert third.num_scheduled_tokens == {"a": 8, "b": 8}
    assert third.scheduled_cached_reqs.new_block_ids == [([5], [], [])]
    assert third.scheduled_new_reqs[0].block_ids == ([6], [7], [8])
    check_invariants(scheduler)
    while scheduler.has_requests():
        step(scheduler)
        check_invariants(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 23


def test_preemption_frees_attention_blocks_and_states() -> None:
    # 9 usable blocks; each request needs 2 state blocks plus 1 attention block per 16 tokens.
    scheduler = hybrid_scheduler(num_blocks=10, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", 14, first_token=100 * (i + 1), max_tokens=40, ignore_eos=True))
    preempted: set[str] = set()
    while scheduler.has_requests():
        output, _ = step(scheduler)
        for request_id in output.preempted_req_ids:
            preempted.add(request_id)
            assert scheduler.kv_cache_manager.get_block_ids(request_id) == ([], [], [])
        check_invariants(scheduler)
    assert preempted and scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 9


def test_a_request_too_long_for_a_hybrid_cache_names_its_state_blocks() -> None:
    scheduler = hybrid_scheduler(num_blocks=5)  # 4 usable: 33 tokens need 3 + 2
    scheduler.add_request(make_request("long", 33))
    finals = run_to_completion(scheduler)
    assert finals["long"].finish_message == (
        "The request needs 5 KV cache blocks for its 33 tokens, more than the 4 blocks of the whole KV cache "
        "(block_size=16, plus 2 state block(s), one per state group)."
    )


def test_invariants_catch_a_block_held_by_two_groups() -> None:
    scheduler = hybrid_scheduler(num_blocks=12)
    scheduler.add_request(make_request("a", 20))
    step(scheduler)
    check_invariants(scheduler)
    attention, state, _ = scheduler.kv_cache_manager.coordinator.single_type_managers
    stolen = attention.req_to_blocks["a"][0]
    state.req_to_blocks["a"].append(stolen)
    stolen.ref_cnt += 1  # keep the ref count consistent: only the group rule is broken
    with pytest.raises(InvariantViolation, match=f"block {stolen.block_id} is held by KV cache groups 0 and 1"):
        check_invariants(scheduler)


def test_the_tree_shows_each_groups_manager_over_one_pool() -> None:
    text = tree_to_text(tiny_manager(num_blocks=12))  # the instruments' tree printer, from outside
    assert "coordinator: HybridKVCacheCoordinator" in text
    assert "single_type_managers[0]: FullAttentionManager" in text and "group=0 layers=2 block_size=16" in text
    assert "single_type_managers[2]: MambaManager" in text and "group=2 layers=2 block_size=64" in text
    assert text.count("block_pool: BlockPool") == 3 and "(same object as" in text
    plain = KVCacheManager(KVCacheConfig(8, FullAttentionSpec(4, 1, 8, 4, 2)), 64, enable_caching=True)
    assert isinstance(plain.coordinator, UnitaryKVCacheCoordinator)
    assert "single_type_managers[0]: FullAttentionManager" in tree_to_text(plain)


# ---- prefix caching is off for hybrid models -----------------------------------------


def model_config(hf_config: object) -> ModelConfig:
    return ModelConfig(model="m", model_path="/m", hf_config=hf_config, max_model_len=64)


def test_prefix_caching_is_turned_off_for_a_hybrid_model(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nanoengine.engine.arg_utils"):
        assert resolve_prefix_caching(True, model_config(qwen35_08b())) is False
        assert resolve_prefix_caching(False, model_config(qwen35_08b())) is False
        assert resolve_prefix_caching(True, model_config(LlamaConfig(num_hidden_layers=2))) is True
    (record,) = caplog.records
    assert record.getMessage().startswith("Prefix caching is off for m: it is a hybrid model")
    assert model_config(qwen35_08b()).is_hybrid and not model_config(LlamaConfig()).is_hybrid
