"""The live view's HTTP routes: the page, its script, a server-sent-events feed, the clicks.

Chapters 3-5 and 9, in a browser; chapter 8 for where it is served. One
``APIRouter`` serves both places the page lives:

* ``nanoengine serve`` adds it to its app (``server_plugin.py``): the engine
  core is in another process, so frames come through the utility calls
  ``live_view_frames`` / ``live_view_control`` (``UtilityFrameSource``);
* ``llm.serve_ui()`` runs it on a thread beside an offline ``LLM``, reading the
  in-process core directly (``CoreFrameSource``, ``offline.py``).

Routes: ``GET /ui`` (the page: static, it holds no data), ``GET /ui/viewer.js``
and ``/ui/viewer.css``, and, under ``/ui/api/`` (behind ``--api-key`` like
``/v1``): ``feed`` (``text/event-stream``: a ``hello`` event with the pool's
shape, then one ``frame`` event per step and a ``gate`` event when the
pause state changes), ``state`` (the newest frame, JSON) and ``control``
(``POST {"action": "pause" | "resume" | "step"}``; 403 unless the server was
started to allow it). Errors are OpenAI's error body, as on ``/v1``: 400 for a
bad ``after`` or action, 500 once the engine core is dead, 503 when it did not
answer within ``ANSWER_TIMEOUT_S``. A feed ends by itself after
``MAX_STREAM_S``, or when the core dies, saying why in an ``end`` event.

Every read is a utility call to the core process, and a page can go away at
any moment: a closed tab cancels the route's await, and the core's answer
then arrives for a call nobody waits for. The client drops such answers
(``MPClient``, chapter 8); the routes here never rely on an answer arriving.

vLLM 0.32 counterpart: none (vLLM serves no page).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from nanoengine.engine.exceptions import EngineDeadError
from nanoengine.entrypoints.openai.api_server import error_response
from nanoengine.entrypoints.openai.openapi_docs import errors, event_stream, text
from nanoengine.instruments.live_view.feed import ACTIONS, LiveFeed

STATIC_DIR = Path(__file__).resolve().parent / "static"
# How often a feed asks the core for new frames; a step of SmolLM2 on 2 cores
# takes 20-60 ms, so a frame is at most a few steps late.
POLL_S = 0.1
# A feed stream lasts at most this long; the page reconnects if it is still open.
MAX_STREAM_S = 3600.0
# How long a route waits for the core's answer. The core answers between two
# steps (well under a second, even on a slow CPU), so only a wedged core
# reaches it; a feed then skips that poll, the other routes answer 503.
ANSWER_TIMEOUT_S = 30.0
# Step numbers are counted in a signed 64-bit int on the way to the core.
MAX_STEP = 2**63 - 1
# Each event of the feed: its name, and its JSON data.
FEED_EVENTS: dict[str, dict[str, Any]] = {
    "hello": {"type": "object", "required": ["meta", "gate"], "description": "The pool's shape, and the gate."},
    "frame": {"type": "object", "required": ["step"], "description": "One engine step (frames.py)."},
    "gate": {"type": "object", "required": ["paused", "credits", "steps_taken"], "description": "The pause state."},
    "end": {"type": "object", "required": ["reason"], "description": "Why the feed ended."},
}


class FrameSource(Protocol):
    """Where a page's frames come from: an in-process core, or a core process."""

    async def read(self, after_step: int) -> dict[str, Any]: ...  # {"meta", "frames", "gate"}

    async def control(self, action: str) -> dict[str, Any]: ...


class CoreFrameSource:
    """Frames of a core in this process (an offline ``LLM``), read directly."""

    def __init__(self, feed: LiveFeed) -> None:
        self.feed = feed

    async def read(self, after_step: int) -> dict[str, Any]:
        return read_feed(self.feed, after_step)

    async def control(self, action: str) -> dict[str, Any]:
        return self.feed.control(action)


