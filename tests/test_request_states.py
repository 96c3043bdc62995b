"""Chapter 5: every one of the 12 request states, reached through public API.

The three blocked-waiting states have feature tests of their own
(test_structured_output.py, test_kv_connector.py, test_streaming_input.py);
this file reaches the other nine, checks the enum order, the promotion step
(``Scheduler._handle_blocked_waiting_request``) and the per-request event log.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_helpers import GREEDY, add, make_engine, path, prompt_ids, run
from test_scheduler import make_scheduler

from nanoengine.core.sched.utils import ends_in_repetition
from nanoengine.engine import EngineCoreRequest
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import RepetitionDetectionParams, SamplingParams

S = RequestStatus
MAP_FILE = Path(__file__).resolve().parent.parent / "chapters" / "data" / "vllm_0_32_map.json"


def test_enum_order_matches_vllm_and_is_finished_is_one_compare() -> None:
    vllm_order = json.loads(MAP_FILE.read_text())["states_0_32"]
    assert [s.name for s in RequestStatus] == vllm_order
    finished = [s for s in RequestStatus if RequestStatus.is_finished(s)]
    assert finished == [s for s in RequestStatus if s > S.PREEMPTED]
    assert len(finished) == 6 and S.PREEMPTED not in finished


def test_waiting_running_length_capped(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    request = add(engine, "r", prompt_ids(20))
    out = run(engine)["r"]
    assert path(request) == [S.WAITING, S.RUNNING, S.FINISHED_LENGTH_CAPPED]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_finished_stopped_on_a_stop_token(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    add(engine, "probe", prompt_ids(20))
    third = run(engine)["probe"].outputs[0].token_ids[2]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[third])
    request = add(engine, "r", prompt_ids(20), params)
    out = run(engine)["r"]
    assert path(request) == [S.WAITING, S.RUNNING, S.FINISHED_STOPPED]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == third
    assert out.outputs[0].token_ids[-1] == third


def test_preempted_requests_resume_and_match_an_unconstrained_run(tiny_llama: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100)
    # fp32: a resumed request recomputes its KV as one prefill, where the first run
    # wrote it decode by decode. Both kernels sum in their own order; fp32 keeps that
    # far below any greedy decision over 100 tokens, bf16 rounding need not.
    roomy = make_engine(tiny_llama, dtype="float32")
    for i in range(3):
        add(roomy, f"r{i}", prompt_ids(30, start=5 + i), params)
    expected = {rid: out.outputs[0].token_ids for rid, out in run(roomy).items()}
    # 16 usable blocks = 256 tokens; three requests of 130 tokens cannot all fit.
    tight = make_engine(tiny_llama, dtype="float32", num_gpu_blocks_override=17)
    requests = [add(tight, f"r{i}", prompt_ids(30, start=5 + i), params) for i in range(3)]
    outputs = run(tight)
    preempted = [r for r in requests if S.PREEMPTED in path(r)]
    assert preempted, "the tight KV cache must force a preemption"
    for request in preempted:
        history = path(request)
        assert history[history.index(S.PREEMPTED) + 1] == S.RUNNING  # resumed, not restarted elsewhere
        metrics = outputs[request.request_id].metrics
        assert metrics is not None and metrics.num_preemptions >= 1
        assert "preempted" in [name for name, _ in metrics.events]
    assert {rid: out.outputs[0].token_ids for rid, out in outputs.items()} == expected


def test_abort_a_running_and_a_waiting_request(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama, max_num_seqs=1)
    running = add(engine, "running", prompt_ids(20), SamplingParams(temperature=0.0, max_tokens=50))
    waiting = add(engine, "waiting", prompt_ids(20, start=9))
    engine.step()
    engine.step()
    engine.abort_request(["running", "waiting"])
    assert not engine.has_unfinished_requests()
    assert path(running) == [S.WAITING, S.RUNNING, S.FINISHED_ABORTED]
    assert path(waiting) == [S.WAITING, S.FINISHED_ABORTED]
    assert not engine.engine_core.get_engine_core().scheduler.requests


def test_ignored_when_a_client_skips_the_front_end_checks(tiny_llama: str) -> None:
    """The front end refuses an over-long prompt; the scheduler's own guard
    (FINISHED_IGNORED) is what a request added at the EngineCore level meets."""
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("front", {"prompt_token_ids": prompt_ids(300)}, GREEDY)
    core = engine.engine_core.get_engine_core()
    core.add_request(EngineCoreRequest("core", prompt_ids(300), GREEDY.clone(), eos_token_id=None))
    request = core.scheduler.requests["core"]
    outputs, _ = core.step()
    assert path(request) == [S.WAITING, S.FINISHED_IGNORED]
    (output,) = outputs.outputs
    assert output.finish_reason is not None and str(output.finish_reason) == "length"
    assert output.finish_message is not None and "max_model_len=256" in output.finish_message


def test_repetition_detection_stops_a_loop(tiny_llama: str) -> None:
    detection = RepetitionDetectionParams(max_pattern_size=8, min_count=2)
    engine = make_engine(tiny_llama)
    request = add(
        engine,
        "r",
        prompt_ids(10),
        SamplingParams(temperature=0.0, max_tokens=200, repetition_detection=detection),
    )
    out = run(engine)["r"]
    tokens = out.outputs[0].token_ids
    assert path(request) == [S.WAITING, S.RUNNING, S.FINISHED_REPETITION]
    assert out.outputs[0].finish_reason == "repetition" and len(tokens) < 200
    assert ends_in_repetition(tokens, 1, 8, 2) and not ends_in_repetition(tokens[:-1], 1, 8, 2)


def test_ends_in_repetition() -> None:
    assert ends_in_repetition([1, 2, 3, 2, 3], 1, 4, 2)
    assert not ends_in_repetition([1, 2, 3, 2, 3], 1, 4, 3)
    assert ends_in_repetition([9, 4, 4, 4], 1, 1, 3)
    assert not ends_in_repetition([1, 2, 3, 4], 2, 2, 2)
    with pytest.raises(ValueError, match="min_count"):
        RepetitionDetectionParams(max_pattern_size=4, min_count=1)
    with pytest.raises(ValueError, match="min_pattern_size"):
        RepetitionDetectionParams(max_pattern_size=2, min_pattern_size=3)


def _streaming_request(num_preemptions: int) -> Request:
    request = Request("r", [5, 6, 7, 8], SamplingParams(), eos_token_id=None)
    request.streaming_input_open = True
    request.num_computed_tokens = 3  # everything but the held-back last token
    request.num_preemptions = num_preemptions
    request.status = S.WAITING_FOR_STREAMING_REQ
    return request


@pytest.mark.parametrize(("num_preemptions", "promoted_to"), [(0, S.WAITING), (1, S.PREEMPTED)])
def test_promotion_returns_to_waiting_or_preempted(num_preemptions: int, promoted_to: RequestStatus) -> None:
    scheduler, request = make_scheduler(), _streaming_request(num_preemptions)
    assert not scheduler._handle_blocked_waiting_request(request)  # nothing new yet
    assert request.status == S.WAITING_FOR_STREAMING_REQ
    request.append_prompt_token_ids([9])
    assert scheduler._handle_blocked_waiting_request(request)
    assert request.status == promoted_to


def test_promotion_of_remote_kv_needs_the_finished_load() -> None:
    scheduler = make_scheduler()
    request = Request("r", [5, 6, 7], SamplingParams(), eos_token_id=None)
    request.status = S.WAITING_FOR_REMOTE_KVS
    scheduler.finished_recving_kv_req_ids = {"other"}
    assert not scheduler._handle_blocked_waiting_request(request)
    scheduler.finished_recving_kv_req_ids.add("r")
    assert scheduler._handle_blocked_waiting_request(request)
    assert request.status == S.WAITING and scheduler.finished_recving_kv_req_ids == {"other"}


def test_event_log_feeds_queue_time_ttft_tpot(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    add(engine, "r", prompt_ids(20))
    metrics = run(engine)["r"].metrics
    assert metrics is not None
    names = [name for name, _ in metrics.events]
    assert names == ["queued", "scheduled", "first_token", "finished"]
    times = [t for _, t in metrics.events]
    assert times == sorted(times) and metrics.arrival_time <= times[0]
    assert metrics.queue_time is not None and metrics.queue_time >= 0
    assert metrics.time_to_first_token is not None and metrics.time_to_first_token >= metrics.queue_time
    assert metrics.time_per_output_token is not None and metrics.time_per_output_token > 0
    assert metrics.num_generation_tokens == GREEDY.max_tokens
