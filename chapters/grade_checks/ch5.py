"""The grader's checks for exercises 5.1 and 5.2 (chapter 5).

Each promise on the exercise pages has a check of its own, named in a
student's words, so a wrong answer is named by the behaviour it breaks. The
unit checks call the function directly -- including on states a short
generation never reaches (a grammar that fails to compile, a remote KV load) --
and return labeled tables: each key names the call, the request's state and
its inputs; each value is what came back. The end-to-end runs come last.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from chapters.grade_checks.common import PROMPTS, SMALL_BLOCKS, Check, kv_spec, make_request
from nanoengine import LLM, SamplingParams
from nanoengine.config import CacheConfig, SchedulerConfig
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.structured_output.request import StructuredOutputRequest

# ------------------------------------------------ 5.1 RequestStatus.is_finished
FINISHED_STATES = [s for s in RequestStatus if s.name.startswith("FINISHED_")]
LIVE_STATES = [s for s in RequestStatus if not s.name.startswith("FINISHED_")]


def finished_states_are_finished(model: str) -> dict[str, Any]:
    """`RequestStatus.is_finished(status)` for each of the six `FINISHED_*` states."""
    table = {f"is_finished({status.name})": RequestStatus.is_finished(status) for status in FINISHED_STATES}
    assert len(table) == 6, f"the page promises six FINISHED_* states, found {len(table)}"
    return table


def live_states_are_not_finished(model: str) -> dict[str, Any]:
    """`RequestStatus.is_finished(status)` for `WAITING`, the three `WAITING_FOR_*` states,
    `RUNNING` and `PREEMPTED`."""
    table = {f"is_finished({status.name})": RequestStatus.is_finished(status) for status in LIVE_STATES}
    assert len(table) == 6, f"the page promises six live states, found {len(table)}"
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
    kept = final["kept"]
    assert kept[1] == "length" and len(kept[0]) == 8, f"the kept request ended as {kept}"
    return final


# ----------------------------------------- 5.2 Scheduler._handle_blocked_waiting_request
# Labels name the state a request starts in, then what the check set up.
GRAMMAR = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR.name
REMOTE = RequestStatus.WAITING_FOR_REMOTE_KVS.name
STREAM = RequestStatus.WAITING_FOR_STREAMING_REQ.name
# What each value holds: what the call returned, then the request's state after
# it (and, for remote KVs, what is left of the scheduler's set of finished loads).
OUTCOME = "(returned, status)"
REMOTE_OUTCOME = "(returned, status, finished_recving_kv_req_ids after)"


def small_scheduler() -> Scheduler:
    """A scheduler over 16 blocks of 4 tokens, for calling its methods directly."""
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        KVCacheConfig(num_blocks=16, spec=kv_spec()),
    )


def _promote(scheduler: Scheduler, request: Request) -> tuple[bool, str]:
    """Call the method under test; record its answer and the state it left the request in."""
    returned = scheduler._handle_blocked_waiting_request(request)
    return returned, request.status.name


def _blocked(request_id: str, status: RequestStatus, num_preemptions: int = 0) -> Request:
    request = make_request(request_id, 6)
    request.status = status
    request.num_preemptions = num_preemptions
    return request


# -- grammar: a real StructuredOutputRequest around a Future the check controls,
# so "still compiling", "compiled" and "failed" are each one call away.
def _grammar_request(request_id: str, num_preemptions: int = 0) -> tuple[Request, Future[Any]]:
    request = _blocked(request_id, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, num_preemptions)
    compiling: Future[Any] = Future()
    request.structured_output_request = StructuredOutputRequest(StructuredOutputsParams(choice=["yes", "no"]),
                                                                compiling)
    return request, compiling


def _compiled_grammar_request(request_id: str, num_preemptions: int = 0) -> Request:
    request, compiling = _grammar_request(request_id, num_preemptions)
    compiling.set_result(object())  # the scheduler never looks inside a compiled grammar
    return request


# -- remote KVs: the set of finished loads is the scheduler's own attribute.
def _remote_call(scheduler: Scheduler, request: Request, finished: set[str]) -> tuple[bool, str, list[str]]:
    """Promote with ``finished`` as the finished loads; also record what is left of the set."""
    scheduler.finished_recving_kv_req_ids = set(finished)
    returned, status = _promote(scheduler, request)
    return returned, status, sorted(scheduler.finished_recving_kv_req_ids)


# -- streaming: an open stream holds back its last prompt token, so 6 prompt
# tokens of which 5 are computed leave nothing to prefill until more arrives.
def _stream(request_id: str, num_preemptions: int = 0) -> Request:
    request = _blocked(request_id, RequestStatus.WAITING_FOR_STREAMING_REQ, num_preemptions)
    request.streaming_input_open = True
    request.num_computed_tokens = 5
    return request


def never_blocked(model: str) -> dict[str, Any]:
    """A `WAITING` request and a `PREEMPTED` one (preempted once)."""
    scheduler = small_scheduler()
    waiting = make_request("waiting", 6)
    preempted = _blocked("preempted", RequestStatus.PREEMPTED, num_preemptions=1)
    return {f"WAITING: {OUTCOME}": _promote(scheduler, waiting),
            f"PREEMPTED, preempted once: {OUTCOME}": _promote(scheduler, preempted)}


def grammar_compiling(model: str) -> dict[str, Any]:
    """A `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR` request whose grammar `Future` is not done yet."""
    request, _ = _grammar_request("grammar")
    assert request.structured_output_request is not None and not request.structured_output_request.is_ready, (
        "a Future nobody has completed must read as still compiling"
    )
    return {f"{GRAMMAR}, grammar still compiling: {OUTCOME}": _promote(small_scheduler(), request)}


def grammar_compiled(model: str) -> dict[str, Any]:
    """A `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR` request after `set_result` on its grammar
    `Future` (never preempted)."""
    request = _compiled_grammar_request("grammar")
    return {f"{GRAMMAR}, grammar compiled: {OUTCOME}": _promote(small_scheduler(), request)}


def grammar_failed(model: str) -> dict[str, Any]:
    """A `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR` request after
    `set_exception(ValueError("bad grammar"))` on its grammar `Future`."""
    request, compiling = _grammar_request("grammar")
    compiling.set_exception(ValueError("bad grammar"))
    returned, status = _promote(small_scheduler(), request)
    assert request.structured_output_request is not None, "the check built a grammar request"
    assert request.structured_output_request.compile_error, "a failed Future gives a compile_error"
    failed = f"{GRAMMAR}, grammar failed to compile"
    return {f"{failed}: returned": returned,
            f"{failed}: status": status,
            f"{failed}: finish_message": request.finish_message}


def remote_kvs_waiting(model: str) -> dict[str, Any]:
    """A `WAITING_FOR_REMOTE_KVS` request "mine" while `self.finished_recving_kv_req_ids` is
    empty, then while it holds only `"other"`."""
    scheduler = small_scheduler()
    request = _blocked("mine", RequestStatus.WAITING_FOR_REMOTE_KVS)
    return {f"{REMOTE}, no load finished: {REMOTE_OUTCOME}": _remote_call(scheduler, request, set()),
            f"{REMOTE}, only 'other' finished loading: {REMOTE_OUTCOME}":
                _remote_call(scheduler, request, {"other"})}


def remote_kvs_loaded(model: str) -> dict[str, Any]:
    """A `WAITING_FOR_REMOTE_KVS` request "mine" once `self.finished_recving_kv_req_ids` is
    `{"mine", "other"}` (never preempted)."""
    request = _blocked("mine", RequestStatus.WAITING_FOR_REMOTE_KVS)
    return {f"{REMOTE}, 'mine' and 'other' finished loading: {REMOTE_OUTCOME}":
            _remote_call(small_scheduler(), request, {"mine", "other"})}


def stream_nothing_new(model: str) -> dict[str, Any]:
    """An open `WAITING_FOR_STREAMING_REQ` stream of 6 prompt tokens with 5 computed: it
    holds back its last token, so 5 are prefillable and nothing new can be prefilled."""
    stream = _stream("stream")
    assert stream.num_prefillable_tokens == stream.num_computed_tokens == 5, (
        "an open stream holds back its last prompt token"
    )
    return {f"{STREAM}, open stream, 6 prompt tokens, 5 computed: {OUTCOME}":
            _promote(small_scheduler(), stream)}


def stream_more_to_prefill(model: str) -> dict[str, Any]:
    """That stream after 1 more prompt token arrives (6 prefillable), and after its
    input is closed instead (the held-back token is released: 6 prefillable)."""
    scheduler = small_scheduler()
    grown, closed = _stream("grown"), _stream("closed")
    grown.append_prompt_token_ids([7])
    closed.streaming_input_open = False
    assert grown.num_prefillable_tokens == closed.num_prefillable_tokens == 6, "one more token is prefillable"
    return {f"{STREAM}, open stream, 7 prompt tokens, 5 computed: {OUTCOME}": _promote(scheduler, grown),
            f"{STREAM}, closed stream, 6 prompt tokens, 5 computed: {OUTCOME}": _promote(scheduler, closed)}


def promoted_state(model: str) -> dict[str, Any]:
    """Each of the three blocked states, ready, with `num_preemptions` 0, 1 and 2."""
    scheduler = small_scheduler()
    table: dict[str, Any] = {}
    for preemptions, state in ((0, "never preempted"), (1, "preempted once"), (2, "preempted twice")):
        grammar = _compiled_grammar_request(f"grammar{preemptions}", preemptions)
        table[f"{GRAMMAR}, grammar compiled, {state}: {OUTCOME}"] = _promote(scheduler, grammar)
        remote = _blocked(f"remote{preemptions}", RequestStatus.WAITING_FOR_REMOTE_KVS, preemptions)
        scheduler.finished_recving_kv_req_ids = {remote.request_id}
        table[f"{REMOTE}, load finished, {state}: {OUTCOME}"] = _promote(scheduler, remote)
        stream = _stream(f"stream{preemptions}", preemptions)
        stream.streaming_input_open = False
        table[f"{STREAM}, input closed, {state}: {OUTCOME}"] = _promote(scheduler, stream)
    return table


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
    "5.1": (Check("every FINISHED_* state is finished", finished_states_are_finished),
            Check("WAITING*, RUNNING and PREEMPTED are not finished", live_states_are_not_finished),
            Check("end to end: generation with an abort", e2e_abort)),
    "5.2": (Check("WAITING and PREEMPTED pass unchanged", never_blocked),
            Check("grammar still compiling: not ready", grammar_compiling),
            Check("grammar compiled: promoted", grammar_compiled),
            Check("grammar failed: FINISHED_ERROR, its message, False", grammar_failed),
            Check("remote KVs not loaded: not ready, set untouched", remote_kvs_waiting),
            Check("remote KVs loaded: promoted, only its id removed", remote_kvs_loaded),
            Check("stream with nothing new to prefill: not ready", stream_nothing_new),
            Check("stream with more to prefill: promoted", stream_more_to_prefill),
            Check("promoted to PREEMPTED if ever preempted, else WAITING", promoted_state),
            Check("end to end: a prompt streamed in three pieces", e2e_streaming_prompt)),
}
