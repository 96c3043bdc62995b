"""Requests drawn from the server's own ``/openapi.json``, and answers checked against it (chapter 8).

Shared by ``tests/test_openapi_schema.py`` (a few hundred requests) and
``scripts/fuzz_openapi.py`` (thousands). Each body is drawn by
``schema_strategies.from_schema`` from the route's documented request schema, narrowed
only where a wide value would just make a request slow (``max_tokens``, ``n``)
or add properties nobody declared -- a narrower schema draws a subset of the
documented one, so every drawn body is one the schema calls valid.

``check`` holds the answer to the documentation: no 5xx; a status the route
documents; the documented content type (none for an empty ``/health``); a
body that validates against the documented schema (each event of a stream,
as a client parses it, against the route's ``itemSchema``, and the JSON in its
data against the ``contentSchema`` there, as schemathesis reads them); and a
2xx, unless the refusal names a field of one of the documented exceptions
(``schema_notes.SCHEMA_EXCEPTIONS``). The live view's feed never ends by
itself: it is read for ``FEED_READ_S`` and its complete events are checked.

vLLM 0.32 counterpart: ``tests/entrypoints/openai/test_openai_schema.py``
(schemathesis over ``/openapi.json``, checking only for server errors).
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
from hypothesis import strategies as st
from schema_strategies import from_schema

from nanoengine.entrypoints.openai.schema_notes import exception_for

Json = Any
# The OpenAI routes and the live view's reads. Not its control route: a drawn
# "pause" would stall every later request of the run.
ROUTES = (("get", "/health"), ("get", "/version"), ("get", "/v1/models"), ("get", "/metrics"),
          ("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("post", "/tokenize"),
          ("post", "/detokenize"), ("get", "/ui/api/feed"), ("get", "/ui/api/state"))
# The live view's feed streams until the client leaves: read until it is this long
# quiet (its hello comes at once; an idle engine sends nothing more), then hang up.
FEED_QUIET_S = 1.0
# Narrowed so that a request is a few decode steps on the tiny model, never a run to max_model_len.
NARROWER = {"max_tokens": {"maximum": 4}, "max_completion_tokens": {"maximum": 4}, "n": {"maximum": 2},
            "min_tokens": {"maximum": 2}}
DEADLINE_S = 30.0  # per request: a hang is reported, not waited out


@dataclass
class Drawn:
    method: str
    path: str
    body: Json = None
    params: dict[str, Any] = field(default_factory=dict)  # the query string


@dataclass
class Tally:
    """What a run saw: per route and status, the exceptions met, the mismatches."""

    statuses: Counter[str] = field(default_factory=Counter)
    exceptions: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"{key}: {count}" for key, count in sorted(self.statuses.items())]
        lines += [f"refused under exception '{rule}': {count}" for rule, count in sorted(self.exceptions.items())]
        lines.append(f"schema mismatches: {len(self.mismatches)}")
        return "\n".join(lines + self.mismatches[:20])


def request_schema(openapi: Json, path: str) -> Json:
    """The route's body schema, narrowed, with the components its $refs point into."""
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    components = copy.deepcopy(openapi["components"])
    body = components["schemas"][ref.rsplit("/", 1)[-1]]
    body["additionalProperties"] = False
    for name, narrower in NARROWER.items():
        if name in body.get("properties", {}):
            body["properties"][name].update(narrower)
    return {**body, "components": components}


def requests(openapi: Json) -> st.SearchStrategy[Drawn]:
    """Any documented route, with a body drawn from its schema where it takes one."""
    choices = []
    for method, path in ROUTES:
        if method == "get":
            choices.append(query(openapi, path))
        else:
            schema = request_schema(openapi, path)
            choices.append(from_schema(schema, schema).map(
                lambda body, path=path: Drawn("post", path, body)))
    return st.one_of(choices)


def query(openapi: Json, path: str) -> st.SearchStrategy[Drawn]:
    """A GET of ``path`` with each documented query parameter drawn from its schema (or left out)."""
    parameters = [p for p in openapi["paths"][path]["get"].get("parameters", []) if p["in"] == "query"]
    drawn = {p["name"]: st.none() | from_schema(p["schema"], openapi) for p in parameters}
    return st.fixed_dictionaries(drawn).map(lambda values: Drawn(
        "get", path, params={name: value for name, value in values.items() if value is not None}))


def send(client: httpx.Client, drawn: Drawn) -> httpx.Response:
    """One request, bounded by DEADLINE_S (httpx raises a timeout naming what it waited for)."""
    if drawn.path == "/ui/api/feed":
        return read_feed_briefly(client, drawn.params)
    return client.request(drawn.method, drawn.path, json=drawn.body, params=drawn.params, timeout=DEADLINE_S)


