"""``/openapi.json`` tells the truth: requests drawn from it are answered as it documents (chapter 8).

One server on the tiny random-weight model (``server_fuzz.SERVER_FLAGS``:
max_model_len 128) publishes its schema; ``schema_strategies`` draws bodies
from it (``openapi_fuzz.requests``) and ``openapi_fuzz.check`` holds every
answer to the documentation: a documented status and content type, a body
valid against the documented schema, no 5xx, and a 2xx unless the refusal
falls under one of ``schema_notes.SCHEMA_EXCEPTIONS`` (the rules that join two
fields, or a field and the loaded model). ``derandomize``, a fixed number of
examples and per-request deadlines keep it reproducible and bounded; the
long run is ``python scripts/fuzz_openapi.py --requests 2000``.

vLLM 0.32 counterpart: ``tests/entrypoints/openai/test_openai_schema.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from openapi_fuzz import ROUTES, Drawn, Tally, check, requests, send
from prometheus_client import CONTENT_TYPE_LATEST
from server_fuzz import SERVER_FLAGS
from server_helpers import API_KEY, running_server

EXAMPLES = int(os.environ.get("NANOENGINE_OPENAPI_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def served(tiny_llama: str) -> Iterator[tuple[httpx.Client, Any]]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (running_server(tiny_llama, *SERVER_FLAGS) as (base_url, _),
          httpx.Client(base_url=base_url, headers=headers) as client):
        yield client, client.get("/openapi.json", timeout=10).json()


def test_every_route_documents_its_content_types_and_errors(served: tuple[httpx.Client, Any]) -> None:
    _, openapi = served
    paths = openapi["paths"]
    for method, path in ROUTES:
        responses = paths[path][method]["responses"]
        assert "422" not in responses, path  # the server answers pydantic's refusals with a 400
        errors = [responses[status] for status in responses if int(status) >= 400 and path != "/health"]
        assert all(error["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
                   for error in errors), path
    assert paths["/health"]["get"]["responses"]["200"].get("content") is None  # an empty body, as vLLM's
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == [CONTENT_TYPE_LATEST]
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(paths[path]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


def test_requests_drawn_from_the_schema_are_answered_as_documented(served: tuple[httpx.Client, Any]) -> None:
    client, openapi = served
    tally = Tally()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate),
              suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much))
    @given(drawn=requests(openapi))
    def answered_as_documented(drawn: Drawn) -> None:
        assert check(openapi, drawn, send(client, drawn), tally) == []

    answered_as_documented()
    assert tally.mismatches == [], tally.report()
