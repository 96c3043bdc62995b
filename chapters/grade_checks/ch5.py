"""The grader's checks for exercises 5.1 and 5.2 (chapter 5).

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from typing import Any

from chapters.grade_checks.common import PROMPTS, SMALL_BLOCKS, Check, kv_spec, make_request
from nanoengine import LLM, SamplingParams
from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.request import RequestStatus


# ------------------------------------------------ 5.1 RequestStatus.is_finished
def finished_states(model: str) -> dict[str, bool]:
    table = {status.name: RequestStatus.is_finished(status) for status in RequestStatus}
    assert table == {s.name: s > RequestStatus.PREEMPTED for s in RequestStatus}
    request = make_request("r", 3)
    request.status = RequestStatus.FINISHED_ABORTED
    table["Request.is_finished"] = request.is_finished()
    return table


def e2e_abort(model: str) -> dict[str, Any]:
    """Abort one of two running requests; the other must finish unchanged."""
    llm = LLM(model=model, **SMALL_BLOCKS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for request_id, prompt in (("kept", PROMPTS[0]), ("aborted", PROMPTS[1])):
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    outputs = engine.step() + engine.step()
    engine.abort_request("aborted")
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.shutdown()
    final = {o.request_id: (list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs}
    assert final["kept"][1] == "length" and len(final["kept"][0]) == 8
    return final


# ----------------------------------------- 5.2 Scheduler._handle_blocked_waiting_request
def small_scheduler() -> Scheduler:
    """A scheduler over 16 blocks of 4 tokens, for calling its methods directly."""
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        KVCacheConfig(num_blocks=16, spec=kv_spec()),
    )


def promotions(model: str) -> list[Any]:
    scheduler = small_scheduler()
    promote = scheduler._handle_blocked_waiting_request
    trace: list[Any] = []
    plain = make_request("plain", 4)
    trace.append((promote(plain), str(plain.status)))
    for preempted_before in (0, 1):
        remote = make_request(f"remote{preempted_before}", 4)
        remote.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        remote.num_preemptions = preempted_before
        scheduler.finished_recving_kv_req_ids = set()
        trace.append((promote(remote), str(remote.status)))
        scheduler.finished_recving_kv_req_ids.add(remote.request_id)
        trace.append((promote(remote), str(remote.status), sorted(scheduler.finished_recving_kv_req_ids)))
    stream = make_request("stream", 6)
    stream.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    stream.num_computed_tokens = 6
    trace.append((promote(stream), str(stream.status)))
    stream.append_prompt_token_ids([7, 8])
    trace.append((promote(stream), str(stream.status)))
    assert trace[0] == (True, "WAITING") and trace[2][:2] == (True, "WAITING")
    return trace


def e2e_streaming_prompt(model: str) -> dict[str, Any]:
    """A prompt sent in three pieces, next to an ordinary request."""
    llm = LLM(model=model, **SMALL_BLOCKS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("plain", TokensPrompt(prompt_token_ids=PROMPTS[1]), params)
    engine.add_request("stream", TokensPrompt(prompt_token_ids=PROMPTS[0][:3]), params, streaming=True)
    pieces = [(PROMPTS[0][3:5], False), (PROMPTS[0][5:], True)]
    finished: dict[str, list[int]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        if pieces:
            piece, final = pieces.pop(0)
            engine.append_prompt("stream", piece, final=final)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    engine.shutdown()
    assert set(finished) == {"plain", "stream"}, f"finished: {sorted(finished)}"
    return finished


CHECKS: dict[str, tuple[Check, ...]] = {
    "5.1": (Check("finished states", finished_states),
            Check("end to end: generation with an abort", e2e_abort)),
    "5.2": (Check("promotion out of the WAITING_FOR_* states", promotions),
            Check("end to end: a prompt streamed in three pieces", e2e_streaming_prompt)),
}
