"""Outputs: what ``LLM.generate`` returns, and what the model runner returns to the scheduler.

Chapter 1 prints ``RequestOutput``s (one ``CompletionOutput`` per sample);
chapter 7 shows the output processor that builds them. Chapter 7 also follows
one step's ``ModelRunnerOutput`` from the worker back to
``Scheduler.update_from_output``; chapter 8 adds its logprobs.
vLLM 0.32 counterpart: ``vllm/outputs.py`` (``RequestOutput``,
``CompletionOutput``) and ``vllm/v1/outputs.py`` (``ModelRunnerOutput``,
``KVConnectorOutput``, ``LogprobsTensors``, ``EMPTY_MODEL_RUNNER_OUTPUT``). vLLM
keeps the second file apart from its older engine's outputs; nanoengine has one
engine, so one file holds both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoengine.distributed.kv_transfer.base import KVTransferStats
from nanoengine.engine import EngineCoreEvent, EngineCoreEventType
from nanoengine.logprobs import LogprobsLists, PromptLogprobs, SampleLogprobs
from nanoengine.spec_decode.metrics import RequestSpecDecodeMetrics

if TYPE_CHECKING:  # annotations only: this module stays importable without torch (core/ reads it)
    import torch


@dataclass
class CompletionOutput:
    """One generated sequence (a request with ``n=2`` has two)."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error" (or "repetition"); None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence, if any.
    stop_reason: int | str | None = None
    # With SamplingParams.logprobs: the sum of the sampled tokens' logprobs, and
    # one {token id: Logprob} dict per token of token_ids (the sampled token and
    # the top candidates). None when logprobs were not asked for.
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    # Chapter 9, once finished: the sequence's drafts and kept drafts (vLLM's field).
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic``) of a request's life.

    The engine core reports QUEUED / SCHEDULED / PREEMPTED events (chapter 5's
    event log); the output processor adds token times. It keeps one per user
    request (``RequestOutput.metrics``) and one per sample, from which a
    server's ``/metrics`` measures each sample alone. vLLM 0.32 counterpart:
    ``RequestStateStats`` in ``vllm/v1/metrics/stats.py``.
    """

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    queued_ts: float | None = None  # entered the scheduler's waiting queue
    scheduled_ts: float | None = None  # first admitted to the running batch
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # (event name, timestamp) in order: "queued", "scheduled", "preempted",
    # "first_token", "finished" -- the per-request event log.
    events: list[tuple[str, float]] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds in the waiting queue before the first schedule."""
        if self.queued_ts is None or self.scheduled_ts is None:
            return None
        return self.scheduled_ts - self.queued_ts

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between output tokens after the first (TPOT)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    def record_engine_output(self, events: list[EngineCoreEvent] | None, num_new_tokens: int, now: float) -> None:
        """Fold one engine-core output in: its events, then its new tokens."""
        for event in events or []:
            self.events.append((event.type.name.lower(), event.timestamp))
            if event.type == EngineCoreEventType.QUEUED and self.queued_ts is None:
                self.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and self.scheduled_ts is None:
                self.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                self.num_preemptions += 1
        if num_new_tokens:
            if self.first_token_time is None:
                self.first_token_time = now
                self.events.append(("first_token", now))
            self.last_token_time = now
            self.num_generation_tokens += num_new_tokens

    def record_finished(self, now: float) -> None:
        self.finished_time = now
        self.events.append(("finished", now))


@dataclass
class RequestOutput:
    """Everything the user gets back for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int = 0
    # Why the engine ended it early (IGNORED / ERROR), in words.
    finish_message: str | None = field(default=None, repr=False)
    # Prompt tokens whose KV a KV connector loaded instead of computing (chapter 5).
    num_external_computed_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one dict per prompt token, the first None.
    prompt_logprobs: PromptLogprobs | None = None
    # Chapter 10: on a producer's finished output, where the decode engine finds
    # the prompt's KV blocks (vLLM's field of the same name).
    kv_transfer_params: dict[str, Any] | None = None


# ---- the model runner's side (vllm/v1/outputs.py) ----------------------------------


@dataclass
class LogprobsTensors:
    """Per row: the chosen token, then the top ``k``, with their logprobs."""

    logprob_token_ids: torch.Tensor  # [N, 1 + k] int64: chosen id, then top-1 .. top-k
    logprobs: torch.Tensor  # [N, 1 + k] float32, same order
    selected_token_ranks: torch.Tensor  # [N] int64: rank of the chosen id, 1 = most likely

    def tolists(self, start: int, end: int, num_logprobs: int) -> LogprobsLists:
        """Rows ``[start, end)`` with only the top ``num_logprobs`` candidates kept.

        The batch computes as many candidates as its most demanding row; each
        request gets back the number it asked for.
        """
        columns = slice(0, 1 + num_logprobs)
        return LogprobsLists(
            self.logprob_token_ids[start:end, columns].tolist(),
            self.logprobs[start:end, columns].tolist(),
            self.selected_token_ranks[start:end].tolist(),
        )


@dataclass
class KVConnectorOutput:
    """What the worker's KV connector finished since the last step (chapters 5 and 10).

    Under tensor parallelism every rank reports its own; the executor merges
    them (``KVOutputAggregator``): a request is finished once all ranks say so.
    """

    finished_sending: set[str] = field(default_factory=set)  # producer: blocks read (or expired): free them
    finished_recving: set[str] = field(default_factory=set)  # loads done: promote these
    # Loads that failed, with the reason: the scheduler applies kv_load_failure_policy.
    # (vLLM reports the failed block ids, invalid_block_ids; a request is the unit here.)
    failed_recving: dict[str, str] = field(default_factory=dict)
    kv_connector_stats: KVTransferStats | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving or self.kv_connector_stats)


@dataclass
class ModelRunnerOutput:
    """What the worker returns: the tokens sampled for each scheduled request.

    A request in the middle of a chunked prefill gets an empty list: its last
    scheduled position is not the end of its known tokens, so nothing is sampled.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    kv_connector_output: KVConnectorOutput | None = None
    # Chapter 8. req_id -> one row per sampled token, only for requests that ask
    # for logprobs (vLLM keeps one batch-wide LogprobsLists instead).
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> one row per prompt token after the first, sent once, with the
    # step that samples the request's first token.
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)

    def by_request(self) -> dict[str, list[int]]:
        return dict(zip(self.req_ids, self.sampled_token_ids))


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass
class DraftTokenIds:
    """Speculative decoding (chapter 9): the proposer's drafts after a step.

    The engine core takes them from the worker after each step
    (``EngineCore.post_step``) and hands them to the scheduler, which schedules
    them with the next step. Parallel lists, one entry per request that drafted.
    """

    req_ids: list[str]
    draft_token_ids: list[list[int]]
