"""Waits with deadlines survive the answers that come after them; critical threads die loudly (chapter 8).

The engine-core process is slowed on purpose here (``NANOENGINE_INJECT_DELAY``,
nanoengine/utils/deadlines.py), so the late answers a slow, busy CPU produces
happen on any machine: utility calls given up before the core answers, a
client that cancels its await, a thread that others depend on dying.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.async_llm import AsyncLLM
from nanoengine.engine.core_client import SyncMPClient
from nanoengine.engine.exceptions import EngineDeadError
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.utils.deadlines import INJECT_DELAY_ENV, parse_injected_delays, settle, with_injected_delay

SMALL = {"max_model_len": 64, "kv_cache_memory_bytes": 1 << 22}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_settle_drops_an_answer_that_comes_after_the_caller_gave_up() -> None:
    given_up: Future[int] = Future()
    given_up.cancel()
    assert settle(given_up, 1) is False and given_up.cancelled()
    failed: Future[int] = Future()
    assert settle(failed, error=RuntimeError("dead")) is True
    assert settle(failed, 2) is False and isinstance(failed.exception(), RuntimeError)


@pytest.mark.parametrize(("text", "words"), [
    ("stepp=0.1", "unknown delay 'stepp'"), ("step=fast", "needs seconds"), ("step=60", "outside [0, 10] s"),
])
def test_a_bad_delay_switch_is_refused_naming_it(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=INJECT_DELAY_ENV) as refused:
        parse_injected_delays(text)
    assert words in str(refused.value)
    assert parse_injected_delays(" step=0.05, utility=0.3 ") == {"step": 0.05, "utility": 0.3}


def test_without_the_switch_nothing_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INJECT_DELAY_ENV, raising=False)

    def step() -> int:
        return 1

    assert with_injected_delay(step, "step") is step


def _async_engine(model: str) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(model=model, skip_tokenizer_init=True, **SMALL))


async def _tokens(engine: AsyncLLM, request_id: str) -> list[int]:
    final = None
    async for output in engine.generate(TokensPrompt(prompt_token_ids=[5, 6, 7], prompt=""), GREEDY, request_id):
        final = output
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids)


def test_late_utility_answers_are_dropped_and_every_request_finishes(tiny_llama: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each utility answer comes 0.2 s late, and every caller gives up first: by a deadline,
    or by a cancelled await (a closed page). The output thread lives on; requests finish."""
    monkeypatch.setenv(INJECT_DELAY_ENV, "utility=0.2")
    engine = _async_engine(tiny_llama)

    async def scenario() -> tuple[list[list[int]], str]:
        for _ in range(3):
            with pytest.raises(TimeoutError, match="did not answer the utility call 'get_stats' within 0.01 s"):
                await engine.client.call_utility_async("get_stats", timeout_s=0.01)
        abandoned = asyncio.ensure_future(engine.client.call_utility_async("get_stats"))
        await asyncio.sleep(0.01)
        abandoned.cancel()  # an HTTP client hung up while its route awaited the core
        tokens = await asyncio.gather(*(_tokens(engine, f"r{i}") for i in range(4)))
        await asyncio.sleep(0.3)  # the last late answers arrive
        stats = await engine.get_stats()  # answered, in time, after all that
        return tokens, str(stats["num_running"])

    try:
        tokens, running = asyncio.run(scenario())
        assert all(len(t) == GREEDY.max_tokens for t in tokens) and running == "0"
        assert engine.client.num_late_answers == 4 and engine.client._output_thread.is_alive()
        with pytest.raises(TimeoutError, match="'get_stats' within 0.01 s"):
            engine.client.call_utility("get_stats", timeout_s=0.01)  # the blocking call has its deadline too
    finally:
        engine.shutdown()


def test_a_dead_output_thread_fails_every_waiting_request_at_once(tiny_llama: str) -> None:
    """A frame the client cannot decode kills its output thread: the engine is dead, and
    the requests that waited, and every later one, fail with EngineDeadError."""
    engine = _async_engine(tiny_llama)

    async def scenario() -> None:
        waiting = asyncio.ensure_future(_tokens(engine, "waits"))
        await asyncio.sleep(0)
        _push_garbage_to(engine.client)
        with pytest.raises(EngineDeadError, match="the client's output thread failed"):
            await asyncio.wait_for(waiting, 10.0)
        with pytest.raises(EngineDeadError):
            await _tokens(engine, "later")

    try:
        asyncio.run(scenario())
        assert engine.errored
    finally:
        engine.shutdown()


def _push_garbage_to(client: SyncMPClient) -> None:
    """Send the client's output socket a frame that is no msgpack of EngineCoreOutputs."""
    import zmq

    address = client.output_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    with zmq.Context() as context, context.socket(zmq.PUSH) as pusher:
        pusher.setsockopt(zmq.LINGER, 2000)  # sent before the socket closes
        pusher.connect(address)
        pusher.send(b"\xc1 not msgpack")


def test_a_dead_socket_thread_ends_the_core_loudly(tiny_llama: str) -> None:
    """A frame of a request type the core does not know kills its input thread: the busy loop
    notices, tells the front end (ENGINE_CORE_DEAD) and exits; the client fails every call."""
    llm = LLM(tiny_llama, multiprocess_mode=True, **SMALL)
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    try:
        with client._send_lock:
            client.input_socket.send_multipart([client._core_identity, b"\x7f", b""])
        client.core_process.wait(15)
        with pytest.raises(EngineDeadError):
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], GREEDY, use_tqdm=False)
        assert client.core_process.returncode != 0
    finally:
        llm.llm_engine.shutdown()
