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
        # Params a decode server cannot act on get a 400 naming the field, before any stream starts.
        bad = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
               "remote_port": 1, "remote_block_ids": [0], "tp_size": 2}
        for stream in (False, True):
            refused = completion(urls[2], prompts[0], 2, stream, kv_transfer_params=bad)
            assert refused["error"]["code"] == 400 and refused["error"]["param"] == "kv_transfer_params"
            assert "tensor_parallel_size=2" in refused["error"]["message"]


def _kill_hard(pid: int) -> None:
    """``kill -9`` of a server and everything under it (its engine core holds the blocks)."""
    from server_helpers import descendant_pids

    for victim in [pid, *descendant_pids(pid)]:
        os.kill(victim, signal.SIGKILL)


def test_a_producer_killed_before_the_pulls(model: str) -> None:
    """20 prefills done, the producer killed with ``kill -9``, then the 20 pulls.

    With ``fail`` every request ends with a 500 that says what happened; with
    ``recompute`` every request finishes with the colocated tokens. Both
    consumers keep serving and hold no block afterwards.
    """
    ports = [free_port() for _ in range(4)]
    ref, prod, failing, recomputing = ports
    quick = {"kv_connector_extra_config": {"transfer_timeout_s": 2}}
    commands = [colocated(model), producer(model), consumer(model, kv_load_failure_policy="fail", **quick),
                consumer(model, kv_load_failure_policy="recompute", **quick)]
    prompts = _prompts(20, seed=1)
    with running_processes(commands, ports=ports) as started:
        urls = [url for url, _ in started]
        with ThreadPoolExecutor(20) as pool:
            expected = list(pool.map(lambda p: token_ids(completion(urls[0], p, MAX_TOKENS)), prompts))
            prefills = list(pool.map(lambda p: completion(urls[1], p, 1, kv_transfer_params={
                "do_remote_decode": True}), prompts))
            params = [answer["kv_transfer_params"] for answer in prefills]
            assert metric(urls[1], "nanoengine:kv_transfer_held_requests") == 20
            _kill_hard(started[1][1].pid)
            failed = list(pool.map(lambda pp: completion(urls[2], pp[0], MAX_TOKENS, kv_transfer_params=pp[1]),
                                   zip(prompts, params)))
            recomputed = list(pool.map(lambda pp: token_ids(completion(urls[3], pp[0], MAX_TOKENS,
                                                                       kv_transfer_params=pp[1])),
                                       zip(prompts, params)))
        for answer in failed:
            assert answer["error"]["code"] == 500, answer
            assert "Loading the KV cache from the prefill engine failed" in answer["error"]["message"]
            assert "did not answer within 2 s" in answer["error"]["message"]
        assert recomputed == expected
        for url in urls[2:]:
            assert metric(url, "vllm:kv_transfer_num_failed_transfers_total") == 20
            assert token_ids(completion(url, prompts[0], MAX_TOKENS)) == expected[0]  # still serving
        assert _no_blocks_held(*urls[2:])


