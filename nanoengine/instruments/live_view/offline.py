"""The live view beside an offline ``LLM`` (``llm.serve_ui()``), and trace files for the docs site.

Chapters 3-5 and 9. ``serve_live_view(client)`` starts the live view's routes
(``app.py``) on a uvicorn thread of this process, on a free 127.0.0.1 port,
and returns a handle with the page's URL. With the default in-process core
the page reads it directly; with ``multiprocess_mode=True`` it asks the core
process, as ``nanoengine serve`` does. The learner's own thread keeps calling
``llm.generate(...)``; the page's "pause" makes that call wait between two
steps, "step" lets exactly one ``EngineCore.step()`` through.

``record_frames(core)`` is the docs site's recorder: every step of a run,
kept whether or not a page reads them, written with ``save_trace`` into the
versioned file the replays load.

vLLM 0.32 counterpart: none.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import uvicorn
from fastapi import FastAPI

from nanoengine.engine.core_client import SyncMPClient
from nanoengine.instruments.live_view.app import (
    CoreFrameSource,
    FrameSource,
    UtilityFrameSource,
    live_view_router,
)
from nanoengine.instruments.live_view.feed import LiveFeed
from nanoengine.instruments.live_view.frames import trace_document
from nanoengine.instruments.plugin import live_feed

if TYPE_CHECKING:
    from nanoengine.engine.core import EngineCore
    from nanoengine.engine.core_client import EngineCoreClient

# uvicorn binds and starts within this long, or serve_live_view says it did not.
START_TIMEOUT_S = 15.0


@dataclass
class LiveViewServer:
    """A running live view: open ``url`` in a browser; ``close()`` (or ``with``) stops it."""

    url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread

    def close(self) -> None:
        self.app.state.shutting_down = True  # an open page's feed ends at its next poll
        self.server.should_exit = True
        self.thread.join(timeout=START_TIMEOUT_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_live_view(client: EngineCoreClient, port: int = 0, allow_control: bool = True) -> LiveViewServer:
    """The page for the engine behind ``client``, served on 127.0.0.1:``port`` (0: a free one)."""
    app = FastAPI(title="nanoengine live view")
    app.include_router(live_view_router(_source_for(client), allow_control))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="LiveView", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the live view's HTTP server did not start on 127.0.0.1:{port} "
                               f"within {START_TIMEOUT_S:.0f} s (is the port taken?)")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return LiveViewServer(f"http://127.0.0.1:{bound}/ui", app, server, thread)


def _source_for(client: EngineCoreClient) -> FrameSource:
    """Read the core itself when it is in this process, else over its utility calls."""
    if isinstance(client, SyncMPClient):  # a core process (multiprocess_mode=True)
        call_utility = client.call_utility

        async def call_in_thread(method: str, *args: Any, timeout_s: float) -> Any:
            return await asyncio.to_thread(call_utility, method, *args, timeout_s=timeout_s)

        return UtilityFrameSource(call_in_thread)
    core = client.get_engine_core()
    # Attached here, on the learner's thread, before the engine's thread steps again.
    return CoreFrameSource(live_feed(core))


@contextmanager
def record_frames(core: EngineCore) -> Iterator[LiveFeed]:
    """Keep a frame of every step ``core`` runs inside the block (no page needed)."""
    feed = LiveFeed(core, idle_s=math.inf)
    try:
        yield feed
    finally:
        feed.stop()


def save_trace(feed: LiveFeed, path: Path, meta: dict[str, Any]) -> Path:
    """Write the feed's frames as a trace file (``frames.trace_document``)."""
    document = trace_document(list(feed.frames), {**feed.describe(), **meta})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, separators=(",", ":")), encoding="utf-8")
    return path
