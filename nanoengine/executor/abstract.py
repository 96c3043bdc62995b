"""Executor: what the engine core calls to reach its workers, however many and wherever they run.

Chapter 5 (engine skeleton) shows it as ``EngineCore.model_executor``; chapter 6
follows its construction calls (``determine_available_memory``,
``initialize_from_config``); chapter 6's tensor-parallelism section is where
there is more than one worker. Every call the engine makes is one
``collective_rpc``: "run this Worker method on every rank". The executors
differ only in how the call travels:

* ``UniProcExecutor`` ("uni"): one Worker in this process, run on a forward thread;
* ``MultiprocExecutor`` ("mp"): one worker process per rank, calls over pipes;
* ``RayDistributedExecutor`` ("ray"): one Ray actor per rank.

Every rank runs the whole step, sampler included, and samples the same tokens
(same logits after the gather, same seeds); the engine reads rank 0's answer.
The KV cache gets the block count the tightest rank allows.

vLLM 0.32 counterpart: ``vllm/v1/executor/abstract.py`` (``Executor``:
``get_class``, ``collective_rpc``, ``execute_model``, ``sample_tokens``,
``determine_available_memory``). vLLM gives the KV cache sizing a list of
per-worker values and reduces it in the engine core; nanoengine reduces it
here, so the engine core sees one worker's worth whatever the rank count.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, overload

from nanoengine.config import EngineConfig
from nanoengine.core.sched.output import GrammarOutput, SchedulerOutput
from nanoengine.distributed.kv_transfer.utils import KVOutputAggregator
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from nanoengine.outputs import DraftTokenIds, ModelRunnerOutput
from nanoengine.utils.deadlines import settle
from nanoengine.worker.worker import MemoryProfile, Worker

# distributed_executor_backend -> (module, class), imported only when chosen: an
# engine with one rank never loads the process or Ray machinery.
EXECUTOR_CLASSES: dict[str, tuple[str, str]] = {
    "uni": ("nanoengine.executor.uniproc_executor", "UniProcExecutor"),
    "mp": ("nanoengine.executor.multiproc_executor", "MultiprocExecutor"),
    "ray": ("nanoengine.executor.ray_executor", "RayDistributedExecutor"),
}
# The rank whose ModelRunnerOutput the engine uses (every rank computes the same one).
OUTPUT_RANK = 0


def _memory_profile_of(worker: Worker) -> MemoryProfile | None:
    """Read a worker's memory profile (module-level, so it can be sent to a worker process)."""
    return worker.memory_profile


