"""The ZmqConnector inside two engines of one test process (chapter 10).

A producer engine prefills and holds the blocks; a consumer engine pulls the
ones it lacks over loopback TCP and decodes the same greedy tokens as an
engine that did everything itself. The consumer's own prefix-cache hits are
not pulled; an abort on either side frees the blocks on both; a bad request
or configuration is refused with the field named.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest
from engine_helpers import add, make_engine, path, prompt_ids, run
from server_helpers import NANOENGINE, free_port, wait_until

from nanoengine.config import KVTransferConfig
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.request import RequestStatus
from nanoengine.sampling_params import SamplingParams

S = RequestStatus
BLOCK = 16
PROMPT = prompt_ids(70)  # 4 full blocks and 6 tokens: 5 blocks, of which the consumer needs 5 (69 tokens)


def _zmq(role: str, **fields: Any) -> dict[str, Any]:
    return {"kv_connector": "ZmqConnector", "kv_role": role, "kv_port": free_port(), **fields}


def _greedy(max_tokens: int = 10, **kv_transfer_params: Any) -> SamplingParams:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)


def _scheduler(engine: LLMEngine) -> Any:
    return engine.engine_core.get_engine_core().scheduler


def _prefill(producer: LLMEngine, request_id: str, prompt: list[int]) -> dict[str, Any]:
    """Step 1 of the proxy's protocol, on the engine: the prompt's kv_transfer_params."""
    add(producer, request_id, prompt, _greedy(1, do_remote_decode=True))
    params = run(producer)[request_id].kv_transfer_params
    assert params is not None
    producer.engine_core.get_engine_core().step()  # the worker registers the hold
    return params


def _step_until(engine: LLMEngine, condition: Any, seconds: float = 10) -> bool:
    def stepped() -> bool:
        engine.engine_core.get_engine_core().step()
        return bool(condition())
    return wait_until(stepped, seconds, 0.01)


@pytest.fixture(scope="module")
def expected(tiny_llama: str) -> list[int]:
    engine = make_engine(tiny_llama)
    add(engine, "r", PROMPT, _greedy())
    tokens = run(engine)["r"].outputs[0].token_ids
    engine.shutdown()
    return list(tokens)


@pytest.fixture
def pair(tiny_llama: str) -> Any:
    producer = make_engine(tiny_llama, kv_transfer_config=_zmq("kv_producer", kv_connector_extra_config={
        "abort_request_timeout_s": 30}), check_invariants=True)
    consumer = make_engine(tiny_llama, kv_transfer_config=_zmq("kv_consumer", kv_connector_extra_config={
        "transfer_timeout_s": 2}), check_invariants=True)
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


def test_the_consumer_pulls_the_prompt_and_decodes_the_same_tokens(pair: Any, expected: list[int]) -> None:
    producer, consumer = pair
    params = _prefill(producer, "p", PROMPT)
    assert params["remote_block_ids"] and params["tp_size"] == 1 and params["remote_request_id"] == "p"
    held = _scheduler(producer).held_for_remote
    assert list(held) == ["p"]  # finished, its 5 blocks kept for the consumer
    request = add(consumer, "c", PROMPT, _greedy(**params))
    output = run(consumer)["c"]
    assert path(request) == [S.WAITING, S.WAITING_FOR_REMOTE_KVS, S.WAITING, S.RUNNING, S.FINISHED_LENGTH_CAPPED]
    assert output.num_external_computed_tokens == len(PROMPT) - 1  # the last token is computed here
    assert output.outputs[0].token_ids == expected
    assert _step_until(producer, lambda: not held)  # read, so freed
    stats = _scheduler(producer).make_stats().kv_transfer_stats
    assert stats.num_transfers == 1 and stats.num_expired_holds == 0


def test_the_consumer_pulls_only_the_blocks_its_prefix_cache_lacks(pair: Any, expected: list[int]) -> None:
    producer, consumer = pair
    add(consumer, "local", PROMPT[:3 * BLOCK + 5], _greedy(1))  # puts 3 full blocks of PROMPT in its cache
    run(consumer)
    params = _prefill(producer, "p", PROMPT)
    add(consumer, "c", PROMPT, _greedy(**params))
    output = run(consumer)["c"]
    # As in vLLM, num_cached_tokens counts the local hits and the pulled tokens.
    assert output.num_cached_tokens == len(PROMPT) - 1
    assert output.num_external_computed_tokens == len(PROMPT) - 1 - 3 * BLOCK
    assert output.outputs[0].token_ids == expected
    stats = _scheduler(consumer).make_stats().kv_transfer_stats
    assert stats.num_transfers == 1 and stats.bytes_transferred == 2 * _block_bytes(consumer)  # blocks 3 and 4


def _block_bytes(engine: LLMEngine) -> int:
    runner = engine.engine_core.get_engine_core().model_executor.driver_worker.model_runner
    return sum(cache[:, 0].numel() * cache.element_size() for cache in runner.kv_caches)


def test_an_abort_on_the_consumer_frees_the_producer_at_once(pair: Any) -> None:
    producer, consumer = pair
    params = _prefill(producer, "p", PROMPT)
    add(consumer, "c", PROMPT, _greedy(**params))
    consumer.abort_request("c")  # still queued: it never pulled
    consumer.engine_core.get_engine_core().step()  # the release goes out
    held = _scheduler(producer).held_for_remote
    assert _step_until(producer, lambda: not held, seconds=5)  # long before the 30 s timeout
    assert _scheduler(producer).make_stats().kv_transfer_stats.num_expired_holds == 0
    assert _scheduler(consumer).kv_cache_manager.usage == 0.0


def test_a_dead_block_server_fails_the_producers_next_step_loudly(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's block server thread dies answering a read: its engine's next step raises,
    naming it, rather than holding blocks nobody can read any more."""
    producer, consumer = pair
    runner = producer.engine_core.get_engine_core().model_executor.driver_worker.model_runner
    server_side = runner.kv_connector

    def breaks(*args: Any) -> None:
        raise MemoryError("a gather that failed")

    monkeypatch.setattr(server_side, "_send_blocks", breaks)
    params = _prefill(producer, "p", PROMPT)
    add(consumer, "c", PROMPT, _greedy(**params))
    consumer.engine_core.get_engine_core().step()  # the pull's read goes out
    with pytest.raises(RuntimeError, match=r"the KV block server of rank 0 died: MemoryError\('a gather that failed'\)"):
        _step_until(producer, lambda: False, seconds=10)
    consumer_side = _scheduler(consumer)
    assert _step_until(consumer, lambda: "c" not in consumer_side.requests)  # its pull timed out: policy "fail"
    assert consumer_side.make_stats().kv_transfer_stats.num_failed_transfers == 1


