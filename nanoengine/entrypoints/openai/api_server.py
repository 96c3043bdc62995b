"""``nanoengine serve``: an OpenAI-compatible HTTP server over ``AsyncLLM``.

Chapter 8 (online serving). Three processes' worth of work in two processes:
this one runs uvicorn's event loop (HTTP, JSON, tokenizing, detokenizing, the
output handler of ``AsyncLLM``); the engine core runs in its own process
(``EngineCoreProc``) and only ever sees token ids. The routes:

* ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (JSON, or
  server-sent events with ``"stream": true``);
* ``/tokenize``, ``/detokenize``, ``/health`` (503 once the core is gone),
  ``/version``, ``/metrics`` (Prometheus text, vLLM's metric names, see metrics.py).

Once the engine core is dead -- its process killed, or a thread it cannot
live without gone (``EngineDeadError``, chapter 8) -- every pending and later
generation fails with a 500 in OpenAI's error body (in-band on a stream that
already started), ``/health`` answers 503, and the server stays up to say so
until it is stopped; SIGTERM still stops it within seconds.

Bad input never reaches the engine: every error is OpenAI's JSON body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status -- 400
for a malformed or out-of-range request, 401 without the API key, 404 for an
unknown model -- and the server goes on serving. When the mistake is one
field's value, ``param`` names the field, as vLLM's does. A client that
disconnects, streaming or not, has its request aborted in the core at once.

``/openapi.json`` documents what each route answers (``openapi_docs.py``):
JSON or ``text/event-stream``, Prometheus text for ``/metrics``, an empty
``/health``, and the error bodies above; its request schemas carry the same
ranges the server enforces (``schema_notes.py``).

At ``--uvicorn-log-level info`` (the default, as in vLLM) uvicorn logs one
access line per request; a request carrying fields the server does not know
is served, and the fields are named in a warning.

    nanoengine serve SmolLM2-135M-Instruct --port 8000 [--api-key KEY] [engine arguments]
    python -m nanoengine.entrypoints.openai.api_server SmolLM2-135M-Instruct ...

vLLM 0.32 counterpart: ``vllm/entrypoints/launchers/app.py`` (``build_app``),
``vllm/entrypoints/launchers/api_server/entry.py`` (``build_async_engine_client``,
``run_server``), the routers of ``vllm/entrypoints/openai/`` and
``with_cancellation`` / ``listen_for_disconnect`` of
``vllm/entrypoints/serve/utils/api_utils.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from http import HTTPStatus
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from nanoengine import __version__
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.async_llm import AsyncLLM
from nanoengine.engine.exceptions import EngineDeadError
from nanoengine.entrypoints.openai.metrics import ServerMetrics
from nanoengine.entrypoints.openai.openapi_docs import HEALTH, METRICS, errors, finish, generation
from nanoengine.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelPermission,
    RequestModel,
    TokenizeRequest,
    TokenizeResponse,
    conversation,
)
from nanoengine.entrypoints.openai.protocol_chat import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from nanoengine.entrypoints.openai.protocol_completion import (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from nanoengine.entrypoints.openai.serving import NEEDS_TOKENIZER
from nanoengine.entrypoints.openai.serving_chat import OpenAIServingChat
from nanoengine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from nanoengine.exceptions import KVTransferError
from nanoengine.plugins import load_api_server_plugins

logger = logging.getLogger("nanoengine.serve")

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


# Segments pydantic puts in an error's location that name a type, not a field:
# "prompt" fails as a "str" and as a "list[int]" before the union gives up.
_TYPE_SEGMENTS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "union", "function-after",
                            "function-before", "function-wrap", "function-plain"})


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    """OpenAI's error body, the status repeated as ``code``; ``kind`` overrides the usual type."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind or _ERROR_TYPES.get(status, "Error"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def field_path(location: tuple[int | str, ...]) -> str:
    """A pydantic error location as vLLM's ``param``: ``body.messages.0.role``, type names left out."""
    kept = [str(part) for part in location if not ("[" in str(part) or str(part) in _TYPE_SEGMENTS)]
    return ".".join(kept)


