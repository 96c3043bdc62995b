"""Chapter 8 -- online serving: a server, an engine-core process, one request's journey.

The walkthrough serves the model over HTTP from this process (uvicorn on a
thread, the FastAPI app of ``nanoengine serve``) with the engine core in a
process of its own, then follows requests through both:

1. the process tree: the API server (this process) and ``EngineCoreProc``,
   each with its threads;
2. the component tree across the process boundary (the core's half is built
   in its process and fetched over the socket);
3. one chat answer streamed token by token as server-sent events;
4. that request's message timeline: HTTP in, ``EngineCoreRequest`` encoded to
   msgpack bytes, queued and scheduled in the core, output batches back over
   ZMQ, SSE chunks out -- each with its time;
5. a client that hangs up mid-stream: the core ends the request as
   FINISHED_ABORTED and its KV blocks are free again.

    python -m chapters.ch08_serving [--model DIR] [--max-tokens N]

vLLM 0.32 counterpart: the same journey through ``vllm serve``
(``vllm/entrypoints/openai/``, ``vllm/v1/engine/async_llm.py``,
``vllm/v1/engine/core_client.py``, ``EngineCoreProc`` in ``vllm/v1/engine/core.py``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from rich.table import Table

from chapters._common import base_parser, console
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.async_llm import AsyncLLM
from nanoengine.engine.core_proc import EngineCoreRequestType
from nanoengine.entrypoints.openai.api_server import build_app
from nanoengine.instruments.method_taps import tap
from nanoengine.outputs import RequestOutput
from nanoengine.serial_utils import MsgpackEncoder

QUESTION = "What is the capital of France?"


@dataclass
class Timeline:
    """Monotonic-clock moments of one request, from both processes (one clock on Linux)."""

    events: list[tuple[float, str, str]] = field(default_factory=list)  # (time, where, what)

    def add(self, where: str, what: str, at: float | None = None) -> None:
        self.events.append((time.monotonic() if at is None else at, where, what))

    def table(self) -> Table:
        table = Table(title="one request's messages (ms after the HTTP request left the client)")
        for column in ("ms", "where", "what"):
            table.add_column(column, justify="right" if column == "ms" else "left")
        start = min(moment for moment, _, _ in self.events)
        for moment, where, what in sorted(self.events):
            table.add_row(f"{(moment - start) * 1000:.1f}", where, what)
        return table


@dataclass
class Ch08Result:
    core_pid: int
    core_threads: list[str]
    streamed_text: str
    num_chunks: int
    timeline: Timeline
    aborted_status: str | None  # how the core ended the request whose client hung up
    blocks_free_after_abort: bool


# How long a walkthrough waits for uvicorn to listen before it gives up.
SERVER_START_TIMEOUT_S = 30.0


@contextmanager
def serving_app(app: Any, name: str = "uvicorn") -> Iterator[str]:
    """An ASGI app on a free 127.0.0.1 port, on a thread of its own; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"{name}: the server did not start listening within {SERVER_START_TIMEOUT_S:g} s")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def serving(engine: AsyncLLM, model: str) -> Iterator[str]:
    """The app of ``nanoengine serve`` on a free 127.0.0.1 port, on a thread; yields its URL."""
    with serving_app(build_app(engine, model)) as url:
        yield url


def process_tree(engine: AsyncLLM) -> tuple[Table, dict[str, Any]]:
    """This process and the core's, with their threads (the core tells us its own)."""
    core = engine.client.call_utility("describe")
    table = Table(title="processes and threads")
    for column in ("process", "pid", "threads"):
        table.add_column(column)
    table.add_row("API server (uvicorn, AsyncLLM, tokenizer)", str(os.getpid()),
                  ", ".join(sorted(t.name for t in threading.enumerate())))
    table.add_row("EngineCoreProc (scheduler, KV cache, model)", str(core["pid"]), ", ".join(core["threads"]))
    return table, core


