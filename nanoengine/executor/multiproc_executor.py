"""MultiprocExecutor: one worker process per tensor-parallel rank, driven over pipes.

Chapter 6 (tensor parallelism). ``LLM(..., tensor_parallel_size=N)`` starts N
worker processes. Each hosts a ``WorkerWrapperBase`` for its rank, joins the
ranks' torch.distributed group (gloo on a CPU, NCCL on CUDA) and loads its
slice of every weight. The engine core stays in the parent process, unaware of
ranks: each ``collective_rpc`` is pickled once and written to every worker's
pipe, and every rank answers on its own pipe, in the order it received the
calls. Every rank runs the whole step, sampler included; the future of a step
holds rank 0's ``ModelRunnerOutput`` (the others answer "done" and nothing
else, so their outputs never cross a pipe).

The parent side (``MultiprocExecutor``) and the worker side (``WorkerProc``)
share one protocol: a call is ``(method, args, kwargs, unique_reply_rank)``,
an answer ``(ok, result or error text)``; the first answer of a worker is its
ready message. Messages are pickled: both ends are this same program, and the
dataclasses (SchedulerOutput, KVCacheConfig, ModelRunnerOutput with its numpy
rows) pickle as they are, with no schema to keep in step.

Failures end in an error, never in a wait without end:

* a worker that cannot start sends its traceback, and the executor raises it;
  a start that takes longer than ``_READY_TIMEOUT_S`` raises TimeoutError;
* a worker that dies (killed, crashed) closes its pipe; the reply thread fails
  every pending call, and every later one, naming the rank and exit code;
* a worker method that raises fails its call with the rank's exception text.

After a failure the ranks may disagree (one may wait in a collective for a peer
that gave up), so the executor stops the workers and refuses further calls.
``shutdown()``, the executor's garbage collection and interpreter exit stop
the workers; a worker whose parent dies exits by itself (its stdin, see
utils/system_utils.py).

vLLM 0.32 counterpart: ``vllm/v1/executor/multiproc_executor.py``
(``MultiprocExecutor``, ``WorkerProc``, ``start_worker_monitor``). vLLM broadcasts
through a shared-memory ring buffer and starts workers with ``multiprocessing``.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any, cast

from nanoengine.config import EngineConfig
from nanoengine.executor.abstract import Executor
from nanoengine.utils.deadlines import settle, start_critical_thread
from nanoengine.utils.system_utils import (
    describe_exit_code,
    encode_startup,
    exit_when_parent_dies,
    get_distributed_init_method,
    get_open_port,
    raise_system_exit,
    read_startup,
)
from nanoengine.worker.worker_base import WorkerWrapperBase, method_name

# What a worker process runs (``worker_main`` below), in a fresh interpreter.
_WORKER_MAIN = "from nanoengine.executor.multiproc_executor import worker_main; worker_main()"
# Loading a slice of the weights and profiling it happen before a worker is ready.
_READY_TIMEOUT_S = 600.0
# A worker that ignores SIGTERM this long (stuck in a collective) is killed.
_SHUTDOWN_GRACE_S = 5.0


@dataclass
class WorkerStartup:
    """What the parent writes to a worker's stdin: everything it needs to build its rank."""

    engine_config: EngineConfig
    rank: int
    local_rank: int
    distributed_init_method: str
    rpc_fd: int  # the worker's end of its call/answer pipe (a socket kept open across exec)


class WorkerProcHandle:
    """The parent's view of one worker process: its rank, its process, its pipe."""

    def __init__(self, rank: int, process: subprocess.Popen[bytes], connection: Connection) -> None:
        self.rank = rank
        self.process = process
        self.connection = connection

    @classmethod
    def start(cls, engine_config: EngineConfig, rank: int, distributed_init_method: str) -> WorkerProcHandle:
        parent_end, worker_end = Pipe(duplex=True)
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE, pass_fds=(worker_end.fileno(),)
        )
        # One machine: the rank is also the local rank (its GPU index on CUDA).
        startup = WorkerStartup(engine_config, rank, rank, distributed_init_method, worker_end.fileno())
        worker_end.close()  # the worker holds its own copy now
        assert process.stdin is not None
        process.stdin.write(encode_startup(startup))
        process.stdin.flush()  # and the pipe stays open: closing it is how the worker learns we are gone
        return cls(rank, process, parent_end)

    def exit_status(self) -> str:
        """How the process ended, in words (waits briefly: its pipe closes just before it exits)."""
        try:
            return describe_exit_code(self.process.wait(timeout=2.0))
        except subprocess.TimeoutExpired:
            return "still running"



