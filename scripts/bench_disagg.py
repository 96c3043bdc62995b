"""Disaggregated prefill and decode against one colocated server, side by side (chapter 10).

The load mixes long prompts (about 1,500 tokens, a short answer each) among
short chat-sized turns (30-80 tokens, a longer answer), at a fixed
concurrency; every request streams greedy tokens with ``ignore_eos``, so both
set-ups do exactly the same work. Two set-ups on this machine's first two cores:

* **colocated**: one ``nanoengine serve`` on both cores (``taskset -c 0,1``),
  chunked prefill as by default: a long prompt's prefill shares its steps with
  the other requests' decodes, and every running request waits for it;
* **P/D**: a prefill server on core 0, a decode server on core 1 and
  ``nanoengine proxy`` in front (vLLM's two-request protocol): the decode
  server computes only each prompt's last token, the rest arrives as KV
  blocks over the ZmqConnector.

Reported for each, as medians over ``--rounds`` runs: the decode's inter-token
latency (ITL) p50/p99 of the short turns, the time to first token (TTFT) p50/p99
of short and long requests, and output tokens per second. Then the transfer:
the decode server's own figures (``vllm:kv_transfer_bytes_total`` over
``vllm:kv_transfer_time_seconds_total``: asking, the producer's gather, the
bytes, the copy into the cache) and the producer's share of it (its own
``vllm:kv_transfer_time_seconds_total``: the gather and the hand-over to
ZMQ), against a plain loopback copy of the same bytes, in the same message
sizes, over a bare TCP socket and over pyzmq.

    python scripts/bench_disagg.py                       # SmolLM2-135M-Instruct, fp32
    python scripts/bench_disagg.py --rounds 3 --concurrency 8 --num-long 8 --num-short 48

The CPU line comes first: a figure means little without it.
vLLM 0.32 counterpart: ``benchmarks/disagg_benchmarks/`` (a proxy, two servers, ``vllm bench serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_serve import RequestResult, one_request  # the same streamed request and timings
from disagg_helpers import kv_config  # the ZmqConnector's --kv-transfer-config
from server_helpers import API_KEY, NANOENGINE, free_port, metric, running_processes

from nanoengine.platforms.cpu import describe_cpu
from nanoengine.transformers_utils.config import resolve_model_path

SERVED = "m"


@dataclass(frozen=True)
class Turn:
    """One request of the mixed load."""

    prompt: list[int]
    max_tokens: int

    @property
    def is_long(self) -> bool:
        return len(self.prompt) >= 1000


def mixed_load(num_long: int, num_short: int, long_tokens: int, vocab_size: int, seed: int) -> list[Turn]:
    """Long prompts spread evenly among the short turns (random token ids: no prefix is shared)."""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(100, vocab_size - 100) for _ in range(count)]

    turns = [Turn(ids(rng.randint(30, 80)), rng.randint(48, 96)) for _ in range(num_short)]
    every = max(1, (num_short + num_long) // max(num_long, 1))
    for i in range(num_long):
        turns.insert(min(i * every, len(turns)), Turn(ids(long_tokens), 8))
    return turns


# ---- the two set-ups ----------------------------------------------------------------------


def serve(model: str, cores: str, *flags: str) -> list[str]:
    """``nanoengine serve`` pinned to ``cores`` (its engine core inherits the mask and sizes its threads by it)."""
    return ["taskset", "-c", cores, NANOENGINE, "serve", model, "--host", "127.0.0.1", "--port", "{port}",
            "--served-model-name", SERVED, "--api-key", API_KEY, "--uvicorn-log-level", "warning", *flags]


def colocated_commands(model: str, flags: list[str]) -> list[list[str]]:
    return [serve(model, "0,1", *flags)]


def disaggregated_commands(model: str, flags: list[str]) -> list[list[str]]:
    """Prefill on core 0, decode on core 1, the proxy beside the decode server; the proxy is last."""
    return [serve(model, "0", *flags, "--kv-transfer-config", kv_config("kv_producer")),
            serve(model, "1", *flags, "--kv-transfer-config", kv_config("kv_consumer")),
            ["taskset", "-c", "1", NANOENGINE, "proxy", "--prefill", "{prefill}", "--decode", "{decode}",
             "--port", "{port}"]]


# ---- one measured run -------------------------------------------------------------------------


async def run_load(base_url: str, turns: list[Turn], concurrency: int) -> tuple[list[tuple[Turn, RequestResult]], float]:
    limit = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:

        async def limited(turn: Turn) -> tuple[Turn, RequestResult]:
            async with limit:
                return turn, await one_request(client, SERVED, turn.prompt, turn.max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(turn) for turn in turns))
    return list(results), time.perf_counter() - start


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile in milliseconds (0 with fewer than two values)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000 if len(values) > 1 else 0.0


def figures(results: list[tuple[Turn, RequestResult]], duration: float) -> dict[str, float]:
    short = [r for t, r in results if not t.is_long]
    long = [r for t, r in results if t.is_long]
    itls = [itl for r in short for itl in r.itls]
    return {"short ITL p50": percentile(itls, 50), "short ITL p99": percentile(itls, 99),
            "short TTFT p50": percentile([r.ttft for r in short], 50),
            "short TTFT p99": percentile([r.ttft for r in short], 99),
            "long TTFT p50": percentile([r.ttft for r in long], 50),
            "long TTFT p99": percentile([r.ttft for r in long], 99),
            "output tok/s": sum(r.output_tokens for _, r in results) / duration}


def measure(commands: list[list[str]], turns: list[Turn], concurrency: int, rounds: int,
            ) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Start the set-up, warm it up, run ``rounds`` loads; each round's figures, and the decode
    server's transfer counters (empty for the colocated set-up)."""
    ports = [free_port() for _ in commands]
    # The proxy's two back ends: the first server prefills, the one before the proxy decodes.
    named = {"{prefill}": f"http://127.0.0.1:{ports[0]}", "{decode}": f"http://127.0.0.1:{ports[-2 % len(ports)]}"}
    filled = [[named.get(arg, arg) for arg in command] for command in commands]
    with running_processes(filled, ports=ports) as started:
        urls = [url for url, _ in started]
        asyncio.run(run_load(urls[-1], turns[:4], 4))  # warm-up, not reported
        rounds_out = [figures(*asyncio.run(run_load(urls[-1], turns, concurrency))) for _ in range(rounds)]
        transfer = {}
        if len(urls) > 1:
            transfer = {name: metric(urls[1], f"vllm:kv_transfer_{name}_total")
                        for name in ("num_transfers", "bytes", "time_seconds")}
            # The producer counts only its own part of each read: the gather and the hand-over to ZMQ.
            transfer["producer_time_seconds"] = metric(urls[0], "vllm:kv_transfer_time_seconds_total")
    return rounds_out, transfer


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


