"""What each route of ``nanoengine serve`` answers, as ``/openapi.json`` documents it.

Chapter 8 (online serving). FastAPI documents a route's 200 as JSON and adds a
422 for every parsed body; neither is what this server sends everywhere.
These tables, passed as the routes' ``responses=``, say what it does send:
``text/event-stream`` beside JSON for the generation routes (each event
described as OpenAPI 3.2's ``itemSchema`` describes one: the ``event`` name
and ``data`` string a client parses, the JSON inside it in ``contentSchema``,
which is how a schema-driven fuzzer such as schemathesis reads it), Prometheus' text
format for ``/metrics`` (prometheus_client's ``CONTENT_TYPE_LATEST``), an
empty body without a content type for ``/health`` (vLLM's
``Response(status_code=200)``), and OpenAI's error body for each 4xx and 5xx
a route can give. ``finish`` takes FastAPI's 422 back out: pydantic's
refusals are 400s here, as in vLLM (``invalid_body`` in api_server.py).

vLLM 0.32 counterpart: the ``responses=`` tables on vLLM's OpenAI routes
(``create_completion``, ``create_chat_completion``: ``text/event-stream`` and
``ErrorResponse``); vLLM leaves FastAPI's 422 entry in.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from nanoengine.entrypoints.openai.protocol import ErrorResponse

JsonDict = dict[str, Any]


def errors(*statuses: int) -> dict[int | str, JsonDict]:
    """OpenAI's error body for each status; pydantic's refusals are 400s here, as in vLLM, never 422s."""
    why = {400: "A malformed or out-of-range request (pydantic's refusals included).",
           401: "No or a wrong API key (only with --api-key).",
           403: "The live view is read-only (start the server with --enable-ui-control).", 404: "Not the served model.",
           500: "The engine core died (EngineDeadError), or the prefill server's KV never arrived (chapter 10).",
           503: "The engine core did not answer in time (busy, or paused by the live view)."}
    return {status: {"model": ErrorResponse, "description": why[status]} for status in statuses}


# The stream chunks' models: no route returns one as its body, so FastAPI would leave them out.
STREAM_CHUNKS: dict[str, type[BaseModel]] = {}


def generation(answer: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, JsonDict]:
    """A generation route: ``answer`` as JSON, or with ``"stream": true`` server-sent events,
    one ``chunk`` per ``data:`` line (an error body in-band if one comes late), then ``data: [DONE]``."""
    STREAM_CHUNKS[chunk.__name__] = chunk
    chunk_or_error = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                {"$ref": "#/components/schemas/ErrorResponse"}]}
    data = {"anyOf": [{"const": "[DONE]", "description": "The stream's last event."},
                      json_text(chunk_or_error, f"One {chunk.__name__}, or an error after the stream began.")]}
    events = {"itemSchema": sse_event("message", data)}
    return {200: {"model": answer, "content": {"text/event-stream": events}}, **errors(400, 401, 404, 500)}


def json_text(schema: JsonDict, description: str) -> JsonDict:
    """A string that holds JSON described by ``schema`` (JSON Schema's ``contentSchema``)."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema,
            "description": description}


def sse_event(name: str, data: JsonDict) -> JsonDict:
    """One server-sent event as a client parses it: its name ("message" when no ``event:`` line
    names it) and its ``data`` string."""
    return {"type": "object", "required": ["event", "data"], "properties": {"event": {"const": name}, "data": data}}


def event_stream(events: dict[str, JsonDict]) -> JsonDict:
    """A ``text/event-stream`` body of named events, each with JSON data (event name -> its data's schema)."""
    return {"itemSchema": {"oneOf": [sse_event(name, json_text(schema, str(schema.get("description", ""))))
                                     for name, schema in events.items()]}}


HEALTH: dict[int | str, JsonDict] = {200: {"description": "The engine core is alive: an empty body, no content type (as vLLM)."},
          503: {"description": "The engine core is gone: an empty body."}}
METRICS: dict[int | str, JsonDict] = {200: {"description": "Prometheus' text format, vLLM's metric names.",
                 "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}}


def text(media_type: str, description: str) -> dict[int | str, JsonDict]:
    """A 200 whose body is text of ``media_type`` (a page, a script, an event stream)."""
    return {200: {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}}


def finish(schema: JsonDict) -> JsonDict:
    """FastAPI's schema made true: its 422s dropped (this server answers those with a 400), the
    stream chunks' models added. Idempotent: FastAPI caches the schema, this may see it again."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, chunk in STREAM_CHUNKS.items():
        made = chunk.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        components.update(made.pop("$defs", {}))
        components[name] = made
    for operation in (op for path in schema.get("paths", {}).values() for op in path.values()):
        operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    _exact_bounds(schema)
    return schema


# FastAPI's OpenAPI model holds bounds as floats, and float(2**63 - 1) is 2**63: a
# client trusting it would send a seed one past int64. The exact ints, back.
_INT64_BOUNDS = {float(2**63 - 1): 2**63 - 1, float(-(2**63)): -(2**63)}


def _exact_bounds(node: Any) -> None:
    """Every integral bound as an int again, the int64 limits exact."""
    if isinstance(node, list):
        for item in node:
            _exact_bounds(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in ("minimum", "maximum") and isinstance(value, float) and value.is_integer():
                node[key] = _INT64_BOUNDS.get(value, int(value))
            else:
                _exact_bounds(value)
