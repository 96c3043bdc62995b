"""The second half of a scheduler step: fold the sampled tokens back in, retire requests.

Chapter 3 (scheduler) and chapter 7 (the engine loop). ``Scheduler.schedule()``
decides what runs; once the model runner has run it, ``update_from_output``
appends each request's sampled token, checks the stop conditions and frees the
requests that ended. It is the only method that produces outputs for the front
end. ``AsyncScheduler`` (async_scheduler.py) overrides
``_update_request_with_output`` to settle its output placeholders.

Kept apart from scheduler.py so that file reads as the scheduling policy alone;
``Scheduler`` inherits this mixin and provides the attributes declared below.

vLLM 0.32 counterpart: ``Scheduler.update_from_output``,
``Scheduler._update_request_with_output`` and ``Scheduler._free_request`` in
``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

from collections import Counter

from nanoengine.core.kv_cache_manager import KVCacheManager
from nanoengine.core.sched.output import ModelRunnerOutput, SchedulerOutput
from nanoengine.core.sched.request_queue import RequestQueue
from nanoengine.core.sched.utils import check_stop, make_engine_core_output
from nanoengine.engine import EngineCoreOutput, EngineCoreOutputs
from nanoengine.request import Request, RequestStatus
from nanoengine.trace.recorder import StepRecorder


class OutputUpdateMixin:
    """``update_from_output`` and the bookkeeping of requests that end."""

    # Set by Scheduler.__init__.
    requests: dict[str, Request]
    waiting: RequestQueue
    running: list[Request]
    finished_req_ids: set[str]
    finished_in_flight: Counter[str]
    finished_recving_kv_req_ids: set[str]
    _pending_outputs: list[EngineCoreOutput]
    kv_cache_manager: KVCacheManager
    recorder: StepRecorder
    max_model_len: int

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Fold sampled tokens into the requests, retire finished ones, report."""
        sampled_by_req = model_runner_output.by_request()
        if model_runner_output.kv_connector_output is not None:  # remote KV loads that completed
            self.finished_recving_kv_req_ids |= model_runner_output.kv_connector_output.finished_recving
        outputs, self._pending_outputs = self._pending_outputs, []
        stopped_running: set[Request] = set()
        stopped_waiting: list[Request] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            if self.finished_in_flight[req_id] and sampled_by_req.get(req_id):
                # Async scheduling: the request ended (stopped by the previous
                # step's token, or aborted) while this step sampled for it. The
                # token is dropped even if a new request has taken the id since.
                self.finished_in_flight[req_id] -= 1
                if not self.finished_in_flight[req_id]:
                    del self.finished_in_flight[req_id]
                continue
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted while a step without a token for it ran
            was_running = request.status == RequestStatus.RUNNING
            # Empty for a partial prefill: its last position sampled nothing.
            new_token_ids, is_stopped = self._update_request_with_output(
                request, sampled_by_req.get(req_id, [])
            )
            if is_stopped:
                if was_running:
                    stopped_running.add(request)
                else:
                    # Only async scheduling stops a waiting request: one preempted
                    # while the step that samples its last token was in flight.
                    stopped_waiting.append(request)
                self._free_request(request)
            if new_token_ids or is_stopped:
                outputs.append(make_engine_core_output(request, new_token_ids))
        if stopped_running:
            self.running = [request for request in self.running if request not in stopped_running]
        if stopped_waiting:
            self.waiting.remove_requests(stopped_waiting)
        return EngineCoreOutputs(outputs=outputs)

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], bool]:
        """Append tokens one by one, stopping at the first stop condition.

        Returns the tokens kept and whether the request stopped. One token per
        step in nanoengine, but a list keeps the door open for speculative
        decoding, where tokens after a stop must be dropped.
        """
        for num_kept, token_id in enumerate(new_token_ids, start=1):
            request.append_output_token_ids(token_id)
            if request.structured_output_request is not None:  # advance the grammar
                request.structured_output_request.accept_tokens([token_id])
            if check_stop(request, self.max_model_len):
                return new_token_ids[:num_kept], True
        return new_token_ids, False

    def _free_request(self, request: Request) -> None:
        """Forget a finished request: blocks back to the pool, worker told.

        Its blocks may go back while a step in flight still writes its KV: that
        is safe, as the forward passes run in order and a block's next owner
        only writes it in a later step, and reads only the slots it wrote.
        """
        if request.num_output_placeholders:
            self.finished_in_flight[request.request_id] += request.num_output_placeholders
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self.recorder.on_request_finished(request)
