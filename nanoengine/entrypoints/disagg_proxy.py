"""``nanoengine proxy``: one OpenAI endpoint in front of prefill servers and decode servers.

Chapter 10 (disaggregated prefill and decode). The proxy speaks vLLM's protocol
(the requests of vLLM's example proxy, which work on two nanoengine servers
as they are):

1. the client's request goes to a **prefill** server (a ``kv_producer``) with
   ``max_tokens: 1``, no stream, and ``kv_transfer_params: {"do_remote_decode":
   true}``: the server prefills the prompt, keeps its KV blocks, and answers
   with ``kv_transfer_params`` saying where they are;
2. the client's request, unchanged but for those ``kv_transfer_params``, goes
   to a **decode** server (a ``kv_consumer``), which pulls the blocks and
   generates; its answer -- a stream or not -- goes back to the client as it is.

Several servers of each kind take turns (round robin). A client that hangs up
closes the upstream connection, and the server it was on aborts the request.
A server that cannot be reached or answers an error is reported to the client
with OpenAI's error body (the server's own body when it sent one).

vLLM 0.32 counterpart: ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
and ``examples/online_serving/disaggregated_serving/`` (vLLM ships its proxy as
an example, not a command; here it is ``nanoengine proxy``, since chapter 10 starts it).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoengine.entrypoints.openai.api_server import GRACEFUL_SHUTDOWN_S, cancel_on_disconnect, error_response

# What the prefill server is asked for: the KV of the prompt, and one token it throws away.
PREFILL_OVERRIDES: dict[str, Any] = {
    "max_tokens": 1,
    "stream": False,
    "kv_transfer_params": {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    },
}
# Headers a server must see as the client sent them.
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as the prefill server gets it (step 1)."""
    request = {key: value for key, value in body.items() if key != "stream_options"}
    request.update(PREFILL_OVERRIDES)
    if "max_completion_tokens" in body:  # the chat API's newer name for the same limit
        request["max_completion_tokens"] = 1
    return request


def decode_request(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body as the decode server gets it (step 2): the prefill's answer attached."""
    return {**body, "kv_transfer_params": kv_transfer_params} if kv_transfer_params else dict(body)


@dataclass
class Backends:
    """The servers behind the proxy, each kind taken in turn."""

    prefill: list[str]
    decode: list[str]

    def __post_init__(self) -> None:
        self._prefill: Iterator[str] = itertools.cycle(self.prefill)
        self._decode: Iterator[str] = itertools.cycle(self.decode)

    def next_prefill(self) -> str:
        return next(self._prefill)

    def next_decode(self) -> str:
        return next(self._decode)


class UpstreamError(Exception):
    """A server answered with an error, or could not be reached: the client gets this response."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def build_proxy_app(backends: Backends, timeout_s: float = 600.0) -> FastAPI:
    """The proxy's routes: the two generation APIs, the model list, and a health check."""
    client: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal client
        # One pool of connections for the proxy's life; a server that stops
        # answering fails the request after timeout_s instead of holding it forever.
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
            yield

    app = FastAPI(title="nanoengine proxy", lifespan=lifespan)

    def http() -> httpx.AsyncClient:
        assert client is not None, "the proxy's HTTP client exists while the app runs"
        return client

    async def disaggregate(path: str, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object.")
        headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
        try:
            kv_transfer_params = await _prefill(http(), backends.next_prefill() + path, body, headers)
            return await _decode(http(), backends.next_decode() + path, decode_request(body, kv_transfer_params),
                                 headers, stream=bool(body.get("stream")))
        except UpstreamError as error:
            return error.response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _respond(request, disaggregate("/v1/completions", request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _respond(request, disaggregate("/v1/chat/completions", request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
        upstream = await _send(http(), "GET", backends.decode[0] + "/v1/models", headers)
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        """200 when every server answers its own /health, else 503 naming those that do not."""
        failing = []
        for url in backends.prefill + backends.decode:
            try:
                ok = (await http().get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                failing.append(url)
        if failing:
            return error_response(503, f"these servers are not healthy: {failing}")
        return JSONResponse({"status": "ok", "prefill": backends.prefill, "decode": backends.decode})

    return app


async def _respond(request: Request, work: Any) -> Response:
    """Run the two requests; a client that hangs up cancels them (the upstream connection closes)."""
    response = await cancel_on_disconnect(request, work)
    return Response(status_code=499) if response is None else response


async def _send(client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str],
                body: dict[str, Any] | None = None, stream: bool = False) -> httpx.Response:
    """One request upstream; a server that cannot be reached becomes a 502 for the client."""
    try:
        return await client.send(client.build_request(method, url, json=body, headers=headers), stream=stream)
    except httpx.HTTPError as error:
        raise UpstreamError(error_response(502, f"the proxy could not reach {url}: {error!r}")) from error


async def _prefill(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                   headers: dict[str, str]) -> dict[str, Any] | None:
    """Step 1: the prefill server's ``kv_transfer_params`` (None if it sent none: the decode computes all)."""
    upstream = await _send(client, "POST", url, headers, prefill_request(body))
    if upstream.status_code != 200:
        raise UpstreamError(Response(upstream.content, upstream.status_code, media_type="application/json"))
    params = upstream.json().get("kv_transfer_params")
    return params if isinstance(params, dict) else None


async def _decode(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                  stream: bool) -> Response:
    """Step 2: the decode server's answer, relayed as it comes (a stream chunk by chunk)."""
    upstream = await _send(client, "POST", url, headers, body, stream=stream)
    if not stream or upstream.status_code != 200:
        content = await upstream.aread()
        await upstream.aclose()
        return Response(content, upstream.status_code, media_type="application/json")

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()  # a client that left closes the decode server's stream too

    return StreamingResponse(relay(), media_type="text/event-stream")


def make_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoengine proxy",
                                     description="One OpenAI endpoint in front of prefill and decode servers.")
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill servers (kv_producer), e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode servers (kv_consumer), e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="the longest the proxy waits for a server's answer (default 600)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = make_arg_parser().parse_args(argv)
    for url in args.prefill + args.decode:
        if not url.startswith(("http://", "https://")):
            raise SystemExit(f"nanoengine proxy: error: a server URL must start with http:// or https://, got {url!r}")
    backends = Backends([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode])
    # A stop waits for open answers as nanoengine serve does, at most GRACEFUL_SHUTDOWN_S (uvicorn's
    # own default waits for ever, and a relayed stream lasts up to --timeout-s).
    uvicorn.run(build_proxy_app(backends, args.timeout_s), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


if __name__ == "__main__":
    main()
