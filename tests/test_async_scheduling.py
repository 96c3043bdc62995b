"""Async scheduling (chapter 7): step N+1 is scheduled while step N runs.

Whole tiny-model engines with ``async_scheduling=True`` against the default
loop, token for token: prefix caching on and off, chunked prefill, preemption,
max_tokens of 1 and more, stop tokens and stop strings, aborts, the KV
connector and streamed input, and the engine draining when idle. The
scheduler's placeholder accounting is tested in test_async_scheduler.py.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import add, make_engine, path, prompt_ids, run

from nanoengine import LLM, SamplingParams
from nanoengine.config import KVTransferConfig
from nanoengine.core.sched.output import SchedulerOutput
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import RequestOutput
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.request import RequestStatus
from nanoengine.sampling_params import StructuredOutputsParams

# Engine settings per scenario; the tiny cache forces preemption.
SCENARIOS: dict[str, dict[str, Any]] = {
    "prefix_caching": {"enable_prefix_caching": True},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_small_budget": {"max_num_batched_tokens": 32},
    "preemption": {"num_gpu_blocks_override": 25, "block_size": 4, "max_model_len": 96},
}
MAX_TOKENS = [1, 2, 48, 7, 1, 40]  # per request: a single token, a few, many


def _prompts(lengths: list[int]) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 300) for _ in range(12)]  # a common prefix for every other prompt
    bodies = [[rng.randrange(3, 300) for _ in range(length)] for length in lengths]
    return [(shared + body) if i % 2 else body for i, body in enumerate(bodies)]


def _watch_placeholders(llm: LLM) -> list[int]:
    """Record, at every schedule(), the most placeholders any running request has."""
    scheduler = llm.llm_engine.engine_core.get_engine_core().scheduler
    seen: list[int] = []
    schedule = scheduler.schedule

    def spy() -> SchedulerOutput:
        seen.append(max((r.num_output_placeholders for r in scheduler.running), default=0))
        return schedule()

    scheduler.schedule = spy
    return seen


def _generate(llm: LLM, prompts: list[list[int]], **params: Any) -> list[tuple[list[int], str | None]]:
    sampling = [SamplingParams(temperature=0.0, max_tokens=n, **params) for n in MAX_TOKENS[: len(prompts)]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_async_engine_matches_the_synchronous_engine(tiny_llama: str, scenario: str) -> None:
    settings = {"kv_cache_memory_bytes": 1 << 24, "max_model_len": 256, **SCENARIOS[scenario]}
    prompts = _prompts([5, 17, 3, 30, 9, 24])
    expected = _generate(LLM(tiny_llama, **settings), prompts, ignore_eos=True)
    llm = LLM(tiny_llama, async_scheduling=True, **settings)
    placeholders = _watch_placeholders(llm)
    assert _generate(llm, prompts, ignore_eos=True) == expected
    assert [len(tokens) for tokens, _ in expected] == MAX_TOKENS
    # Steps really were scheduled on top of tokens still being sampled.
    assert max(placeholders) == 1
    core = llm.llm_engine.engine_core.get_engine_core()
    if scenario == "preemption":
        assert core.scheduler.num_preemptions > 0, "the tiny KV cache was meant to force preemption"
    # Again on the same engine: the prefix cache now holds these prompts.
    assert _generate(llm, prompts, ignore_eos=True) == expected
    _assert_drains(llm.llm_engine)


def _assert_drains(engine: LLMEngine) -> None:
    """Idle front end: no block held; stepping on empties the queue and the worker."""
    core = engine.engine_core.get_engine_core()
    manager = core.scheduler.kv_cache_manager
    assert not engine.has_unfinished_requests() and not core.scheduler.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_usable_blocks
    for _ in range(2 * core.batch_queue_size):  # each call retires at most one queued step
        core.step_fn()
    assert not core.batch_queue and not core.scheduler.has_requests()
    runner = core.model_executor.driver_worker.model_runner
    assert runner is not None and runner.requests == {}


class FinishedInFlight:
    """An ``on_step`` hook for ``run``: the requests whose final output arrived
    while a step already scheduled for them was still in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.core = engine.engine_core.get_engine_core()
        self.hits: set[str] = set()

    def __call__(self, _: int, outputs: list[RequestOutput]) -> None:
        queued = [step.scheduler_output for step in self.core.batch_queue]
        in_flight = {rid for output in queued for rid in output.num_scheduled_tokens}
        self.hits.update(o.request_id for o in outputs if o.finished and o.request_id in in_flight)