class UtilityFrameSource:
    """Frames of a core in another process, over its utility calls (``nanoengine serve``)."""

    def __init__(self, call_utility_async: Callable[..., Any]) -> None:
        self.call = call_utility_async

    async def read(self, after_step: int) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("live_view_frames", after_step, timeout_s=ANSWER_TIMEOUT_S)
        return result

    async def control(self, action: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("live_view_control", action, timeout_s=ANSWER_TIMEOUT_S)
        return result


def read_feed(feed: LiveFeed, after_step: int) -> dict[str, Any]:
    """One answer to a page's poll: the pool's shape, new frames, the gate."""
    return {"meta": feed.describe(), "frames": feed.frames_after(after_step), "gate": feed.gate_state()}


class ControlBody(BaseModel):
    # Documented as an enum, checked by hand: the refusal then names the choices.
    action: str = Field(json_schema_extra={"enum": list(ACTIONS)})


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def feed_events(source: FrameSource, first: dict[str, Any], after_step: int,
                      request: Request) -> AsyncIterator[str]:
    """The stream: ``hello``, then frames as steps end, until the client leaves, the core dies or time is up.

    ``first`` is the answer the route read before the stream began (an error
    there is still a JSON answer); every later read happens mid-stream, where
    an error can only be told in an ``end`` event.
    """
    answer, gate = first, first["gate"]
    yield sse("hello", {"meta": answer["meta"], "gate": gate})
    deadline = time.monotonic() + MAX_STREAM_S
    while time.monotonic() < deadline:
        # One write per poll, however many steps ended: after a hang-up the
        # stream notices at its next poll, having written at most once more.
        events = [sse("frame", frame) for frame in answer["frames"]]
        if answer["frames"]:
            after_step = answer["frames"][-1]["step"]
        if answer["gate"] != gate:
            gate = answer["gate"]
            events.append(sse("gate", gate))
        if events:
            yield "".join(events)
        if await request.is_disconnected():
            return
        if getattr(request.app.state, "shutting_down", False):  # set on SIGTERM (api_server.StoppingServer)
            yield sse("end", {"reason": "the server is stopping"})
            return
        await asyncio.sleep(POLL_S)
        try:
            answer = await source.read(after_step)
        except TimeoutError:  # a busy core: nothing new this poll
            answer = {**answer, "frames": []}
        except EngineDeadError as error:
            yield sse("end", {"reason": str(error)})
            return
    yield sse("end", {"reason": f"a feed lasts at most {MAX_STREAM_S:.0f} s; reconnect for more"})


async def answer_or_error(question: Awaitable[dict[str, Any]]) -> dict[str, Any] | JSONResponse:
    """The core's answer; OpenAI's error body when the core is dead (500) or did not answer in time (503)."""
    try:
        return await question
    except EngineDeadError as error:
        return error_response(500, str(error))
    except TimeoutError as error:
        return error_response(503, str(error))


def live_view_router(source: FrameSource, allow_control: bool) -> APIRouter:
    """The page and its data routes, over ``source``."""
    router = APIRouter()

    # Each route documents what it really sends (/openapi.json, chapter 8).
    @router.get("/ui", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(static_text("live.html").replace("__ALLOW_CONTROL__", json.dumps(allow_control)))

    @router.get("/ui/viewer.js", response_class=Response, responses=text("text/javascript", "The page's script."))
    async def script() -> Response:
        return Response(static_text("viewer.js"), media_type="text/javascript")

    @router.get("/ui/viewer.css", response_class=Response, responses=text("text/css", "The page's style sheet."))
    async def style() -> Response:
        return Response(static_text("viewer.css"), media_type="text/css")

    @router.get("/ui/api/feed", response_class=StreamingResponse, responses={
        200: {"description": "Server-sent events: hello, then frame and gate events, then end.",
              "content": {"text/event-stream": event_stream(FEED_EVENTS)}}, **errors(400, 401, 500, 503)})
    async def feed(request: Request, after: int = Query(-1, ge=-1, le=MAX_STEP, description=(
            "Send the frames of the steps after this one (-1: every frame kept)."))) -> Response:
        first = await answer_or_error(source.read(after))
        if isinstance(first, JSONResponse):
            return first
        return StreamingResponse(feed_events(source, first, after, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @router.get("/ui/api/state", response_model=None, responses=errors(401, 500, 503))
    async def state() -> dict[str, Any] | JSONResponse:
        answer = await answer_or_error(source.read(-1))
        if isinstance(answer, JSONResponse):
            return answer
        frames = answer["frames"]
        return {"meta": answer["meta"], "gate": answer["gate"], "frame": frames[-1] if frames else None}

    @router.post("/ui/api/control", response_model=None, responses=errors(400, 401, 403, 500, 503))
    async def control(body: ControlBody) -> dict[str, Any] | JSONResponse:
        if not allow_control:
            return error_response(403, "This server's live view is read-only: start it with --enable-ui-control "
                                   "to pause and single-step the engine.")
        if body.action not in ACTIONS:
            return error_response(400, f"action {body.action!r} is not one of {', '.join(ACTIONS)}.", "action")
        return await answer_or_error(source.control(body.action))

    return router


@functools.cache
def static_text(name: str) -> str:
    """One of the page's files (read once per process)."""
    return (STATIC_DIR / name).read_text(encoding="utf-8")
