"""Fuzz ``nanoengine serve`` with hypothesis-drawn requests, and report what came back.

Chapter 8 (online serving). Starts the server itself (127.0.0.1, a free port,
``tests/server_helpers.running_server``), sends ``--requests`` requests drawn
by ``tests/server_fuzz.fuzz_requests`` one after another -- valid bodies,
bodies with fields out of range or of the wrong type, bytes that are no JSON
object, streams hung up on -- and checks each answer with
``server_fuzz.send``. A request that leaves the server unhealthy (its engine
core dead, say) is reported and the server restarted, so that one run can
find more than one bug. Printed at the end: the count of answers per route
and status, the slowest request, every kind of problem with its first
request, the tracebacks in the server's log, and the final check that the
server is healthy with every KV block free.

    python scripts/fuzz_server.py                                   # 2000 requests, tiny random model
    python scripts/fuzz_server.py --requests 300 --seed 7
    python scripts/fuzz_server.py --model SmolLM2-135M-Instruct     # the prepared real model

Exit status 1 on any 5xx, hang, malformed answer, restart, traceback in the
server's log, or a server not idle at the end. The same property runs, smaller,
as ``tests/test_server_fuzz.py``.

vLLM 0.32 counterpart: ``tests/entrypoints/openai/test_openai_schema.py``
(schemathesis drawing requests from the server's OpenAPI schema).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_fuzz import (  # the fuzzer lives with the tests, which run it too
    DEADLINE_S,
    N_NOT_SENT,
    SERVER_FLAGS,
    FuzzRequest,
    Outcome,
    Target,
    check_idle,
    fuzz_client,
    fuzz_requests,
    send,
    target_of,
    tracebacks,
)
from server_helpers import API_KEY, running_server

TINY = "tiny"
CANARY = {"prompt": "hello", "max_tokens": 1}
# The server inherits these: no tokenizer thread pool on a small machine, no network.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class FuzzedServer:
    """``running_server`` that can be restarted: a request that kills the server ends one server, not the run."""

    def __init__(self, model_dir: str, log_dir: Path, flags: tuple[str, ...]) -> None:
        self.model_dir = model_dir
        self.flags = flags
        self.log_dir = log_dir
        self.logs: list[Path] = []
        self.deaths: list[Outcome] = []  # the request after which each server was found unhealthy
        self._stack = ExitStack()
        self.base_url = ""
        self.client = httpx.Client()

    def start(self) -> None:
        log = self.log_dir / f"server-{len(self.logs)}.log"
        self.logs.append(log)
        self.base_url, _ = self._stack.enter_context(running_server(self.model_dir, *self.flags, log=log))
        self.client = self._stack.enter_context(fuzz_client(self.base_url, API_KEY))

    def stop(self) -> None:
        self._stack.close()

    def healthy(self) -> bool:
        """``/health`` is 200 and a one-token completion comes back: a wedged engine can pass the first alone."""
        try:
            return (self.client.get("/health", timeout=5.0).status_code == 200
                    and self.client.post("/v1/completions", json=CANARY, timeout=10.0).status_code == 200)
        except httpx.HTTPError:
            return False

    def restart_after(self, outcome: Outcome) -> None:
        print(f"!! the server is unhealthy after request: {outcome.request}", flush=True)
        self.deaths.append(outcome)
        try:
            self.stop()
        except AssertionError as error:  # running_server found engine processes left behind
            print(f"!! {error}", flush=True)
        self.start()


def fuzz(server: FuzzedServer, target: Target, requests: int, seed: int, deadline_s: float) -> list[Outcome]:
    """``requests`` drawn requests, each checked; nothing raises, so hypothesis draws them all."""
    outcomes: list[Outcome] = []

    @hypothesis_seed(seed)
    @settings(max_examples=requests, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(request=fuzz_requests(target))
    def one(request: FuzzRequest) -> None:
        outcome = send(server.client, request, target, deadline_s)
        outcomes.append(outcome)
        if outcome.problems:
            print(f"!! #{len(outcomes)}: {outcome.report()}"[:1500], flush=True)
            if not server.healthy():
                server.restart_after(outcome)
        if len(outcomes) % 100 == 0:
            failed = sum(1 for o in outcomes if o.problems)
            print(f"  {len(outcomes)} requests, {failed} with problems", flush=True)

    one()
    return outcomes


def report(outcomes: list[Outcome], server: FuzzedServer, idle: list[str], elapsed: float) -> bool:
    """Print the run's summary; True when nothing went wrong."""
    print(f"\n{len(outcomes)} requests in {elapsed:.0f} s ({len(outcomes) / elapsed:.1f}/s)")
    print("\nanswers per route and status:")
    for (route, status), count in sorted(Counter((o.request.route, str(o.status)) for o in outcomes).items()):
        print(f"  {route:22} {status:>4}  {count}")
    print("\nanswers per kind of body and status class:")
    classes = Counter((o.request.kind, "hang" if o.status is None else f"{o.status // 100}xx") for o in outcomes)
    for (kind, status_class), count in sorted(classes.items()):
        print(f"  {kind:8} {status_class:>4}  {count}")
    slowest = max(outcomes, key=lambda o: o.seconds)
    print(f"\nslowest request ({slowest.seconds:.2f} s, status {slowest.status}):\n  {slowest.request}")
    groups: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        if outcome.problems:
            groups.setdefault(problem_kind(outcome), []).append(outcome)
    print(f"\nproblems: {sum(len(g) for g in groups.values())} requests, {len(groups)} kinds")
    for kind, members in sorted(groups.items(), key=lambda item: -len(item[1])):
        print(f"\n[{len(members)}x] {kind}\n  first: {members[0].report()}")
    print(f"\nserver restarts: {len(server.deaths)}")
    errors = Counter(line for log in server.logs for line in tracebacks(log.read_text(errors="replace")))
    print(f"tracebacks in the server logs ({', '.join(str(log) for log in server.logs)}): {sum(errors.values())}")
    for line, count in errors.most_common():
        print(f"  [{count}x] {line}")
    print(f"\nnot sent: {N_NOT_SENT}")
    print(f"final check (health 200, no request left, every KV block free): {'; '.join(idle) or 'ok'}")
    return not groups and not server.deaths and not errors and not idle


