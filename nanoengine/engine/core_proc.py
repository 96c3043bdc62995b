"""EngineCoreProc: the engine core in a process of its own, behind two ZMQ sockets.

Chapter 8 (online serving). A server must keep accepting HTTP requests, turning
text into tokens and tokens into text while the model runs; in one Python process
that work and ``EngineCore.step()`` would take turns on the same interpreter.
vLLM therefore runs the core in its own process, and so does nanoengine with
``LLM(..., multiprocess_mode=True)`` and ``nanoengine serve``. Three threads:

* the **input thread** (``process_input_sockets``) receives ``(request type,
  msgpack bytes)`` frames from the front end, decodes them and puts them on
  ``input_queue``;
* the **main thread** runs ``run_busy_loop``: take what is on ``input_queue``
  (and block on it while there is nothing to do, so an idle core uses no CPU),
  then ``step()``, then put the outputs on ``output_queue``;
* the **output thread** (``process_output_sockets``) encodes each
  ``EngineCoreOutputs`` and pushes it to the front end.

The socket threads spend their time in ZMQ calls, which release the GIL, so
decoding the next request overlaps the forward pass. Both are critical: if one
dies, the busy loop raises at its next turn and the core dies loudly (below)
rather than serving on without ears or a mouth. The front end starts the
process (``MPClient`` in core_client.py: a fresh interpreter running ``main``
below, its configuration pickled into our stdin) and waits for a ready message
on the input socket. The core exits when its parent dies (its stdin reaches
end-of-file, or it is handed to a new parent; see ``exit_when_parent_dies``)
and, if the busy loop fails, tells the front end so with ``ENGINE_CORE_DEAD``
before it goes.

vLLM 0.32 counterpart: ``EngineCoreProc`` in ``vllm/v1/engine/core.py``
(``run_engine_core``, ``run_busy_loop``, ``_process_input_queue``,
``_process_engine_step``, ``_handle_client_request``, ``process_input_sockets``,
``process_output_sockets``) and ``EngineCoreRequestType`` in
``vllm/v1/engine/__init__.py``. vLLM keeps the class in core.py; it is beside
it here so that core.py stays the one-process engine of chapters 5-7.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from nanoengine.config import EngineConfig
from nanoengine.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    UtilityOutput,
)
from nanoengine.engine.core import EngineCore
from nanoengine.serial_utils import MsgpackDecoder, MsgpackEncoder
from nanoengine.utils.deadlines import injected_delay, start_critical_thread
from nanoengine.utils.system_utils import encode_startup as encode_startup_message
from nanoengine.utils.system_utils import exit_when_parent_dies, raise_system_exit, read_startup

logger = logging.getLogger(__name__)

# How long an idle busy loop sleeps in one wait on the input queue before it
# looks again; a request wakes it at once, this only bounds how late an idle
# core notices that a socket thread died.
_IDLE_WAIT_S = 1.0
# Connecting a socket on this machine takes milliseconds.
_SOCKET_READY_TIMEOUT_S = 60.0


class EngineCoreRequestType(enum.Enum):
    """The first frame of every message the front end sends: what the rest is."""

    ADD = b"\x00"  # an EngineCoreRequest
    ABORT = b"\x01"  # a list of request ids
    UTILITY = b"\x03"  # (call_id, method name, args): run an EngineCore method by name


# The last message a failing core sends, so the front end need not wait for
# the process exit to learn of it.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
# The methods a utility call may run (a socket is no reason to expose every method).
UTILITY_METHODS = frozenset({"append_prompt", "reset_prefix_cache", "get_stats", "describe"})
# Utility calls that plugins add (nanoengine/plugins/): name -> function(core, *args).
# The instruments add theirs here (the component tree of this core, for one).
UTILITY_EXTENSIONS: dict[str, Callable[..., Any]] = {}


class EngineCoreProc(EngineCore):
    """An ``EngineCore`` fed by an input thread and drained by an output thread."""

    def __init__(self, engine_config: EngineConfig, input_address: str, output_address: str) -> None:
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | bytes] = queue.Queue()
        # Set by a socket thread as it dies; the busy loop raises it at its next turn.
        self.socket_thread_death: BaseException | None = None
        # The slow-machine switch (utils/deadlines.py): seconds before each utility answer.
        self._utility_delay_s = injected_delay("utility")
        # Builds the model, sizes the KV cache, makes the scheduler (chapter 6).
        super().__init__(engine_config)
        ready = threading.Event()
        start_critical_thread(lambda: self.process_input_sockets(input_address, ready), "EngineCoreInput",
                              self._socket_thread_died)
        start_critical_thread(lambda: self.process_output_sockets(output_address), "EngineCoreOutput",
                              self._socket_thread_died)
        if not ready.wait(_SOCKET_READY_TIMEOUT_S):  # the front end has our ready message: requests may come
            raise TimeoutError(f"The engine core's input thread did not connect to {input_address} within "
                               f"{_SOCKET_READY_TIMEOUT_S:g} s.")

    def _socket_thread_died(self, error: BaseException) -> None:
        self.socket_thread_death = error

    @staticmethod
    def run_engine_core(
        engine_config: EngineConfig, input_address: str, output_address: str, parent_alive_fd: int
    ) -> None:
        """Build the core, then loop until told to stop.

        SIGTERM (the front end's shutdown) and the parent's death both end the
        busy loop through ``SystemExit``; any other exception is reported to
        the front end as ``ENGINE_CORE_DEAD`` before the process exits.
        """
        signal.signal(signal.SIGTERM, raise_system_exit)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the front end
        exit_when_parent_dies(parent_alive_fd, "EngineCoreParentWatch")
        engine_core: EngineCoreProc | None = None
        try:
            engine_core = EngineCoreProc(engine_config, input_address, output_address)
            engine_core.run_busy_loop()
        except SystemExit:
            logger.debug("EngineCore process %d exiting.", os.getpid())
        except Exception:
            logger.exception("EngineCore failed; telling the front end.")
            if engine_core is not None:
                engine_core.output_queue.put_nowait(ENGINE_CORE_DEAD)
                time.sleep(0.5)  # let the output thread send it
            raise
        finally:
            if engine_core is not None:
                engine_core.shutdown()

    # ---- the main thread -------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Take requests in, step, send outputs out; forever (until SystemExit)."""
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def _raise_if_a_socket_thread_died(self) -> None:
        if self.socket_thread_death is not None:
            raise RuntimeError(f"a socket thread of the engine core died: {self.socket_thread_death!r}")

    def _process_input_queue(self) -> None:
        """Block while idle; then take everything that has arrived, in order."""
        self._raise_if_a_socket_thread_died()
        while not self._has_work():
            self._raise_if_a_socket_thread_died()
            try:
                self._handle_client_request(*self.input_queue.get(timeout=_IDLE_WAIT_S))
            except queue.Empty:
                continue
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        outputs, model_executed = self.step_fn()
        self.post_step(model_executed)
        if outputs.outputs:
            self.output_queue.put_nowait(outputs)
        if not model_executed and self.scheduler.has_requests():
            # Only blocked requests (a grammar compiling, KV loading): let
            # those threads run instead of spinning on the GIL.
            time.sleep(0.001)

    def _handle_client_request(self, request_type: EngineCoreRequestType, request: Any) -> None:
        if request_type is EngineCoreRequestType.ADD:
            self._add_or_reject(request)
        elif request_type is EngineCoreRequestType.ABORT:
            self.abort_requests(request)
        else:
            call_id, method, args = request
            if self._utility_delay_s:
                time.sleep(self._utility_delay_s)
            self.output_queue.put_nowait(EngineCoreOutputs(utility_output=self._run_utility(call_id, method, args)))

    def _add_or_reject(self, request: EngineCoreRequest) -> None:
        """Add a request; one the core refuses ends at once with an error, and the rest go on."""
        try:
            self.add_request(request)
        except (ValueError, TypeError) as error:
            rejected = EngineCoreOutput(request.request_id, [], FinishReason.ERROR, finish_message=str(error))
            self.output_queue.put_nowait(EngineCoreOutputs(outputs=[rejected]))

    def _run_utility(self, call_id: int, method: str, args: list[Any]) -> UtilityOutput:
        if method in UTILITY_METHODS:
            run: Callable[..., Any] = getattr(self, method)
        elif method in UTILITY_EXTENSIONS:
            run = functools.partial(UTILITY_EXTENSIONS[method], self)
        else:
            return UtilityOutput(call_id, failure_message=f"{method!r} is not a utility method of the engine core.")
        try:
            return UtilityOutput(call_id, result=run(*args))
        except Exception as error:  # noqa: BLE001 -- the caller gets it; the core keeps serving
            return UtilityOutput(call_id, failure_message=f"{type(error).__name__}: {error}")

    # ---- the socket threads ----------------------------------------------------------

    def process_input_sockets(self, input_address: str, ready: threading.Event) -> None:
        """Input thread: socket frames -> decoded requests on ``input_queue``."""
        add_decoder: MsgpackDecoder[EngineCoreRequest] = MsgpackDecoder(EngineCoreRequest)
        generic_decoder: MsgpackDecoder[Any] = MsgpackDecoder()
        with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
            socket.connect(input_address)
            # The first message tells the front end's ROUTER socket who we are.
            socket.send(MsgpackEncoder().encode({"status": "READY", "pid": os.getpid(), **self.describe()}))
            ready.set()
            while True:
                type_frame, data = socket.recv_multipart()
                request_type = EngineCoreRequestType(type_frame)
                if request_type is not EngineCoreRequestType.ADD:
                    self.input_queue.put_nowait((request_type, generic_decoder.decode(data)))
                    continue
                try:
                    self.input_queue.put_nowait((request_type, add_decoder.decode(data)))
                except msgspec.MsgspecError as error:
                    self._refuse_undecodable(generic_decoder.decode(data), error)

    def _refuse_undecodable(self, raw: Any, error: Exception) -> None:
        """A request whose fields the core refuses to decode ends at once with the reason.

        Decoding re-checks every field (``SamplingParams.__post_init__`` runs
        again), so a value the front end let through is caught here; raised, it
        would end this thread, and with it every later request.
        """
        request_id = raw.get("request_id") if isinstance(raw, dict) else None
        if not isinstance(request_id, str):
            logger.error("The engine core dropped a request it could not decode: %s", error)
            return
        refused = EngineCoreOutput(request_id, [], FinishReason.ERROR, finish_message=f"Refused by the engine core: {error}")
        self.output_queue.put_nowait(EngineCoreOutputs(outputs=[refused]))

    def process_output_sockets(self, output_address: str) -> None:
        """Output thread: ``output_queue`` -> msgpack bytes on the socket."""
        encoder = MsgpackEncoder()
        # linger: a last ENGINE_CORE_DEAD still leaves before the socket closes.
        with zmq.Context() as context, context.socket(zmq.PUSH) as socket:
            socket.setsockopt(zmq.LINGER, 4000)
            socket.connect(output_address)
            while True:
                outputs = self.output_queue.get()
                if isinstance(outputs, bytes):
                    socket.send(outputs)
                    break
                socket.send(_encode_or_refuse(encoder, outputs))

    # ---- what utility calls may ask ----------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The in-process facts, plus this process's threads (chapter 8 prints them)."""
        return {**super().describe(), "threads": sorted(thread.name for thread in threading.enumerate())}

    def get_stats(self) -> dict[str, Any]:
        """The scheduler's counters (for ``/metrics``): queues, KV usage, prefix cache,
        and with speculative decoding (chapter 9) the draft counts, else None."""
        stats = self.scheduler.make_stats()
        spec, transfer = stats.spec_decoding_stats, stats.kv_transfer_stats
        return {
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_free_blocks": self.scheduler.kv_cache_manager.num_free_blocks,
            "num_usable_blocks": self.scheduler.kv_cache_manager.num_usable_blocks,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_preemptions": stats.num_preemptions,
            # Plain ints and lists: they cross the socket as msgpack.
            "spec_decoding": None if spec is None else {
                "num_drafts": spec.num_drafts,
                "num_draft_tokens": spec.num_draft_tokens,
                "num_accepted_tokens": spec.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
            },
            # Chapter 10: KV moved between engines, else None.
            "kv_transfer": None if transfer is None else dataclasses.asdict(transfer),
            "num_held_for_remote": stats.num_held_for_remote,
        }


def _encode_or_refuse(encoder: MsgpackEncoder, outputs: EngineCoreOutputs) -> bytes:
    """The outputs as msgpack; a utility answer msgpack cannot carry fails that one call instead.

    A step's outputs that do not encode are a bug: that raises, and the output
    thread dies loudly (the busy loop then ends the core).
    """
    try:
        return encoder.encode(outputs)
    except (TypeError, ValueError, OverflowError) as error:
        answer = outputs.utility_output
        if answer is None:
            raise
        refusal = UtilityOutput(answer.call_id, failure_message=f"the answer could not be sent: {error}")
        return encoder.encode(EngineCoreOutputs(utility_output=refusal))


def main() -> None:
    """The core process: ``python -c "from nanoengine.engine.core_proc import main; main()"``.

    The front end writes ``encode_startup(engine_config, input_address,
    output_address)`` to our stdin and keeps the pipe open for as long as it
    lives. A fresh interpreter started this way (rather than with
    ``multiprocessing``) never re-imports the user's own script.
    """
    stdin = sys.stdin.fileno()
    engine_config, input_address, output_address = read_startup(stdin)
    EngineCoreProc.run_engine_core(engine_config, input_address, output_address, stdin)


def encode_startup(engine_config: EngineConfig, input_address: str, output_address: str) -> bytes:
    """What the front end writes to the core's stdin: a length, then the pickled arguments."""
    return encode_startup_message((engine_config, input_address, output_address))