def test_a_producer_server_killed_mid_transfer_leaves_no_process(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a slow machine on purpose (NANOENGINE_INJECT_DELAY): 16 requests through the proxy,
    and ``kill -9`` of the producer's API server alone while their KV moves. Its engine core
    (which holds the blocks and serves the reads) notices and exits within 10 s; the consumer
    ends every request it was given, keeps serving and holds no block."""
    from server_helpers import descendant_pids, is_running

    monkeypatch.setenv("NANOENGINE_INJECT_DELAY", "step=0.02,utility=0.1")
    ports = [free_port() for _ in range(3)]
    prod, cons, front = ports
    quick = {"kv_connector_extra_config": {"transfer_timeout_s": 2}}
    commands = [producer(model), consumer(model, **quick), proxy(prod, cons)]
    prompts = _prompts(16, seed=5)
    with running_processes(commands, ports=ports) as started:
        urls = [url for url, _ in started]
        producer_engine = descendant_pids(started[0][1].pid)
        with ThreadPoolExecutor(16) as pool:
            answers = [pool.submit(completion, urls[2], prompt, MAX_TOKENS) for prompt in prompts]
            assert wait_until(lambda: metric(urls[0], "vllm:kv_transfer_num_transfers_total") > 0, 60, 0.02)
            started[0][1].kill()  # the API server only: the core must learn of it by itself
            alive = [pid for pid in producer_engine if not wait_until(lambda pid=pid: not is_running(pid), 10)]
            assert producer_engine and not alive, f"the producer's engine processes {alive} outlived its server"
            ended = [answer.result(timeout=120) for answer in answers]
        assert len(ended) == len(prompts)  # each answered: tokens, or an error saying what failed
        assert token_ids(completion(urls[1], prompts[0], MAX_TOKENS)) is not None  # the consumer still serves
        assert _no_blocks_held(urls[1])


def test_a_soak_with_hang_ups_through_the_proxy_loses_nothing(model: str) -> None:
    """300 requests, 20% of whose clients hang up early; the rest get the colocated tokens.

    Hang-ups land anywhere: during the prefill, between the two requests (the
    producer then frees the blocks after its timeout, 2 s here), or during the
    decode (the consumer aborts and, mid-pull, releases the producer's blocks).
    """
    ports = [free_port() for _ in range(4)]
    ref, prod, cons, front = ports
    commands = [colocated(model), producer(model, kv_connector_extra_config={"abort_request_timeout_s": 2}),
                consumer(model), proxy(prod, cons)]
    prompts = _prompts(30, seed=2)
    rng = random.Random(3)
    plan = [(rng.randrange(len(prompts)), rng.random() < 0.2, rng.random() < 0.5) for _ in range(300)]
    with running_processes(commands, ports=ports) as started:
        urls = [url for url, _ in started]

        def one(item: tuple[int, bool, bool]) -> list[int] | None:
            index, hang_up, stream = item
            if not hang_up:
                return token_ids(completion(urls[3], prompts[index], MAX_TOKENS, stream))
            try:
                completion(urls[3], prompts[index], 64, stream, timeout=rng.uniform(0.01, 0.3))
            except httpx.TimeoutException:
                pass  # the client gave up: the connection closes
            return None

        with ThreadPoolExecutor(16) as pool:
            expected = list(pool.map(lambda p: token_ids(completion(urls[0], p, MAX_TOKENS)), prompts))
            deadline_s = 300
            futures = [pool.submit(one, item) for item in plan]
            results = [future.result(timeout=deadline_s) for future in futures]
        for (index, hang_up, _), got in zip(plan, results):
            if not hang_up:
                assert got == expected[index]
        assert sum(hang_up for _, hang_up, _ in plan) >= 40
        assert _no_blocks_held(urls[1], urls[2], seconds=15)
        assert metric(urls[1], "nanoengine:kv_transfer_held_requests") == 0
        assert metric(urls[2], "vllm:num_requests_running") == 0


def test_tensor_parallel_prefill_and_decode(model: str) -> None:
    """Two ranks on each side (mp executor): rank r pulls its slice of the heads from rank r."""
    ports = [free_port() for _ in range(4)]
    ref, prod, cons, front = ports
    tp = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    # No prefix cache on the consumer: every request pulls, so the transfers can be counted.
    commands = [colocated(model), producer(model, *tp), consumer(model, *tp, "--no-enable-prefix-caching"),
                proxy(prod, cons)]
    prompts = _prompts(10, seed=4)
    with running_processes(commands, ports=ports) as started:
        urls = [url for url, _ in started]
        with ThreadPoolExecutor(4) as pool:
            expected = list(pool.map(lambda p: token_ids(completion(urls[0], p, MAX_TOKENS)), prompts))
            for stream in (False, True):
                got = list(pool.map(lambda p: token_ids(completion(urls[3], p, MAX_TOKENS, stream)), prompts))
                assert got == expected
        assert metric(urls[1], "vllm:kv_transfer_num_transfers_total") == 2 * 2 * len(prompts)  # two ranks
        assert _no_blocks_held(urls[1], urls[2])
        params = completion(urls[1], prompts[0], 1, kv_transfer_params={"do_remote_decode": True})
        assert params["kv_transfer_params"]["tp_size"] == 2  # a decode engine of another size refuses it
