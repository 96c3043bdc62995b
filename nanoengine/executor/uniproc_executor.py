"""UniProcExecutor: the engine core's ``model_executor`` for one rank, driving one in-process worker.

Chapter 5 (engine skeleton) places it under ``EngineCore.model_executor``; chapter 7
explains ``execute_model(..., non_block=True)``: the call returns a Future at once,
the forward pass runs on a helper thread (torch releases the GIL inside its
kernels), and the engine thread meanwhile does CPU work such as building the
grammar bitmask, then waits with ``future.result()``. It is the executor of
``distributed_executor_backend="uni"``, the default for ``tensor_parallel_size=1``
(executor/abstract.py lists the others).
vLLM 0.32 counterpart: ``vllm/v1/executor/uniproc_executor.py`` (``UniProcExecutor``)
with ``collective_rpc``; the multi-rank executors send the same calls to other processes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nanoengine.executor.abstract import Executor
from nanoengine.worker.worker import Worker
from nanoengine.worker.worker_base import run_method


class UniProcExecutor(Executor):
    """Creates the worker and runs its construction steps in chapter-6 order."""

    def _init_executor(self) -> None:
        # One thread is enough: steps are sequential, the thread exists so the
        # engine thread can work while a forward pass runs.
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoengine-forward")
        self.driver_worker = Worker(self.engine_config)
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Run a worker method on the forward thread; its result (a list of one, or
        the result itself for ``unique_reply_rank``), or a Future of it.

        Every torch call of the worker -- construction, profiling, warm-up, the
        steps -- runs on that one thread. On a CPU this matters for speed: an
        OpenMP runtime keeps one pool of threads per calling thread, so torch
        work split across the engine thread and the forward thread would keep
        two pools on the same cores, and each pool's spin-waiting threads would
        steal time from the other's (a decode step measured ~17% slower).
        One thread also keeps the calls in the order they were made, which
        async scheduling relies on. vLLM's ``collective_rpc`` sends the same
        calls to worker processes.
        """
        call_kwargs = kwargs or {}
        if unique_reply_rank is None:
            future = self._forward_thread.submit(
                lambda: [run_method(self.driver_worker, method, args, call_kwargs)]
            )
        else:
            future = self._forward_thread.submit(run_method, self.driver_worker, method, args, call_kwargs)
        return future if non_block else future.result(timeout)

    def shutdown(self) -> None:
        self.collective_rpc("shutdown")  # on the forward thread, after every step sent before it
        self._forward_thread.shutdown(wait=True)
