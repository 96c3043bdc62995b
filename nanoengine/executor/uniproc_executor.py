"""UniProcExecutor: the engine core's ``model_executor``, driving one in-process worker.

Chapter 5 (engine skeleton) places it under ``EngineCore.model_executor``; chapter 7
explains ``execute_model(..., non_block=True)``: the call returns a Future at once,
the forward pass runs on a helper thread (torch releases the GIL inside its
kernels), and the engine thread meanwhile does CPU work such as building the
grammar bitmask, then waits with ``future.result()``.
vLLM 0.32 counterpart: ``vllm/v1/executor/uniproc_executor.py`` (``UniProcExecutor``)
with ``collective_rpc``; the multi-GPU executors send the same calls over RPC.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar, overload

from nanoengine.config import EngineConfig
from nanoengine.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from nanoengine.utils.component_tree import TreeNode
from nanoengine.worker.worker import MemoryProfile, Worker

T = TypeVar("T")


class UniProcExecutor(TreeNode):
    """Creates the worker and runs its construction steps in chapter-6 order."""

    tree_children = ("driver_worker",)

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        # One thread is enough: steps are sequential, the thread exists so the
        # engine thread can work while a forward pass runs.
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoengine-forward")
        self.driver_worker = Worker(engine_config)
        self.collective_rpc(self.driver_worker.init_device)
        self.collective_rpc(self.driver_worker.load_model)

    def collective_rpc(self, method: Callable[..., T], *args: Any) -> T:
        """Run a worker method on the forward thread and wait for its result.

        Every torch call of the worker -- construction, profiling, warm-up, the
        steps -- runs on that one thread. On a CPU this matters for speed: an
        OpenMP runtime keeps one pool of threads per calling thread, so torch
        work split across the engine thread and the forward thread would keep
        two pools on the same cores, and each pool's spin-waiting threads would
        steal time from the other's (a decode step measured ~17% slower).
        vLLM's ``collective_rpc`` sends the same calls to worker processes.
        """
        return self._forward_thread.submit(method, *args).result()

    def get_kv_cache_spec(self) -> FullAttentionSpec | dict[int, KVCacheSpec]:
        return self.driver_worker.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        return self.collective_rpc(self.driver_worker.determine_available_memory)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc(self.driver_worker.initialize_from_config, kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        self.collective_rpc(self.driver_worker.compile_or_warm_up_model)

    @property
    def memory_profile(self) -> MemoryProfile | None:
        return self.driver_worker.memory_profile

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[False] = ...
    ) -> ModelRunnerOutput | None: ...

    @overload
    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput | None]: ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future[ModelRunnerOutput | None]:
        """Run the forward pass now, or (non_block) on the forward thread.

        The result is None when sampling was deferred to ``sample_tokens``.
        """
        if not non_block:
            return self.collective_rpc(self.driver_worker.execute_model, scheduler_output)
        return self._forward_thread.submit(self.driver_worker.execute_model, scheduler_output)

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[False] = ...
    ) -> ModelRunnerOutput: ...

    @overload
    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: Literal[True]
    ) -> Future[ModelRunnerOutput]: ...

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Sample from the logits ``execute_model`` kept, now or (non_block) on the forward thread.

        Async scheduling queues it right behind its ``execute_model``: the one
        forward thread runs them in submission order, so a step's tokens are
        sampled (and appended to the worker's request copies) before the next
        step's forward pass reads them as inputs.
        """
        if not non_block:
            return self.collective_rpc(self.driver_worker.sample_tokens, grammar_output)
        return self._forward_thread.submit(self.driver_worker.sample_tokens, grammar_output)

    def shutdown(self) -> None:
        self._forward_thread.shutdown(wait=True)
