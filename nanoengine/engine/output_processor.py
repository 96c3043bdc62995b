"""OutputProcessor: engine-core outputs (token ids) -> RequestOutputs (text, reasons).

Chapter 7 (``generate(...)``) ends each step here: new token ids are detokenized,
stop strings are checked (a match asks the engine core to abort the request),
and the ``n`` samples of one prompt are gathered into one RequestOutput.
Chapter 8 adds logprobs (engine/logprobs.py) and the three output kinds of
``SamplingParams.output_kind``: CUMULATIVE (every output holds all samples and
everything so far), DELTA (only the samples that moved this step, each with
only its new tokens and text: a server streams these) and FINAL_ONLY (one
output, when every sample is done; ``LLM.generate`` asks for this). For a
server's ``/metrics`` it also fills one ``IterationStats`` per batch
(nanoengine/metrics/stats.py) and hands it to ``stat_loggers``.
vLLM 0.32 counterpart: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``,
``RequestState``) and ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nanoengine.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from nanoengine.engine.detokenizer import IncrementalDetokenizer
from nanoengine.engine.logprobs import LogprobsProcessor
from nanoengine.logprobs import PromptLogprobs
from nanoengine.metrics.stats import IterationStats
from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoengine.sampling_params import RequestOutputKind
from nanoengine.spec_decode.metrics import RequestSpecDecodeMetrics


@dataclass
class RequestState:
    """The front end's view of one engine-core request (one of the ``n`` samples)."""

    request_id: str
    parent: ParentRequest
    index: int  # which of the parent's n samples this is
    detokenizer: IncrementalDetokenizer
    logprobs_processor: LogprobsProcessor
    # This sample's own timeline and token count, for the metrics: the
    # parent's RequestMetrics mixes its n samples' tokens into one.
    stats: RequestMetrics
    max_tokens: int | None  # the max_tokens parameter, a histogram of /metrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # DELTA: how many tokens the earlier outputs carried.
    num_tokens_sent: int = 0
    # Chapter 9: the engine core's counts of drafts, in the finished output.
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None

    def completion(self) -> CompletionOutput:
        """This sample's part of the next RequestOutput: all of it, or only what is new."""
        delta = self.output_kind is RequestOutputKind.DELTA
        start = self.num_tokens_sent if delta else 0
        self.num_tokens_sent = len(self.token_ids)
        logprobs = self.logprobs_processor.logprobs
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.get_next_output_text(self.finish_reason is not None, delta),
            token_ids=self.token_ids[start:],
            finish_reason=str(self.finish_reason) if self.finish_reason is not None else None,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.logprobs_processor.cumulative_logprob,
            # A slice either way: an output never shares a list the next step extends.
            logprobs=None if logprobs is None else logprobs[start:],
            spec_decode_metrics=self.spec_decode_metrics if self.finish_reason is not None else None,
        )


@dataclass
class ParentRequest:
    """One user request; its ``n`` samples run as separate engine-core requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    children: list[RequestState] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_external_computed_tokens: int = 0
    finish_message: str | None = None
    # Chapter 10: where a producer holds this prompt's KV for the decode engine.
    kv_transfer_params: dict[str, Any] | None = None
    # From the first sample to report them (every sample scores the same prompt).
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(child.finish_reason is not None for child in self.children)

    @property
    def output_kind(self) -> RequestOutputKind:
        """The samples' params are copies of the user's, so they share one kind."""
        return self.children[0].output_kind

    def make_output(self, moved: list[RequestState]) -> RequestOutput | None:
        """The RequestOutput for this step, given the samples that ``moved``; None
        while a FINAL_ONLY request runs.
        """
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        children = moved if kind is RequestOutputKind.DELTA else self.children
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[child.completion() for child in children],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            finish_message=self.finish_message,
            num_external_computed_tokens=self.num_external_computed_tokens,
            prompt_logprobs=self._prompt_logprobs_for_output(),
            kv_transfer_params=self.kv_transfer_params,
        )

    def _prompt_logprobs_for_output(self) -> PromptLogprobs | None:
        """DELTA outputs carry the prompt's logprobs once, in the first output that has them."""
        if self.output_kind is not RequestOutputKind.DELTA:
            return self.prompt_logprobs
        if self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = self.prompt_logprobs is not None
        return self.prompt_logprobs


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Requests that hit a stop string: the engine core must stop computing them.
    reqs_to_abort: list[str]


