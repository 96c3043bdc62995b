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
started to allow it). Errors are OpenAI's error body, as on ``/v1``. A feed
ends by itself after ``MAX_STREAM_S``, saying so in an ``end`` event.

vLLM 0.32 counterpart: none (vLLM serves no page).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from nanoengine.entrypoints.openai.api_server import error_response
from nanoengine.entrypoints.openai.openapi_docs import errors, text
from nanoengine.instruments.live_view.feed import ACTIONS, LiveFeed

STATIC_DIR = Path(__file__).resolve().parent / "static"
# How often a feed asks the core for new frames; a step of SmolLM2 on 2 cores
# takes 20-60 ms, so a frame is at most a few steps late.
POLL_S = 0.1
# A feed stream lasts at most this long; the page reconnects if it is still open.
MAX_STREAM_S = 3600.0


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
        result: dict[str, Any] = await self.call("live_view_frames", after_step)
        return result

    async def control(self, action: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("live_view_control", action)
        return result


def read_feed(feed: LiveFeed, after_step: int) -> dict[str, Any]:
    """One answer to a page's poll: the pool's shape, new frames, the gate."""
    return {"meta": feed.describe(), "frames": feed.frames_after(after_step), "gate": feed.gate_state()}


class ControlBody(BaseModel):
    # Documented as an enum, checked by hand: the refusal then names the choices.
    action: str = Field(json_schema_extra={"enum": list(ACTIONS)})


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def feed_events(source: FrameSource, after_step: int, request: Request) -> AsyncIterator[str]:
    """The stream: ``hello``, then frames as steps end, until the client leaves or time is up."""
    answer = await source.read(after_step)
    yield sse("hello", {"meta": answer["meta"], "gate": answer["gate"]})
    gate = answer["gate"]
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
        await asyncio.sleep(POLL_S)
        answer = await source.read(after_step)
    yield sse("end", {"reason": f"a feed lasts at most {MAX_STREAM_S:.0f} s; reconnect for more"})


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
        **text("text/event-stream", "Server-sent events: hello, then frame and gate events, then end."), **errors(401)})
    async def feed(request: Request, after: int = -1) -> StreamingResponse:
        return StreamingResponse(feed_events(source, after, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @router.get("/ui/api/state", responses=errors(401))
    async def state() -> dict[str, Any]:
        answer = await source.read(-1)
        frames = answer["frames"]
        return {"meta": answer["meta"], "gate": answer["gate"], "frame": frames[-1] if frames else None}

    @router.post("/ui/api/control", response_model=None, responses=errors(400, 401, 403))
    async def control(body: ControlBody) -> dict[str, Any] | JSONResponse:
        if not allow_control:
            return error_response(403, "This server's live view is read-only: start it with --enable-ui-control "
                                   "to pause and single-step the engine.")
        if body.action not in ACTIONS:
            return error_response(400, f"action {body.action!r} is not one of {', '.join(ACTIONS)}.", "action")
        return await source.control(body.action)

    return router


@functools.cache
def static_text(name: str) -> str:
    """One of the page's files (read once per process)."""
    return (STATIC_DIR / name).read_text(encoding="utf-8")
