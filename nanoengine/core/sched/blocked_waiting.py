"""Blocked waiting: the three WAITING_FOR_* states and how requests leave them.

Chapter 5 (engine skeleton). The waiting queue holds requests that could run
now (WAITING, PREEMPTED) and requests that wait for something else first:

* WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR -- its grammar compiles on a thread;
* WAITING_FOR_REMOTE_KVS -- a KV connector loads part of its prompt's KV;
* WAITING_FOR_STREAMING_REQ -- its prompt arrives in pieces and every piece
  received so far is computed.

Each step ``Scheduler._schedule_waiting`` asks ``handle_blocked_waiting_request``
whether a blocked request can be promoted; the state machine is what decides
who can run. The helpers after it put requests *into* those states.
Pure bookkeeping, no torch.

vLLM 0.32 counterpart: ``Scheduler._handle_blocked_waiting_request`` (0.30:
``_try_promote_blocked_waiting_request``) and ``_update_waiting_for_remote_kv``
in ``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

from nanoengine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nanoengine.core.sched.request_queue import RequestQueue
from nanoengine.distributed.kv_transfer.scheduler_side import SharedStorageConnectorScheduler
from nanoengine.request import Request, RequestStatus


# BEGIN EXERCISE 5.2
def handle_blocked_waiting_request(request: Request, finished_recving_kv_req_ids: set[str]) -> bool:
    """Promote ``request`` if what it waits for is ready; True if it may be scheduled now.

    A request that was never blocked (WAITING, PREEMPTED) is schedulable as is.
    A promoted request returns to PREEMPTED if it had been preempted before
    (so it is resumed, not started), else to WAITING. A grammar that failed to
    compile ends the request as FINISHED_ERROR (the caller retires it).
    """
    status = request.status
    if status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        structured = request.structured_output_request
        if structured is None or not structured.is_ready:
            return False
        if structured.compile_error is not None:
            request.finish_message = structured.compile_error
            request.status = RequestStatus.FINISHED_ERROR
            return False
    elif status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        if request.request_id not in finished_recving_kv_req_ids:
            return False
        finished_recving_kv_req_ids.discard(request.request_id)
    elif status == RequestStatus.WAITING_FOR_STREAMING_REQ:
        # More prompt arrived, or the input was closed (which releases the
        # held-back last token).
        if request.num_prefillable_tokens <= request.num_computed_tokens:
            return False
    else:
        return True
    request.status = RequestStatus.PREEMPTED if request.num_preemptions > 0 else RequestStatus.WAITING
    return True


# END EXERCISE 5.2


def waits_for_more_input(request: Request) -> bool:
    """A streamed prompt whose every received token (but the held-back last) is computed."""
    return request.streaming_input_open and request.num_prefillable_tokens <= request.num_computed_tokens


def is_blocked(request: Request, finished_recving_kv_req_ids: set[str]) -> bool:
    """True if the scheduler must skip ``request`` this step (it may have just finished)."""
    if not handle_blocked_waiting_request(request, finished_recving_kv_req_ids):
        return True
    if waits_for_more_input(request):
        request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
        return True
    return False


def park_streaming_requests(running: list[Request], waiting: RequestQueue) -> list[Request]:
    """Move running streams that computed all they have to the waiting queue.

    Called right after scheduling, when ``num_computed_tokens`` already counts
    this step. They keep their blocks (the KV of every piece so far) and wait
    in WAITING_FOR_STREAMING_REQ; the scheduler sends them to the worker again
    as new requests when they resume. Returns the requests still running.
    """
    still_running: list[Request] = []
    for request in running:
        if waits_for_more_input(request):
            request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            waiting.add_request(request)
        else:
            still_running.append(request)
    return still_running


def computed_blocks(kv_cache_manager: KVCacheManager, request: Request) -> tuple[KVCacheBlocks, int]:
    """(prefix-cache hits, tokens computed) for a request about to be admitted.

    A request that already holds KV -- a resumed stream, or a finished remote
    load -- keeps it and looks nothing up.
    """
    if request.num_computed_tokens > 0:
        return KVCacheBlocks(), request.num_computed_tokens
    return kv_cache_manager.get_computed_blocks(request)


def start_remote_kv_load(
    connector: SharedStorageConnectorScheduler,
    kv_cache_manager: KVCacheManager,
    request: Request,
    hit_blocks: KVCacheBlocks,
    num_cached_tokens: int,
) -> bool:
    """If the connector holds more of the prompt, allocate blocks and block the request.

    The worker fills the blocks on a thread; the request waits in
    WAITING_FOR_REMOTE_KVS until ``ModelRunnerOutput`` reports the load done.
    The blocks stay out of the prefix cache until then. False (nothing changed)
    when there is nothing to load or no room for it.
    """
    if request.num_computed_tokens > 0:
        return False
    num_external = connector.get_num_new_matched_tokens(request, num_cached_tokens)
    if num_external == 0:
        return False
    new_blocks = kv_cache_manager.allocate_slots(
        request, num_external, num_cached_tokens, hit_blocks, delay_cache_blocks=True
    )
    if new_blocks is None:
        return False
    block_ids = kv_cache_manager.get_block_ids(request.request_id)
    connector.update_state_after_alloc(request, block_ids, num_cached_tokens, num_external)
    request.num_computed_tokens = num_cached_tokens + num_external
    request.num_external_computed_tokens = num_external
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    return True
