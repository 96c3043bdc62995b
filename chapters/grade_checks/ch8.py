"""The grader's checks for exercises 8.1 and 8.2 (chapter 8).

Both exercises are front-end code: it runs in the grader's own process, which
is where the grader swaps the candidate in (the engine core's process is a
fresh interpreter that never sees the swap). ``SyncMPClient.get_output`` is
what ``LLM(..., multiprocess_mode=True)`` calls on every step;
``AsyncLLM._run_output_handler`` is the task that feeds every request of a
server.

Each promise of an exercise's page has a unit check of its own, named by that
promise. The unit checks call the method on a stand-in: for 8.1 a
``SyncMPClient`` made without ``__init__`` (no process, no socket), holding
only the queue and the ``_dead`` field the method reads; for 8.2 an
``AsyncLLM`` made the same way, with a scripted client and output processor,
so a dead engine, a request whose consumer went away or a stop string is one
line away. The end-to-end runs come last and start a real engine-core process.
Every check returns a dict whose keys name the call and its inputs.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from chapters.grade_checks.common import PROMPTS, SMALL_BLOCKS, Check, greedy_run
from nanoengine import LLM, SamplingParams
from nanoengine.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.async_llm import AsyncLLM
from nanoengine.engine.core_client import SyncMPClient
from nanoengine.engine.exceptions import EngineDeadError
from nanoengine.engine.output_processor import OutputProcessorOutput
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.renderers.hf import TokensPrompt

# What the monitor thread puts into the queue when the core process dies.
DEATH = "the process exited with code -9"


def _error_text(error: BaseException) -> str:
    """An exception in a few words: an EngineDeadError by its name (its message is long)."""
    if isinstance(error, EngineDeadError) or not str(error):
        return type(error).__name__
    return f"{type(error).__name__}: {error}"


def _outcome(call: Callable[[], Any], shown: Callable[[Any], str]) -> str:
    """What ``call`` returned (as ``shown`` words it), or the exception it raised.

    An unwritten stub still ends the check, so the grader reports its
    NotImplementedError as such.
    """
    try:
        value = call()
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 -- the exception is the answer being checked
        return f"raised {_error_text(error)}"
    return f"returned {shown(value)}"


# ------------------------------------------------- 8.1 SyncMPClient.get_output
# How long a single get_output() call may take: the reference waits at most
# _OUTPUT_WAIT_S (0.5 s); this leaves room for a loaded machine.
CALL_BOUND_S = 2.0


def _batch(request_id: str) -> EngineCoreOutputs:
    """A batch holding one new token for ``request_id``: easy to tell apart from another."""
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id, [7])])


def _shown_batch(value: Any) -> str:
    if isinstance(value, EngineCoreOutputs):
        if not value.outputs:
            return "an empty EngineCoreOutputs"
        return "the batch for " + ", ".join(repr(output.request_id) for output in value.outputs)
    if isinstance(value, BaseException):
        return f"the error object ({_error_text(value)}) instead of raising it"
    return repr(value)


def _client(*queued: EngineCoreOutputs | EngineDeadError, dead: EngineDeadError | None = None) -> SyncMPClient:
    """A SyncMPClient without a process: ``outputs_queue`` holds ``queued``; ``_dead`` is ``dead``."""
    client = SyncMPClient.__new__(SyncMPClient)
    client.outputs_queue = queue.Queue()
    for item in queued:
        client.outputs_queue.put_nowait(item)
    client._dead = dead
    return client


def _get_output(client: SyncMPClient) -> str:
    return _outcome(client.get_output, _shown_batch)


def returns_the_queued_batch(model: str) -> dict[str, Any]:
    """A queue holding one batch (for request 'a'); the engine is alive."""
    return {"get_output(), the batch for 'a' queued": _get_output(_client(_batch("a")))}


def returns_batches_in_order(model: str) -> dict[str, Any]:
    """A queue holding three batches, for 'a', 'b' and 'c' in that order; three calls."""
    client = _client(_batch("a"), _batch("b"), _batch("c"))
    return {f"get_output(), call {number}": _get_output(client) for number in (1, 2, 3)}


def waits_for_a_batch(model: str) -> dict[str, Any]:
    """An empty queue; a batch for 'late' is put into it 0.05 s after the call starts."""
    client = _client()
    timer = threading.Timer(0.05, client.outputs_queue.put_nowait, [_batch("late")])
    timer.start()
    try:
        returned = _get_output(client)
    finally:
        timer.cancel()
        timer.join()
    return {"get_output(), the batch for 'late' arrives 0.05 s into the wait": returned}


def empty_batch_when_nothing_comes(model: str) -> dict[str, Any]:
    """An empty queue that stays empty; the engine is alive."""
    started = time.monotonic()
    returned = _get_output(_client())
    label = "get_output(), nothing queued"
    return {label: returned,
            f"{label}: returned within {CALL_BOUND_S:.0f} s": time.monotonic() - started < CALL_BOUND_S}


def raises_the_queued_error(model: str) -> dict[str, Any]:
    """A queue holding the EngineDeadError the monitor thread put there (``_dead`` is that error)."""
    error = EngineDeadError(DEATH)
    return {"get_output(), the EngineDeadError queued": _get_output(_client(error, dead=error))}


def raises_when_dead_and_empty(model: str) -> dict[str, Any]:
    """An empty queue, and ``_dead`` set: the error was already taken out of the queue by an earlier call."""
    started = time.monotonic()
    returned = _get_output(_client(dead=EngineDeadError(DEATH)))
    label = "get_output(), nothing queued, _dead set"
    return {label: returned,
            f"{label}: returned within {CALL_BOUND_S:.0f} s": time.monotonic() - started < CALL_BOUND_S}


def batches_before_the_death(model: str) -> dict[str, Any]:
    """A queue holding a batch for 'a', then the EngineDeadError (``_dead`` is that error); two calls."""
    error = EngineDeadError(DEATH)
    client = _client(_batch("a"), error, dead=error)
    return {f"get_output(), call {number}": _get_output(client) for number in (1, 2)}


def _wait_for_death(client: SyncMPClient, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while client._dead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return client._dead is not None


def e2e_multiprocess(model: str) -> dict[str, Any]:
    """``LLM(model, multiprocess_mode=True)`` generates 8 greedy tokens for each of four
    prompts; then one more request is added, the core process is killed (SIGKILL) and
    ``engine.step()`` is called until it raises (at most 10 s).
    """
    expected = greedy_run(model, PROMPTS, max_tokens=8, **SMALL_BLOCKS)  # in-process, the same tokens
    llm = LLM(model=model, multiprocess_mode=True, **SMALL_BLOCKS)
    engine = llm.llm_engine
    try:
        client = engine.engine_core
        assert type(client) is SyncMPClient, f"multiprocess_mode=True gave a {type(client).__name__}"
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        assert token_ids == expected.token_ids, (
            f"the multi-process tokens {token_ids} differ from an in-process run's {expected.token_ids}"
        )
        result: dict[str, Any] = {"generate(4 prompts): token ids": token_ids,
                                  "generate(4 prompts): finish reasons": [o.outputs[0].finish_reason for o in outputs]}
        engine.add_request("after-kill", TokensPrompt(prompt_token_ids=PROMPTS[0]), params)
        pid = client.core_process.pid
        assert pid is not None, "the core process has a pid"
        os.kill(pid, signal.SIGKILL)
        assert _wait_for_death(client, 10.0), "the client's monitor thread never noticed the killed core"
        deadline, ended = time.monotonic() + 10.0, "no error after 10 s of steps"
        while time.monotonic() < deadline:
            try:
                engine.step()
            except EngineDeadError as error:
                ended = f"raised {type(error).__name__}"
                break
        result["after the core process is killed: engine.step() until it raises"] = ended
        return result
    finally:
        engine.shutdown()


# ------------------------------------------- 8.2 AsyncLLM._run_output_handler
# How long the handler may take over a handful of scripted batches.
HANDLER_BOUND_S = 2.0
READ_ALL = "read every batch, then waited for the next"


class _ScriptedClient:
    """Stands in for ``AsyncMPClient``: hands out prepared batches, then raises or waits.

    After the last batch, ``get_output_async`` raises ``then_raise`` if there is
    one (as a dead engine's client does); otherwise it waits for ever, as a
    quiet engine would, after setting ``drained`` so the check knows every
    batch was read.
    """

    def __init__(self, batches: list[EngineCoreOutputs], then_raise: BaseException | None = None) -> None:
        self.batches = list(batches)
        self.then_raise = then_raise
        self.aborted: list[str] = []
        self.drained = asyncio.Event()

    async def get_output_async(self) -> EngineCoreOutputs:
        await asyncio.sleep(0)  # a real client always yields to the event loop
        if self.batches:
            return self.batches.pop(0)
        if self.then_raise is not None:
            raise self.then_raise
        self.drained.set()
        await asyncio.Event().wait()  # nothing more will come; the check cancels the handler
        raise AssertionError("a wait that no one ends came to an end")

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        raise RuntimeError(
            "called self.client.get_output(), which blocks until the core sends a batch: inside an "
            "async def that stops the whole event loop. Await self.client.get_output_async() instead."
        )

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"called self.client.{name}, which exercise 8.2 does not use: the handler needs "
            "get_output_async() and abort_requests() (see docs/exercises/8.2.md)."
        )


class _ScriptedProcessor:
    """Stands in for ``OutputProcessor``: one ``RequestOutput`` per core output, with the
    same request id and tokens, finished when the core output is. A request id in
    ``stop_hits`` hits a stop string: its output is finished ("stop") and its id
    goes into ``reqs_to_abort``. ``fail_on_call`` makes that call raise ValueError.
    """

    def __init__(self, stop_hits: tuple[str, ...] = (), fail_on_call: int | None = None) -> None:
        self.stop_hits = stop_hits
        self.fail_on_call = fail_on_call
        self.calls: list[list[str]] = []

    def process_outputs(self, engine_core_outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        self.calls.append([output.request_id for output in engine_core_outputs])
        if len(self.calls) == self.fail_on_call:
            raise ValueError("a bad batch")
        outputs, to_abort = [], []
        for output in engine_core_outputs:
            reason = "length" if output.finished else None
            if output.request_id in self.stop_hits:
                reason = "stop"
                to_abort.append(output.request_id)
            completion = CompletionOutput(0, "", list(output.new_token_ids), finish_reason=reason)
            outputs.append(RequestOutput(output.request_id, None, [], [completion], finished=reason is not None))
        return OutputProcessorOutput(outputs, to_abort)


def _new(request_id: str, token: int, finished: bool = False) -> EngineCoreOutput:
    """One new token for ``request_id``; with ``finished``, its last (length reached)."""
    return EngineCoreOutput(request_id, [token], FinishReason.LENGTH if finished else None)


def _core_batch(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outputs))


def _stand_in(client: _ScriptedClient, processor: _ScriptedProcessor, request_ids: list[str]) -> Any:
    """An AsyncLLM without ``__init__`` (no process): the scripted client and processor,
    and an empty ``asyncio.Queue`` in ``collectors`` for each of ``request_ids``."""
    engine: Any = AsyncLLM.__new__(AsyncLLM)
    engine.client = engine.engine_core = client
    engine.output_processor = processor
    engine.collectors = {request_id: asyncio.Queue() for request_id in request_ids}
    engine.output_handler = None
    engine.dead_error = None
    engine.finished_listeners = []
    engine.abort_request = _wrong_abort
    return engine


def _wrong_abort(request_ids: Any) -> None:
    """What ``self.abort_request`` does in these checks: say why it is the wrong call."""
    raise RuntimeError(
        f"called self.abort_request({request_ids!r}): that one is for a consumer that went away (it drops "
        "the request's queue, so its final output would be lost). A request that hit a stop string is "
        "aborted in the core: self.client.abort_requests(...)."
    )


def _how_it_ended(handler: asyncio.Future[None]) -> str:
    """How a finished handler task ended; an unwritten stub's NotImplementedError is raised."""
    if handler.cancelled():
        return "cancelled"
    error = handler.exception()
    if isinstance(error, NotImplementedError):
        raise error
    return "returned" if error is None else f"raised {_error_text(error)}"


def _shown_item(item: Any) -> str:
    if isinstance(item, RequestOutput):
        return f"{item.request_id}: {item.outputs[0].token_ids}" + (", finished" if item.finished else "")
    if isinstance(item, BaseException):
        return _error_text(item)
    return repr(item)


def _dead_error(engine: Any) -> str | None:
    return None if engine.dead_error is None else _error_text(engine.dead_error)


def _queues(engine: Any) -> dict[str, Any]:
    """What each request's queue holds now, in order (taking it out)."""
    shown = {}
    for request_id, waiting in engine.collectors.items():
        items = []
        while not waiting.empty():
            items.append(_shown_item(waiting.get_nowait()))
        shown[f"then the queue of '{request_id}'"] = items
    return shown


def _state(engine: Any, how: str) -> dict[str, Any]:
    return {"the handler": how, **_queues(engine), "then dead_error": _dead_error(engine)}


async def _cancel(handler: asyncio.Future[None]) -> None:
    """Cancel the handler task, as ``AsyncLLM.shutdown`` does, and give it a moment to end."""
    handler.cancel()
    await asyncio.wait({handler}, timeout=HANDLER_BOUND_S)


async def _start_until_drained(engine: Any, client: _ScriptedClient) -> tuple[asyncio.Future[None], bool]:
    """Start the handler task; return it once it has ended or read every batch
    (at most ``HANDLER_BOUND_S``), and whether every batch was read.
    """
    handler = asyncio.ensure_future(engine._run_output_handler())
    drained = asyncio.ensure_future(client.drained.wait())
    done, _ = await asyncio.wait({handler, drained}, timeout=HANDLER_BOUND_S, return_when=asyncio.FIRST_COMPLETED)
    drained.cancel()
    return handler, drained in done


def _run_handler(engine: Any, client: _ScriptedClient) -> dict[str, Any]:
    """Run ``engine._run_output_handler()`` until it returns, or until it has read every
    batch and waits for the next, at most ``HANDLER_BOUND_S``. The result says which,
    then what each queue holds and ``dead_error``, read before the check cancels a
    waiting handler (the cancellation has a check of its own).
    """

    async def drive() -> dict[str, Any]:
        handler, read_all = await _start_until_drained(engine, client)
        if handler.done():
            how = _how_it_ended(handler)
        else:
            how = READ_ALL if read_all else f"still running after {HANDLER_BOUND_S:.0f} s, batches left unread"
        state = _state(engine, how)
        if not handler.done():
            await _cancel(handler)
        return state

    return asyncio.run(drive())


def routes_to_its_own_queue(model: str) -> dict[str, Any]:
    """Queues for 'a', 'b' and 'c'; three batches: [a 1, b 2], then [c 3, a 4], then [b 5,
    finished]; then the client waits for more.
    """
    client = _ScriptedClient([_core_batch(_new("a", 1), _new("b", 2)), _core_batch(_new("c", 3), _new("a", 4)),
                              _core_batch(_new("b", 5, finished=True))])
    processor = _ScriptedProcessor()
    result = _run_handler(_stand_in(client, processor, ["a", "b", "c"]), client)
    result["then process_outputs was given (request ids, batch by batch)"] = processor.calls
    return result


def skips_unknown_requests(model: str) -> dict[str, Any]:
    """A queue for 'a' only; two batches: [gone 1, a 2], then [gone 3, finished; a 4], where
    'gone' has no queue (its consumer went away); then the client waits for more.
    """
    client = _ScriptedClient([_core_batch(_new("gone", 1), _new("a", 2)),
                              _core_batch(_new("gone", 3, finished=True), _new("a", 4))])
    return _run_handler(_stand_in(client, _ScriptedProcessor(), ["a"]), client)


def aborts_stop_strings(model: str) -> dict[str, Any]:
    """Queues for 'a' and 'b'; two batches: [a 1, b 2] where 'b' hits a stop string (the
    processor finishes it and lists it in ``reqs_to_abort``), then [a 3].
    """
    client = _ScriptedClient([_core_batch(_new("a", 1), _new("b", 2)), _core_batch(_new("a", 3))])
    result = _run_handler(_stand_in(client, _ScriptedProcessor(stop_hits=("b",)), ["a", "b"]), client)
    result["then the request ids aborted in the core"] = client.aborted
    return result


def calls_finished_listeners(model: str) -> dict[str, Any]:
    """Queues for 'a' and 'b', two finished listeners; three batches: [a 1, b 2], then
    [a 3, finished; b 4], then [b 5, finished; gone 6, finished] ('gone' has no queue).
    """
    client = _ScriptedClient([_core_batch(_new("a", 1), _new("b", 2)),
                              _core_batch(_new("a", 3, finished=True), _new("b", 4)),
                              _core_batch(_new("b", 5, finished=True), _new("gone", 6, finished=True))])
    engine = _stand_in(client, _ScriptedProcessor(), ["a", "b"])
    heard: dict[str, list[str]] = {"first": [], "second": []}
    for calls in heard.values():
        engine.finished_listeners.append(lambda output, calls=calls: calls.append(_shown_item(output)))
    result: dict[str, Any] = {"the handler": _run_handler(engine, client)["the handler"]}
    for name, calls in heard.items():
        result[f"then the {name} listener was called with"] = calls
    return result


def death_reaches_every_waiter(model: str) -> dict[str, Any]:
    """Queues for 'a', 'b' and 'c': one batch [a 1], then the client raises EngineDeadError.
    Then, afresh, queues for 'a' and 'b': process_outputs raises ValueError on the second
    of two batches, [a 1] and [b 2].
    """
    error = EngineDeadError(DEATH)
    client = _ScriptedClient([_core_batch(_new("a", 1))], then_raise=error)
    engine = _stand_in(client, _ScriptedProcessor(), ["a", "b", "c"])
    label = "the client raises EngineDeadError"
    result = {f"{label}: {key}": value for key, value in _run_handler(engine, client).items()}
    result[f"{label}: then dead_error is the error raised"] = engine.dead_error is error

    client = _ScriptedClient([_core_batch(_new("a", 1)), _core_batch(_new("b", 2))])
    engine = _stand_in(client, _ScriptedProcessor(fail_on_call=2), ["a", "b"])
    label = "process_outputs raises ValueError"
    result.update({f"{label}: {key}": value for key, value in _run_handler(engine, client).items()})
    return result


def cancelled_is_no_death(model: str) -> dict[str, Any]:
    """Queues for 'a' and 'b'; one batch [a 1]; then, while the handler waits for the next
    batch, its task is cancelled, as ``AsyncLLM.shutdown`` does.
    """
    client = _ScriptedClient([_core_batch(_new("a", 1))])
    engine = _stand_in(client, _ScriptedProcessor(), ["a", "b"])

    async def drive() -> dict[str, Any]:
        handler, _ = await _start_until_drained(engine, client)
        if handler.done():  # it should have been waiting for the next batch
            return {"before cancel(): " + key: value for key, value in _state(engine, _how_it_ended(handler)).items()}
        await _cancel(handler)
        how = _how_it_ended(handler) if handler.done() else f"still running {HANDLER_BOUND_S:.0f} s after cancel()"
        return {"after cancel(): " + key: value for key, value in _state(engine, how).items()}

    return asyncio.run(drive())


# -- end to end: a real AsyncLLM, its core in its own process.
E2E_LIMIT_S = 120.0


async def _read_all(outputs: AsyncGenerator[RequestOutput, None]) -> dict[str, Any]:
    streamed = [output async for output in outputs]
    last = streamed[-1].outputs[0]
    return {"token ids": list(last.token_ids), "text": last.text, "finish reason": last.finish_reason,
            "outputs streamed": len(streamed)}


async def _serve(engine: AsyncLLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    """Send every request, then read all their streams at once, as a server's handlers do.

    The output handler is watched too: if it ends while requests still wait,
    its exception (or the fact) is raised, instead of waiting for ever.
    """
    streams = {request_id: engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id)
               for request_id, (prompt, params) in requests.items()}
    readers = {request_id: asyncio.ensure_future(_read_all(stream)) for request_id, stream in streams.items()}
    handler = engine.output_handler
    assert handler is not None, "generate() starts the output handler"
    waiting: set[asyncio.Future[Any]] = set(readers.values())
    deadline = time.monotonic() + E2E_LIMIT_S
    try:
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"requests still waiting for outputs after {E2E_LIMIT_S:.0f} s")
            done, _ = await asyncio.wait(waiting | {handler}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if handler in done:
                ended = _how_it_ended(handler)
                error = None if handler.cancelled() else handler.exception()
                raise error if error is not None else RuntimeError(
                    f"the output handler ended ({ended}) while requests were still waiting for outputs")
            waiting -= done
    finally:
        for reader in readers.values():
            reader.cancel()
    served = {}
    for request_id, reader in readers.items():
        if reader.cancelled():  # CancelledError is no Exception: the grader could not report it
            raise RuntimeError(f"the stream of {request_id!r} ended with asyncio.CancelledError: it was aborted")
        served[request_id] = reader.result()
    return served


def _stop_piece(text: str) -> str:
    """Two letters or digits from inside ``text`` (not at its start), to stop on."""
    for start in range(1, len(text) - 1):
        piece = text[start:start + 2]
        if piece.isascii() and piece.isalnum():
            return piece
    raise AssertionError(f"the greedy text {text!r} has no two ASCII letters or digits to stop on")


def e2e_async_llm(model: str) -> dict[str, Any]:
    """An ``AsyncLLM`` streams four greedy requests at once (8 tokens each, a finished
    listener registered); then a request with the first one's prompt and a stop string
    taken from its text (two letters or digits from inside it), next to a plain one.
    """
    expected = greedy_run(model, PROMPTS, max_tokens=8, **SMALL_BLOCKS)  # in-process, one batch
    engine = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(model, **SMALL_BLOCKS))
    finished: list[str] = []
    engine.finished_listeners.append(lambda output: finished.append(output.request_id))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def both_rounds() -> dict[str, Any]:
        first = await _serve(engine, {f"r{i}": (prompt, greedy) for i, prompt in enumerate(PROMPTS)})
        stop = _stop_piece(first["r0"]["text"])
        stopping = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop])
        second = await _serve(engine, {"stop": (PROMPTS[0], stopping), "plain": (PROMPTS[1], greedy)})
        return {"first": first, "second": second, "stop": stop}

    try:
        served = asyncio.run(both_rounds())
    finally:
        engine.shutdown()
    first, second, stop = served["first"], served["second"], served["stop"]
    token_ids = [first[f"r{i}"]["token ids"] for i in range(len(PROMPTS))]
    assert token_ids == expected.token_ids, (
        f"the streamed tokens {token_ids} differ from an in-process run's {expected.token_ids}"
    )
    cut = first["r0"]["text"][: first["r0"]["text"].index(stop)]
    assert second["stop"]["finish reason"] == "stop" and second["stop"]["text"] == cut, (
        f"the stop string {stop!r} should cut {first['r0']['text']!r} to {cut!r}, got {second['stop']}"
    )
    result: dict[str, Any] = {}
    for request_id, got in first.items():
        for field, value in got.items():
            result[f"4 at once, {request_id}: {field}"] = value
    for request_id, got in second.items():
        for field, value in got.items():
            result[f"then with stop=[{stop!r}], {request_id}: {field}"] = value
    result["finished listener: request ids, sorted"] = sorted(finished)
    return result


