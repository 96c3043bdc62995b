"""Draw thousands of requests from ``nanoengine serve``'s own ``/openapi.json`` and count the answers.

Chapter 8 (online serving). Starts the server itself (127.0.0.1, a free port,
``tests/server_helpers.running_server``, the tiny random-weight model), fetches
its schema, and sends ``--requests`` requests drawn from it by
``tests/openapi_fuzz.requests``, each checked by ``openapi_fuzz.check``: a
documented status, content type and body, no 5xx, and a 2xx unless the refusal
falls under one of ``schema_notes.SCHEMA_EXCEPTIONS``. Printed at the end:
the count per route and status, the refusals per documented exception, and
every mismatch between schema and server (the first 20 in full).

    python scripts/fuzz_openapi.py                      # 2000 requests
    python scripts/fuzz_openapi.py --requests 300 --seed 7 --max-seconds 120

Exit status 1 on any mismatch. The same property runs, smaller, as
``tests/test_openapi_schema.py``.

vLLM 0.32 counterpart: ``tests/entrypoints/openai/test_openai_schema.py``
(schemathesis over the schema, checking only for server errors).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from openapi_fuzz import (  # the generator lives with the tests, which run it too
    Drawn,
    Tally,
    check,
    requests,
    send,
)
from server_fuzz import SERVER_FLAGS
from server_helpers import API_KEY, running_server
from tiny_models import make_tiny_model_dir


def fuzz(client: httpx.Client, openapi: Any, count: int, seed: int, max_seconds: float) -> Tally:
    """``count`` drawn requests, one after another; a mismatch is counted, not raised, so the run goes on.
    Past ``max_seconds`` the rest are drawn but not sent (counted as such), so a slow machine still reports."""
    tally = Tally()
    stop_at = time.monotonic() + max_seconds

    # No shrinking: the server is shared state, and the run reports what it drew.
    @hypothesis_seed(seed)
    @settings(max_examples=count, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
              suppress_health_check=list(HealthCheck))
    @given(drawn=requests(openapi))
    def one(drawn: Drawn) -> None:
        if time.monotonic() > stop_at:
            tally.statuses["not sent: out of time (--max-seconds)"] += 1
            return
        check(openapi, drawn, send(client, drawn), tally)

    one()
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="stop sending after this long")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-openapi-") as workdir:
        model = str(make_tiny_model_dir(Path(workdir) / "tiny-llama", "llama"))
        log = Path(workdir) / "server.log"
        with running_server(model, *SERVER_FLAGS, log=log) as (base_url, _):
            headers = {"Authorization": f"Bearer {API_KEY}"}
            with httpx.Client(base_url=base_url, headers=headers) as client:
                openapi = client.get("/openapi.json", timeout=10).json()
                started = time.monotonic()
                tally = fuzz(client, openapi, args.requests, args.seed, args.max_seconds)
    print(tally.report())
    print(f"{sum(tally.statuses.values())} requests drawn in {time.monotonic() - started:.0f} s")
    return 1 if tally.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
