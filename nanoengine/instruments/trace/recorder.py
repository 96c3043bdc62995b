"""The step recorder: watches the scheduler from outside and writes one StepTrace per step.

Chapters 3 (scheduler) and 4 (KV cache manager). To *see* a scheduling decision
one needs the facts at the moment they are made: which request got how many
tokens, which blocks it received, who was preempted and why, which cached block
was evicted. Rather than sprinkling calls through ``Scheduler.schedule()``,
``TraceRecorder.attach(scheduler)`` taps a few methods of that one scheduler,
its KV cache manager and its block pool (``nanoengine/instruments/method_taps.py``):

* ``Scheduler.add_request``: an arrival;
* ``Scheduler.schedule``: the step's chunks, read off the ``SchedulerOutput``,
  and the KV usage and queue sizes it leaves;
* ``KVCacheManager.allocate_slots``: who asked for blocks, and what they got;
* ``Scheduler._preempt_request``: a preemption (victim, reason, beneficiary);
* ``KVCacheManager.free``: the block table a request gives back;
* ``BlockPool._maybe_evict_cached_block``: a cached block reused (LRU eviction);
* ``Scheduler._free_request``: a request that finished, and how;
* ``Scheduler.update_from_output``: the sampled tokens, hence how many drafts
  each request kept (chapter 9), and the end of the step.

The scheduler's code contains none of this, and an engine without
``trace=True`` has nothing tapped, so tracing off costs nothing at all.
Pure Python, no torch.

vLLM 0.32 counterpart: none as such. vLLM exposes the same facts through its
metrics (``SchedulerStats``, ``PrefixCacheStats`` in ``vllm/v1/metrics/stats.py``),
KV cache events (``BlockStored``, ``BlockRemoved``) and ``EngineCoreEvent``
timestamps on each request; nanoengine records them per step so a learner can
replay a run.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

from nanoengine.instruments.method_taps import tap
from nanoengine.instruments.trace.data import EngineTrace, Preemption, ScheduledChunk, StepTrace
from nanoengine.request import Request, RequestStatus

if TYPE_CHECKING:  # annotations only: the recorder watches these, it does not build them
    from nanoengine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from nanoengine.core.kv_cache_utils import KVCacheBlock
    from nanoengine.core.sched.output import SchedulerOutput
    from nanoengine.core.sched.scheduler import Scheduler
    from nanoengine.engine.core import EngineCore
    from nanoengine.outputs import ModelRunnerOutput

# The recorder of each traced engine core (the instruments' plugin attaches them);
# weak keys, so a core that is gone takes its trace with it.
_RECORDERS: weakref.WeakKeyDictionary[EngineCore, TraceRecorder] = weakref.WeakKeyDictionary()

# Why a running request lost its blocks (``Preemption.reason``).
PREEMPT_OUT_OF_BLOCKS = "out of KV blocks"
PREEMPT_FOR_PRIORITY = "priority"


class TraceRecorder:
    """Records a scheduler's decisions into an ``EngineTrace``, one ``StepTrace`` per step.

    A step runs from ``schedule()`` to the end of ``update_from_output()``.
    Events between two steps (new arrivals, aborts) are filed under the next
    step: that is the first step in which they make a difference.
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.trace = EngineTrace(block_size=block_size, num_blocks=num_blocks)
        self._open = StepTrace(step=0)
        self._clock = 0.0  # perf_counter() at the start of the current phase
        # The last request that asked the KV cache manager for blocks, and the
        # blocks each request got this step (allocate_slots' answers).
        self._asking: Request | None = None
        self._new_block_ids: dict[str, list[int]] = {}

    @classmethod
    def attach(cls, scheduler: Scheduler) -> TraceRecorder:
        """Tap ``scheduler`` (and its KV cache manager and block pool); return the recorder."""
        manager = scheduler.kv_cache_manager
        recorder = cls(scheduler.block_size, manager.block_pool.num_blocks)
        tap(scheduler, "add_request", after=lambda _, request: recorder._open.arrived.append(request.request_id))
        tap(scheduler, "schedule", before=recorder._on_schedule_begin,
            after=lambda output: recorder._on_schedule_done(scheduler, output))
        tap(manager, "allocate_slots", before=recorder._on_allocate, after=recorder._on_allocated)
        tap(scheduler, "_preempt_request", before=recorder._on_preempt)
        tap(manager, "free", before=lambda request: recorder._on_free(manager, request))
        tap(manager.block_pool, "_maybe_evict_cached_block", before=recorder._on_maybe_evict)
        tap(scheduler, "_free_request", after=recorder._on_request_freed)
        tap(scheduler, "update_from_output", before=recorder._on_update_begin, after=recorder._on_step_end)
        return recorder

    # ---- schedule() ------------------------------------------------------------

    def _on_schedule_begin(self) -> None:
        self._clock = time.perf_counter()
        self._new_block_ids = {}

    def _on_allocate(self, request: Request, *args: object, **kwargs: object) -> None:
        self._asking = request

    def _on_allocated(self, new_blocks: KVCacheBlocks | None, request: Request, *args: object, **kwargs: object) -> None:
        if new_blocks is not None:
            self._new_block_ids[request.request_id] = _pool_view(new_blocks.get_block_ids())

    def _on_preempt(self, victim: Request, *args: object) -> None:
        """Name the preemption's cause from the allocation that just failed.

        A preemption always follows an ``allocate_slots`` that returned None;
        the request that asked is the one the blocks are for. A running asker
        ran out of blocks for its next tokens; a waiting one is being admitted
        over a lower-ranked runner, which only the priority policy does.
        """
        beneficiary = self._asking if self._asking is not None else victim
        reason = PREEMPT_OUT_OF_BLOCKS if beneficiary.status == RequestStatus.RUNNING else PREEMPT_FOR_PRIORITY
        self._open.preemptions.append(Preemption(victim.request_id, reason, beneficiary.request_id))

    def _on_free(self, manager: KVCacheManager, request: Request) -> None:
        block_ids = _pool_view(manager.get_block_ids(request.request_id))
        if block_ids:
            self._open.freed_block_ids[request.request_id] = block_ids

    def _on_maybe_evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:  # it held cached contents: they are lost now
            self._open.evicted_block_ids.append(block.block_id)

    def _on_request_freed(self, _: None, request: Request) -> None:
        self._open.finished[request.request_id] = request.status.name

    def _on_schedule_done(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        """Read the step's chunks off the output, and the state it leaves."""
        step = self._open
        step.schedule_s = self._lap()
        new_starts = {data.req_id: data.num_computed_tokens for data in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        cached_starts = dict(zip(cached.req_ids, cached.num_computed_tokens))
        # num_scheduled_tokens keeps booking order: running requests, then admissions.
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            is_new = req_id in new_starts
            start = new_starts[req_id] if is_new else cached_starts[req_id]
            # Drafts to verify (chapter 9) ride along with a decode; without
            # them the chunk is the one token sampled last step.
            num_drafts = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
            step.scheduled.append(
                ScheduledChunk(
                    request_id=req_id,
                    kind=_chunk_kind(request, start, num_tokens - num_drafts, is_new),
                    start=start,
                    num_tokens=num_tokens,
                    num_prompt_tokens=request.num_prompt_tokens,
                    new_block_ids=self._new_block_ids.get(req_id, []),
                    num_cached_tokens=start if is_new else 0,
                    num_draft_tokens=num_drafts,
                )
            )
        manager = scheduler.kv_cache_manager
        step.kv_usage = manager.usage
        step.num_free_blocks = manager.num_free_blocks
        step.num_running, step.num_waiting = scheduler.get_request_counts()
        stats = manager.prefix_cache_stats
        step.prefix_cache_queries, step.prefix_cache_hits = stats.queries, stats.hits
        self._asking = None

    # ---- update_from_output() ----------------------------------------------------

    def _on_update_begin(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> None:
        # From the end of schedule() to here: the forward pass and sampling.
        self._open.execute_s = self._lap()
        if scheduler_output.scheduled_spec_decode_tokens:
            self._count_accepted(scheduler_output, model_runner_output)

    def _count_accepted(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> None:
        """How many drafts each request kept (chapter 9), read off the sampled tokens.

        A request that verified drafts samples the accepted ones plus one token
        of the target's own, hence ``len(sampled) - 1``: the count the
        scheduler rolls back over. One that sampled nothing (ended meanwhile)
        kept none.
        """
        sampled = model_runner_output.by_request()
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            chunk = self._open.chunk_for(req_id)
            if chunk is not None:  # None only if the recorder was attached between schedule and update
                chunk.num_accepted_tokens = min(max(len(sampled.get(req_id, ())) - 1, 0), len(drafts))

    def _on_step_end(self, *args: object) -> None:
        finished_step = self._open
        finished_step.update_s = self._lap()
        self.trace.steps.append(finished_step)
        self._open = StepTrace(step=finished_step.step + 1)
        for listener in self.trace.listeners:
            listener(finished_step)

    def _lap(self) -> float:
        """Seconds since the last lap (or since the step began)."""
        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        return elapsed


def _pool_view(block_ids: tuple[list[int], ...]) -> list[int]:
    """One list per KV cache group flattened, in group order: the trace follows
    the block pool, which every group draws from.
    """
    return [block_id for group in block_ids for block_id in group]


def _chunk_kind(request: Request, start: int, num_new_tokens: int, is_new: bool) -> str:
    """Name what ``num_new_tokens`` tokens from position ``start`` are.

    * "recompute": a preempted request rebuilding KV it had computed before
      (its re-admission always counts, even when the prefix cache left 1 token);
    * "decode": the one token sampled last step (the gap of a running request);
      the caller leaves out the drafts verified with it (chapter 9);
    * "prefill": prompt tokens seen for the first time (maybe one chunk of many).
    """
    is_decode = num_new_tokens == 1 and start + 1 == request.num_tokens and start >= request.num_prompt_tokens
    if request.num_preemptions > 0 and (is_new or not is_decode):
        return "recompute"
    return "decode" if is_decode else "prefill"


def record_steps_of(core: EngineCore) -> TraceRecorder:
    """Attach a recorder to ``core``'s scheduler; ``trace_of(core)`` reads it from then on."""
    recorder = _RECORDERS[core] = TraceRecorder.attach(core.scheduler)
    return recorder


def trace_of(core: EngineCore) -> EngineTrace | None:
    """The step trace of ``core`` (still growing as steps run), or None when nobody records it."""
    recorder = _RECORDERS.get(core)
    return None if recorder is None else recorder.trace
