"""EngineCore: the engine loop's body -- schedule, execute, make output.

Chapter 5 (engine skeleton) is about this class: it owns the three members of
the study notes' map (``model_executor``, ``structured_output_manager``,
``scheduler``), and ``step()`` is where the three roles of chapter 1 meet.
Chapter 6 explains ``_initialize_kv_caches``, chapter 7 the loop around ``step``
and its async-scheduling variant ``step_with_batch_queue``.
vLLM 0.32 counterpart: ``vllm/v1/engine/core.py`` (``EngineCore``, ``step``,
``step_with_batch_queue``, ``_initialize_kv_caches``); the busy loop of a server process is
``EngineCoreProc.run_busy_loop`` in the same file (chapter 8).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from nanoengine.config import EngineConfig
from nanoengine.core.kv_cache_groups import group_kv_cache_layers
from nanoengine.core.kv_cache_sizing import get_kv_cache_config, max_concurrency, token_capacity
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.async_scheduler import AsyncScheduler
from nanoengine.core.sched.output import SchedulerOutput
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.engine import EngineCoreOutputs, EngineCoreRequest
from nanoengine.executor.abstract import Executor
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from nanoengine.outputs import ModelRunnerOutput
from nanoengine.plugins import load_engine_core_plugins
from nanoengine.request import Request, RequestStatus
from nanoengine.structured_output import StructuredOutputManager
from nanoengine.utils.deadlines import with_injected_delay

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


class EngineCore:
    """Owns the worker(s), the scheduler and the grammars; advances all requests."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        # init_device and load_model happen inside the executor's constructor:
        # in this process for one rank, in one worker process per rank for
        # tensor parallelism (chapter 6); the engine calls both the same way.
        executor_class = Executor.get_class(engine_config)
        self.model_executor = executor_class(engine_config)
        self.kv_cache_config = self._initialize_kv_caches()
        self.structured_output_manager = StructuredOutputManager(engine_config)
        # The scheduler gets the block count decided above; its KV cache manager
        # will hand out exactly those blocks (chapter 4).
        async_scheduling = engine_config.scheduler_config.async_scheduling
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            engine_config.scheduler_config,
            engine_config.cache_config,
            self.kv_cache_config,
            kv_transfer_config=engine_config.kv_transfer_config,
            structured_output_manager=self.structured_output_manager,
            speculative_config=engine_config.speculative_config,
            tensor_parallel_size=engine_config.parallel_config.tensor_parallel_size,
        )
        self.use_spec_decode = engine_config.speculative_config is not None
        # Async scheduling keeps up to two steps in flight: the one whose
        # tokens the scheduler waits for, and the next one, already launched.
        self.batch_queue_size = 2 if async_scheduling else 1
        self.batch_queue: deque[InFlightStep] = deque()
        # What one turn of the engine loop runs (vLLM's ``step_fn``).
        self.step_fn: Callable[[], tuple[EngineCoreOutputs, bool]] = (
            self.step_with_batch_queue if async_scheduling else self.step
        )
        # The tests' slow-machine switch (NANOENGINE_INJECT_DELAY, utils/deadlines.py);
        # without it, step_fn stays the method itself.
        self.step_fn = with_injected_delay(self.step_fn, "step")
        cache_config = engine_config.cache_config
        self.block_hasher = (
            get_request_block_hasher(cache_config.block_size) if cache_config.enable_prefix_caching else None
        )
        # Last, the plugins (nanoengine/plugins/): the instruments of chapters
        # 3-5 attach to this core from there (the step tracer, the invariant
        # checks), so nothing in this class traces, checks or times itself.
        for attach in load_engine_core_plugins().values():
            attach(self)

    def _initialize_kv_caches(self) -> KVCacheConfig:
        """determine_available_memory -> block count -> initialize_from_config."""
        config = self.engine_config
        available = self.model_executor.determine_available_memory()
        spec = self.model_executor.get_kv_cache_spec()
        # A hybrid model reports one spec per layer; grouping them decides the
        # block size and page size every group shares (chapter 4).
        layout = spec if isinstance(spec, FullAttentionSpec) else group_kv_cache_layers(spec)
        kv_cache_config = get_kv_cache_config(
            layout,
            available,
            config.model_config.max_model_len,
            config.cache_config.num_gpu_blocks_override,
            budget_note=profile.describe() if (profile := self.model_executor.memory_profile) else "",
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        )
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        if kv_cache_config.block_size != config.cache_config.block_size:
            # A hybrid model's attention pages must hold a state layer's state:
            # the groups raised the block size (vLLM raises it the same way).
            logger.info(
                "block_size raised from %d to %d tokens so that one attention page holds a state (hybrid model).",
                config.cache_config.block_size,
                kv_cache_config.block_size,
            )
            config.cache_config.block_size = kv_cache_config.block_size
        self.model_executor.initialize_from_config(kv_cache_config)
        # CUDA graphs are recorded now: they read the KV cache just bound.
        self.model_executor.compile_or_warm_up_model()
        self._log_kv_cache_size(kv_cache_config)
        return kv_cache_config

    def _log_kv_cache_size(self, kv_cache_config: KVCacheConfig) -> None:
        """vLLM's start-up lines: where the memory went, what the KV cache holds.

        Chapter 6's table of the same facts is built from outside, on demand
        (``nanoengine/instruments/memory_report.py``).
        """
        profile = self.model_executor.memory_profile
        if profile is not None:
            logger.info("%s", profile.describe())
        max_model_len = self.engine_config.model_config.max_model_len
        logger.info(
            "KV cache size: %d tokens (%d blocks of %d). Maximum concurrency for %d tokens per request: %.2fx",
            token_capacity(kv_cache_config),
            kv_cache_config.num_blocks,
            kv_cache_config.block_size,
            max_model_len,
            max_concurrency(
                kv_cache_config,
                max_model_len,
                max_num_batched_tokens=self.engine_config.scheduler_config.max_num_batched_tokens,
            ),
        )

    def describe(self) -> dict[str, Any]:
        """Plain facts about this core: its process and its KV cache.

        A client in another process (chapter 8) asks for them over the socket.
        """
        return {
            "pid": os.getpid(),
            "num_blocks": self.kv_cache_config.num_blocks,
            "block_size": self.kv_cache_config.block_size,
        }

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

    # ---- the loop body (chapter 7) -------------------------------------------

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """Schedule, execute, and make output.

        Returns the outputs and whether the model ran (False when there was
        nothing to schedule, e.g. every waiting request is blocked). The forward
        pass starts on the forward thread and ``execute_model`` returns a future
        at once, so the grammar bitmask is built while the model runs; sampling
        waits for both. (Chapter 5's step table times these phases from outside,
        with ``StepTimer`` in step_timing.py.)
        """
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(), False
        scheduler_output = self.scheduler.schedule()
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        grammar_output = self.scheduler.get_grammar_bitmask(scheduler_output)
        model_output = future.result()
        if model_output is None:
            # Sampling was deferred until the bitmask was ready.
            model_output = self.model_executor.sample_tokens(grammar_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
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
        return outputs, model_executed

    def post_step(self, model_executed: bool) -> None:
        """After a step: hand the proposer's drafts to the scheduler (chapter 9).

        The worker drafted right after sampling, from the tokens it just
        appended; the scheduler books the drafts into the next step, where the
        target model verifies them. (vLLM skips this under async scheduling,
        where the worker keeps its drafts; nanoengine refuses that combination.)
        """
        if self.use_spec_decode and model_executed:
            draft_token_ids = self.model_executor.take_draft_token_ids()
            if draft_token_ids is not None:
                self.scheduler.update_draft_token_ids(draft_token_ids)

    def shutdown(self) -> None:
        self.model_executor.shutdown()
        self.structured_output_manager.shutdown()
