"""Chapter 5 -- all 12 request states, reached by real requests on a real engine.

Chapter 5 of the study notes lists the 12 states of ``RequestStatus``; here each one is
*reached*, each by the feature that needs it, and every transition a request
goes through is recorded (``Request.status_history``):

* a choice grammar -> WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR while it compiles;
  a broken regex -> FINISHED_ERROR, while the others carry on;
* a prompt another engine (the *producer*) already prefilled and saved ->
  WAITING_FOR_REMOTE_KVS while this engine loads its KV blocks (the store is
  keyed by prefix hash, so every chat prompt sharing the system prompt's
  blocks loads those too, and a preempted request reloads them and returns to
  PREEMPTED, not WAITING);
* a prompt sent in pieces -> WAITING_FOR_STREAMING_REQ between pieces;
* a loop caught by ``repetition_detection`` -> FINISHED_REPETITION;
* ``abort_request`` -> FINISHED_ABORTED; ``max_tokens`` -> FINISHED_LENGTH_CAPPED;
  EOS -> FINISHED_STOPPED;
* a KV cache of just ``max_model_len`` tokens shared by several long answers
  -> PREEMPTED (and back);
* a prompt longer than ``max_model_len`` handed straight to ``EngineCore``
  (the front end would refuse it with ValueError; the scheduler's own guard is
  what a client that skips those checks meets) -> FINISHED_IGNORED.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field

from rich.table import Table

from chapters._common import SEED_PROMPTS
from nanoengine.config import KVTransferConfig
from nanoengine.engine import EngineCoreRequest
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import RequestOutput
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import RepetitionDetectionParams, SamplingParams, StructuredOutputsParams

# A KV cache of exactly one max_model_len request (plus the null block): several
# long answers at once cannot all fit, so the scheduler must preempt.
TOUR_MAX_MODEL_LEN = 256
# 16-token blocks (not the CPU's default 128), so a cache of a few hundred tokens
# still has enough blocks to run out of one at a time.
TOUR_BLOCK_SIZE = 16
TOUR_NUM_BLOCKS = TOUR_MAX_MODEL_LEN // TOUR_BLOCK_SIZE + 1
START = "[*]"  # mermaid's name for "before the first state" and "after the last"

# Why each transition happens, in the words of the code that makes it.
TRANSITION_CAUSES: dict[tuple[str, str], str] = {
    (START, "WAITING"): "add_request",
    (
        START,
        "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",
    ): "add_request with structured_outputs: grammar compiling",
    ("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING"): "_handle_blocked_waiting_request: grammar ready",
    (
        "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",
        "FINISHED_ERROR",
    ): "_handle_blocked_waiting_request: compile failed",
    ("WAITING", "WAITING_FOR_REMOTE_KVS"): "_start_remote_kv_load: connector has the prefix",
    ("WAITING_FOR_REMOTE_KVS", "WAITING"): "_handle_blocked_waiting_request: load finished",
    ("WAITING", "RUNNING"): "schedule(): admitted",
    ("PREEMPTED", "RUNNING"): "schedule(): resumed (recompute)",
    ("RUNNING", "PREEMPTED"): "schedule(): out of KV blocks, newest runner evicted",
    ("RUNNING", "WAITING_FOR_STREAMING_REQ"): "_park_streaming_requests: all received prompt computed",
    ("WAITING_FOR_STREAMING_REQ", "WAITING"): "_handle_blocked_waiting_request: more prompt arrived",
    ("WAITING_FOR_STREAMING_REQ", "PREEMPTED"): "_handle_blocked_waiting_request: more prompt, was preempted",
    ("PREEMPTED", "WAITING_FOR_REMOTE_KVS"): "_start_remote_kv_load: evicted prefix reloaded from storage",
    ("WAITING_FOR_REMOTE_KVS", "PREEMPTED"): "_handle_blocked_waiting_request: loaded, was preempted",
    ("PREEMPTED", "WAITING_FOR_STREAMING_REQ"): "schedule(): stream parked, nothing new to prefill",
    ("WAITING", "FINISHED_IGNORED"): "schedule(): can never fit max_model_len / the KV cache",
    ("RUNNING", "FINISHED_STOPPED"): "check_stop: EOS or stop token",
    ("RUNNING", "FINISHED_LENGTH_CAPPED"): "check_stop: max_tokens reached",
    ("RUNNING", "FINISHED_REPETITION"): "check_stop: repetition_detection",
    ("RUNNING", "FINISHED_ABORTED"): "abort_request",
    ("WAITING", "FINISHED_ABORTED"): "abort_request",
    ("PREEMPTED", "FINISHED_ABORTED"): "abort_request",
}


@dataclass
class TourRequest:
    """One request of the tour: what drives it, the engine's Request, the user's output."""

    name: str
    feature: str
    request: Request
    output: RequestOutput | None = None

    @property
    def path(self) -> list[str]:
        return [status.name for _, status in self.request.status_history]


@dataclass
class StateTour:
    requests: list[TourRequest]
    steps: int
    seconds: float
    skipped_prefill_tokens: int  # prompt tokens the consumer loaded instead of computing
    transitions: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        found: dict[tuple[str, str], list[str]] = defaultdict(list)
        for tour_request in self.requests:
            path = [START, *tour_request.path]
            for before, after in itertools.pairwise(path):
                found[(before, after)].append(tour_request.name)
        self.transitions = dict(found)

    def states_reached(self) -> set[RequestStatus]:
        return {status for r in self.requests for _, status in r.request.status_history}


def _engine(model: str, transfer: KVTransferConfig, num_blocks: int) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            max_model_len=TOUR_MAX_MODEL_LEN,
            block_size=TOUR_BLOCK_SIZE,
            num_gpu_blocks_override=num_blocks,
            kv_transfer_config=transfer,
        )
    )


def _chat_ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.renderer.render_chat([{"role": "user", "content": text}])["prompt_token_ids"]


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


SHARED_PROMPT = (
    "You are a careful assistant. Read the following question twice before answering, "
    "then answer in one short sentence. Question: what is the capital of France?"
)


def run_state_tour(model: str, storage_dir: str, max_tokens: int = 32) -> StateTour:
    """Drive one request per feature through a consumer engine; return what happened."""
    start = time.perf_counter()
    producer = _engine(model, KVTransferConfig("SharedStorageConnector", "kv_producer", {"shared_storage_path": storage_dir}), num_blocks=4 * TOUR_NUM_BLOCKS)
    shared_ids = _chat_ids(producer, SHARED_PROMPT)
    producer.add_request(
        "prefill", {"prompt_token_ids": shared_ids}, SamplingParams(temperature=0, max_tokens=1)
    )
    _drain(producer)  # its prompt's full KV blocks are now files in storage_dir
    producer.shutdown()

    engine = _engine(model, KVTransferConfig("SharedStorageConnector", "kv_consumer", {"shared_storage_path": storage_dir}), num_blocks=TOUR_NUM_BLOCKS)
    core = engine.engine_core.get_engine_core()  # the tour reads its Requests
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    tour: dict[str, TourRequest] = {}

    def add(
        name: str, feature: str, prompt_ids: list[int], params: SamplingParams, streaming: bool = False
    ) -> None:
        engine.add_request(name, {"prompt_token_ids": prompt_ids}, params, streaming=streaming)
        tour[name] = TourRequest(name, feature, core.scheduler.requests[name])

    def with_params(**changes: object) -> SamplingParams:
        params = greedy.clone()
        for key, value in changes.items():
            setattr(params, key, value)
        return params

    add(
        "grammar",
        "structured_outputs choice",
        _chat_ids(engine, "Is Paris in France? Answer yes or no."),
        with_params(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    )
    add(
        "bad-grammar",
        "structured_outputs regex='('",
        _chat_ids(engine, "Say something."),
        with_params(structured_outputs=StructuredOutputsParams(regex="(")),
    )
    add("remote-kv", "KV connector (consumer)", shared_ids, greedy)
    stream_ids = _chat_ids(engine, "Write a Python function that reverses a list, with a docstring.")
    pieces = [stream_ids[i : i + 8] for i in range(8, len(stream_ids), 8)]
    add("streaming", "streaming input, 8-token pieces", stream_ids[:8], greedy, streaming=True)
    add(
        "repetition",
        "repetition_detection (the study notes' first prompt loops on emoji)",
        _chat_ids(engine, SEED_PROMPTS[0]),
        with_params(
            max_tokens=None,  # until it loops (or the context is full)
            repetition_detection=RepetitionDetectionParams(max_pattern_size=16, min_count=2),
        ),
    )
    add("abort", "abort_request after 1 token", _chat_ids(engine, "Tell me a long story."), greedy)
    for index, topic in enumerate(["a river", "the sea", "a mountain"]):
        add(
            f"long-{index}",
            "long answers in a small KV cache",
            _chat_ids(engine, f"Write a long poem about {topic}."),
            with_params(max_tokens=TOUR_MAX_MODEL_LEN // 2),
        )
    # The one request that skips the front end: EngineCore.add_request directly.
    too_long = EngineCoreRequest("ignored", [shared_ids[0]] * (TOUR_MAX_MODEL_LEN + 8), greedy.clone(), None)
    core.add_request(too_long)
    tour["ignored"] = TourRequest(
        "ignored", "EngineCore-level add, prompt > max_model_len", core.scheduler.requests["ignored"]
    )

    steps = 0
    while engine.has_unfinished_requests() or core.scheduler.has_requests():
        steps += 1
        for output in engine.step():
            tour[output.request_id].output = output
            if output.request_id == "abort" and output.outputs[0].token_ids and not output.finished:
                engine.abort_request("abort")
        if tour["streaming"].request.status == RequestStatus.WAITING_FOR_STREAMING_REQ and pieces:
            piece = pieces.pop(0)
            engine.append_prompt("streaming", piece, final=not pieces)
    engine.shutdown()
    skipped = tour["remote-kv"].request.num_external_computed_tokens
    return StateTour(list(tour.values()), steps, time.perf_counter() - start, skipped)


# ---------------------------------------------------------------------- display


def _order(name: str) -> int:
    return -1 if name == START else int(RequestStatus[name])


def transitions_table(tour: StateTour) -> Table:
    table = Table(title=f"Observed transitions ({len(tour.requests)} requests, {tour.steps} steps)")
    for column in ("from", "to", "count", "requests", "cause"):
        table.add_column(column, justify="right" if column == "count" else "left")
    for (before, after), names in sorted(
        tour.transitions.items(), key=lambda kv: (_order(kv[0][0]), _order(kv[0][1]))
    ):
        table.add_row(
            before,
            after,
            str(len(names)),
            ", ".join(sorted(set(names))),
            TRANSITION_CAUSES.get((before, after), ""),
        )
    return table


def paths_table(tour: StateTour) -> Table:
    """Each request's own path through the machine, and its timings."""
    table = Table(title="Per request: feature, path, metrics (queue / TTFT / TPOT in ms)")
    for column in ("request", "feature", "path", "queue", "TTFT", "TPOT"):
        table.add_column(column)
    for r in tour.requests:
        metrics = r.output.metrics if r.output is not None else None
        cells = (
            [metrics.queue_time, metrics.time_to_first_token, metrics.time_per_output_token]
            if metrics
            else []
        )
        table.add_row(
            r.name,
            r.feature,
            " -> ".join(_short(s) for s in r.path),
            *[f"{value * 1000:.0f}" if value is not None else "" for value in cells] or ["", "", ""],
        )
    return table


def _short(status: str) -> str:
    return status.replace("WAITING_FOR_", "WF_").replace("STRUCTURED_OUTPUT_", "")


def mermaid(tour: StateTour) -> str:
    """A mermaid stateDiagram of what was observed; paste into any mermaid viewer."""
    lines = ["stateDiagram-v2"]
    for (before, after), names in sorted(
        tour.transitions.items(), key=lambda kv: (_order(kv[0][0]), _order(kv[0][1]))
    ):
        lines.append(f"    {before} --> {after}: {len(names)}")
    for status in sorted(tour.states_reached()):
        if RequestStatus.is_finished(status):
            lines.append(f"    {status.name} --> {START}")
    return "\n".join(lines)
