"""``nanoengine serve`` under hypothesis-drawn requests: no 5xx, no hang, nothing left behind (chapter 8).

One server on the tiny random-weight model gets about 300 requests drawn by
``server_fuzz.fuzz_requests`` -- valid bodies, bodies with fields out of
range or of the wrong type, bytes that are no JSON object, streams the client
hangs up on -- and every answer is checked (``server_fuzz.send``): status <
500, OpenAI's error JSON on a 4xx, the route's shape on a 200, no error
reported inside a 200. Afterwards the server must be healthy, with no request
left in the engine and every KV block free, and its log free of tracebacks.

Why ``@given`` over single requests rather than a stateful machine: the
server's state that matters -- the engine core alive, its KV blocks -- has no
rules of its own to model; it is checked by every later request (a dead core
answers 503) and by the idle check at the end. The property is defined inside
the test because its strategies need the served model's vocabulary, known
once the fixture has built the model.

The settings: ``derandomize`` -- the same requests on every run, so CI is
reproducible; ``deadline=None`` -- hypothesis' own deadline would time the
machine, the 30-second deadline of ``send`` bounds each request instead; no
shrinking -- the server is shared state: after a request that kills the
engine core every request fails, and shrinking would blame bodies that did
nothing, so the first failing request is reported as it was drawn. The long
run is ``python scripts/fuzz_server.py --requests 2000``.

vLLM 0.32 counterpart: ``tests/entrypoints/openai/test_openai_schema.py``
(schemathesis over ``/openapi.json``, checking only "not a server error").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from server_fuzz import (
    MAX_MODEL_LEN,
    SERVER_FLAGS,
    FuzzRequest,
    Target,
    check_idle,
    fuzz_client,
    fuzz_requests,
    send,
    target_of,
    tracebacks,
    uncovered_fields,
)
from server_helpers import API_KEY, running_server

EXAMPLES = int(os.environ.get("NANOENGINE_FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "server.log"


@pytest.fixture(scope="module")
def served(tiny_llama: str, server_log: Path) -> Iterator[tuple[str, Target]]:
    with running_server(tiny_llama, *SERVER_FLAGS, log=server_log) as (base_url, _):
        yield base_url, target_of(tiny_llama)


def test_every_request_field_has_a_strategy() -> None:
    uncovered = uncovered_fields(Target("any-model", vocab_size=320, max_model_len=MAX_MODEL_LEN))
    assert uncovered == {}, "add these fields to the tables of tests/server_fuzz.py"


def test_drawn_requests_get_no_server_error_and_leave_the_server_idle(
    served: tuple[str, Target], server_log: Path
) -> None:
    base_url, target = served

    with fuzz_client(base_url, API_KEY) as client:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=(Phase.explicit, Phase.generate),
                  suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large,
                                         HealthCheck.large_base_example, HealthCheck.filter_too_much))
        @given(request=fuzz_requests(target))
        def answered_well(request: FuzzRequest) -> None:
            outcome = send(client, request, target)
            assert not outcome.problems, outcome.report()

        answered_well()

    assert check_idle(base_url) == []
    assert list(tracebacks(server_log.read_text(errors="replace"))) == []
