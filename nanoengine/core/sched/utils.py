"""Small pure decisions the scheduler delegates: who to preempt, when to stop,
and whether its limits make sense at all.

Chapter 3 (scheduler). Each is a plain function of its arguments, kept apart
from ``Scheduler`` so it can be read, tested and changed on its own.

vLLM 0.32 counterpart: ``vllm/v1/core/sched/utils.py`` (``check_stop``); the
victim choice is inline in ``Scheduler.schedule()`` there, and the config checks
live in ``vllm/config/scheduler.py``.
"""

from __future__ import annotations

from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.sched.request_queue import SchedulingPolicy
from nanoengine.kv_cache_interface import KVCacheConfig
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


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether ``request`` is done after its latest output token.

    Sets ``request.status`` (and ``stop_reason``) when it is. The order matters
    when several conditions hold at once:

    a) a stop token -- EOS (unless ``ignore_eos``) or one of
       ``all_stop_token_ids`` -- ends the request as STOPPED, but only once
       ``min_tokens`` outputs exist; before that it is generated like any token;
    b) reaching ``max_tokens`` outputs, or ``max_model_len`` tokens in total
       (the model has no positions beyond it), ends it as LENGTH_CAPPED.

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
    return False


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
