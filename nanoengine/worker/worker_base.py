"""WorkerWrapperBase: one rank's Worker, built where it runs and driven by method name.

Chapter 6 (tensor parallelism). With several ranks the engine cannot hold its
workers as Python objects: each lives in another process (``MultiprocExecutor``)
or, later, in a Ray actor. What crosses to it is a *call*: a method name (or a
function to run on the worker) and its arguments. The wrapper is the object
that sits in that process and turns such a call into a method call on its
Worker. It knows nothing about pipes, sockets or actors, so whichever host
carries the calls reuses it unchanged.

The wrapper exists before its worker: a host first builds the wrapper (it knows
only its rank), then ``init_worker`` builds the Worker from the engine config
that arrived with the first message.

vLLM 0.32 counterpart: ``vllm/v1/worker/worker_base.py`` (``WorkerWrapperBase``:
``init_worker``, ``execute_method``) and ``run_method`` in
``vllm/v1/serial_utils.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nanoengine.config import EngineConfig
from nanoengine.worker.worker import Worker


def run_method(worker: Worker, method: str | Callable[..., Any], args: Sequence[Any],
               kwargs: Mapping[str, Any]) -> Any:
    """Run ``worker.<method>(*args, **kwargs)``, or ``method(worker, *args, **kwargs)`` for a function.

    A function lets a caller run code the Worker has no method for (a test
    reading a value, a walkthrough printing the rank's tree); across processes
    it must be a module-level function, which pickle sends by name.
    """
    if isinstance(method, str):
        return getattr(worker, method)(*args, **kwargs)
    return method(worker, *args, **kwargs)


def method_name(method: str | Callable[..., Any]) -> str:
    """How an error message names a call: the Worker method's name, or the function's."""
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))


class WorkerWrapperBase:
    """Holds one rank's Worker and runs the calls sent to it."""

    def __init__(self, rpc_rank: int = 0) -> None:
        # The rank the executor addresses; with tensor parallelism alone it is
        # also the rank in the TP group.
        self.rpc_rank = rpc_rank
        self.worker: Worker | None = None

    def init_worker(
        self, engine_config: EngineConfig, local_rank: int, distributed_init_method: str | None,
        local_world_size: int | None = None,
    ) -> None:
        """Build the Worker; its device and model come with the first calls (``init_device``, ``load_model``).

        ``local_world_size``: the ranks on this machine (default: all of them).
        """
        self.worker = Worker(engine_config, rank=self.rpc_rank, local_rank=local_rank,
                             distributed_init_method=distributed_init_method, local_world_size=local_world_size)

    def execute_method(self, method: str | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.worker is None:
            raise RuntimeError(f"Rank {self.rpc_rank}: init_worker() must run before {method!r}.")
        return run_method(self.worker, method, args, kwargs)

    def shutdown(self) -> None:
        """Leave the process group, if the worker joined one."""
        if self.worker is not None:
            self.worker.shutdown()
