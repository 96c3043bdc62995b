"""EngineCore: the engine loop's body -- schedule, execute, make output.

Chapter 5 (engine skeleton) is about this class: it owns the three members of
the seed note's map (``model_executor``, ``structured_output_manager``,
``scheduler``), and ``step()`` is where the three roles of chapter 1 meet.
Chapter 6 explains ``_initialize_kv_caches``, chapter 7 the loop around ``step``
and its async-scheduling variant ``step_with_batch_queue``.
vLLM 0.32 counterpart: ``vllm/v1/engine/core.py`` (``EngineCore``, ``step``,
``step_with_batch_queue``, ``_initialize_kv_caches``); the busy loop of a server process is
``EngineCoreProc.run_busy_loop`` in the same file (chapter 8).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

from nanoengine.config import EngineConfig
from nanoengine.core.invariants import check_invariants
from nanoengine.core.kv_cache_sizing import get_kv_cache_config
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.async_scheduler import AsyncScheduler
from nanoengine.core.sched.output import ModelRunnerOutput, SchedulerOutput
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.engine import EngineCoreOutputs, EngineCoreRequest
from nanoengine.engine.step_timing import CompletionClock, StepTiming
from nanoengine.executor.uniproc_executor import UniProcExecutor
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.request import Request, RequestStatus
from nanoengine.structured_output import StructuredOutputManager
from nanoengine.trace import NULL_RECORDER, EngineTrace, StepRecorder, TraceRecorder
from nanoengine.utils.component_tree import TreeNode
from nanoengine.worker.memory_report import MemoryReport, render_memory_table

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    """One launched step of the batch queue (async scheduling, chapter 7)."""

    scheduler_output: SchedulerOutput
    executed: Future[ModelRunnerOutput | None]  # execute_model
    sampled: Future[ModelRunnerOutput]  # sample_tokens, queued right behind it

    def result(self) -> ModelRunnerOutput:
        """Block until the step's tokens are sampled.

        A step that ran no tokens answers from ``execute_model`` already (and
        its ``sample_tokens`` has nothing to sample).
        """
        output = self.executed.result()
        return output if output is not None else self.sampled.result()


class EngineCore(TreeNode):
    """Owns the worker(s), the scheduler and the grammars; advances all requests."""

    tree_children = ("model_executor", "structured_output_manager", "scheduler")

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        # Chapter 6's breakdown (weights, activations, KV cache, concurrency).
        self.memory_report: MemoryReport | None = None
        timings: dict[str, float] = {}
        start = time.perf_counter()
        # init_device and load_model happen inside the executor's constructor.
        self.model_executor = UniProcExecutor(engine_config)
        timings["init_device + load_model"] = time.perf_counter() - start
        self.kv_cache_config = self._initialize_kv_caches(timings)
        self.structured_output_manager = StructuredOutputManager(engine_config)
        # The scheduler gets the block count decided above; its KV cache manager
        # will hand out exactly those blocks (chapter 4).
        observability = engine_config.observability_config
        # Chapters 3-4: every scheduling decision is reported to this recorder;
        # with tracing off it is the no-op one and costs an empty call.
        self.recorder: StepRecorder = (
            TraceRecorder(self.kv_cache_config.block_size, self.kv_cache_config.num_blocks)
            if observability.trace
            else NULL_RECORDER
        )
        self.check_invariants = observability.check_invariants
        async_scheduling = engine_config.scheduler_config.async_scheduling
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            engine_config.scheduler_config, engine_config.cache_config, self.kv_cache_config, self.recorder,
            kv_transfer_config=engine_config.kv_transfer_config,
        )
        # Async scheduling keeps up to two steps in flight: the one whose
        # tokens the scheduler waits for, and the next one, already launched.
        self.batch_queue_size = 2 if async_scheduling else 1
        self.batch_queue: deque[InFlightStep] = deque()
        # What one turn of the engine loop runs (vLLM's ``step_fn``).
        self.step_fn: Callable[[], tuple[EngineCoreOutputs, bool]] = (
            self.step_with_batch_queue if async_scheduling else self.step
        )
        cache_config = engine_config.cache_config
        self.block_hasher = (
            get_request_block_hasher(cache_config.block_size) if cache_config.enable_prefix_caching else None
        )
        # Seconds per construction step, shown by chapters 1, 5 and 6.
        self.startup_timings = timings
        # Where the last step's time went (chapter 5's overlap of CPU work and
        # forward); step() only, as async steps overlap each other.
        self.last_step_timing: StepTiming | None = None

    def _initialize_kv_caches(self, timings: dict[str, float]) -> KVCacheConfig:
        """determine_available_memory -> block count -> initialize_from_config."""
        config = self.engine_config
        start = time.perf_counter()
        available = self.model_executor.determine_available_memory()
        timings["determine_available_memory"] = time.perf_counter() - start
        kv_cache_config = get_kv_cache_config(
            self.model_executor.get_kv_cache_spec(),
            available,
            config.model_config.max_model_len,
            config.cache_config.num_gpu_blocks_override,
            budget_note=profile.describe() if (profile := self.model_executor.memory_profile) else "",
        )
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        start = time.perf_counter()
        self.model_executor.initialize_from_config(kv_cache_config)
        timings["initialize_from_config"] = time.perf_counter() - start
        start = time.perf_counter()
        # CUDA graphs are recorded now: they read the KV cache just bound.
        self.model_executor.compile_or_warm_up_model()
        timings["compile_or_warm_up_model"] = time.perf_counter() - start
        profile = self.model_executor.memory_profile
        if profile is not None:
            self.memory_report = MemoryReport(profile, kv_cache_config, config.model_config.max_model_len)
            if logger.isEnabledFor(logging.INFO):
                logger.info("\n%s", render_memory_table(self.memory_report))
        return kv_cache_config

    @property
    def trace(self) -> EngineTrace | None:
        """The step trace (chapters 3-4), or None when tracing is off."""
        return self.recorder.trace if isinstance(self.recorder, TraceRecorder) else None

    def tree_label_extra(self) -> str | None:
        running, waiting = self.scheduler.get_request_counts()
        return f"running={running} waiting={waiting}"

    # ---- requests in and out -----------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Wrap the validated request in the engine's Request and queue it.

        A grammar-constrained request starts compiling now, off this thread;
        it waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR meanwhile (chapter 5).
        """
        core_request = Request.from_engine_core_request(request, self.block_hasher)
        if core_request.sampling_params.structured_outputs is not None:
            self.structured_output_manager.grammar_init(core_request)
        self.scheduler.add_request(core_request)

    def append_prompt(self, request_id: str, token_ids: list[int], final: bool) -> None:
        """Streaming input: the next piece of a request's prompt (chapter 5).

        The scheduler picks the new tokens up at its next step; ``final``
        closes the input, after which the request decodes.
        """
        request = self.scheduler.requests.get(request_id)
        if request is None or not request.streaming_input_open:
            raise ValueError(f"Request {request_id!r} is not a live request with open streaming input.")
        request.append_prompt_token_ids(token_ids)
        request.streaming_input_open = not final

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests early (the user aborted, or a stop string was found)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
        if self.check_invariants:
            check_invariants(self.scheduler)

    # ---- the loop body (chapter 7) -------------------------------------------

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """Schedule, execute, and make output.

        Returns the outputs and whether the model ran (False when there was
        nothing to schedule, e.g. every waiting request is blocked).
        """
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(), False
        self.recorder.on_step_begin()
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.recorder.on_schedule_done(self.scheduler)
        launched = time.perf_counter()
        # The forward pass starts on the forward thread and this call returns at
        # once, so the grammar bitmask below is built while the model runs.
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        forward_clock = CompletionClock(future)
        grammar_output = self.structured_output_manager.grammar_bitmask(scheduler_output)
        bitmask_end = time.perf_counter()
        model_output = future.result()
        result_end = time.perf_counter()
        if model_output is None:
            # Sampling was deferred until the bitmask was ready.
            model_output = self.model_executor.sample_tokens(grammar_output)
        self.recorder.on_execute_done()
        sampled = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.recorder.on_step_end()
        self.last_step_timing = StepTiming.from_marks(
            scheduler_output.total_num_scheduled_tokens,
            start, launched, forward_clock.end(result_end), bitmask_end, result_end, sampled, time.perf_counter()
        )
        if self.check_invariants:
            check_invariants(self.scheduler)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs, bool]:
        """Async scheduling: launch step N+1 before waiting for step N's tokens.

        Each call schedules and launches one step when there is anything to
        schedule; while fewer than ``batch_queue_size`` steps are in flight it
        returns at once, with no outputs, so the scheduler plans the next step
        while this one runs (``AsyncScheduler`` books the tokens being sampled
        as placeholders). Otherwise it waits for the oldest step and folds its
        tokens in. With nothing left to schedule it drains the queue, one step
        per call. Structured output is refused with async scheduling (its
        bitmask needs the previous token), so sampling never waits for one.

        vLLM also takes the oldest step early when it has already finished;
        waiting only for a full queue makes every run interleave the same way.
        Returns the outputs and whether a step that runs the model was launched.
        """
        model_executed = False
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            # Both calls go to the one forward thread, in this order, so each
            # step is sampled before the next step's forward pass starts.
            executed = self.model_executor.execute_model(scheduler_output, non_block=True)
            sampled = self.model_executor.sample_tokens(None, non_block=True)
            self.batch_queue.appendleft(InFlightStep(scheduler_output, executed, sampled))
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            if model_executed and len(self.batch_queue) < self.batch_queue_size:
                return EngineCoreOutputs(), True
        elif not self.batch_queue:
            return EngineCoreOutputs(), False
        oldest = self.batch_queue.pop()
        outputs = self.scheduler.update_from_output(oldest.scheduler_output, oldest.result())
        if self.check_invariants:
            check_invariants(self.scheduler)
        return outputs, model_executed

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        self.structured_output_manager.shutdown()
