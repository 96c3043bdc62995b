"""EngineCoreClient: the adapter between LLMEngine and EngineCore.

Chapter 5 (engine skeleton) explains why this seemingly empty layer exists: in one
process the client calls the core directly; in a server (chapter 8) the core runs
in its own process and the client ships the same messages over a socket -- and
``LLMEngine`` does not change. vLLM 0.32 counterpart:
``vllm/v1/engine/core_client.py`` (``EngineCoreClient``, ``InprocClient``,
``MPClient``, ``SyncMPClient``, ``AsyncMPClient``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import zmq

from nanoengine.config import EngineConfig
from nanoengine.engine import EngineCoreOutputs, EngineCoreRequest, UtilityOutput
from nanoengine.engine.core import EngineCore
from nanoengine.engine.core_proc import ENGINE_CORE_DEAD, EngineCoreRequestType, encode_startup
from nanoengine.engine.exceptions import EngineDeadError
from nanoengine.serial_utils import MsgpackDecoder, MsgpackEncoder
from nanoengine.utils.deadlines import settle, start_critical_thread

logger = logging.getLogger(__name__)


class EngineCoreClient(ABC):
    """The interface every transport implements; LLMEngine sees only this."""

    @staticmethod
    def make_client(
        engine_config: EngineConfig, multiprocess_mode: bool = False, asyncio_mode: bool = False
    ) -> EngineCoreClient:
        """Pick a transport, as vLLM does: asyncio (a server's ``AsyncLLM``) always
        talks to a core process; ``LLM`` does too with ``multiprocess_mode``, and
        otherwise calls the core in its own process.
        """
        if asyncio_mode:
            return AsyncMPClient(engine_config)
        if multiprocess_mode:
            return SyncMPClient(engine_config)
        return InprocClient(engine_config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """Advance the engine and return what it produced."""

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None: ...

    @abstractmethod
    def append_prompt(self, request_id: str, token_ids: list[int], final: bool) -> None:
        """Streaming input: more prompt for a request added with ``streaming_input``."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def get_engine_core(self) -> EngineCore:
        """The live ``EngineCore`` behind this client, for code that inspects it.

        Driving the engine needs only the messages above, which any transport
        can carry; reading the core's state (its scheduler, its KV cache, the
        memory report of chapter 6) needs the object itself, and only a client
        in the same process has it: ``InprocClient``, as in vLLM 0.32. The
        multi-process clients of chapter 8 raise ``RuntimeError`` instead.
        """
        raise RuntimeError(
            f"{type(self).__name__} does not hold the EngineCore: with this client it "
            "lives in another process, so there is no live object to hand out. Only "
            "the in-process client (InprocClient, the default of LLM(...)) can give it."
        )


class InprocClient(EngineCoreClient):
    """In-process: each ``get_output`` is one direct ``EngineCore.step()``
    (``step_with_batch_queue()`` with async scheduling).

    The client, not LLMEngine, holds the EngineCore, so printing the client
    shows the subtree that chapter 5 of the study notes draws below
    ``engine_core``.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_core = EngineCore(engine_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        outputs, model_executed = self.engine_core.step_fn()
        self.engine_core.post_step(model_executed)
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def append_prompt(self, request_id: str, token_ids: list[int], final: bool) -> None:
        self.engine_core.append_prompt(request_id, token_ids, final)

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def get_engine_core(self) -> EngineCore:
        """The ``EngineCore`` this client drives: same process, the object itself."""
        return self.engine_core


# ---- chapter 8: the engine core in another process ---------------------------------

# get_output() waits at most this long for the core, then returns an empty batch,
# so a caller's loop can look at its own state (a streamed prompt, a deadline).
_OUTPUT_WAIT_S = 0.5
# Building the core (weights, profiling, KV cache) happens before it is ready.
_READY_TIMEOUT_S = 900.0
# A core that ignores SIGTERM this long is killed.
_SHUTDOWN_GRACE_S = 5.0
# A utility call the core has not answered in this long gives up (TimeoutError).
# The core answers between two steps; even a long prefill step on a slow CPU
# takes seconds, so this only ends waits on a core that is wedged.
UTILITY_TIMEOUT_S = 120.0
# What the core process runs (see nanoengine/engine/core_proc.py ``main``).
_CORE_MAIN = "from nanoengine.engine.core_proc import main; main()"


class MPClient(EngineCoreClient):
    """Starts an ``EngineCoreProc`` and talks to it over two ZMQ sockets.

    The client binds both sockets (unix-domain ``ipc://`` paths in a private
    temporary directory) and starts the core process, which connects to them:

    * requests go out on a ROUTER socket as ``[core identity, type, msgpack]``;
      the core's first message on it (``READY``, with its pid) is what tells the
      ROUTER where to send;
    * outputs come back on a PULL socket, read by one background thread that
      hands ``EngineCoreOutputs`` to ``outputs_queue`` and the answers of utility
      calls to the futures waiting for them.

    A second thread waits on the process itself: if the core exits while the
    client still wants it (killed, crashed), every waiting call fails with
    ``EngineDeadError`` instead of waiting forever. The output thread is as
    critical: if it dies (a frame it cannot decode, say), the engine is dead
    too. The core, for its part, watches its stdin, a pipe only this process
    writes to, and exits when this process dies.

    A utility call may be given up before its answer comes (a deadline, or a
    web page that closed and cancelled its await): the answer, when it comes,
    finds its future cancelled and is dropped and counted (``num_late_answers``),
    never raised in the output thread that every request depends on.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="nanoengine-ipc-")
        input_address, output_address = f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output"
        self._context = zmq.Context()
        self.input_socket = self._context.socket(zmq.ROUTER)
        self.input_socket.bind(input_address)
        self.output_socket = self._context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        # A fresh interpreter, not a fork (a forked child inherits this process's
        # threads' locks) and not multiprocessing's spawn (it re-imports the
        # user's script). Its stdin brings the configuration, then stays open:
        # end-of-file there is how the core learns that this process is gone.
        self.core_process = subprocess.Popen([sys.executable, "-c", _CORE_MAIN], stdin=subprocess.PIPE)
        assert self.core_process.stdin is not None
        self.core_process.stdin.write(encode_startup(engine_config, input_address, output_address))
        self.core_process.stdin.flush()
        self._closing = False
        self._dead: EngineDeadError | None = None
        self._send_lock = threading.Lock()
        self._encoder = MsgpackEncoder()
        self.outputs_queue: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        # call id -> its caller's future; callers, the output and the monitor thread share it.
        self._utility_lock = threading.Lock()
        self._utility_calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        # Utility answers that came after their caller had given up (dropped).
        self.num_late_answers = 0
        try:
            self._core_identity, ready = self._wait_for_ready()
        except BaseException:
            self.shutdown()
            raise
        self.engine_core = RemoteEngineCore(self, ready["pid"])
        self._output_thread = start_critical_thread(
            self._process_outputs_socket, "CoreClientOutput",
            on_death=lambda error: self._engine_died(f"the client's output thread failed ({type(error).__name__}: "
                                                     f"{error})"))
        threading.Thread(target=self._monitor_core_process, name="CoreClientMonitor", daemon=True).start()

    def _wait_for_ready(self) -> tuple[bytes, dict[str, Any]]:
        """The core's READY message: (its socket identity, what it told us)."""
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if poller.poll(100):
                identity, payload = self.input_socket.recv_multipart()
                ready: dict[str, Any] = MsgpackDecoder().decode(payload)
                return identity, ready
            if self.core_process.poll() is not None:
                raise RuntimeError(
                    f"The engine core process exited while starting (exit code {self.core_process.returncode}); "
                    "its error is printed above."
                )
        raise TimeoutError(f"The engine core process was not ready after {_READY_TIMEOUT_S:.0f} s.")

    # ---- the two background threads ------------------------------------------------

    def _process_outputs_socket(self) -> None:
        decoder: MsgpackDecoder[EngineCoreOutputs] = MsgpackDecoder(EngineCoreOutputs)
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        while not self._closing:
            if not poller.poll(100):
                continue
            frame = self.output_socket.recv()
            if frame == ENGINE_CORE_DEAD:
                self._engine_died("it reported a fatal error (its log is above)")
                return
            outputs = decoder.decode(frame)
            if outputs.utility_output is not None:
                self._resolve_utility(outputs.utility_output)
            else:
                self.outputs_queue.put_nowait(outputs)

    def _monitor_core_process(self) -> None:
        exit_code = self.core_process.wait()
        if not self._closing:
            self._engine_died(f"the process exited with code {exit_code}")

    def _engine_died(self, detail: str) -> None:
        """Fail every waiting call and every later one (the monitor's, the output thread's last act)."""
        with self._utility_lock:
            if self._dead is not None:
                return
            self._dead = EngineDeadError(detail)
            waiting = list(self._utility_calls.values())
            self._utility_calls.clear()
        self.outputs_queue.put_nowait(self._dead)  # wakes a get_output() that is waiting
        for future in waiting:
            settle(future, error=self._dead)  # one its caller cancelled stays cancelled

    def _resolve_utility(self, answer: UtilityOutput) -> None:
        """Hand a utility answer to its caller; an answer nobody waits for any more is dropped."""
        with self._utility_lock:
            future = self._utility_calls.pop(answer.call_id, None)
        error = None if answer.failure_message is None else RuntimeError(answer.failure_message)
        if future is None or not settle(future, answer.result, error):
            self.num_late_answers += 1  # only this thread counts
            logger.debug("Dropped the late answer to utility call %d (its caller gave up).", answer.call_id)

    # ---- requests out --------------------------------------------------------------------

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self._dead is not None:
            raise self._dead
        with self._send_lock:  # a ZMQ socket is used by one thread at a time
            self.input_socket.send_multipart([self._core_identity, request_type.value, self._encoder.encode(payload)])

    def _start_utility(self, method: str, *args: Any) -> Future[Any]:
        """Ask the core to run ``method(*args)``; the future holds its result. Registered
        before it is sent (the answer may come first); a send that fails leaves nothing behind."""
        call_id = next(self._call_ids)
        future: Future[Any] = Future()
        with self._utility_lock:
            if self._dead is not None:
                raise self._dead
            self._utility_calls[call_id] = future
        try:
            self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        except BaseException:
            with self._utility_lock:
                self._utility_calls.pop(call_id, None)
            raise
        return future

    def call_utility(self, method: str, *args: Any, timeout_s: float = UTILITY_TIMEOUT_S) -> Any:
        """Run an ``EngineCore`` method in the core process and return its result; after
        ``timeout_s`` give the call up (a late answer is dropped) and raise ``TimeoutError``."""
        future = self._start_utility(method, *args)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise _no_answer(method, timeout_s) from None

    def shutdown(self) -> None:
        """Stop the core process (SIGTERM, then SIGKILL after a grace period) and free the sockets."""
        if self._closing:
            return
        self._closing = True
        if self.core_process.poll() is None:
            self.core_process.terminate()
            try:
                self.core_process.wait(_SHUTDOWN_GRACE_S)
            except subprocess.TimeoutExpired:
                self.core_process.kill()
                self.core_process.wait()
        output_thread = getattr(self, "_output_thread", None)
        if output_thread is not None:
            output_thread.join(_SHUTDOWN_GRACE_S)  # it looks at _closing every 100 ms
        if self.core_process.stdin is not None:
            self.core_process.stdin.close()
        self._context.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class SyncMPClient(MPClient):
    """The multi-process client for ``LLM(..., multiprocess_mode=True)``: blocking calls."""

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def get_output(self) -> EngineCoreOutputs:
        """The core's next batch of outputs, waiting at most ``_OUTPUT_WAIT_S`` seconds for one.

        ``outputs_queue`` holds, in order, the batches the output thread
        received and, last, the ``EngineDeadError`` the monitor thread puts
        there when the core process dies: every batch sent before a death comes
        out before the error. An empty batch after the wait lets the caller's
        loop look at its own state; a dead engine raises instead.
        """
        try:
            outputs = self.outputs_queue.get(timeout=_OUTPUT_WAIT_S)
        except queue.Empty:
            if self._dead is not None:
                raise self._dead from None
            return EngineCoreOutputs()
        if isinstance(outputs, EngineDeadError):
            raise outputs
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def append_prompt(self, request_id: str, token_ids: list[int], final: bool) -> None:
        self.call_utility("append_prompt", request_id, token_ids, final)


