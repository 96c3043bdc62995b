"""The grader's checks for exercises 4.4 and 4.5 (chapter 4, hybrid models).

4.4 (``KVCacheCoordinator.get_num_blocks_to_allocate``) is called directly on
a hand-built hybrid cache: one full-attention group of 4-token blocks and two
state groups, whose one block stands for a whole request, all over one block
pool of a handful of blocks. Each count's label names the request, the tokens
and the hits, and, in brackets, what each group's own manager says it needs:
the sum you should return. The setup never runs the exercise's code (it calls
the coordinator's ``allocate_new_blocks`` and ``cache_blocks`` directly), but
for the all-or-nothing check, which goes through ``allocate_slots`` on purpose.

4.5 (``align_hybrid_block_size``) is called with byte counts chosen so that each
kind of wrong rounding shows in its own check, then on Qwen3.5-0.8B's shapes.

The end-to-end runs build an engine on the grader's own tiny Qwen3.5
(``tiny_model.py``: three Gated DeltaNet layers and a full-attention layer),
whatever model the grader was given: only a hybrid model has state groups.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from chapters.grade_checks.common import PROMPTS, Check, block_ids, greedy_run, kv_spec, make_request
from chapters.grade_checks.tiny_model import tiny_hybrid_model_dir
from nanoengine.core.kv_cache_coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from nanoengine.core.kv_cache_groups import align_hybrid_block_size, group_kv_cache_layers
from nanoengine.core.kv_cache_manager import KVCacheManager
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
)
from nanoengine.transformers_utils.dummy_configs import BUILTIN_CONFIGS

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
# K and V of 4 tokens, one head of 8, fp32: a 256-byte page per layer.
ATTENTION = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_dim=8, dtype_size=4, num_layers=1)
# A 64-byte state padded to the attention page; one block stands for MAX_MODEL_LEN tokens.
STATE = MambaSpec(((16,),), dtype_size=4, block_size=MAX_MODEL_LEN,
                  page_size_padded=ATTENTION.page_size_per_layer)
NO_HITS: tuple[list[KVCacheBlock], ...] = ([], [], [])


# ------------------------------------------ 4.4 get_num_blocks_to_allocate
def _hybrid_config(num_blocks: int) -> KVCacheConfig:
    """Layer 0 full attention, layers 1 and 2 state layers: group 0 attention, groups 1 and 2 states."""
    groups = (KVCacheGroupSpec((0,), ATTENTION), KVCacheGroupSpec((1,), STATE), KVCacheGroupSpec((2,), STATE))
    return KVCacheConfig(num_blocks, ATTENTION, groups)


def _hybrid_coordinator(num_blocks: int) -> KVCacheCoordinator:
    return get_kv_cache_coordinator(_hybrid_config(num_blocks), MAX_MODEL_LEN, enable_caching=False)


def _kind(spec: KVCacheSpec) -> str:
    return "state" if isinstance(spec, MambaSpec) else "attention"


def _label(coordinator: KVCacheCoordinator, request_id: str, num_tokens: int,
           hits: tuple[Sequence[KVCacheBlock], ...], hits_note: str = "no hits") -> str:
    """The call, and in brackets each group's own count (from its manager): what the sum is made of."""
    managers = coordinator.single_type_managers
    parts = [f"{_kind(m.kv_cache_spec)} {m.get_num_blocks_to_allocate(request_id, num_tokens, h)}"
             for m, h in zip(managers, hits, strict=True)]
    call = f"get_num_blocks_to_allocate({request_id}, {_tokens(num_tokens)}, {hits_note})"
    return f"{call} [{' + '.join(parts)}]"


def _tokens(count: int) -> str:
    return f"{count} token{'s' * (count != 1)}"


def _tables(coordinator: KVCacheCoordinator, request_id: str) -> tuple[list[int], ...]:
    """The request's block ids, one list per group."""
    return tuple([block.block_id for block in table] for table in coordinator.get_blocks(request_id))


def counts_a_new_request(model: str) -> dict[str, Any]:
    """An attention group (4-token blocks) and two state groups on one pool of 29
    usable blocks: a request ``new`` that holds nothing yet, of 1, 4, 5, 17 and 64
    (max_model_len) tokens, no cache hits.
    """
    coordinator = _hybrid_coordinator(num_blocks=30)
    result: dict[str, Any] = {
        _label(coordinator, "new", n, NO_HITS): coordinator.get_num_blocks_to_allocate("new", n, NO_HITS)
        for n in (1, 4, 5, 17, MAX_MODEL_LEN)
    }
    result["afterwards (counting takes nothing): free blocks"] = coordinator.block_pool.get_num_free_blocks()
    result["afterwards: new's block ids per group"] = _tables(coordinator, "new")
    return result