CHECKS: dict[str, tuple[Check, ...]] = {
    "8.1": (
        Check("returns the batch in the queue", returns_the_queued_batch),
        Check("returns the batches in the order they were queued", returns_batches_in_order),
        Check("waits for a batch that arrives during the wait", waits_for_a_batch),
        Check("nothing within the wait: an empty EngineCoreOutputs, not None, not a hang",
              empty_batch_when_nothing_comes),
        Check("raises the EngineDeadError that comes out of the queue", raises_the_queued_error),
        Check("dead and nothing queued: raises self._dead after the wait", raises_when_dead_and_empty),
        Check("the batches queued before the death come out before the error", batches_before_the_death),
        Check("end to end: LLM(multiprocess_mode=True), then a killed core", e2e_multiprocess),
    ),
    "8.2": (
        Check("each output goes to its own request's queue", routes_to_its_own_queue),
        Check("an output with no queue (consumer gone) is skipped", skips_unknown_requests),
        Check("requests that hit a stop string are aborted in the core", aborts_stop_strings),
        Check("every finished output goes to every finished listener, once", calls_finished_listeners),
        Check("an exception sets dead_error and reaches every waiting request", death_reaches_every_waiter),
        Check("cancelled (shutdown) is no death: the task ends, no request is told", cancelled_is_no_death),
        Check("end to end: AsyncLLM streams concurrent requests, and a stop string", e2e_async_llm),
    ),
}
