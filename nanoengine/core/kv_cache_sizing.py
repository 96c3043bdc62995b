"""From a memory budget to a number of KV cache blocks (chapter 6, then chapter 2).

``determine_available_memory`` on the worker says how many bytes the KV cache may
take; this module divides that budget by the size of one block and checks that at
least one request of ``max_model_len`` tokens fits. The block count is the real
upper bound on batch size that chapter 2 talks about.
vLLM 0.32 counterpart: ``vllm/v1/core/kv_cache_utils.py`` (``get_kv_cache_configs``,
``check_enough_kv_cache_memory``).
"""

from __future__ import annotations

from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nanoengine.utils.math_utils import cdiv
from nanoengine.utils.mem_utils import format_bytes


# BEGIN EXERCISE 6.1
def num_blocks_from_budget(available_bytes: int, spec: FullAttentionSpec) -> int:
    """How many whole blocks fit in ``available_bytes``.

    One block stores K and V for ``block_size`` tokens in every layer, so its
    size is ``spec.page_size_bytes``; a partial block is useless, hence floor.
    """
    return max(available_bytes // spec.page_size_bytes, 0)


# END EXERCISE 6.1


def check_enough_kv_cache_memory(
    available_bytes: int, spec: FullAttentionSpec, max_model_len: int, budget_note: str = ""
) -> None:
    """Refuse to start an engine that could never finish one longest request.

    ``budget_note`` (from the worker's memory profile) says where the rest of
    the budget went and which knob value would be enough; it ends the message.
    """
    # +1: block 0 is the block pool's reserved null block and holds no tokens.
    needed_bytes = (cdiv(max_model_len, spec.block_size) + 1) * spec.page_size_bytes
    if available_bytes >= needed_bytes:
        return
    fitting_len = max(num_blocks_from_budget(available_bytes, spec) - 1, 0) * spec.block_size
    raise ValueError(
        f"The KV cache budget of {format_bytes(available_bytes)} ({available_bytes} bytes) is too "
        f"small for one request of max_model_len={max_model_len} tokens, which needs "
        f"{format_bytes(needed_bytes)} ({needed_bytes} bytes; {needed_bytes - available_bytes} "
        f"bytes missing). With this budget the longest context would be {fitting_len} tokens. "
        "Raise kv_cache_memory_bytes (CPU), cpu_kv_cache_fraction or gpu_memory_utilization, "
        "or lower max_model_len." + (f" {budget_note}" if budget_note else "")
    )


def get_kv_cache_config(
    spec: FullAttentionSpec,
    available_bytes: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    budget_note: str = "",
) -> KVCacheConfig:
    """Decide the block count: the override if given, else what the budget buys."""
    if num_blocks_override is not None:
        check_enough_kv_cache_memory(num_blocks_override * spec.page_size_bytes, spec, max_model_len)
        return KVCacheConfig(num_blocks=num_blocks_override, spec=spec)
    check_enough_kv_cache_memory(available_bytes, spec, max_model_len, budget_note)
    return KVCacheConfig(num_blocks=num_blocks_from_budget(available_bytes, spec), spec=spec)


def max_concurrency(kv_cache_config: KVCacheConfig, max_model_len: int) -> float:
    """How many requests of ``max_model_len`` tokens fit at once (chapter 2's bound)."""
    per_request = cdiv(max_model_len, kv_cache_config.block_size)
    return (kv_cache_config.num_blocks - 1) / per_request  # minus the null block