def read_feed_briefly(client: httpx.Client, params: dict[str, Any]) -> httpx.Response:
    """The feed's answer: its complete events until it is ``FEED_QUIET_S`` quiet, at most
    ``DEADLINE_S`` (an error answer whole)."""
    timeout = httpx.Timeout(DEADLINE_S, read=FEED_QUIET_S)
    received, stop_at = b"", time.monotonic() + DEADLINE_S
    with client.stream("GET", "/ui/api/feed", params=params, timeout=timeout) as streamed:
        if streamed.status_code != 200:
            streamed.read()
            return httpx.Response(streamed.status_code, headers=streamed.headers, content=streamed.content)
        try:
            for chunk in streamed.iter_bytes():
                received += chunk
                if time.monotonic() > stop_at:
                    break
        except httpx.ReadTimeout:
            pass  # quiet: the engine is idle
    complete = received[: received.rfind(b"\n\n") + 2]  # a hang-up can cut the last event short
    if not complete:
        raise TimeoutError(f"the feed sent no complete event within {FEED_QUIET_S:g} s of its headers")
    return httpx.Response(200, headers=streamed.headers, content=complete)


def check(openapi: Json, drawn: Drawn, response: httpx.Response, tally: Tally) -> list[str]:
    """Every way ``response`` disagrees with the documentation (also counted in ``tally``)."""
    status = response.status_code
    tally.statuses[f"{drawn.method.upper()} {drawn.path} {status}"] += 1
    documented = openapi["paths"][drawn.path][drawn.method]["responses"].get(str(status))
    if documented is None:
        problems = [f"status {status} is not documented: {response.text[:200]}"]
    else:
        problems = _check_content(openapi, documented.get("content") or {}, response)
    if status >= 300 and not problems:
        problems = _check_refusal(response, tally)
    if problems:
        tally.mismatches.append(f"{drawn.method.upper()} {drawn.path} {json.dumps(drawn.body)[:300]}: {problems}")
    return problems


def _check_content(openapi: Json, content: Json, response: httpx.Response) -> list[str]:
    kind = response.headers.get("content-type")
    if not content:
        return [] if kind is None and not response.content else [f"documented empty, got {kind} {response.text[:80]}"]
    documented = _documented_type(kind or "", content)
    if documented is None:
        return [f"content type {kind!r} is not among {sorted(content)}"]
    if documented == "application/json":
        return _invalid(openapi, content[documented]["schema"], response.json())
    if documented == "text/event-stream":
        item = content[documented]["itemSchema"]
        return [problem for event in parse_events(response.text) for problem in _check_event(openapi, item, event)]
    return []


def parse_events(text: str) -> list[dict[str, str]]:
    """The stream's events as a client parses them: the ``event`` name ("message" when none is
    given) and the ``data`` lines joined; comment lines skipped."""
    events: list[dict[str, str]] = []
    name, data = "", []
    for line in [*text.splitlines(), ""]:
        if not line:
            if data:
                events.append({"event": name or "message", "data": "\n".join(data)})
            name, data = "", []
        elif line.startswith("event:"):
            name = line[len("event:"):].removeprefix(" ")
        elif line.startswith("data:"):
            data.append(line[len("data:"):].removeprefix(" "))
    return events


def _check_event(openapi: Json, item_schema: Json, event: dict[str, str]) -> list[str]:
    """The event against ``itemSchema``; then the JSON in its data against its ``contentSchema``."""
    problems = _invalid(openapi, item_schema, event)
    content_schema = None if problems else _content_schema(item_schema, event)
    if content_schema is None:
        return problems
    try:
        data = json.loads(event["data"])
    except json.JSONDecodeError as error:
        return [f"event {event['event']!r}: its data is not JSON ({error}): {event['data'][:80]}"]
    return [f"event {event['event']!r}: {problem}" for problem in _invalid(openapi, content_schema, data)]


def _content_schema(item_schema: Json, event: dict[str, str]) -> Json | None:
    """The schema of the JSON in ``event``'s data; None for a documented constant such as [DONE]."""
    for branch in item_schema.get("oneOf", [item_schema]):
        if branch["properties"]["event"]["const"] != event["event"]:
            continue
        options = branch["properties"]["data"].get("anyOf", [branch["properties"]["data"]])
        if any(option.get("const") == event["data"] for option in options):
            return None
        return next(option["contentSchema"] for option in options if "contentSchema" in option)
    return None


def _documented_type(kind: str, content: Json) -> str | None:
    """The documented media type ``kind`` is: itself, or a bare type plus the charset Starlette adds to text."""
    if kind in content:
        return kind
    bare = kind.split(";")[0].strip()
    return bare if bare in content and kind.removeprefix(bare).strip() in ("", "; charset=utf-8") else None


def _invalid(openapi: Json, schema: Json, body: Json) -> list[str]:
    validator = jsonschema.Draft202012Validator({**schema, "components": openapi["components"]})
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message[:160]}" for error in validator.iter_errors(body)]


def _check_refusal(response: httpx.Response, tally: Tally) -> list[str]:
    """A schema-valid request refused: allowed only under a documented exception."""
    error = response.json().get("error", {})
    param = error.get("param")
    exception = exception_for(param, str(error.get("message")))
    if exception is None:
        return [f"a schema-valid request was refused ({param}): {error.get('message')}"]
    tally.exceptions[exception.rule] += 1
    return []