class Executor(ABC):
    """The engine core's one handle on its workers."""

    @staticmethod
    def get_class(engine_config: EngineConfig) -> type[Executor]:
        """The executor class ``parallel_config.distributed_executor_backend`` names."""
        backend = engine_config.parallel_config.distributed_executor_backend or "uni"
        if backend not in EXECUTOR_CLASSES:
            raise ValueError(
                f"distributed_executor_backend must be one of {sorted(EXECUTOR_CLASSES)}, got {backend!r}."
            )
        module_name, class_name = EXECUTOR_CLASSES[backend]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if missing.partition(".")[0] == "nanoengine" and missing != module_name:
                raise  # a bug inside nanoengine, not a missing piece: show it as it is
            what = f"{module_name} is not part of this nanoengine" if missing == module_name else (
                f"it needs the {missing!r} package, which is not installed"
            )
            raise ValueError(
                f"distributed_executor_backend={backend!r} is not available: {what}. "
                "Use 'mp' (one process per rank) or 'uni' (one rank)."
            ) from error
        executor_class: type[Executor] = getattr(module, class_name)
        return executor_class

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        self.parallel_config = engine_config.parallel_config
        # The first failure of a rank (death, exception); once set, every call
        # is refused, since the ranks may no longer agree on where they are.
        self._failure: BaseException | None = None
        # Several ranks with a KV connector: every rank's transfers must finish (chapter 10).
        world_size = self.parallel_config.world_size
        self.kv_output_aggregator = (
            KVOutputAggregator(world_size) if world_size > 1 and engine_config.kv_transfer_config else None
        )
        # Starts the worker(s), then init_device and load_model on each.
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None: ...

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"The executor has stopped: {self._failure}") from self._failure

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run ``Worker.<method>(*args, **kwargs)`` on every rank.

        ``method`` may also be a function, run as ``method(worker, *args, **kwargs)``.
        Returns every rank's result, in rank order, or only ``unique_reply_rank``'s;
        with ``non_block`` a Future of that, at once. A rank's exception fails the
        call with its text; ``timeout`` (seconds) bounds a blocking call.
        """

    @abstractmethod
    def shutdown(self) -> None: ...

    # ---- chapter 6: the construction calls -------------------------------------------

    def determine_available_memory(self) -> int:
        """The KV cache bytes every rank can give: the smallest rank's answer.

        All ranks get the same block count (the scheduler hands out one block
        id for all of them), so the rank with the least room decides it.
        """
        return min(self.collective_rpc("determine_available_memory"))

    def get_kv_cache_spec(self) -> FullAttentionSpec | dict[int, KVCacheSpec]:
        """One rank's KV layout (rank 0's: every rank holds the same number of heads)."""
        spec: FullAttentionSpec | dict[int, KVCacheSpec] = self.collective_rpc(
            "get_kv_cache_spec", unique_reply_rank=OUTPUT_RANK
        )
        return spec

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_from_config", args=(kv_cache_config,))

    def compile_or_warm_up_model(self) -> None:
        self.collective_rpc("compile_or_warm_up_model")

    @property
    def memory_profile(self) -> MemoryProfile | None:
        """Rank 0's memory profile (chapter 6's table is per worker)."""
        profile: MemoryProfile | None = self.collective_rpc(_memory_profile_of, unique_reply_rank=OUTPUT_RANK)
        return profile

    # ---- chapter 7: one step ------------------------------------------------------------

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
        """Run the forward pass on every rank; rank 0's output, now or (non_block) as a Future.

        The result is None when sampling was deferred to ``sample_tokens``.
        """
        return self._step_rpc("execute_model", scheduler_output, non_block)  # type: ignore[no-any-return]

    def _step_rpc(self, method: str, arg: object, non_block: bool) -> Any:
        """One step call: rank 0's answer, or with a KV connector on several ranks every rank's, merged.

        Each rank's connector finishes its own slice of a transfer
        (``KVOutputAggregator``, chapter 10); without one, rank 0 speaks for all.
        """
        if self.kv_output_aggregator is None:
            return self.collective_rpc(method, args=(arg,), non_block=non_block, unique_reply_rank=OUTPUT_RANK)
        future: Future[list[ModelRunnerOutput | None]] = self.collective_rpc(method, args=(arg,), non_block=True)
        merged: Future[ModelRunnerOutput | None] = Future()
        aggregate = self.kv_output_aggregator.aggregate

        def merge(done: Future[list[ModelRunnerOutput | None]]) -> None:
            error = done.exception()
            if error is not None:
                settle(merged, error=error)
            else:
                settle(merged, aggregate(done.result()))

        future.add_done_callback(merge)
        return merged if non_block else merged.result()

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
        """Sample from the logits ``execute_model`` kept, on every rank; rank 0's tokens.

        Async scheduling queues it right behind its ``execute_model``: every
        executor runs a rank's calls in the order they were sent, so a step's
        tokens are sampled (and appended to the worker's request copies)
        before the next step's forward pass reads them as inputs.
        """
        return self._step_rpc("sample_tokens", grammar_output, non_block)  # type: ignore[no-any-return]

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts the last ``sample_tokens`` proposed (chapter 9), from rank 0.

        Every rank drafts the same tokens from the same inputs; one answer is enough.
        """
        drafts: DraftTokenIds | None = self.collective_rpc("take_draft_token_ids", unique_reply_rank=OUTPUT_RANK)
        return drafts