@dataclass
class _PendingCall:
    """One collective_rpc on its way: the answers in so far, and the future the caller holds."""

    method: str  # for error messages
    future: Future[Any]
    unique_reply_rank: int | None
    results: list[Any]
    unanswered: int


class MultiprocExecutor(Executor):
    """Starts one worker process per rank; broadcasts calls; answers with rank 0's output."""

    def _init_executor(self) -> None:
        # Stops the workers when this object is collected or the interpreter
        # exits; shutdown() runs it early. It holds the processes, not self
        # (which it would keep alive), and exists before the first one starts.
        processes: list[subprocess.Popen[bytes]] = []
        self._finalizer = weakref.finalize(self, _stop_workers, processes)
        # Rank 0 listens at this address; every rank meets there in init_device.
        init_method = get_distributed_init_method("127.0.0.1", get_open_port())
        self.workers: list[WorkerProcHandle] = []
        for rank in range(self.parallel_config.world_size):
            self.workers.append(WorkerProcHandle.start(self.engine_config, rank, init_method))
            processes.append(self.workers[-1].process)
        self._closing = False
        # _send_lock keeps every rank's calls in one order; _pending_lock guards
        # the answer queues, which the reply thread shares. A send never holds
        # _pending_lock: a worker blocked on writing an answer must be read.
        self._send_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._awaiting: list[deque[_PendingCall]] = [deque() for _ in self.workers]
        try:
            self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise
        # All ranks started together: each rank's init_device waits for the
        # others to join the group, so the ready messages come at about once.
        # Critical: if it dies, no answer would ever reach a caller again, so its
        # death fails every pending and later call instead.
        self._reply_thread = start_critical_thread(
            functools.partial(_reply_loop, weakref.ref(self), [w.connection for w in self.workers]),
            "MultiprocExecutorReplies", functools.partial(_reply_thread_died, weakref.ref(self)),
        )

    def _wait_for_ready(self) -> None:
        """Each worker's first answer: ready (after init_device and load_model), or its traceback."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        starting = {worker.connection: worker for worker in self.workers}
        while starting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(worker.rank for worker in starting.values())
                raise TimeoutError(f"Worker rank(s) {ranks} not ready after {_READY_TIMEOUT_S:.0f} s.")
            for connection in wait(list(starting), timeout=remaining):
                worker = starting.pop(cast(Connection, connection))
                try:
                    ok, detail = pickle.loads(worker.connection.recv_bytes())
                except (EOFError, OSError):
                    raise RuntimeError(
                        f"Worker rank {worker.rank} exited while starting ({worker.exit_status()}); "
                        "its error is printed above."
                    ) from None
                if not ok:
                    raise RuntimeError(f"Worker rank {worker.rank} failed while starting:\n{detail}")

    # ---- calls out --------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Send the call to every rank; every rank's result, or ``unique_reply_rank``'s.

        A function as ``method`` must be defined at module level (pickle sends it by name).
        """
        self._raise_if_failed()
        # Pickled once, written N times: the same bytes reach every rank.
        message = pickle.dumps((method, args, kwargs or {}, unique_reply_rank))
        name = method_name(method)
        call = _PendingCall(name, Future(), unique_reply_rank, [None] * len(self.workers), len(self.workers))
        with self._send_lock:
            with self._pending_lock:
                self._raise_if_failed()
                for queue in self._awaiting:
                    queue.append(call)
            for worker in self.workers:
                try:
                    worker.connection.send_bytes(message)
                except OSError:
                    # The worker is gone; its closed pipe makes the reply
                    # thread fail this call, with the rank and exit code.
                    break
        return call.future if non_block else call.future.result(timeout)

    # ---- answers in (the reply thread) ---------------------------------------------------

    def _on_answer(self, rank: int, ok: bool, result: Any) -> None:
        with self._pending_lock:
            call = self._awaiting[rank].popleft()
        if not ok:
            error = RuntimeError(f"Worker rank {rank} raised in {call.method!r}: {result}")
            settle(call.future, error=error)  # popped above, so _fail no longer sees it
            self._fail(error)
            return
        call.results[rank] = result
        call.unanswered -= 1
        if call.unanswered == 0:
            reply = call.results if call.unique_reply_rank is None else call.results[call.unique_reply_rank]
            settle(call.future, result=reply)

    def _on_worker_death(self, rank: int) -> None:
        if self._closing:
            return
        worker = self.workers[rank]
        self._fail(RuntimeError(f"Worker rank {rank} (pid {worker.process.pid}) died: {worker.exit_status()}."))

    def _fail(self, error: BaseException) -> None:
        """Fail every pending call and every later one with ``error``; stop the workers."""
        with self._pending_lock:
            if self._failure is None:
                self._failure = error
            pending = {id(call): call for queue in self._awaiting for call in queue}
            for queue in self._awaiting:
                queue.clear()
        for call in pending.values():
            settle(call.future, error=error)  # a caller may have given one up
        self._finalizer()

    def shutdown(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after a grace period); fail what is pending."""
        if self._closing:
            return
        self._closing = True
        self._fail(RuntimeError("the executor was shut down"))
        reply_thread = getattr(self, "_reply_thread", None)
        if reply_thread is not None:
            # The workers are gone, so their pipes are at end-of-file and the thread ends.
            reply_thread.join(timeout=_SHUTDOWN_GRACE_S)
            if reply_thread.is_alive():
                return  # never close a pipe under a thread that still waits on it
        for worker in self.workers:
            worker.connection.close()


def _reply_thread_died(executor_ref: weakref.ref[MultiprocExecutor], error: BaseException) -> None:
    executor = executor_ref()
    if executor is not None:
        executor._fail(RuntimeError(f"the executor's reply thread died ({type(error).__name__}: {error})"))


def _reply_loop(executor_ref: weakref.ref[MultiprocExecutor], connections: list[Connection]) -> None:
    """The reply thread: route each answer to its call; a closed pipe is a dead worker.

    It holds the executor only while handling an answer, so an executor that
    nobody uses any more can be collected (its finalizer stops the workers,
    their pipes close, and this loop ends).
    """
    while True:
        for connection in wait(connections):
            rank = connections.index(cast(Connection, connection))
            executor = executor_ref()
            if executor is None:
                return
            try:
                ok, result = pickle.loads(connections[rank].recv_bytes())
            except (EOFError, OSError):
                executor._on_worker_death(rank)
                return
            executor._on_answer(rank, ok, result)
            del executor


def _stop_workers(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every worker, SIGKILL the ones still running after the grace period, reap all."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + _SHUTDOWN_GRACE_S
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdin is not None:
            process.stdin.close()


# ---- the worker side ---------------------------------------------------------------------


class WorkerProc:
    """Runs in a worker process: builds the rank's worker, then answers calls until told to stop."""

    def __init__(self, startup: WorkerStartup, connection: Connection) -> None:
        self.rank = startup.rank
        self.connection = connection
        self.wrapper = WorkerWrapperBase(rpc_rank=startup.rank)
        self.wrapper.init_worker(startup.engine_config, startup.local_rank, startup.distributed_init_method)
        # Joins the group, then builds this rank's slice of the model.
        self.wrapper.execute_method("init_device")
        self.wrapper.execute_method("load_model")

    def worker_busy_loop(self) -> None:
        """Take a call, run it, answer; in the order the calls came. Ends at end-of-file."""
        while True:
            try:
                message = self.connection.recv_bytes()
            except EOFError:
                return
            # Pickling both ways is inside the try: a function this process
            # cannot import, or a result pickle cannot carry, fails the call,
            # not the rank.
            try:
                method, args, kwargs, unique_reply_rank = pickle.loads(message)
                result = self.wrapper.execute_method(method, *args, **kwargs)
                # Only the asked rank's result crosses the pipe; the others say "done".
                wanted = unique_reply_rank is None or unique_reply_rank == self.rank
                answer = pickle.dumps((True, result if wanted else None))
            except Exception as error:  # noqa: BLE001 -- the engine gets it, with the traceback
                answer = pickle.dumps((False, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
            self.connection.send_bytes(answer)


def worker_main() -> None:
    """A worker process: ``python -c "from nanoengine.executor.multiproc_executor import worker_main; ..."``.

    Reads its ``WorkerStartup`` from stdin, then keeps stdin open to learn of
    the parent's death. SIGTERM (the parent's shutdown) and the parent's death
    both end it through ``SystemExit``, leaving the process group on the way out.
    """
    stdin = sys.stdin.fileno()
    startup: WorkerStartup = read_startup(stdin)
    signal.signal(signal.SIGTERM, raise_system_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent, which stops us
    exit_when_parent_dies(stdin, f"WorkerParentWatch-{startup.rank}")
    connection = Connection(startup.rpc_fd)
    worker: WorkerProc | None = None
    try:
        try:
            worker = WorkerProc(startup, connection)
        except Exception:
            connection.send_bytes(pickle.dumps((False, traceback.format_exc())))
            raise
        connection.send_bytes(pickle.dumps((True, os.getpid())))
        worker.worker_busy_loop()
    except SystemExit:
        pass
    finally:
        if worker is not None:
            worker.wrapper.shutdown()

