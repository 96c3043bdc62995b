"""Chapter 10 end to end: a prefill server, decode servers and the proxy, as processes.

Greedy tokens through the proxy are the tokens one colocated server gives, for
prompts of 10 to 1,500 tokens, streamed and not, with the decode server's
prefix caching on and off and chunked prefill on the prefill server. Then the
faults: a producer killed with its blocks unread, a consumer that never comes,
and a soak with client hang-ups; every server keeps serving and holds no block
afterwards.
"""

from __future__ import annotations

import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from disagg_helpers import colocated, completion, consumer, long_context_model, producer, proxy, token_ids
from server_helpers import free_port, metric, running_processes, wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts from 10 to 1,500 tokens; the later ones share a 200-token prefix with an
    earlier one, so a decode server with prefix caching finds some blocks at home."""
    rng = random.Random(seed)
    lengths = [round(10 + (1500 - 10) * i / (count - 1)) for i in range(count)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    for i in range(count // 2, count):
        if len(prompts[i]) > 220:
            prompts[i][:200] = prompts[i - count // 2][:200] if len(prompts[i - count // 2]) >= 200 else prompts[i][:200]
    return prompts


def _kv_usage(url: str) -> float:
    return metric(url, "vllm:kv_cache_usage_perc")


def _no_blocks_held(*urls: str, seconds: float = 10) -> bool:
    return wait_until(lambda: all(_kv_usage(url) == 0.0 for url in urls), seconds, 0.2)


@pytest.fixture(scope="module")
def model(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return long_context_model(tiny_llama, tmp_path_factory.mktemp("disagg"))


def test_greedy_tokens_through_the_proxy_equal_a_colocated_server(model: str) -> None:
    """50 prompts, each streamed and not through two decode servers (prefix caching on, off)."""
    ports = [free_port() for _ in range(6)]
    ref, prod, cons_cached, cons_plain, proxy_cached, proxy_plain = ports
    commands = [
        colocated(model),
        producer(model, "--max-num-batched-tokens", "256"),  # chunked prefill: 1,500 tokens take six steps
        consumer(model),
        consumer(model, "--no-enable-prefix-caching"),
        proxy(prod, cons_cached),
        proxy(prod, cons_plain),
    ]
    prompts = _prompts(50)
    with running_processes(commands, ports=ports) as started:
        urls = [url for url, _ in started]
        with ThreadPoolExecutor(8) as pool:
            expected = list(pool.map(lambda p: token_ids(completion(urls[0], p, MAX_TOKENS)), prompts))
            for proxy_url in (urls[4], urls[5]):
                for stream in (False, True):
                    got = list(pool.map(lambda p: token_ids(completion(proxy_url, p, MAX_TOKENS, stream)), prompts))
                    mismatched = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
                    assert not mismatched, f"{proxy_url} stream={stream}: prompts {mismatched} differ"
        # Blocks crossed the network for every request, except where the cached consumer had
        # every block but the last token's at home (it released them instead) ...
        assert 3 * len(prompts) < metric(urls[1], "vllm:kv_transfer_num_transfers_total") <= 4 * len(prompts)
        # ... and the cached consumer pulled less than the plain one (its own hits stay home) ...
        assert metric(urls[2], "vllm:kv_transfer_bytes_total") < metric(urls[3], "vllm:kv_transfer_bytes_total")
        # ... and nobody holds a block now.
        assert _no_blocks_held(*urls[:4])