# ---- the same bytes over plain loopback --------------------------------------------------------


def loopback_seconds(message_bytes: int, count: int, send: Callable[[bytes], object],
                     receive: Callable[[int], object]) -> float:
    """Seconds to move ``count`` messages of ``message_bytes`` from one thread to another."""
    payload = bytes(message_bytes)
    receiver = threading.Thread(target=lambda: [receive(message_bytes) for _ in range(count)])
    start = time.perf_counter()
    receiver.start()
    for _ in range(count):
        send(payload)
    receiver.join(timeout=120)
    if receiver.is_alive():
        raise TimeoutError(f"the loopback receiver got fewer than {count} messages within 120 s")
    return time.perf_counter() - start


def tcp_copy(message_bytes: int, count: int) -> float:
    """A bare TCP socket on 127.0.0.1: sendall, recv_into a preallocated buffer."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname(), timeout=60)
    peer, _ = server.accept()
    buffer = memoryview(bytearray(message_bytes))

    def receive(size: int) -> None:
        got = 0
        while got < size:
            got += peer.recv_into(buffer[got:], size - got)

    try:
        return loopback_seconds(message_bytes, count, client.sendall, receive)
    finally:
        for sock in (client, peer, server):
            sock.close()


def zmq_copy(message_bytes: int, count: int) -> float:
    """pyzmq PUSH/PULL over tcp://127.0.0.1, no copy on send (the connector's transport, nothing else)."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        return loopback_seconds(message_bytes, count, lambda data: push.send(data, copy=False),
                                lambda _: pull.recv(copy=False))
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


# ---- report ---------------------------------------------------------------------------------


def report(results: dict[str, dict[str, float]]) -> None:
    names = list(next(iter(results.values())))
    print(f"{'':<16}" + "".join(f"{name:>16}" for name in names))
    for setup, values in results.items():
        unit = "".join(f"{values[n]:>16.1f}" for n in names)
        print(f"{setup:<16}{unit}")
    colocated, disagg = results["colocated"], results["P/D"]
    ratios = ", ".join(f"{n}: {disagg[n] / colocated[n]:.2f}x" for n in names if colocated[n])
    print(f"P/D / colocated: {ratios}  (latencies in ms; below 1 is better for latencies, above for tok/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a model name or folder")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-long", type=int, default=6)
    parser.add_argument("--num-short", type=int, default=36)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(describe_cpu())
    model = resolve_model_path(args.model)
    vocab_size = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    turns = mixed_load(args.num_long, args.num_short, args.long_tokens, vocab_size, args.seed)
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.long_tokens + 256)]
    print(f"load: {args.num_long} prompts of {args.long_tokens} tokens (8 out) among {args.num_short} of "
          f"30-80 (48-96 out), concurrency {args.concurrency}, {args.rounds} rounds, {args.dtype}, greedy")
    sys.stdout.flush()

    colocated, _ = measure(colocated_commands(model, flags), turns, args.concurrency, args.rounds)
    disagg, transfer = measure(disaggregated_commands(model, flags), turns, args.concurrency, args.rounds)
    report({"colocated": medians(colocated), "P/D": medians(disagg)})

    transfers = int(transfer["num_transfers"])
    per_transfer = int(transfer["bytes"] / max(transfers, 1))
    connector = transfer["bytes"] / transfer["time_seconds"] / 1e9 if transfer["time_seconds"] else 0.0
    print(f"\nKV transfer: {transfers} pulls, {transfer['bytes'] / 1e6:.1f} MB, {per_transfer / 1e6:.2f} MB each")
    print(f"  ZmqConnector (decode side, request to cache): {connector:.2f} GB/s, "
          f"{transfer['time_seconds'] / max(transfers, 1) * 1e3:.1f} ms a pull")
    print(f"    of which the producer's gather and hand-over to ZMQ: "
          f"{transfer['producer_time_seconds'] / max(transfers, 1) * 1e3:.1f} ms a pull")
    for name, copy in (("bare TCP socket", tcp_copy), ("pyzmq PUSH/PULL", zmq_copy)):
        rates = [per_transfer * transfers / copy(per_transfer, transfers) / 1e9 for _ in range(3)]
        print(f"  {name} loopback, same bytes and sizes: {statistics.median(rates):.2f} GB/s "
              f"(connector at {connector / statistics.median(rates):.0%} of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
