"""Waiting with a deadline, surviving the answer that comes after it, and a slow machine on purpose.

Chapter 8 (online serving). A server is a web of waits: a request waits for
its tokens, a utility call for the core's answer, the core for its worker. A
wait with a deadline can give up -- and then the answer still arrives. Three
rules keep such an answer harmless, and this module holds the pieces that
every waiting place in the engine shares:

* **Settle once** (``settle``): the thread that delivers an answer does not
  assume that anybody still waits for it. A future that was cancelled (an HTTP
  client hung up, an ``asyncio.wait_for`` ran out) or already failed (the
  engine died first) keeps its state, and the late answer is dropped and
  counted instead of raised -- raised, it would kill the delivering thread,
  and with it every request that thread serves.
* **A critical thread dies loudly** (``start_critical_thread``): a thread that
  others depend on (the client's output thread, the core's socket threads,
  the KV block server) reports its own death to a handler, which marks the
  engine dead, so every waiting request fails at once instead of waiting
  forever on a thread that is gone.
* **Test on the slow path** (``NANOENGINE_INJECT_DELAY``): a timeout tuned on a
  fast machine fires only on a slow one. ``NANOENGINE_INJECT_DELAY="step=0.05,
  utility=0.3"`` adds 50 ms to every engine step and 300 ms before every
  utility answer of a core process, so the tests meet late answers on any
  machine. Unset (the default), nothing is added and nothing is wrapped.

vLLM 0.32 counterpart: ``_process_utility_output`` in
``vllm/v1/engine/core_client.py`` (drops an answer whose future was cancelled:
``except asyncio.InvalidStateError``) and the ``EngineDeadError`` path of
``vllm/v1/engine/core_client.py`` / ``exceptions.py``. vLLM has no delay switch.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

INJECT_DELAY_ENV = "NANOENGINE_INJECT_DELAY"
# The places a delay can be injected, and what each one slows.
DELAY_KINDS = {
    "step": "every EngineCore step (the busy loop's turn, in any process)",
    "utility": "every utility call's answer in a core process, before it is sent",
}
# A delay longer than this is surely a typo (seconds, not milliseconds).
MAX_INJECTED_DELAY_S = 10.0

T = TypeVar("T")


def settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> bool:
    """Resolve ``future`` with ``result`` (or ``error``) unless it is already done.

    True when this call resolved it; False when the answer came late -- the
    future was cancelled or resolved before -- and was dropped. Checking
    ``done()`` first is not enough on its own: a cancel can land between the
    check and the ``set_result``, so the state error is caught too.
    """
    if future.done():
        return False
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


def start_critical_thread(target: Callable[[], None], name: str,
                          on_death: Callable[[BaseException], None]) -> threading.Thread:
    """Start ``target`` on a daemon thread whose exception is logged and handed to ``on_death``.

    ``target`` returning is a normal end (a shutdown); raising is a death that
    the engine must hear of. Without this, Python prints the traceback and the
    thread is simply gone: the requests that waited on it wait forever.
    """

    def run() -> None:
        try:
            target()
        except BaseException as error:  # any death, SystemExit included, must be told
            logger.exception("The thread %s died; the engine cannot go on without it.", name)
            on_death(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def parse_injected_delays(text: str) -> dict[str, float]:
    """``"step=0.05,utility=0.3"`` -> ``{"step": 0.05, "utility": 0.3}``; a bad entry raises, naming it."""
    delays: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        kind, _, value = entry.partition("=")
        kind = kind.strip()
        if kind not in DELAY_KINDS:
            raise ValueError(f"{INJECT_DELAY_ENV}: unknown delay {kind!r} in {text!r}; known: "
                             f"{', '.join(DELAY_KINDS)} (e.g. 'step=0.05,utility=0.3')")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"{INJECT_DELAY_ENV}: {entry!r} needs seconds after '=', e.g. '{kind}=0.05'") from None
        if not 0.0 <= seconds <= MAX_INJECTED_DELAY_S:
            raise ValueError(f"{INJECT_DELAY_ENV}: {kind}={seconds:g} is outside [0, {MAX_INJECTED_DELAY_S:g}] s")
        delays[kind] = seconds
    return delays


def injected_delay(kind: str) -> float:
    """Seconds ``NANOENGINE_INJECT_DELAY`` adds at the place ``kind`` (0.0 when unset)."""
    assert kind in DELAY_KINDS, kind
    return parse_injected_delays(os.environ.get(INJECT_DELAY_ENV, "")).get(kind, 0.0)


def with_injected_delay(function: Callable[[], T], kind: str) -> Callable[[], T]:
    """``function``, slowed by the injected delay of ``kind``; ``function`` itself when there is none."""
    delay = injected_delay(kind)
    if delay == 0.0:
        return function
    logger.info("%s=%s: %s takes %g s longer (a slow machine, on purpose).",
                   INJECT_DELAY_ENV, os.environ.get(INJECT_DELAY_ENV), DELAY_KINDS[kind], delay)

    @functools.wraps(function)
    def slowed() -> T:
        time.sleep(delay)
        return function()

    return slowed