def counts_a_running_request(model: str) -> dict[str, Any]:
    """The same groups: ``run`` holds blocks for 5 tokens (2 attention blocks, one
    block in each state group); then it is to hold 5, 8, 9, 13 and 64 tokens in all.
    """
    coordinator = _hybrid_coordinator(num_blocks=30)
    coordinator.allocate_new_blocks("run", 5)
    held = [len(table) for table in coordinator.get_blocks("run")]
    result: dict[str, Any] = {
        f"run holds {held}: " + _label(coordinator, "run", n, NO_HITS):
            coordinator.get_num_blocks_to_allocate("run", n, NO_HITS)
        for n in (5, 8, 9, 13, MAX_MODEL_LEN)
    }
    result["afterwards: run's block ids per group"] = _tables(coordinator, "run")
    return result


def counts_cache_hits(model: str) -> dict[str, Any]:
    """One group of 4-token blocks, prefix caching on, 9 usable blocks: ``held``
    (tokens 1-8) keeps its 2 cached blocks; ``gone`` (tokens 100-107) cached 2
    blocks and finished, so they wait in the free queue (ref_cnt 0). Requests with
    the same 8 tokens and 8 more hit those blocks: counts for 8 and 16 tokens.
    """
    manager = KVCacheManager(KVCacheConfig(10, kv_spec(BLOCK_SIZE)), MAX_MODEL_LEN, enable_caching=True)
    coordinator = manager.coordinator
    owners = {"held": 1, "gone": 100}  # request id -> its first token
    for request_id, first_token in owners.items():
        request = make_request(request_id, 8, block_size=BLOCK_SIZE, first_token=first_token)
        coordinator.allocate_new_blocks(request_id, 8)
        coordinator.cache_blocks(request, 8)
    coordinator.free("gone")
    result: dict[str, Any] = {}
    for owner, first_token in owners.items():
        twin = make_request(f"twin_of_{owner}", 16, block_size=BLOCK_SIZE, first_token=first_token)
        hits, _ = coordinator.find_longest_cache_hit(twin.block_hashes, 15)
        note = f"{owner}'s 2 blocks as hits, ref_cnt {[block.ref_cnt for block in hits[0]]}"
        for num_tokens in (8, 16):
            label = _label(coordinator, twin.request_id, num_tokens, hits, note)
            result[label] = coordinator.get_num_blocks_to_allocate(twin.request_id, num_tokens, hits)
    result["afterwards (counting claims no hit): free blocks"] = manager.num_free_blocks
    return result


def all_or_nothing_across_groups(model: str) -> dict[str, Any]:
    """``allocate_slots`` on the same groups, 7 usable blocks: ``a`` (8 tokens: 2 +
    1 + 1 blocks), then ``b`` (5 tokens: 2 + 1 + 1, with 3 free), then ``c`` (1
    token: 1 + 1 + 1, exactly the 3 free), then a's 9th token (1 more attention
    block, none free).
    """
    manager = KVCacheManager(_hybrid_config(num_blocks=8), MAX_MODEL_LEN, enable_caching=False)
    coordinator = manager.coordinator
    requests = {request_id: make_request(request_id, n) for request_id, n in (("a", 8), ("b", 5), ("c", 1))}
    result: dict[str, Any] = {}
    for request_id, request in requests.items():
        num_tokens = request.num_tokens
        label = f"allocate_slots({request_id}, {_tokens(num_tokens)}), {manager.num_free_blocks} blocks free"
        result[f"{label}: new block ids per group"] = block_ids(manager.allocate_slots(request, num_tokens))
        result[f"after {label}: free blocks"] = manager.num_free_blocks
        result[f"after {label}: {request_id}'s block ids per group"] = _tables(coordinator, request_id)
    a = requests["a"]
    a.num_computed_tokens = 8
    a.append_output_token_ids(99)
    label = f"allocate_slots(a, 1 token: its 9th), {manager.num_free_blocks} blocks free"
    result[f"then {label}: new block ids per group"] = block_ids(manager.allocate_slots(a, 1))
    result[f"after {label}: a's block ids per group"] = _tables(coordinator, "a")
    return result