def build_app(engine: AsyncLLM, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI application: routes, error handlers, the API-key check, metrics."""
    completion_serving = OpenAIServingCompletion(engine, served_model_name)  # refuses an engine without tokenizer
    chat_serving = OpenAIServingChat(engine, served_model_name)
    tokenizer = completion_serving.tokenizer
    model_config = engine.engine_config.model_config
    metrics = ServerMetrics(served_model_name, engine.engine_config.model_config.max_model_len)
    engine.output_processor.stat_loggers.append(metrics.record_iteration)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="nanoengine", lifespan=lifespan)
    framework_schema = app.openapi
    # FastAPI builds the schema on the first request for it; finish() amends it then.
    app.openapi = lambda: finish(framework_schema())  # type: ignore[method-assign]

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """What the framework refuses on its own (an unknown route, a body that is not
        UTF-8, JSON nested too deep) gets OpenAI's error body too, typed as vLLM types it.
        Its headers stay: a 405 names the methods the route takes in ``Allow`` (RFC 9110)."""
        response = error_response(error.status_code, str(error.detail), kind=HTTPStatus(error.status_code).phrase)
        response.headers.update(error.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        """A body pydantic refused, answered as vLLM does: type "Bad Request", ``param`` the field's path
        (for JSON that does not parse, ``body.<character offset>``)."""
        first = error.errors()[0] if error.errors() else {}
        where = field_path(tuple(first.get("loc", ()))) or None
        if first.get("type") == "json_invalid":
            message = f"The request body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return error_response(400, message, where, kind="Bad Request")

    if api_key is not None:
        app.add_middleware(AuthenticationMiddleware, api_key=api_key)

    def check_model(body: RequestModel) -> JSONResponse | None:
        """An unknown model is a 404; unknown fields are served, and named in a warning."""
        if ignored := body.ignored_fields():
            logger.warning("The request carried fields this server ignores: %s", ", ".join(ignored))
        model = getattr(body, "model", None)
        if model is not None and model != served_model_name:
            return error_response(404, f"The model {model!r} does not exist; this server serves "
                                       f"{served_model_name!r}.", "model")
        return None

    @app.get("/health", response_class=Response, responses=HEALTH)
    async def health() -> Response:
        return Response(status_code=503 if engine.errored else 200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models", responses=errors(401))
    async def models() -> dict[str, Any]:
        card = ModelCard(id=served_model_name, root=model_config.model, max_model_len=model_config.max_model_len,
                         permission=[ModelPermission()])
        return {"object": "list", "data": [card.model_dump()]}

    @app.post("/v1/completions", response_model=None,
              responses=generation(CompletionResponse, CompletionStreamResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if (refused := check_model(body)) is not None:
            return refused
        try:
            params, prompts = completion_serving.render_completion_request(body)
        except (ValueError, TypeError) as error:
            return client_error(error)
        return await _respond(request, completion_serving.create_completion(body, params, prompts))

    @app.post("/v1/chat/completions", response_model=None,
              responses=generation(ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if (refused := check_model(body)) is not None:
            return refused
        try:
            params, prompt = chat_serving.render_chat_request(body)
        except (ValueError, TypeError) as error:
            return client_error(error)
        return await _respond(request, chat_serving.create_chat_completion(body, params, prompt))

    @app.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse}, **errors(400, 404)})
    async def tokenize(body: TokenizeRequest) -> Response:
        if (refused := check_model(body)) is not None:
            return refused
        try:
            if body.messages is not None:
                rendered = engine.renderer.render_chat(conversation(body.messages),
                                                       add_generation_prompt=body.add_generation_prompt)
                tokens = rendered["prompt_token_ids"]
            else:
                tokens = list(tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens))
        except (ValueError, TypeError) as error:
            return client_error(error)
        strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": model_config.max_model_len, "tokens": tokens,
                             "token_strs": strs})

    @app.post("/detokenize", response_model=None,
              responses={200: {"model": DetokenizeResponse}, **errors(400, 404)})
    async def detokenize(body: DetokenizeRequest) -> Response:
        if (refused := check_model(body)) is not None:
            return refused
        vocab_size = model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            return error_response(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab_size}).", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    @app.get("/metrics", response_class=Response, responses=METRICS)
    async def prometheus_metrics() -> Response:
        if not engine.errored:
            try:
                metrics.update_engine_stats(await engine.get_stats())
            except (EngineDeadError, TimeoutError) as error:  # the last figures stay; /health tells the rest
                logger.warning("/metrics: the engine core's figures are stale: %s", error)
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    return app


# On SIGTERM or Ctrl-C, open responses get this long to finish before uvicorn closes
# them (a long completion, say; a live view's feed ends at once, see StoppingServer).
GRACEFUL_SHUTDOWN_S = 10  # seconds
# The routes --api-key guards: the API, and the live view's data (its page itself holds none).
GUARDED_PREFIXES = ("/v1", "/ui/api/")


class AuthenticationMiddleware:
    """401 for a ``/v1`` (or ``/ui/api/``) request without ``Authorization: Bearer <key>``.

    A plain ASGI middleware, as vLLM's is: FastAPI's ``@app.middleware("http")``
    would pass every chunk of every stream through an extra queue and task,
    which at one chunk per token was a tenth of the server's own CPU time.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["path"].startswith(GUARDED_PREFIXES)
        if guarded and dict(scope["headers"]).get(b"authorization") != self.expected:
            refusal = error_response(401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.")
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


def client_error(error: ValueError | TypeError) -> JSONResponse:
    """A 400; a ``ValidationError`` knows which field was wrong."""
    return error_response(400, str(error), getattr(error, "parameter", None))


async def _respond(request: Request, work: Awaitable[Any]) -> Response:
    """Run a generation; a disconnect aborts it, the client's mistakes become 400s."""
    try:
        result = await cancel_on_disconnect(request, work)
    except EngineDeadError as error:  # as vLLM: an internal error, and /health turns 503
        return error_response(500, str(error))
    except KVTransferError as error:  # chapter 10: the prefill engine's KV never arrived
        return error_response(500, str(error))
    except (ValueError, TypeError) as error:
        return client_error(error)
    if result is None:  # the client left: nobody to answer
        return Response(status_code=499)
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream")


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first; then cancel it (None).

    Cancelling the handler closes its ``AsyncLLM.generate`` generators, which
    abort their requests in the engine core, freeing their KV blocks.
    """
    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if handler in done:
        watcher.cancel()
        return handler.result()
    handler.cancel()
    return None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_arg_parser() -> argparse.ArgumentParser:
    """vLLM's serve flags where they overlap, then every engine argument."""
    parser = argparse.ArgumentParser(prog="nanoengine serve", description="An OpenAI-compatible server.")
    parser.add_argument("model", nargs="?", default="SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("NANOENGINE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (or NANOENGINE_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="uvicorn's log level; at info it logs one access line per request")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access line per request")
    parser.add_argument("--enable-ui-control", action="store_true",
                        help="let the live view's page (/ui) pause the engine and advance it one step at a time")
    EngineArgs.add_cli_args(parser)
    return parser


def run_server(args: argparse.Namespace) -> None:
    """Build the engine (the core process starts), then serve until interrupted."""
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.skip_tokenizer_init:
        # Refused before the engine core process is started for nothing.
        raise ValueError(NEEDS_TOKENIZER)
    engine = AsyncLLM.from_engine_args(engine_args)
    app = build_app(engine, args.served_model_name or args.model, args.api_key)
    for add_to_app in load_api_server_plugins().values():
        add_to_app(app, engine, args)  # the instruments' live view (/ui) comes in here
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    try:
        StoppingServer(config, app).run()
    finally:
        engine.shutdown()


class StoppingServer(uvicorn.Server):
    """uvicorn's server, telling the app the moment SIGTERM (or Ctrl-C) arrives.

    uvicorn waits for open responses to finish before it stops; a stream that
    never ends by itself (the live view's feed) reads ``app.state.shutting_down``
    and ends at once, so a stop takes a moment, not ``GRACEFUL_SHUTDOWN_S``.
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.shutting_down = True
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    run_server(make_arg_parser().parse_args(argv))


if __name__ == "__main__":
    main()