def test_a_hold_nobody_reads_expires(tiny_llama: str) -> None:
    producer = make_engine(tiny_llama, kv_transfer_config=_zmq("kv_producer", kv_connector_extra_config={
        "abort_request_timeout_s": 0.5}), check_invariants=True)
    _prefill(producer, "p", PROMPT)
    scheduler = _scheduler(producer)
    assert scheduler.kv_cache_manager.usage > 0
    assert _step_until(producer, lambda: not scheduler.held_for_remote, seconds=5)
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.make_stats().kv_transfer_stats.num_expired_holds == 1
    producer.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_pull_follows_the_policy(tiny_llama: str, expected: list[int], policy: str) -> None:
    """A producer that is not there (nothing listens on the port) never answers the pull."""
    consumer = make_engine(tiny_llama, check_invariants=True, kv_transfer_config=_zmq(
        "kv_consumer", kv_load_failure_policy=policy, kv_connector_extra_config={"transfer_timeout_s": 0.3}))
    params = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "p",
              "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_block_ids": [1, 2, 3, 4, 5],
              "tp_size": 1}
    request = add(consumer, "c", PROMPT, _greedy(**params))
    started = time.monotonic()
    output = run(consumer)["c"]
    assert time.monotonic() - started < 10
    if policy == "fail":
        assert path(request)[-1] == S.FINISHED_ERROR and output.outputs[0].finish_reason == "error"
        assert "did not answer within 0.3 s" in (output.finish_message or "")
    else:
        assert path(request)[-1] == S.FINISHED_LENGTH_CAPPED and output.outputs[0].token_ids == expected
        assert output.num_external_computed_tokens == 0
    assert _scheduler(consumer).make_stats().kv_transfer_stats.num_failed_transfers == 1
    assert _scheduler(consumer).kv_cache_manager.usage == 0.0
    consumer.shutdown()