def test_stop_token_and_stop_string_end_a_request_with_its_next_step_in_flight(tiny_llama: str) -> None:
    probe = make_engine(tiny_llama)
    add(probe, "probe", prompt_ids(20), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    out = run(probe)["probe"].outputs[0]
    stop_token = out.token_ids[4]
    stop_string = out.text[len(out.text) // 2 :][:2]
    cases = {
        "token": SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token]),
        "string": SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_string]),
        "free": SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    }
    results = {}
    for async_scheduling in (False, True):
        engine = make_engine(tiny_llama, async_scheduling=async_scheduling)
        for name, params in cases.items():
            add(engine, name, prompt_ids(20), params)
        hook = FinishedInFlight(engine)
        outputs = {rid: out.outputs[0] for rid, out in run(engine, on_step=hook).items()}
        results[async_scheduling] = {
            rid: (out.token_ids, out.text, out.finish_reason, out.stop_reason) for rid, out in outputs.items()
        }
        if async_scheduling:
            assert {"token", "string"} <= hook.hits
            _assert_drains(engine)
    assert results[True] == results[False]
    assert results[True]["token"][2:] == ("stop", stop_token) and len(results[True]["token"][0]) <= 5
    assert results[True]["string"][2:] == ("stop", stop_string) and len(results[True]["string"][0]) < 30


def test_abort_mid_generation_with_a_step_in_flight(tiny_llama: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reference = make_engine(tiny_llama)
    add(reference, "keep", prompt_ids(12), params)
    expected = run(reference)["keep"].outputs[0].token_ids

    engine = make_engine(tiny_llama, async_scheduling=True)
    keep = add(engine, "keep", prompt_ids(12), params)
    doomed = add(engine, "doomed", prompt_ids(9, start=40), params)
    core = engine.engine_core.get_engine_core()
    for _ in range(5):
        engine.step()
    assert any("doomed" in step.scheduler_output.num_scheduled_tokens for step in core.batch_queue)
    engine.abort_request("doomed")
    outputs = run(engine)
    assert doomed.status == RequestStatus.FINISHED_ABORTED and "doomed" not in outputs
    assert keep.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert outputs["keep"].outputs[0].token_ids == expected
    _assert_drains(engine)


def test_async_scheduling_refuses_structured_output_and_tracing(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama, async_scheduling=True)
    grammar = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="async_scheduling"):
        engine.add_request("json", {"prompt_token_ids": prompt_ids(5)}, grammar)
    assert not engine.has_unfinished_requests() and not engine.engine_core.get_engine_core().scheduler.requests
    with pytest.raises(ValueError, match="async_scheduling"):
        make_engine(tiny_llama, async_scheduling=True, trace=True)


def test_kv_connector_consumer_with_async_scheduling(tiny_llama: str, tmp_path: Path) -> None:
    prompt, params = prompt_ids(70), SamplingParams(temperature=0.0, max_tokens=10)
    reference = make_engine(tiny_llama)
    add(reference, "r", prompt, params)
    expected = run(reference)["r"].outputs[0].token_ids
    producer = make_engine(tiny_llama, async_scheduling=True,
                           kv_transfer_config=KVTransferConfig("SharedStorageConnector", "kv_producer", {"shared_storage_path": str(tmp_path)}))
    add(producer, "prefill", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    run(producer)
    consumer = make_engine(tiny_llama, async_scheduling=True,
                           kv_transfer_config=KVTransferConfig("SharedStorageConnector", "kv_consumer", {"shared_storage_path": str(tmp_path)}))
    request = add(consumer, "r", prompt, params)
    output = run(consumer)["r"]
    assert RequestStatus.WAITING_FOR_REMOTE_KVS in path(request)
    assert output.num_external_computed_tokens == 64 and output.outputs[0].token_ids == expected
    _assert_drains(consumer)


def test_streamed_prompt_with_async_scheduling(tiny_llama: str) -> None:
    prompt, params = prompt_ids(70), SamplingParams(temperature=0.0, max_tokens=10)
    reference = make_engine(tiny_llama)
    add(reference, "whole", prompt, params)
    expected = run(reference)["whole"].outputs[0].token_ids
    engine = make_engine(tiny_llama, async_scheduling=True)
    request = add(engine, "s", prompt[:20], params, streaming=True)
    pieces = [prompt[20:45], prompt[45:]]

    def feed(_: int, outputs: list[RequestOutput]) -> None:
        if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ and pieces:
            piece = pieces.pop(0)
            engine.append_prompt("s", piece, final=not pieces)

    assert run(engine, feed)["s"].outputs[0].token_ids == expected
    assert path(request).count(RequestStatus.WAITING_FOR_STREAMING_REQ) == 2
    _assert_drains(engine)