class AsyncMPClient(SyncMPClient):
    """The multi-process client of ``AsyncLLM`` (chapter 8): the same calls, awaitable.

    Sending never blocks (ZMQ queues the message), so ``AsyncLLM`` sends
    requests with the plain ``add_request``; ``abort_requests_async`` (vLLM's
    name, which exercise 8.2's page offers) just sends too. Waiting for outputs runs
    the blocking wait in the event loop's default thread pool, so the loop
    keeps serving other requests meanwhile. (vLLM reads the socket with
    ``zmq.asyncio`` in a task instead; the effect is the same.)
    """

    async def abort_requests_async(self, request_ids: Iterable[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        return await asyncio.get_running_loop().run_in_executor(None, self.get_output)

    async def call_utility_async(self, method: str, *args: Any, timeout_s: float = UTILITY_TIMEOUT_S) -> Any:
        """``call_utility``, awaited. Cancelling the awaiting task (a client that hung
        up) or running out of ``timeout_s`` cancels the call; its late answer is dropped."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self._start_utility(method, *args)), timeout_s)
        except TimeoutError:
            raise _no_answer(method, timeout_s) from None


def _no_answer(method: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"The engine core did not answer the utility call {method!r} within {timeout_s:g} s "
                        "(is it wedged, or paused by the live view?); the call was given up.")


class RemoteEngineCore:
    """What ``MPClient.engine_core`` holds for a core in another process: the way to reach it.

    Anything about the core itself (its component tree, chapter 5) is asked of
    it over the socket, through ``client.call_utility``.
    """

    def __init__(self, client: MPClient, pid: int) -> None:
        self.client = client
        self.pid = pid
