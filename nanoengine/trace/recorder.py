"""The step recorder: the hooks the scheduler and KV cache manager call.

Chapters 3 (scheduler) and 4 (KV cache manager). To *see* a scheduling decision
one needs the facts at the moment they are made: which request got how many
tokens, which blocks it received, who was preempted and why. Rather than
sprinkling prints through ``Scheduler.schedule()``, the scheduler and the KV
cache manager call a handful of ``on_*`` hooks on a recorder object:

* ``StepRecorder`` (this module's base class) does nothing in every hook. It is
  what an engine gets when tracing is off, so the hot path pays one empty
  method call per event and never builds an argument it would not need (hooks
  receive objects the caller already holds and read what they want themselves).
* ``TraceRecorder`` turns the same calls into ``StepTrace`` records
  (see ``nanoengine/trace/data.py``) collected in an ``EngineTrace``.

``EngineCore`` owns the recorder and brackets each step with
``on_step_begin`` / ``on_schedule_done`` / ``on_execute_done`` / ``on_step_end``,
which also time the three phases. Pure Python, no torch: ``nanoengine/core``
may import it.

vLLM 0.32 counterpart: none as such. vLLM exposes the same facts through its
metrics (``SchedulerStats``, ``PrefixCacheStats`` in ``vllm/v1/metrics/stats.py``)
and through ``EngineCoreEvent`` timestamps on each request; nanoengine records
them per step so a learner can replay a run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nanoengine.request import Request
from nanoengine.trace.data import EngineTrace, Preemption, ScheduledChunk, StepTrace

if TYPE_CHECKING:  # only for annotations: these modules import this one
    from nanoengine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from nanoengine.core.kv_cache_utils import KVCacheBlock
    from nanoengine.core.sched.scheduler import Scheduler

# Why a running request lost its blocks (``Preemption.reason``).
PREEMPT_OUT_OF_BLOCKS = "out of KV blocks"
PREEMPT_FOR_PRIORITY = "priority"


class StepRecorder:
    """The no-op recorder: every hook is empty (tracing off costs a call, nothing more)."""

    enabled = False

    def on_request_added(self, request: Request) -> None:
        """A request entered the waiting queue."""

    def on_step_begin(self) -> None:
        """``EngineCore.step()`` starts; ``schedule()`` is next."""

    def on_scheduled(
        self, request: Request, num_new_tokens: int, new_blocks: KVCacheBlocks, is_new: bool
    ) -> None:
        """``request`` was booked into this step (before its count advances).

        ``request.num_computed_tokens`` is where this step's tokens start; for
        a newly admitted request it already includes the prefix-cache hit.
        """

    def on_preempted(self, victim: Request, reason: str, for_request: Request) -> None:
        """``victim`` lost its blocks so that ``for_request`` could get some."""

    def on_request_freeing(self, manager: KVCacheManager, request: Request) -> None:
        """``request``'s blocks are about to go back to the pool (finish or preemption)."""

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        """A free block that was still in the prefix cache is reused: its hash is dropped."""

    def on_request_finished(self, request: Request) -> None:
        """``request`` reached a FINISHED_* state (stop, length, abort, ignored)."""

    def on_schedule_done(self, scheduler: Scheduler) -> None:
        """``schedule()`` returned: the step's plan and KV usage are final."""

    def on_execute_done(self) -> None:
        """The forward pass and sampling are done; ``update_from_output`` is next."""

    def on_step_end(self) -> None:
        """``update_from_output`` returned: the step is over."""


NULL_RECORDER = StepRecorder()


class TraceRecorder(StepRecorder):
    """Records every hook into an ``EngineTrace``, one ``StepTrace`` per step.

    Events between two steps (new arrivals, aborts) are filed under the next
    step: that is the first step in which they make a difference.
    """

    enabled = True

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.trace = EngineTrace(block_size=block_size, num_blocks=num_blocks)
        self._open = StepTrace(step=0)
        self._clock = 0.0  # perf_counter() at the start of the current phase

    def on_request_added(self, request: Request) -> None:
        self._open.arrived.append(request.request_id)

    def on_step_begin(self) -> None:
        self._clock = time.perf_counter()

    def on_scheduled(
        self, request: Request, num_new_tokens: int, new_blocks: KVCacheBlocks, is_new: bool
    ) -> None:
        start = request.num_computed_tokens
        self._open.scheduled.append(
            ScheduledChunk(
                request_id=request.request_id,
                kind=_chunk_kind(request, start, num_new_tokens, is_new),
                start=start,
                num_tokens=num_new_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                new_block_ids=new_blocks.get_block_ids(),
                num_cached_tokens=start if is_new else 0,
            )
        )

    def on_preempted(self, victim: Request, reason: str, for_request: Request) -> None:
        # A victim booked earlier in this step is unbooked: drop its chunk too.
        victim_id = victim.request_id
        self._open.scheduled = [chunk for chunk in self._open.scheduled if chunk.request_id != victim_id]
        self._open.preemptions.append(Preemption(victim_id, reason, for_request.request_id))

    def on_request_freeing(self, manager: KVCacheManager, request: Request) -> None:
        block_ids = manager.get_block_ids(request.request_id)
        if block_ids:
            self._open.freed_block_ids[request.request_id] = block_ids

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        self._open.evicted_block_ids.append(block.block_id)

    def on_request_finished(self, request: Request) -> None:
        self._open.finished[request.request_id] = request.status.name

    def on_schedule_done(self, scheduler: Scheduler) -> None:
        step = self._open
        step.schedule_s = self._lap()
        manager = scheduler.kv_cache_manager
        step.kv_usage = manager.usage
        step.num_free_blocks = manager.num_free_blocks
        step.num_running, step.num_waiting = scheduler.get_request_counts()
        stats = manager.prefix_cache_stats
        step.prefix_cache_queries, step.prefix_cache_hits = stats.queries, stats.hits

    def on_execute_done(self) -> None:
        self._open.execute_s = self._lap()

    def on_step_end(self) -> None:
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


def _chunk_kind(request: Request, start: int, num_new_tokens: int, is_new: bool) -> str:
    """Name what ``num_new_tokens`` tokens from position ``start`` are.

    * "recompute": a preempted request rebuilding KV it had computed before
      (its re-admission always counts, even when the prefix cache left 1 token);
    * "decode": the one token sampled last step (the gap of a running request);
    * "prefill": prompt tokens seen for the first time (maybe one chunk of many).
    """
    is_decode = num_new_tokens == 1 and start + 1 == request.num_tokens and start >= request.num_prompt_tokens
    if request.num_preemptions > 0 and (is_new or not is_decode):
        return "recompute"
    return "decode" if is_decode else "prefill"