# The tiny Qwen3.5 has no tokenizer: the prompts are token ids.
HYBRID_ENGINE: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": "float32", "block_size": 16}


def e2e_hybrid_generation(model: str) -> dict[str, Any]:
    """The grader's tiny Qwen3.5 (an attention group, three state groups), whatever
    model the grader is given: four 7-token prompts, 8 greedy tokens each, 64
    blocks of 16 tokens.
    """
    run = greedy_run(tiny_hybrid_model_dir(), PROMPTS, max_tokens=8, max_model_len=64,
                     num_gpu_blocks_override=64, **HYBRID_ENGINE)
    return asdict(run)


def e2e_hybrid_preemption(model: str) -> dict[str, Any]:
    """The tiny Qwen3.5: four 7-token prompts, 16 greedy tokens each, in 9 usable
    blocks of 16 tokens. A request holds 1 attention block and 3 state blocks, 5
    once past 16 tokens, so the scheduler must preempt.
    """
    run = greedy_run(tiny_hybrid_model_dir(), PROMPTS, max_model_len=32, num_gpu_blocks_override=10,
                     max_num_batched_tokens=32, **HYBRID_ENGINE)
    assert run.num_preemptions > 0, "the tight cache was meant to force a preemption"
    return asdict(run)


# ------------------------------------------------------ 4.5 align_hybrid_block_size
def _block_sizes(cases: Sequence[tuple[int, int, int, str]]) -> dict[str, int]:
    """``(requested, attention_bytes_per_token, state_bytes, note)`` -> the labeled answers."""
    return {
        f"align_hybrid_block_size(requested={requested}, attention_bytes_per_token={per_token}, "
        f"state_bytes={state}) ({note})": align_hybrid_block_size(requested, per_token, state)
        for requested, per_token, state, note in cases
    }


def no_state(model: str) -> dict[str, Any]:
    """state_bytes 0 (no state layer) with requested block sizes 4, 16 and 7."""
    return _block_sizes([(4, 512, 0, "a plain model"), (16, 512, 0, "a plain model"),
                         (7, 100, 0, "a plain model, 7 is no multiple of 16")])


def exact_fit(model: str) -> dict[str, Any]:
    """States of exactly 16, 32 and 48 tokens' K and V (8192 and 16384 bytes at
    512 bytes a token, 3072 at 64), requested sizes 16, 4 and 1.
    """
    return _block_sizes([(16, 512, 8192, "16 tokens' K/V are 8192 bytes"),
                         (16, 512, 16384, "32 tokens' K/V are 16384 bytes"),
                         (4, 512, 8192, "16 tokens' K/V are 8192 bytes"),
                         (1, 64, 3072, "48 tokens' K/V are 3072 bytes")])


def rounds_up(model: str) -> dict[str, Any]:
    """States one byte short of 16, 32 and 48 tokens' K and V (8191, 16383 and
    3071 bytes), requested sizes 16, 4 and 1.
    """
    return _block_sizes([(16, 512, 8191, "16 tokens' K/V are 8192 bytes"),
                         (4, 512, 16383, "32 tokens' K/V are 16384 bytes"),
                         (1, 64, 3071, "48 tokens' K/V are 3072 bytes")])


def aligned_to_16(model: str) -> dict[str, Any]:
    """States one byte over 16 and 32 tokens' K and V (8193, 16385 bytes at 512 a
    token), the tiny Qwen3.5's 5632-byte state (11 tokens at 512 bytes), and 1025
    bytes at 64 a token (17 tokens), requested sizes 16, 4, 4 and 1.
    """
    return _block_sizes([(16, 512, 8193, "16 tokens' K/V are 8192 bytes"),
                         (4, 512, 16385, "32 tokens' K/V are 16384 bytes"),
                         (4, 512, 5632, "11 tokens' K/V would hold it"),
                         (1, 64, 1025, "17 tokens' K/V would hold it")])


def larger_request_kept(model: str) -> dict[str, Any]:
    """Requested 32 and 40 for a state 16 tokens hold, 32 for one 32 tokens hold
    exactly, and 512 for Qwen3.5-0.8B's fp32 state (288 tokens would do).
    """
    return _block_sizes([(32, 512, 5632, "16 tokens would do"),
                         (40, 512, 5632, "16 tokens would do; 40 is no multiple of 16"),
                         (32, 512, 16384, "exactly 32 tokens"),
                         (512, 4096, 1_122_304, "288 tokens would do")])


