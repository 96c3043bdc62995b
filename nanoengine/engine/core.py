"""EngineCore: the engine loop's body -- schedule, execute, make output.

Chapter 5 (engine skeleton) is about this class: it owns the three members of
the seed note's map (``model_executor``, ``structured_output_manager``,
``scheduler``), and ``step()`` is where the three roles of chapter 1 meet.
Chapter 6 explains ``_initialize_kv_caches``, chapter 7 the loop around ``step``.
vLLM 0.32 counterpart: ``vllm/v1/engine/core.py`` (``EngineCore``, ``step``,
``_initialize_kv_caches``); the busy loop of a server process is
``EngineCoreProc.run_busy_loop`` in the same file (chapter 8).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from nanoengine.config import EngineConfig
from nanoengine.core.kv_cache_sizing import get_kv_cache_config
from nanoengine.core.kv_cache_utils import get_request_block_hasher
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.engine import EngineCoreOutputs, EngineCoreRequest
from nanoengine.executor.uniproc_executor import UniProcExecutor
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.request import Request, RequestStatus
from nanoengine.structured_output import StructuredOutputManager
from nanoengine.utils.component_tree import TreeNode


class EngineCore(TreeNode):
    """Owns the worker(s), the scheduler and the grammars; advances all requests."""

    tree_children = ("model_executor", "structured_output_manager", "scheduler")

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        timings: dict[str, float] = {}
        start = time.perf_counter()
        # init_device and load_model happen inside the executor's constructor.
        self.model_executor = UniProcExecutor(engine_config)
        timings["init_device + load_model"] = time.perf_counter() - start
        self.kv_cache_config = self._initialize_kv_caches(timings)
        self.structured_output_manager = StructuredOutputManager(engine_config)
        # The scheduler gets the block count decided above; its KV cache manager
        # will hand out exactly those blocks (chapter 4).
        self.scheduler = Scheduler(
            engine_config.scheduler_config, engine_config.cache_config, self.kv_cache_config
        )
        cache_config = engine_config.cache_config
        self.block_hasher = (
            get_request_block_hasher(cache_config.block_size) if cache_config.enable_prefix_caching else None
        )
        # Seconds per construction step, shown by chapters 1, 5 and 6.
        self.startup_timings = timings

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
        )
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        start = time.perf_counter()
        self.model_executor.initialize_from_config(kv_cache_config)
        timings["initialize_from_config"] = time.perf_counter() - start
        return kv_cache_config

    def tree_label_extra(self) -> str | None:
        running, waiting = self.scheduler.get_request_counts()
        return f"running={running} waiting={waiting}"

    # ---- requests in and out -----------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Wrap the validated request in the engine's Request and queue it."""
        self.scheduler.add_request(Request.from_engine_core_request(request, self.block_hasher))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests early (the user aborted, or a stop string was found)."""
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    # ---- the loop body (chapter 7) -------------------------------------------

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """Schedule, execute, and make output.

        Returns the outputs and whether the model ran (False when there was
        nothing to schedule, e.g. every waiting request is blocked).
        """
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(), False
        scheduler_output = self.scheduler.schedule()
        # The forward pass starts on the forward thread and this call returns at
        # once, so the grammar bitmask below is built while the model runs.
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        grammar_output = self.structured_output_manager.grammar_bitmask(scheduler_output)
        model_output = future.result()
        if model_output is None:
            # Sampling was deferred until the bitmask was ready.
            model_output = self.model_executor.sample_tokens(grammar_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def shutdown(self) -> None:
        self.model_executor.shutdown()
