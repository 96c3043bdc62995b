"""Small pure decisions the scheduler delegates: who to preempt, when to stop,
and whether its limits make sense at all.

Chapter 3 (scheduler). Each is a plain function of its arguments, kept apart
from ``Scheduler`` so it can be read, tested and changed on its own.

vLLM 0.32 counterpart: ``vllm/v1/core/sched/utils.py`` (``check_stop``,
``check_sequence_repetition``); the
victim choice is inline in ``Scheduler.schedule()`` there, and the config checks
live in ``vllm/config/scheduler.py``.
"""

from __future__ import annotations

from typing import Any

from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.kv_cache_manager import KVCacheManager
from nanoengine.core.sched.request_queue import SchedulingPolicy
from nanoengine.engine import EngineCoreOutput
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.logprobs import LogprobsLists
from nanoengine.request import Request, RequestStatus


def select_preemption_victim(running: list[Request], policy: SchedulingPolicy) -> int:
    """Index in ``running`` of the request to preempt when KV blocks run out.

    The victim is the request we care least about finishing soon:

    * FCFS: the newest one, i.e. the last in ``running`` (requests are appended
      as they are admitted). The oldest requests, which have waited and computed
      the most, keep their blocks.
    * priority: the one with the largest ``(priority, arrival_time)``: the
      lowest priority (larger value = less important) and, among equals, the
      latest arrival. On a full tie the later position wins, as in FCFS.

    Returning the index (not the request) saves the caller a linear search.
    """
    if not running:
        raise ValueError("Cannot pick a preemption victim: no request is running.")
    if policy is SchedulingPolicy.FCFS:
        return len(running) - 1
    return max(
        range(len(running)),
        key=lambda index: (running[index].priority, running[index].arrival_time, index),
    )


def select_victim_for_admission(running: list[Request], request: Request, policy: SchedulingPolicy) -> int | None:
    """Index in ``running`` of the request to preempt so waiting ``request`` can start.

    Only the priority policy preempts for a newcomer, and only a request that
    ranks strictly below it by ``(priority, arrival_time)``: the lowest-ranked
    running request (``select_preemption_victim``) if it does, else nobody
    (None: ``request`` waits). FCFS always answers None: everyone running
    arrived before ``request``. Preempting an equal would let two requests
    evict each other forever.
    """
    if policy is not SchedulingPolicy.PRIORITY or not running:
        return None
    victim_index = select_preemption_victim(running, policy)
    victim = running[victim_index]
    if (victim.priority, victim.arrival_time) <= (request.priority, request.arrival_time):
        return None
    return victim_index


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` is done after its latest output token.

    Sets ``request.status`` (and ``stop_reason``) when it is. The order matters
    when several conditions hold at once:

    a) a stop token -- EOS (unless ``ignore_eos``) or one of
       ``all_stop_token_ids`` -- ends the request as STOPPED, but only once
       ``min_tokens`` outputs exist; before that it is generated like any token;
    b) reaching ``max_tokens`` outputs, or ``max_model_len`` tokens in total
       (the model has no positions beyond it), ends it as LENGTH_CAPPED;
    c) an output that ends in a loop (``repetition_detection``) ends it as
       REPETITION.

    Checking (a) first means a stop token that happens to be the last allowed
    token reports "stop", which is what the user asked for. (Some vLLM releases
    test the length first.)
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None  # EOS is the natural end, not a user stop
            return True
        if last_token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    max_tokens = request.max_tokens  # None = only max_model_len limits it
    if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
        request.num_tokens >= max_model_len
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    detection = params.repetition_detection
    if detection is not None and ends_in_repetition(
        request.output_token_ids, detection.min_pattern_size, detection.max_pattern_size, detection.min_count
    ):
        request.status = RequestStatus.FINISHED_REPETITION
        return True
    return False


def ends_in_repetition(token_ids: list[int], min_size: int, max_size: int, min_count: int) -> bool:
    """True if ``token_ids`` ends with some pattern of ``min_size``..``max_size``
    tokens repeated ``min_count`` times back to back.

    Called after every token, so only suffixes need checking: a loop that began
    earlier was already caught when its ``min_count``-th copy completed. Cost per
    call is O(max_size * min_count * max_size) comparisons at most.
    """
    for size in range(min_size, max_size + 1):
        span = size * min_count
        if span > len(token_ids):
            break
        tail = token_ids[-span:]
        pattern = tail[-size:]
        if all(tail[start : start + size] == pattern for start in range(0, span, size)):
            return True
    return False


def why_never_fits(
    request: Request, max_model_len: int, max_num_batched_tokens: int, kv_cache_manager: KVCacheManager
) -> str | None:
    """Why ``request`` can never run with these limits, or None if it can."""
    kv_cache_config, num_usable_blocks = kv_cache_manager.kv_cache_config, kv_cache_manager.num_usable_blocks
    if request.num_tokens > max_model_len:
        return f"The prompt has {request.num_tokens} tokens, more than max_model_len={max_model_len}."
    # Every group's table counts: a hybrid model adds a state block per state
    # group; a sliding window's group holds at most a window and one step's tokens.
    num_blocks_needed = kv_cache_config.max_num_blocks(request.num_tokens, max_num_batched_tokens)
    if num_blocks_needed > num_usable_blocks:
        num_states = kv_cache_config.num_state_groups
        states = f", plus {num_states} state block(s), one per state group" if num_states else ""
        return (
            f"The request needs {num_blocks_needed} KV cache blocks for its "
            f"{request.num_tokens} tokens, more than the {num_usable_blocks} blocks "
            f"of the whole KV cache (block_size={kv_cache_config.block_size}{states})."
        )
    return None


def make_engine_core_output(
    request: Request,
    new_token_ids: list[int],
    new_logprobs: LogprobsLists | None = None,
    new_prompt_logprobs: LogprobsLists | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> EngineCoreOutput:
    """What the front end hears about ``request`` after a step.

    ``new_logprobs`` may hold rows for tokens a stop condition dropped; only
    those of ``new_token_ids`` are kept.
    """
    if new_logprobs is not None:
        new_logprobs = new_logprobs.slice(0, len(new_token_ids))
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=request.get_finished_reason(),
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        finish_message=request.finish_message,
        events=request.take_events(),
        num_external_computed_tokens=request.num_external_computed_tokens,
        new_logprobs=new_logprobs,
        new_prompt_logprobs=new_prompt_logprobs,
        kv_transfer_params=kv_transfer_params,
        spec_decode_metrics=request.spec_decode_metrics if request.is_finished() else None,
    )


def validate_scheduler_configs(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, kv_cache_config: KVCacheConfig
) -> None:
    """Reject limits that would make the scheduler stall or disagree with the worker."""
    for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        value = getattr(scheduler_config, name)
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}.")
    if scheduler_config.policy not in {policy.value for policy in SchedulingPolicy}:
        raise ValueError(f"policy must be 'fcfs' or 'priority', got {scheduler_config.policy!r}.")
    # Without chunking a prompt runs in one step, so the largest prompt must fit
    # the budget, or the waiting queue would stall behind it forever.
    if not scheduler_config.enable_chunked_prefill and (
        scheduler_config.max_num_batched_tokens < scheduler_config.max_model_len
    ):
        raise ValueError(
            f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens} must be at least "
            f"max_model_len={scheduler_config.max_model_len} when chunked prefill is disabled."
        )
    if kv_cache_config.block_size != cache_config.block_size:
        raise ValueError(
            f"kv_cache_config.block_size={kv_cache_config.block_size} differs from "
            f"cache_config.block_size={cache_config.block_size}."
        )