def _qwen3_5_0_8b_layers(dtype_size: int) -> dict[int, KVCacheSpec]:
    """One spec per layer of Qwen3.5-0.8B (nanoengine's shipped config), block size 16 asked for."""
    config = BUILTIN_CONFIGS["Qwen/Qwen3.5-0.8B"].config
    attention = FullAttentionSpec(16, config["num_key_value_heads"], config["head_dim"], dtype_size, 1)
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    # A Gated DeltaNet layer's state: the convolution's window over q, k and v,
    # and one (key dim x value dim) matrix per value head.
    state = MambaSpec(((2 * key_dim + value_dim, config["linear_conv_kernel_dim"] - 1),
                       (config["linear_num_value_heads"], config["linear_key_head_dim"],
                        config["linear_value_head_dim"])), dtype_size, block_size=4096)
    layer_types = config["layer_types"]
    return {i: attention if kind == "full_attention" else state for i, kind in enumerate(layer_types)}


def qwen3_5_0_8b(model: str) -> dict[str, Any]:
    """Qwen3.5-0.8B's layers (nanoengine's shipped config), block size 16 asked
    for, in fp32 and in bf16, grouped by ``group_kv_cache_layers`` (which calls
    ``align_hybrid_block_size``).
    """
    result: dict[str, Any] = {}
    for dtype, dtype_size in (("fp32", 4), ("bf16", 2)):
        specs = _qwen3_5_0_8b_layers(dtype_size)
        attention = next(spec for spec in specs.values() if isinstance(spec, FullAttentionSpec))
        state = next(spec for spec in specs.values() if isinstance(spec, MambaSpec))
        per_token = replace(attention, block_size=1).page_size_per_layer
        note = f"{dtype}, state shapes {state.shapes}"
        result.update(_block_sizes([(16, per_token, state.state_bytes, note)]))
        layout = group_kv_cache_layers(specs)
        result[f"{dtype}: group_kv_cache_layers(...).block_size"] = layout.block_size
        result[f"{dtype}: its page_size_per_layer"] = layout.page_size_per_layer
        result[f"{dtype}: its state_padding_bytes"] = layout.state_padding_bytes
    return result


def e2e_block_size_raised(model: str) -> dict[str, Any]:
    """The grader's tiny Qwen3.5 (512 bytes of K/V a token, a 5632-byte state),
    whatever model the grader is given, asked for 4-token blocks and 1 MiB of KV
    cache: four 7-token prompts, 8 greedy tokens each.
    """
    run = greedy_run(tiny_hybrid_model_dir(), PROMPTS, max_tokens=8, max_model_len=64,
                     kv_cache_memory_bytes=1 << 20, **{**HYBRID_ENGINE, "block_size": 4})
    return asdict(run)


CHECKS: dict[str, tuple[Check, ...]] = {
    "4.4": (
        Check("a new request: attention blocks plus one block per state group, whatever its length",
              counts_a_new_request),
        Check("a running request: no more state blocks, one attention block per block_size tokens",
              counts_a_running_request),
        Check("cache hits: an evictable hit (ref_cnt 0) takes a free block, a held hit none",
              counts_cache_hits),
        Check("all or nothing across groups: short of blocks, no group gets one; an exact fit is admitted",
              all_or_nothing_across_groups),
        Check("end to end: greedy tokens on a tiny hybrid model", e2e_hybrid_generation, own_model="the grader's tiny Qwen3.5"),
        Check("end to end: preemption on a tiny hybrid model", e2e_hybrid_preemption, own_model="the grader's tiny Qwen3.5"),
    ),
    "4.5": (
        Check("no state: the requested block size is kept", no_state),
        Check("exact fit: K and V of the block take exactly the state's bytes", exact_fit),
        Check("rounds up: a state a byte short of 16 tokens' K and V takes those 16 tokens", rounds_up),
        Check("one byte over takes 16 more tokens: always a multiple of 16, even if fewer would do",
              aligned_to_16),
        Check("a larger requested block size is kept as it is", larger_request_kept),
        Check("Qwen3.5-0.8B: 4096 bytes of K/V a token in fp32, its state -> 288 tokens", qwen3_5_0_8b),
        Check("end to end: a tiny hybrid model's 4-token blocks are raised to 16", e2e_block_size_raised,
              own_model="the grader's tiny Qwen3.5"),
    ),
}