class OutputProcessor:
    """Tracks every live request on the front-end side."""

    def __init__(self, tokenizer: Any | None) -> None:
        # None (skip_tokenizer_init): outputs carry token ids and empty text.
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # Called with every batch's IterationStats (a server's metrics, chapter 8).
        # None listening, none are made: an offline run pays nothing.
        self.stat_loggers: list[Callable[[IterationStats], None]] = []

    def add_request(self, parent: ParentRequest, request: EngineCoreRequest, index: int) -> None:
        """Register one sample of ``parent`` (call once per child, in index order)."""
        state = RequestState(
            request_id=request.request_id,
            parent=parent,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.sampling_params),
            logprobs_processor=LogprobsProcessor(self.tokenizer, request.sampling_params),
            stats=RequestMetrics(arrival_time=request.arrival_time),
            max_tokens=request.sampling_params.max_tokens,
            output_kind=request.sampling_params.output_kind,
        )
        parent.children.append(state)
        self.request_states[request.request_id] = state
        self.parents[parent.request_id] = parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Fold one step's outputs in; at most one RequestOutput per touched parent."""
        touched: dict[str, ParentRequest] = {}
        moved: dict[str, list[RequestState]] = {}  # parent id -> its samples with news
        reqs_to_abort: list[str] = []
        now = time.monotonic()
        stats = IterationStats(now) if self.stat_loggers and outputs else None
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted by the user while the step ran
                continue
            if state.finish_reason is not None:
                # A sample of an n > 1 request that hit a stop string: the core
                # ran on until our abort reached it. Those tokens are not kept.
                continue
            parent = state.parent
            if stats is not None:  # counted per batch, so aborted requests' work counts too
                stats.update_from_output(output, state.stats, len(parent.prompt_token_ids))
            state.stats.record_engine_output(output.events, len(output.new_token_ids), now)
            parent.metrics.record_engine_output(output.events, len(output.new_token_ids), now)
            parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
            parent.num_external_computed_tokens = max(
                parent.num_external_computed_tokens, output.num_external_computed_tokens
            )
            if output.kv_transfer_params is not None:
                parent.kv_transfer_params = output.kv_transfer_params
            state.token_ids.extend(output.new_token_ids)
            state.logprobs_processor.update_from_output(output.new_logprobs, output.new_prompt_logprobs)
            if parent.prompt_logprobs is None:
                parent.prompt_logprobs = state.logprobs_processor.prompt_logprobs
            # A stop token (EOS or stop_token_ids) ends the text without showing in it.
            stop_string = state.detokenizer.update(output.new_token_ids, output.finish_reason == FinishReason.STOP)
            if stop_string is not None and output.finish_reason is None:
                # The text matched a stop string the engine core cannot see.
                state.finish_reason, state.stop_reason = FinishReason.STOP, stop_string
                reqs_to_abort.append(output.request_id)
            elif output.finish_reason is not None:
                state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
                parent.finish_message = parent.finish_message or output.finish_message
            if output.spec_decode_metrics is not None:
                state.spec_decode_metrics = output.spec_decode_metrics
            if stats is not None and state.finish_reason is not None:
                stats.update_from_finished_request(
                    state.finish_reason, state.stats, len(parent.prompt_token_ids), output.num_cached_tokens,
                    state.max_tokens,
                )
            touched[parent.request_id] = parent
            moved.setdefault(parent.request_id, []).append(state)
        request_outputs: list[RequestOutput] = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.record_finished(now)
                self._forget(parent)
                if stats is not None:
                    stats.update_from_finished_parent(
                        len(parent.children), [child.stats.num_generation_tokens for child in parent.children]
                    )
            request_output = parent.make_output(moved[parent.request_id])
            if request_output is not None:
                request_outputs.append(request_output)
        if stats is not None:
            for stat_logger in self.stat_loggers:
                stat_logger(stats)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget user requests (parent ids); return their engine-core ids.

        No stats are made here, as in vLLM: an aborted request's tokens were
        counted batch by batch as they came, and it never counts as finished.
        """
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is not None:
                core_ids.extend(child.request_id for child in parent.children)
                self._forget(parent)
        return core_ids

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.request_states.pop(child.request_id, None)
