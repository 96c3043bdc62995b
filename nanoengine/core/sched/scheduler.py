"""Scheduler: each step, decide which requests run and how many tokens each.

Chapter 3 (scheduler). vLLM V1 has no separate "prefill phase" and "decode
phase": every request simply has ``num_tokens`` known tokens of which
``num_computed_tokens`` already have KV, and each step the scheduler hands out
a budget of ``max_num_batched_tokens`` to close those gaps. A decode closes a gap
of 1, a prefill a gap of the prompt length, cut into chunks when the budget is
short (chunked prefill); both kinds mix freely in one step.

One step is ``schedule()`` -> model runner -> ``update_from_output()``:

1. RUNNING requests first, in admission order: each gets its gap, capped by the
   remaining budget. When the KV cache has no block for one, the lowest-priority
   running request is preempted (its blocks freed; it will be recomputed).
2. Then WAITING requests in queue order, as long as budget, ``max_num_seqs`` and
   free blocks last; the prefix cache is consulted before allocating. Requests
   blocked on something else (chapter 5's three WAITING_FOR_* states) keep their
   place; ``_handle_blocked_waiting_request`` decides when they may go.
3. ``update_from_output`` appends the sampled tokens and retires finished
   requests: the only method that produces outputs for the front end.

Policies, as in vLLM: ``fcfs`` (arrival order; the newest runner is the victim)
and ``priority`` (lower ``Request.priority`` first, ties by arrival; the lowest
ranked is the victim, and a waiting request may preempt a runner ranked below it).
``AsyncScheduler`` (async_scheduler.py, chapter 7) is this scheduler made safe
to call again before step 3 of the previous step has happened.

The KV cache manager is a member created here, as in vLLM: whether a request
can run is decided by ``allocate_slots``, so memory is a direct input of every
scheduling decision.

vLLM 0.32 counterpart: ``vllm/v1/core/sched/scheduler.py`` (``Scheduler``), one
class in one file of about 3,400 lines. Its methods are here under the same
names: ``add_request``, ``finish_requests``, ``schedule``, ``_preempt_request``,
``_update_after_schedule``, ``_handle_blocked_waiting_request``,
``update_from_output``, ``_update_request_with_output``, ``_free_request``,
``has_requests``, ``make_stats``. Three small pieces live next door:

* ``schedule()``'s local variables (``token_budget``, ``num_scheduled_tokens``,
  ``req_to_new_blocks``, ``preempted_reqs``) are the ``StepPlan`` of step_plan.py;
* the choice of a preemption victim, inline in vLLM's ``schedule()``, is
  ``select_preemption_victim`` in utils.py, beside ``check_stop`` (which vLLM
  also keeps in ``sched/utils.py``);
* the waiting queue is request_queue.py, as in vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from nanoengine.config import CacheConfig, KVTransferConfig, SchedulerConfig, SpeculativeConfig
from nanoengine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nanoengine.core.sched.output import GrammarOutput, SchedulerOutput
from nanoengine.core.sched.request_queue import SchedulingPolicy, create_request_queue
from nanoengine.core.sched.step_plan import StepPlan
from nanoengine.core.sched.utils import (
    check_stop,
    make_engine_core_output,
    select_preemption_victim,
    select_victim_for_admission,
    validate_scheduler_configs,
    why_never_fits,
)
from nanoengine.distributed.kv_transfer.base import KVTransferStats
from nanoengine.distributed.kv_transfer.factory import create_connector_scheduler
from nanoengine.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from nanoengine.exceptions import KV_LOAD_FAILED
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.metrics.stats import SchedulerStats
from nanoengine.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from nanoengine.request import Request, RequestStatus
from nanoengine.spec_decode.metrics import RequestSpecDecodeMetrics, SpecDecodingStats

if TYPE_CHECKING:  # the manager imports torch; the scheduler only calls it
    from nanoengine.structured_output import StructuredOutputManager


class Scheduler:
    """vLLM V1's scheduler: one token budget, running requests first."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        kv_transfer_config: KVTransferConfig | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        validate_scheduler_configs(scheduler_config, cache_config, kv_cache_config)
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_config = kv_cache_config
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.policy = SchedulingPolicy(scheduler_config.policy)
        self.block_size = kv_cache_config.block_size

        # Every live request by id; a request leaves this dict when it finishes.
        self.requests: dict[str, Request] = {}
        # The engine core's grammars (chapter 5); the scheduler asks it for the
        # step's bitmask, as vLLM's does. None: a scheduler on its own, in tests.
        self.structured_output_manager = structured_output_manager
        self.waiting = create_request_queue(self.policy)
        # Admission order, so running[-1] is the newest (the FCFS victim).
        self.running: list[Request] = []
        # Finished since the last schedule(): the worker drops its copy of them.
        self.finished_req_ids: set[str] = set()
        # Async scheduling (chapter 7): request id -> tokens that steps in flight
        # still sample for a request that has already ended; they are dropped.
        self.finished_in_flight: Counter[str] = Counter()
        # Outputs produced inside schedule() (IGNORED requests), delivered by the
        # next update_from_output(), the only method that returns outputs.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0
        # The scheduler half of a KV connector (chapters 5 and 10), and the loads it finished.
        transfer = kv_transfer_config
        self.connector = (
            create_connector_scheduler(transfer, self.block_size, tensor_parallel_size) if transfer else None
        )
        self.kv_load_failure_policy = transfer.kv_load_failure_policy if transfer else "fail"
        self.finished_recving_kv_req_ids: set[str] = set()
        # Chapter 10, on a producer: finished requests whose blocks are held
        # until a decode engine has read them (vLLM's delay_free_blocks). They
        # are no longer in ``requests``; only their blocks live on.
        self.held_for_remote: dict[str, Request] = {}
        self.kv_transfer_stats = KVTransferStats() if transfer else None
        # Speculative decoding (chapter 9): at most num_spec_tokens drafts per
        # request and step; a draft model also needs slots for its own guesses
        # beyond the verified tokens (num_lookahead_tokens, 0 for n-gram).
        spec = speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        self.num_lookahead_tokens = spec.num_lookahead_tokens if spec else 0
        self.spec_decoding_stats = SpecDecodingStats.new(self.num_spec_tokens) if spec else None

        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
        )

    # ---- requests in and out ---------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.held_for_remote:
            raise ValueError(f"Request id {request.request_id!r} is already in the scheduler.")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)
        if self.spec_decoding_stats is not None:
            request.spec_decode_metrics = RequestSpecDecodeMetrics.new(self.num_spec_tokens)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """End requests from outside (aborts); unknown or finished ids are ignored.

        No output is produced here: the caller (EngineCore) reports the abort.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status}.")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        running_to_remove: set[Request] = set()
        waiting_to_remove: list[Request] = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                running_to_remove.add(request)
            else:
                waiting_to_remove.append(request)
            request.status = finished_status
            self._free_request(request)
        # Remove in bulk: one pass over each queue however many ids were given.
        if running_to_remove:
            self.running = [r for r in self.running if r not in running_to_remove]
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)

    # ---- schedule() --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(token_budget=self.max_num_scheduled_tokens)
        self._schedule_running(plan)
        # A step that had to preempt is short of memory: admitting new requests
        # now would only take blocks the survivors need next step.
        if not plan.preempted_reqs:
            self._schedule_waiting(plan)
        scheduler_output = plan.make_scheduler_output(self.kv_cache_manager.get_block_ids, self.finished_req_ids)
        self._update_after_schedule(scheduler_output)
        self._park_streaming_requests()
        if self.connector is not None:
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
                self.requests, scheduler_output.num_scheduled_tokens, self.kv_cache_manager.get_block_ids
            )
        return scheduler_output

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """Tokens of ``request`` to run this step; 0 means "not this step".

        The gap between known and computed tokens is the whole remaining prompt
        for a prefill and 1 for a decode, plus the drafts to verify (chapter 9).
        Chunked prefill cuts it to what is left of the budget; without chunking
        a gap that does not fit waits.
        """
        num_new_tokens = request.num_prefillable_tokens + len(request.spec_token_ids) - num_computed_tokens
        if num_new_tokens > token_budget and not self.enable_chunked_prefill:
            return 0
        return min(num_new_tokens, token_budget)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Give each running request its next tokens, preempting if blocks run out."""
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if num_new_tokens == 0:
                req_index += 1
                continue
            while (
                new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens
                )
            ) is None:
                # No prefix-cache lookup has happened yet this step, so any running
                # request may go: free() drops the hashes of blocks it never filled.
                victim_index = select_preemption_victim(self.running, self.policy)
                victim = self.running.pop(victim_index)
                # The priority policy may pick a request before this one; the
                # list shifted left, and so must our position in it.
                if victim_index < req_index:
                    req_index -= 1
                self._preempt_request(victim, plan)
                if victim is request:
                    break  # nobody left to preempt that ranks below this request
            if new_blocks is None:
                # The request preempted itself and left the list, so
                # running[req_index] is already the next one. (vLLM stops the
                # loop here; for FCFS that is the same, as the victim is last.)
                continue
            plan.add(request, num_new_tokens, new_blocks, is_new=False)
            if request.spec_token_ids:
                self._schedule_spec_tokens(request, num_new_tokens, plan)
            req_index += 1

    def _schedule_spec_tokens(self, request: Request, num_new_tokens: int, plan: StepPlan) -> None:
        """Book the drafts that fit in the request's ``num_new_tokens`` (chapter 9).

        Whatever the budget left after the last known token is drafts; the
        rest of the drafts are dropped. Either way the request's drafts are
        used up: the proposer makes new ones after this step.
        """
        num_scheduled_spec_tokens = num_new_tokens + request.num_computed_tokens - request.num_tokens
        if num_scheduled_spec_tokens > 0:
            plan.scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_scheduled_spec_tokens]
        request.spec_token_ids = []

    def _preempt_request(self, request: Request, plan: StepPlan) -> None:
        """Preempt by recompute: drop the KV, requeue the request at the front.

        Its computed blocks keep their hashes while free, so when it resumes the
        prefix cache usually returns most of them and little is recomputed.
        A victim already booked into this step is unbooked (its tokens refunded).
        """
        if request.request_id in plan.num_scheduled_tokens:
            plan.undo(request)
        plan.preempted_reqs.append(request)
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # guesses about a step that will not come
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in queue order while budget, seats and blocks last."""
        skipped: list[Request] = []
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_running_reqs:
            request = self.waiting.peek_request()
            if request in plan.preempted_reqs:
                break  # everything from here on ranks below a request we just evicted
            if not self._handle_blocked_waiting_request(request):
                self.waiting.pop_request()
                if request.status == RequestStatus.FINISHED_ERROR:  # its grammar failed to compile
                    self._end_unscheduled(request, request.finish_message or "", request.status)
                else:
                    skipped.append(request)  # still blocked: keep its place for a later step
                continue
            if _waits_for_more_input(request):
                # A stream whose every received token is computed: park it.
                request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
                skipped.append(self.waiting.pop_request())
                continue
            message = why_never_fits(request, self.max_model_len, self.max_num_scheduled_tokens, self.kv_cache_manager)
            if message is not None:
                self.waiting.pop_request()
                self._end_unscheduled(request, message, RequestStatus.FINISHED_IGNORED)
                continue

            # Prefix-cache hits, unless the request already holds KV (a resumed
            # stream, or a finished remote load): it keeps that and looks nothing up.
            if request.num_computed_tokens == 0:
                hit_blocks, num_new_local_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
            else:
                hit_blocks, num_new_local_computed_tokens = self.kv_cache_manager.empty_kv_cache_blocks, 0
            num_computed_tokens = request.num_computed_tokens + num_new_local_computed_tokens
            if self.connector is not None and self._start_remote_kv_load(request, hit_blocks, num_computed_tokens):
                skipped.append(self.waiting.pop_request())  # now WAITING_FOR_REMOTE_KVS
                continue
            num_new_tokens = self._num_new_tokens(request, num_computed_tokens, plan.token_budget)
            if num_new_tokens == 0:
                break  # prompt does not fit and chunking is off: wait, in order
            new_blocks = self._allocate_for_admission(
                request, num_new_tokens, num_new_local_computed_tokens, hit_blocks, plan
            )
            if new_blocks is None:
                break  # out of blocks: wait for running requests to free some

            self.waiting.pop_request()
            self.running.append(request)
            plan.add(request, num_new_tokens, new_blocks, is_new=True)
            request.status = RequestStatus.RUNNING
            request.record_event(EngineCoreEventType.SCHEDULED)
            request.num_computed_tokens = num_computed_tokens
            if request.num_cached_tokens < 0:  # first schedule, not a resume
                request.num_cached_tokens = num_computed_tokens
        self.waiting.prepend_requests(skipped)

    def _allocate_for_admission(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_local_computed_tokens: int,
        hit_blocks: KVCacheBlocks,
        plan: StepPlan,
    ) -> KVCacheBlocks | None:
        """Blocks for a waiting request; under priority, taken from lower-priority runners.

        FCFS never preempts for a newcomer; the priority policy preempts running
        requests that rank strictly below ``request`` until the blocks fit (see
        ``select_victim_for_admission``). Never a victim: a request admitted
        earlier in this step, or one that hashed blocks this step has yet to fill
        -- ``hit_blocks`` (looked up before any preemption) may include them, and
        preempting their owner would leave them unwritten.
        """
        manager = self.kv_cache_manager
        while (
            new_blocks := manager.allocate_slots(
                request,
                num_new_tokens,
                num_new_local_computed_tokens,
                hit_blocks,
                num_lookahead_tokens=self.num_lookahead_tokens,
            )
        ) is None:
            preemptable = [
                r for r in self.running if r not in plan.new_reqs and not manager.has_uncomputed_cached_blocks(r)
            ]
            victim_index = select_victim_for_admission(preemptable, request, self.policy)
            if victim_index is None:
                return None
            victim = preemptable[victim_index]
            self.running.remove(victim)
            self._preempt_request(victim, plan)
        return new_blocks

    def _end_unscheduled(self, request: Request, message: str, status: RequestStatus) -> None:
        request.status = status  # IGNORED (can never fit) or ERROR (bad grammar)
        request.finish_message = message
        self._free_request(request)
        self._pending_outputs.append(make_engine_core_output(request, []))

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Count this step's tokens as computed now, before the model runs.

        Optimistic on purpose: the next ``schedule()`` must start where this
        step ends -- the next prefill chunk after this one, not the same chunk
        again -- and it may be called before this step's results are in (vLLM's
        async scheduling overlaps the next schedule with this step's forward).
        The sampled token of a finished prefill is the one thing that must wait
        for the results; ``update_from_output`` appends it.
        """
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_scheduled
        # This step's output owns the old set; start collecting for the next one.
        self.finished_req_ids = set()

    # ---- blocked waiting (chapter 5) -----------------------------------------

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        """Promote ``request`` if what it waits for is ready; True if it may be scheduled now.

        A request that was never blocked (WAITING, PREEMPTED) is schedulable as is.
        A promoted request returns to PREEMPTED if it had been preempted before
        (so it is resumed, not started), else to WAITING. A grammar that failed to
        compile ends the request as FINISHED_ERROR (the caller retires it).
        A finished remote KV load is read from ``self.finished_recving_kv_req_ids``
        and removed from it.
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
            if request.request_id not in self.finished_recving_kv_req_ids:
                return False
            self.finished_recving_kv_req_ids.discard(request.request_id)
        elif status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            # More prompt arrived, or the input was closed (which releases the
            # held-back last token).
            if request.num_prefillable_tokens <= request.num_computed_tokens:
                return False
        else:
            return True
        request.status = RequestStatus.PREEMPTED if request.num_preemptions > 0 else RequestStatus.WAITING
        return True

    def _park_streaming_requests(self) -> None:
        """Move running streams that computed all they have to the waiting queue.

        Called right after scheduling, when ``num_computed_tokens`` already counts
        this step. They keep their blocks (the KV of every piece so far) and wait
        in WAITING_FOR_STREAMING_REQ; the scheduler sends them to the worker again
        as new requests when they resume.
        """
        still_running: list[Request] = []
        for request in self.running:
            if _waits_for_more_input(request):
                request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
                self.waiting.add_request(request)
            else:
                still_running.append(request)
        self.running = still_running

    def _start_remote_kv_load(self, request: Request, hit_blocks: KVCacheBlocks, num_computed_tokens: int) -> bool:
        """If the connector holds more of the prompt, allocate blocks and block the request.

        The worker fills the blocks on a thread; the request waits in
        WAITING_FOR_REMOTE_KVS until ``ModelRunnerOutput`` reports the load done.
        The blocks stay out of the prefix cache until then. False (nothing changed)
        when there is nothing to load or no room for it. (vLLM does this inline
        in ``schedule()``, around ``connector.get_num_new_matched_tokens``.)
        """
        assert self.connector is not None
        # prompt_logprobs need every prompt position computed here, as with the prefix cache.
        if request.num_computed_tokens > 0 or request.skip_reading_prefix_cache:
            return False
        manager = self.kv_cache_manager
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if num_external == 0:
            # Nothing to load: the connector may still let go of blocks held elsewhere.
            self.connector.update_state_after_alloc(request, (), num_computed_tokens, 0)
            return False
        assert load_async, "nanoengine's connectors load asynchronously (WAITING_FOR_REMOTE_KVS)"
        new_blocks = manager.allocate_slots(
            request, num_external, num_computed_tokens, hit_blocks, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False
        block_ids = manager.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_computed_tokens, num_external)
        request.num_computed_tokens = num_computed_tokens + num_external
        request.num_external_computed_tokens = num_external
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return True

    # ---- the grammar bitmask (chapter 5) ---------------------------------------

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The token masks of the structured requests that sample this step; None if there are none.

        Called after ``schedule()`` advanced ``num_computed_tokens``, so "samples
        this step" is simply "all its known tokens are computed". The rows follow
        the order of ``scheduler_output.num_scheduled_tokens``; the grammar
        manager fills them.
        """
        if self.structured_output_manager is None:
            return None
        structured_output_request_ids = [
            req_id
            for req_id in scheduler_output.num_scheduled_tokens
            if (request := self.requests.get(req_id)) is not None
            and request.structured_output_request is not None
            and request.num_computed_tokens >= request.num_tokens
        ]
        if not structured_output_request_ids:
            return None
        bitmask = self.structured_output_manager.grammar_bitmask(self.requests, structured_output_request_ids)
        return GrammarOutput(structured_output_request_ids=structured_output_request_ids, bitmask=bitmask)

    # ---- update_from_output() (chapters 3 and 7) -------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Fold sampled tokens into the requests, retire finished ones, report."""
        sampled_by_req = model_runner_output.by_request()
        if model_runner_output.kv_connector_output is not None:
            self._update_from_kv_xfer_finished(model_runner_output.kv_connector_output)
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
            generated_token_ids = sampled_by_req.get(req_id, [])
            scheduled_spec_token_ids = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if scheduled_spec_token_ids and generated_token_ids:
                self._roll_back_rejected(request, len(scheduled_spec_token_ids), len(generated_token_ids) - 1)
            new_token_ids, is_stopped = self._update_request_with_output(request, generated_token_ids)
            kv_transfer_params = None
            if is_stopped:
                if was_running:
                    stopped_running.add(request)
                else:
                    # Only async scheduling stops a waiting request: one preempted
                    # while the step that samples its last token was in flight.
                    stopped_waiting.append(request)
                kv_transfer_params = self._free_request(request)
            if new_token_ids or is_stopped:
                outputs.append(
                    make_engine_core_output(
                        request,
                        new_token_ids,
                        model_runner_output.logprobs.get(req_id),
                        model_runner_output.prompt_logprobs_dict.get(req_id),
                        kv_transfer_params,
                    )
                )
        if stopped_running:
            self.running = [request for request in self.running if request not in stopped_running]
        if stopped_waiting:
            self.waiting.remove_requests(stopped_waiting)
        return EngineCoreOutputs(outputs=outputs)

    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput) -> None:
        """Fold in what the connector finished (chapters 5 and 10).

        Loads that completed promote their requests at the next ``schedule()``;
        blocks a decode engine has read (or that nobody came for) are freed
        now; a failed load is handled by ``kv_load_failure_policy``.
        """
        self.finished_recving_kv_req_ids |= kv_connector_output.finished_recving
        for req_id in kv_connector_output.finished_sending:
            held = self.held_for_remote.pop(req_id, None)
            if held is not None:
                self.kv_cache_manager.free(held)
        for req_id, reason in kv_connector_output.failed_recving.items():
            request = self.requests.get(req_id)
            if request is not None:  # else aborted while loading: already freed
                self._handle_failed_kv_load(request, reason)
        if self.kv_transfer_stats is not None and kv_connector_output.kv_connector_stats is not None:
            self.kv_transfer_stats.add(kv_connector_output.kv_connector_stats)

    def _handle_failed_kv_load(self, request: Request, reason: str) -> None:
        """A remote load failed: end the request ("fail") or forget the remote KV and prefill here ("recompute").

        Either way its blocks go back now: the pull is over, so nothing writes
        them any more, and none was cached (``delay_cache_blocks``).
        """
        self.kv_cache_manager.free(request)
        request.num_external_computed_tokens = 0
        if self.kv_load_failure_policy == "recompute":
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED if request.num_preemptions > 0 else RequestStatus.WAITING
            return
        self.waiting.remove_requests([request])
        message = f"{KV_LOAD_FAILED}: {reason}"
        self._end_unscheduled(request, message, RequestStatus.FINISHED_ERROR)

    def _roll_back_rejected(self, request: Request, num_draft_tokens: int, num_accepted: int) -> None:
        """Un-count the rejected drafts (chapter 9).

        ``_update_after_schedule`` counted every draft as computed. The KV the
        rejected ones wrote sits in slots past the request's real tokens: the
        next step overwrites those slots before anything reads them, and no
        block holding them was cached (``allocate_slots`` caches known tokens
        only), so moving the counter back is the whole roll-back.
        """
        num_rejected = num_draft_tokens - num_accepted
        request.num_computed_tokens -= num_rejected
        if self.spec_decoding_stats is not None:
            self.spec_decoding_stats.observe_draft(num_draft_tokens, num_accepted)
        if request.spec_decode_metrics is not None:
            request.spec_decode_metrics.observe(num_draft_tokens, num_accepted)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Take the proposer's drafts, to be scheduled with each request's next step.

        Drafts are dropped for a request that has ended meanwhile, and for one
        with a grammar: its drafts would have to be checked against the grammar
        (vLLM's ``validate_tokens``), which nanoengine does not do, so such a
        request decodes one token per step. A draft is cut so that its last
        token, and the token sampled after it, stay inside ``max_model_len``.
        """
        for req_id, spec_token_ids in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or request.structured_output_request is not None:
                continue
            room = max(self.max_model_len - request.num_tokens - 1, 0)
            request.spec_token_ids = list(spec_token_ids[: min(room, self.num_spec_tokens)])

    def _update_request_with_output(self, request: Request, new_token_ids: list[int]) -> tuple[list[int], bool]:
        """Append tokens one by one, stopping at the first stop condition.

        Returns the tokens kept and whether the request stopped. One token per
        step, or with speculative decoding (chapter 9) the kept drafts and one
        more: tokens after a stop are dropped.
        """
        for num_kept, token_id in enumerate(new_token_ids, start=1):
            request.append_output_token_ids(token_id)
            if request.structured_output_request is not None:  # advance the grammar
                request.structured_output_request.accept_tokens([token_id])
            if check_stop(request, self.max_model_len):
                return new_token_ids[:num_kept], True
        return new_token_ids, False

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Forget a finished request: blocks back to the pool, worker told.

        Its blocks may go back while a step in flight still writes its KV: that
        is safe, as the forward passes run in order and a block's next owner
        only writes it in a later step, and reads only the slots it wrote.
        A KV connector may keep the blocks for a decode engine instead
        (chapter 10); what it returns is the ``kv_transfer_params`` of the
        request's last output.
        """
        if request.num_output_placeholders:
            self.finished_in_flight[request.request_id] += request.num_output_placeholders
        delay_free_blocks, kv_transfer_params = False, None
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            delay_free_blocks, kv_transfer_params = self.connector.request_finished(request, block_ids)
        if delay_free_blocks:
            self.held_for_remote[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return kv_transfer_params

    # ---- queries -----------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """True while a step would do anything.

        That is: run a request, tell the worker about finished ones, deliver
        a pending (IGNORED) output, or wait for a decode engine to read held blocks. EngineCore.step() checks this, not
        ``has_unfinished_requests``, so IGNORED outputs are not stranded.
        """
        return (
            self.has_unfinished_requests()
            or bool(self.finished_req_ids)
            or bool(self._pending_outputs)
            or bool(self.held_for_remote)  # the worker must keep polling who read them
        )

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting)."""
        return len(self.running), len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        prefix_stats = self.kv_cache_manager.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix_stats.queries,
            prefix_cache_hits=prefix_stats.hits,
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=self.spec_decoding_stats,
            kv_transfer_stats=self.kv_transfer_stats,
            num_held_for_remote=len(self.held_for_remote),
        )


def _waits_for_more_input(request: Request) -> bool:
    """A streamed prompt whose every received token (but the held-back last) is computed."""
    return request.streaming_input_open and request.num_prefillable_tokens <= request.num_computed_tokens
