"""The engine's statistics: scheduler snapshots, and what each batch of outputs did.

Two producers, one consumer (chapter 8's ``/metrics``):

* the engine core keeps ``SchedulerStats`` and ``PrefixCacheStats`` (chapter 2
  plots the first step by step; chapter 4's prefix cache keeps the second);
* the front end's output processor fills one ``IterationStats`` per batch of
  engine-core outputs (chapter 8): tokens generated, prompts whose first token
  came, time to first token, inter-token latencies, preemptions, and a
  ``FinishedRequestStats`` for every request that ended in the batch.

Plain dataclasses and arithmetic, no torch, no Prometheus: a stat logger (the
server's ``ServerMetrics``) turns them into metrics.
vLLM 0.32 counterpart: ``vllm/v1/metrics/stats.py`` (``SchedulerStats``,
``PrefixCacheStats``, ``PromptTokenStats``, ``FinishedRequestStats``,
``IterationStats``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanoengine.distributed.kv_transfer.base import KVTransferStats
from nanoengine.engine import EngineCoreEventType, EngineCoreOutput, FinishReason
from nanoengine.spec_decode.metrics import SpecDecodingStats

if TYPE_CHECKING:  # annotations only: outputs.py is the front end's module
    from nanoengine.outputs import RequestMetrics


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (``hits / queries`` = hit rate).

    Every lookup counts, including the retry of a request whose allocation
    failed in an earlier step, as in vLLM.
    """

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler for loggers and metrics (chapter 2 plots these per step).

    In vLLM it travels to the front end inside ``EngineCoreOutputs``; here the
    server's ``/metrics`` asks for it (``get_stats``, chapter 8).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks in use, 0.0 to 1.0
    prefix_cache_queries: int  # cumulative, in tokens
    prefix_cache_hits: int  # cumulative, in tokens
    num_preemptions: int  # cumulative
    # Speculative decoding (chapter 9), cumulative; None when it is off.
    spec_decoding_stats: SpecDecodingStats | None = None
    # KV transfers between engines (chapter 10), cumulative; None without a connector.
    kv_transfer_stats: KVTransferStats | None = None
    # Finished requests whose blocks a producer holds for a decode engine.
    num_held_for_remote: int = 0


@dataclass
class PromptTokenStats:
    """Where the prompt tokens of a batch's newly started requests came from.

    ``computed + local_cache_hit + external_kv_transfer == total``: a prompt
    token was either run through the model, found in this engine's prefix
    cache (chapter 4), or loaded by a KV connector (chapter 5).
    """

    # The label values of vllm:prompt_tokens_by_source, in vLLM's order.
    SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    total: int = 0

    @property
    def cached(self) -> int:
        """Tokens that skipped the forward pass (either cache)."""
        return self.local_cache_hit + self.external_kv_transfer

    def add(self, num_prompt_tokens: int, num_cached_tokens: int, num_external_tokens: int) -> None:
        """One request's prompt. The core counts external tokens inside its cached ones."""
        cached = min(num_cached_tokens, num_prompt_tokens)
        external = min(num_external_tokens, cached)
        self.total += num_prompt_tokens
        self.computed += num_prompt_tokens - cached
        self.local_cache_hit += cached - external
        self.external_kv_transfer += external

    def by_source(self, source: str) -> int:
        return {"local_compute": self.computed, "local_cache_hit": self.local_cache_hit,
                "external_kv_transfer": self.external_kv_transfer}[source]


@dataclass
class FinishedRequestStats:
    """One engine-core request (one of a prompt's ``n`` samples) at its end.

    The intervals split its life at four instants: queued, first scheduled,
    first token, last token. A preemption does not restart them; its time
    stays inside the phase it interrupted. A phase that never began (a
    request refused before it ran) counts as 0 s.
    """

    finish_reason: FinishReason
    e2e_latency: float  # arrival to the batch that finished it
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    max_tokens_param: int | None
    queued_time: float  # queued -> first scheduled
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    inference_time: float  # first scheduled -> last token
    mean_time_per_output_token: float  # decode time / (tokens - 1); 0 for one token


@dataclass
class IterationStats:
    """What one batch of engine-core outputs did, as the front end saw it.

    The output processor fills one per batch, then hands it to the stat
    loggers. Timestamps are ``time.monotonic()``: the core process stamps its
    events (queued, scheduled) on the same clock, since both processes run on
    one machine. Token times are the moment the front end processes the batch.
    """

    iteration_timestamp: float = field(default_factory=time.monotonic)
    num_generation_tokens: int = 0
    # Counted once per request, in the batch that brings its first token
    # (vLLM counts a prompt when its prefill is done, not chunk by chunk).
    prompt_tokens: PromptTokenStats = field(default_factory=PromptTokenStats)
    num_preempted_reqs: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Per user request whose every sample ended: its n, and its longest sample.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)

    def update_from_output(
        self, output: EngineCoreOutput, req_stats: RequestMetrics, num_prompt_tokens: int
    ) -> None:
        """Count one request's output of this batch; call before ``req_stats`` takes it in."""
        num_new_tokens = len(output.new_token_ids)
        self.num_generation_tokens += num_new_tokens
        for event in output.events or []:
            if event.type == EngineCoreEventType.PREEMPTED:
                self.num_preempted_reqs += 1
        if not num_new_tokens:
            return  # an ending without a token (refused, or stopped in flight)
        if req_stats.last_token_time is None:  # the first token: the prompt is done
            cached, external = output.num_cached_tokens, output.num_external_computed_tokens
            self.prompt_tokens.add(num_prompt_tokens, cached, external)
            self.time_to_first_tokens.append(self.iteration_timestamp - req_stats.arrival_time)
        else:
            self.inter_token_latencies.append(self.iteration_timestamp - req_stats.last_token_time)

    def update_from_finished_request(
        self,
        finish_reason: FinishReason,
        req_stats: RequestMetrics,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        max_tokens_param: int | None,
    ) -> None:
        """Close one engine-core request; ``req_stats`` already holds its last output."""
        first_token, last_token = req_stats.first_token_time, req_stats.last_token_time
        decode_time = _interval(first_token, last_token)
        num_tokens = req_stats.num_generation_tokens
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=self.iteration_timestamp - req_stats.arrival_time,
                num_prompt_tokens=num_prompt_tokens,
                num_cached_tokens=num_cached_tokens,
                num_generation_tokens=num_tokens,
                num_preemptions=req_stats.num_preemptions,
                max_tokens_param=max_tokens_param,
                queued_time=_interval(req_stats.queued_ts, req_stats.scheduled_ts),
                prefill_time=_interval(req_stats.scheduled_ts, first_token),
                decode_time=decode_time,
                inference_time=_interval(req_stats.scheduled_ts, last_token),
                # The first token is prefill's work: the mean is over the gaps after it.
                mean_time_per_output_token=decode_time / (num_tokens - 1) if num_tokens > 1 else 0.0,
            )
        )

    def update_from_finished_parent(self, n: int, num_generation_tokens: list[int]) -> None:
        """A user request whose ``n`` samples have all ended (their token counts given)."""
        self.n_params.append(n)
        self.max_num_generation_tokens.append(max(num_generation_tokens, default=0))


def _interval(start: float | None, end: float | None) -> float:
    """Seconds from ``start`` to ``end``; 0 when either never happened."""
    return 0.0 if start is None or end is None else end - start