def problem_kind(outcome: Outcome) -> str:
    """Outcomes grouped by status and the first words of their first problem."""
    words = " ".join(outcome.problems[0].split()[:6])
    return f"status {outcome.status}: {words}"


def model_dir(model: str, workdir: Path) -> str:
    """The tiny random-weight model (written into ``workdir``) or a prepared real one."""
    if model == TINY:
        from tiny_models import make_tiny_model_dir

        return str(make_tiny_model_dir(workdir / "tiny-llama", "llama"))
    from nanoengine.transformers_utils.config import resolve_model_path

    return resolve_model_path(model)


def main(argv: list[str] | None = None) -> int:
    # A SIGTERM unwinds like an exception, so the server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--model", default=TINY, help=f"'{TINY}' (random weights) or a prepared model's name")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis' seed: the same requests for the same seed")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds one request may take")
    parser.add_argument("--check-invariants", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine checks its KV cache and scheduler after every step (slower, stricter)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where the server logs go (default: a new temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-server-") as scratch:
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="fuzz-server-logs-"))  # kept, to read later
        log_dir.mkdir(parents=True, exist_ok=True)
        model = model_dir(args.model, Path(scratch))
        target = target_of(model)
        print(f"fuzzing nanoengine serve {args.model} ({target}), {args.requests} requests, seed {args.seed}",
              flush=True)
        flags = SERVER_FLAGS + (("--check-invariants",) if args.check_invariants else ())
        server = FuzzedServer(model, log_dir, flags)
        server.start()
        try:
            start = time.monotonic()
            outcomes = fuzz(server, target, args.requests, args.seed, args.deadline)
            elapsed = time.monotonic() - start
            idle = check_idle(server.base_url)
        finally:
            server.stop()
        ok = report(outcomes, server, idle, elapsed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