def watch_one_request(engine: AsyncLLM, timeline: Timeline) -> list[RequestOutput]:
    """Record, from outside, what crosses the process boundary for the next request."""
    finished: list[RequestOutput] = []
    encoder = MsgpackEncoder()

    def on_send(request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type is EngineCoreRequestType.ADD:
            timeline.add("front end", f"EngineCoreRequest encoded: {len(encoder.encode(payload))} bytes of msgpack "
                                      f"({len(payload.prompt_token_ids)} prompt tokens)")

    def on_batch(outputs: Any) -> None:
        for output in getattr(outputs, "outputs", []):
            if output.new_token_ids or output.finished:
                timeline.add("ZMQ -> front end", f"output batch: {len(output.new_token_ids)} token(s)"
                                                 + (f", {output.finish_reason}" if output.finished else ""))

    tap(engine.client, "_send", before=on_send)
    tap(engine.client.outputs_queue, "put_nowait", before=on_batch)
    engine.finished_listeners.append(finished.append)
    return finished


def stream_one_answer(url: str, model: str, max_tokens: int, timeline: Timeline) -> tuple[str, int]:
    """POST /v1/chat/completions with stream=true; print each token as it arrives."""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    text, chunks = "", 0
    console.print(f"[bold]user:[/] {QUESTION}\n[bold]assistant:[/] ", end="")
    timeline.add("client", "HTTP POST /v1/chat/completions sent")
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[len("data: "):])["choices"]
            piece = choices[0]["delta"].get("content") or "" if choices else ""
            chunks += 1
            text += piece
            console.print(piece, end="", markup=False)
            if chunks <= 3 or (choices and choices[0].get("finish_reason")):
                timeline.add("client", f"SSE chunk {chunks}: {piece!r}")
    console.print()
    return text, chunks


def hang_up_mid_stream(url: str, model: str, engine: AsyncLLM) -> tuple[str | None, bool]:
    """Read three chunks of a long answer, close the connection, ask the core what happened."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    # The instruments' plugin offers these utility calls in the core's process:
    # from now on the core remembers which requests end, and how.
    engine.client.call_utility("watch_finished")
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        chunk_id = None
        for number, line in enumerate(ln for ln in reply.iter_lines() if ln.startswith("data: {")):
            chunk_id = json.loads(line[len("data: "):])["id"]
            if number == 2:
                break  # leaving the with-block closes the connection
    deadline = time.monotonic() + 5
    status = None
    while time.monotonic() < deadline and status is None:
        finished = dict(engine.client.call_utility("recently_finished"))
        # A completion's engine request is named "<response id>-<prompt index>", as in vLLM.
        status = finished.get(f"{chunk_id}-0")
        time.sleep(0.05)
    stats = engine.client.call_utility("get_stats")
    return status, stats["num_free_blocks"] == stats["num_usable_blocks"]


def main(argv: list[str] | None = None) -> Ch08Result:
    parser = base_parser(__doc__ or "", __name__)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args(argv)
    console.rule("starting AsyncLLM: the engine core gets a process of its own")
    engine = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(args.model, max_model_len=args.max_model_len))
    try:
        with serving(engine, args.model) as url:
            console.print(f"serving {args.model} at {url} (the app of `nanoengine serve`)")
            console.rule("1. processes and threads")
            table, core = process_tree(engine)
            console.print(table)
            console.rule("2. the component tree, across the process boundary")
            print(engine)
            console.rule("3. one answer, streamed as server-sent events")
            timeline = Timeline()
            finished = watch_one_request(engine, timeline)
            text, chunks = stream_one_answer(url, args.model, args.max_tokens, timeline)
            console.rule("4. that request's messages, in time order")
            for name, moment in finished[0].metrics.events if finished and finished[0].metrics else []:
                timeline.add("engine core" if name in ("queued", "scheduled", "preempted") else "front end",
                             f"{name} (request event)", at=moment)
            console.print(timeline.table())
            console.rule("5. a client that hangs up")
            status, blocks_free = hang_up_mid_stream(url, args.model, engine)
            console.print(f"the core ended the request as {status}; every KV block free again: {blocks_free}")
    finally:
        engine.shutdown()
    return Ch08Result(core["pid"], core["threads"], text, chunks, timeline, status, blocks_free)


if __name__ == "__main__":
    main()
