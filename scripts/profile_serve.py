"""Where the API server's own CPU time goes, per streamed token.

Chapter 8 (online serving). The engine core computes in its own process; the
API server's process turns every step's tokens into text, JSON and
server-sent events. This script runs that process's event loop under
``cProfile`` while ``scripts/bench_serve.py`` loads it from a child process,
then prints the busy time per streamed chunk (wall time minus the time the
loop sat waiting in ``epoll``) and the functions that took it.

    python scripts/profile_serve.py [--model SmolLM2-135M-Instruct] [--num-prompts 32] [--top 25]

Only the thread running the event loop is profiled: the output handler, the
detokenizer, pydantic and uvicorn all run there; the socket threads of the
engine-core client do not. vLLM 0.32 counterpart: none (vLLM documents
profiling the server with ``py-spy`` or its torch profiler endpoints).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server_helpers import free_port  # the test helpers start servers too

from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.async_llm import AsyncLLM
from nanoengine.entrypoints.openai.api_server import build_app
from nanoengine.platforms.cpu import describe_cpu
from nanoengine.transformers_utils.config import resolve_model_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--top", type=int, default=25, help="how many functions to list")
    args = parser.parse_args(argv)
    print(describe_cpu())
    engine = AsyncLLM.from_engine_args(EngineArgs.from_kwargs(str(resolve_model_path(args.model))))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, args.model), host="127.0.0.1", port=port,
                                           log_level="warning"))

    def load() -> None:
        """bench_serve.py in a child process, so that its work is not in the profile."""
        while not server.started:
            time.sleep(0.1)
        subprocess.run([sys.executable, str(ROOT / "scripts/bench_serve.py"), "--model", args.model,
                        "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(args.num_prompts),
                        "--concurrency", str(args.concurrency)], check=True, timeout=3600)
        server.should_exit = True

    loader = threading.Thread(target=load, name="load")
    loader.start()
    profile = cProfile.Profile()
    try:
        profile.runcall(server.run)
    finally:
        loader.join()
        engine.shutdown()
    report(pstats.Stats(profile), args.top)


def report(stats: pstats.Stats, top: int) -> None:
    """Busy time per streamed chunk, then the functions with the most time of their own."""
    table = stats.stats  # type: ignore[attr-defined]  # {(file, line, name): (calls, ncalls, own, cumulative, callers)}
    own = {key: row[2] for key, row in table.items()}
    idle = sum(t for (_, _, name), t in own.items() if name in ("<method 'poll' of 'select.epoll' objects>",
                                                                 "<built-in method time.sleep>"))
    # One socket write per server-sent event (and one per response head): a chunk count.
    sends = sum(row[1] for (_, _, name), row in table.items() if name == "<method 'send' of '_socket.socket' objects>")
    total = stats.total_tt  # type: ignore[attr-defined]
    busy = total - idle
    print(f"event loop busy {busy:.2f} s of {total:.2f} s; {sends} socket writes: "
          f"{busy / max(sends, 1) * 1000:.3f} ms of server CPU per streamed chunk")
    stats.sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