def test_a_restarted_producer_refuses_blocks_it_never_held(pair: Any) -> None:
    producer, consumer = pair
    params = {**_prefill(producer, "p", PROMPT), "remote_engine_id": "an-earlier-run"}
    add(consumer, "c", PROMPT, _greedy(**params))
    output = run(consumer)["c"]
    assert "was it restarted?" in (output.finish_message or "")


@pytest.mark.parametrize(("params", "message"), [
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "p", "remote_host": "h",
      "remote_port": 1, "remote_block_ids": [1, 2, 3, 4, 5], "tp_size": 2},
     "tensor_parallel_size=2, this decode engine has 1"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "p", "remote_host": "h",
      "remote_port": 1, "remote_block_ids": [1], "tp_size": 1}, "remote_block_ids must be at least 5 block ids"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "p", "remote_host": "h",
      "remote_port": "1", "remote_block_ids": [1], "tp_size": 1}, "remote_port must be a int"),
    ({"do_remote_decode": True}, "do_remote_decode needs a kv_producer engine; this one is kv_consumer"),
])
def test_params_the_consumer_cannot_act_on_are_refused(
    pair: Any, params: dict[str, Any], message: str
) -> None:
    _, consumer = pair
    with pytest.raises((ValueError, TypeError), match=message):
        add(consumer, "c", PROMPT, _greedy(**params))


def test_without_a_connector_kv_transfer_params_are_ignored_as_in_vllm(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    add(engine, "plain", PROMPT, _greedy(3))
    add(engine, "asked", PROMPT, _greedy(3, do_remote_decode=True))
    outputs = run(engine)
    assert outputs["asked"].outputs[0].token_ids == outputs["plain"].outputs[0].token_ids
    assert outputs["asked"].kv_transfer_params is None
    with pytest.raises(ValueError, match="kv_transfer_params must be a JSON object, got 5"):
        add(engine, "bad", PROMPT, SamplingParams(max_tokens=3, extra_args={"kv_transfer_params": 5}))
    engine.shutdown()


@pytest.mark.parametrize(("config", "message"), [
    ({"kv_connector": "NixlConnector"}, "kv_connector must be one of"),
    ({"kv_connector": "ZmqConnector", "kv_rol": "kv_producer"}, r"unknown key\(s\) \['kv_rol'\]"),
    ({"kv_connector": "ZmqConnector", "kv_connector_extra_config": {"timeout": 1}}, r"unknown key\(s\) \['timeout'\]"),
    ({"kv_connector": "ZmqConnector", "kv_load_failure_policy": "retry"}, "kv_load_failure_policy must be"),
    ({"kv_connector": "ZmqConnector", "kv_port": 70000}, r"kv_port must be an int in \[1, 65535\]"),
    ({"kv_role": "kv_producer"}, "kv_transfer_config needs kv_connector"),
])
def test_a_bad_kv_transfer_config_names_the_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        KVTransferConfig.from_dict(config)


def test_serve_refuses_a_bad_kv_transfer_config_before_it_starts(tiny_llama: str) -> None:
    config = json.dumps({"kv_connector": "ZmqConnector", "kv_role": "kv_sender"})
    done = subprocess.run([NANOENGINE, "serve", tiny_llama, "--kv-transfer-config", config],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "kv_role must be 'kv_producer', 'kv_consumer' or 'kv_both', got 'kv_sender'" in done.stderr
