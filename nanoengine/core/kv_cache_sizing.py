"""From a memory budget to a number of KV cache blocks (chapter 6, then chapter 2).

``determine_available_memory`` on the worker says how many bytes the KV cache may
take; this module divides that budget by the size of one block and checks that at
least one request of ``max_model_len`` tokens fits. The block count is the real
upper bound on batch size that chapter 2 talks about.

A plain model is described by its ``FullAttentionSpec``; a hybrid model (chapter
4) by the ``KVCacheLayout`` of its groups. Both say what one block id costs
(``page_size_bytes``) and the most blocks one request holds at once
(``max_num_blocks``): a block per ``block_size`` tokens in each full-attention
group, one state block per state group whatever the length, and for each
sliding-window group only a window plus one step's tokens (chapter 4: it gives
back the blocks that leave the window), which is why the step's token budget,
``max_num_batched_tokens``, enters the sum.

vLLM 0.32 counterpart: ``vllm/v1/core/kv_cache_utils.py`` (``get_kv_cache_configs``,
``check_enough_kv_cache_memory``).
"""

from __future__ import annotations

from dataclasses import replace

from nanoengine.core.kv_cache_groups import KVCacheLayout, group_kv_cache_layers
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from nanoengine.utils.mem_utils import format_bytes


def num_blocks_from_budget(available_bytes: int, spec: FullAttentionSpec | KVCacheLayout) -> int:
    """How many whole blocks fit in ``available_bytes``.

    One block stores K and V for ``block_size`` tokens in every layer (for a
    hybrid model's ``KVCacheLayout``: a page in every shared tensor), so its
    size is ``spec.page_size_bytes``; a partial block is useless, hence floor.
    """
    return max(available_bytes // spec.page_size_bytes, 0)


def check_enough_kv_cache_memory(
    available_bytes: int,
    spec: FullAttentionSpec | KVCacheLayout,
    max_model_len: int,
    budget_note: str = "",
    *,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Refuse to start an engine that could never finish one longest request.

    ``budget_note`` (from the worker's memory profile) says where the rest of
    the budget went and which knob value would be enough; it ends the message.
    ``max_num_batched_tokens`` bounds one step's tokens (None: a step may
    compute a whole request at once); only sliding-window groups depend on it.
    """
    layout = as_layout(spec)
    # +1: block 0 is the block pool's reserved null block and holds no tokens.
    num_blocks_needed = _max_num_blocks(layout, max_model_len, max_num_batched_tokens) + 1
    needed_bytes = num_blocks_needed * layout.page_size_bytes
    if available_bytes >= needed_bytes:
        return
    raise ValueError(
        f"The KV cache budget of {format_bytes(available_bytes)} ({available_bytes} bytes) is too "
        f"small for one request of max_model_len={max_model_len} tokens, which needs "
        f"{_blocks_needed(layout, max_model_len, num_blocks_needed)} of {layout.page_size_bytes} bytes: "
        f"{format_bytes(needed_bytes)} ({needed_bytes} bytes; {needed_bytes - available_bytes} "
        f"bytes missing). With this budget the longest context would be "
        f"{longest_context(layout, num_blocks_from_budget(available_bytes, layout))} tokens. "
        "Raise kv_cache_memory_bytes (CPU), cpu_kv_cache_fraction or gpu_memory_utilization, "
        "or lower max_model_len." + (f" {budget_note}" if budget_note else "")
    )


def _max_num_blocks(layout: KVCacheLayout, max_model_len: int, max_num_batched_tokens: int | None) -> int:
    """The most blocks one request holds at once; a step of None tokens is a whole request."""
    step_tokens = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    return layout.max_num_blocks(max_model_len, step_tokens)


def _blocks_needed(layout: KVCacheLayout, max_model_len: int, num_blocks_needed: int) -> str:
    """The block count of one longest request, term by term, for the error message."""
    kinds = [type(group.kv_cache_spec) for group in layout.kv_cache_groups]
    num_full_groups = kinds.count(FullAttentionSpec)
    per_group = f"cdiv({max_model_len}, block_size={layout.block_size})"
    terms = [per_group if num_full_groups == 1 else f"{num_full_groups} x {per_group}"] if num_full_groups else []
    if num_sliding := kinds.count(SlidingWindowSpec):
        terms.append(f"{num_sliding} sliding-window group(s) of a window plus one step each")
    if num_states := layout.num_state_groups:
        terms.append(f"{num_states} state block(s), one per state group")
    return f"{num_blocks_needed} blocks ({' + '.join(terms)} + the null block)"


def longest_context(layout: KVCacheLayout, num_blocks: int) -> int:
    """The longest request ``num_blocks`` blocks can hold, once the null block and
    one state block per state group are set aside. A sliding-window group is
    counted as if it kept every block: a lower bound, and exact without one.
    """
    num_attention_groups = len(layout.kv_cache_groups) - layout.num_state_groups
    num_attention_blocks = max(num_blocks - 1 - layout.num_state_groups, 0)
    return num_attention_blocks // num_attention_groups * layout.block_size


def as_layout(spec: FullAttentionSpec | KVCacheLayout) -> KVCacheLayout:
    """A plain model's spec as a layout: one group of all its layers."""
    if isinstance(spec, KVCacheLayout):
        return spec
    return group_kv_cache_layers(dict.fromkeys(range(spec.num_layers), replace(spec, num_layers=1)))


def get_kv_cache_config(
    spec: FullAttentionSpec | KVCacheLayout,
    available_bytes: int,
    max_model_len: int,
    num_blocks_override: int | None = None,
    budget_note: str = "",
    *,
    max_num_batched_tokens: int | None = None,
) -> KVCacheConfig:
    """Decide the block count: the override if given, else what the budget buys."""
    layout = as_layout(spec)
    if num_blocks_override is not None:
        # The override is a budget of exactly that many blocks.
        available_bytes, budget_note = num_blocks_override * layout.page_size_bytes, ""
    check_enough_kv_cache_memory(
        available_bytes, layout, max_model_len, budget_note, max_num_batched_tokens=max_num_batched_tokens
    )
    num_blocks = num_blocks_from_budget(available_bytes, layout)
    return KVCacheConfig(num_blocks, layout.attention_spec, layout.kv_cache_groups)


def token_capacity(kv_cache_config: KVCacheConfig) -> int:
    """Tokens of KV the cache can hold: every block but the null block, full."""
    return (kv_cache_config.num_blocks - 1) * kv_cache_config.block_size


def max_concurrency(
    kv_cache_config: KVCacheConfig, max_model_len: int, *, max_num_batched_tokens: int | None = None
) -> float:
    """How many requests of ``max_model_len`` tokens fit at once (chapter 2's bound).

    Each is counted at the most blocks it holds at once, as vLLM's
    ``get_max_concurrency_for_kv_cache_config`` does; ``max_num_batched_tokens``
    as for ``check_enough_kv_cache_memory``.
    """
    step_tokens = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
    per_request = kv_cache_config.max_num_blocks(max_model_len, step_tokens)
    return (kv_cache_config.num_blocks - 1) / per_request  # minus the null block
