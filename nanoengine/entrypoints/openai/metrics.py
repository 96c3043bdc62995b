"""``/metrics``: the server's Prometheus metrics, with vLLM's names, labels and buckets.

Chapter 8 (online serving). ``ServerMetrics`` is a stat logger: it turns the
engine's statistics into Prometheus counters, gauges and histograms, fed from
two places, as in vLLM:

* every batch of engine-core outputs: the output processor fills an
  ``IterationStats`` (nanoengine/metrics/stats.py) and calls
  ``record_iteration`` -- tokens, time to first token, inter-token latencies,
  preemptions, and every request that finished in the batch;
* the scheduler's state, asked from the core process when ``/metrics`` is
  scraped (``update_engine_stats``): requests running and waiting, KV cache
  usage, prefix-cache lookups. vLLM ships these inside every output batch;
  asking at scrape time gives the same totals with no change to the core.

Every series carries the labels ``model_name`` (the served name) and
``engine`` (the engine core's index, always "0": one core per server), so a
dashboard made for ``vllm serve`` reads these unchanged. Counting per batch
is what makes aborted work visible: a request whose client hung up still
adds the tokens it generated to ``vllm:generation_tokens_total``, though it
never counts as finished (``vllm:request_success_total`` and the
per-request histograms hold only requests that ended on their own).

With speculative decoding on (chapter 9) four more counter families report
the drafts: ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (one
series per draft position, label ``position``). From them a dashboard derives
the acceptance rate (accepted / draft tokens) and the mean acceptance length
(1 + accepted / drafts). A server without speculation has none of these
families, as in vLLM.

Each server has its own ``CollectorRegistry``, so two servers in one process
(tests) never share counters. The two ``nanoengine:`` block counts are ours:
vLLM reports only the usage fraction.

vLLM 0.32 counterpart: ``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py``,
the default buckets of ``vllm/v1/metrics/buckets.py`` and ``SpecDecodingProm``
in ``vllm/v1/spec_decode/metrics.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from nanoengine.engine import FinishReason
from nanoengine.metrics.stats import IterationStats, PromptTokenStats

# ---- histogram buckets: vLLM's defaults, so quantiles compare across servers ----

# Whole-request phases (end to end, queued, prefill, decode, inference):
# a fraction of a second up to a batch job of hours.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Time to first token: finest below a second, where interactive use lives.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# One decode step, from a fast GPU's 10 ms to a stall of a minute.
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0)
# Tokens of one batch: powers of two up to a large token budget.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# Every finished request is observed, so the first bucket holds the never
# preempted ones together with those preempted once.
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: the buckets of per-request token counts.

    Token counts cannot exceed the context length, so ``max_model_len``
    bounds them; a 1-2-5 series keeps about three buckets per factor of ten.
    """
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    """The Prometheus metrics of one served model on one engine core."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, max_model_len: int, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry()
        labelnames = ["model_name", "engine"]
        values = [model_name, str(engine_index)]
        self._labelnames, self._labelvalues = labelnames, values
        # Every metric is made with its labels bound at once, as vLLM does: its
        # series appear (at zero) in the first scrape, before any request.

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames, registry=self.registry).labels(*values)

        def histogram(name: str, buckets: Sequence[float], doc: str) -> Histogram:
            return Histogram(name, doc, labelnames, buckets=buckets, registry=self.registry).labels(*values)

        # Scheduler state (scrape time).
        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests queued, not yet running.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV cache blocks in use, 1 = all.")
        self.free_blocks = gauge("nanoengine:kv_cache_free_blocks", "KV cache blocks free (cached or not).")
        self.usable_blocks = gauge("nanoengine:kv_cache_usable_blocks", "KV cache blocks a request can hold.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")

        # Token and event counters (every batch).
        self.num_preemptions = counter("vllm:num_preemptions", "Running requests sent back to wait.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of prefills completed.")
        by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
                            [*labelnames, "source"], registry=self.registry)
        self.prompt_tokens_by_source = {source: by_source.labels(*values, source)
                                        for source in PromptTokenStats.SOURCES}
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached", "Prompt tokens taken from a cache.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated, aborted requests' too.")
        success = Counter("vllm:request_success", "Requests that ended on their own, by finish reason.",
                          [*labelnames, "finished_reason"], registry=self.registry)
        self.request_success = {reason: success.labels(*values, str(reason)) for reason in FinishReason}

        # Histograms of counts; a request's token counts are bounded by the context.
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", tokens, "Prompt tokens per finished request.")
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", tokens, "Generated tokens per finished request.")
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", ITERATION_TOKENS_BUCKETS,
            "Tokens per batch of outputs: prompt tokens computed plus tokens generated.")
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", tokens, "Longest sample's tokens, per request.")
        self.request_params_n = histogram(
            "vllm:request_params_n", REQUEST_PARAMS_N_BUCKETS, "The n parameter of finished requests.")
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", tokens, "The max_tokens parameter of finished requests.")
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions", REQUEST_NUM_PREEMPTIONS_BUCKETS, "Preemptions per request.")
        self.request_prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens", tokens, "Prompt tokens computed, not cached.")

        # Histograms of time, in seconds.
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", TIME_TO_FIRST_TOKEN_BUCKETS, "Arrival to first token.")
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", INTER_TOKEN_LATENCY_BUCKETS, "Between two token outputs.")
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds", INTER_TOKEN_LATENCY_BUCKETS,
            "Mean time per token after the first, per finished request.")
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS, "Arrival to finish.")
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS, "Queued until first scheduled.")
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", REQUEST_LATENCY_BUCKETS, "First scheduled to last token.")
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS, "First scheduled to first token.")
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS, "First token to last token.")

        # The core's prefix-cache and draft counters are running totals, and a
        # Prometheus counter only goes up by increments: keep the last totals seen.
        self._last_totals: dict[str, float] = {}
        # Speculative decoding's counters (chapter 9): made when the core first
        # reports draft counts, so a server that does not speculate has none.
        self.spec_decode: SpecDecodeCounters | None = None
        # KV transfers between engines (chapter 10): made when the core first
        # reports them, so a server without a KV connector has none.
        self.kv_transfer: KVTransferMetrics | None = None

    def update_engine_stats(self, stats: dict[str, Any]) -> None:
        """The core's current state (``EngineCoreProc.get_stats``), at scrape time."""
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        self.kv_cache_usage.set(stats["kv_cache_usage"])
        self.free_blocks.set(stats["num_free_blocks"])
        self.usable_blocks.set(stats["num_usable_blocks"])
        self._advance(self.prefix_cache_queries, "prefix_cache_queries", stats["prefix_cache_queries"])
        self._advance(self.prefix_cache_hits, "prefix_cache_hits", stats["prefix_cache_hits"])
        spec = stats.get("spec_decoding")
        if spec is not None:
            if self.spec_decode is None:
                # The route updates before it renders, so even the first scrape
                # shows these families, at zero, as vLLM's start-up registration does.
                self.spec_decode = SpecDecodeCounters(self.registry, self._labelnames, self._labelvalues,
                                                      len(spec["num_accepted_tokens_per_pos"]))
            counters = self.spec_decode
            self._advance(counters.num_drafts, "spec_num_drafts", spec["num_drafts"])
            self._advance(counters.num_draft_tokens, "spec_num_draft_tokens", spec["num_draft_tokens"])
            self._advance(counters.num_accepted_tokens, "spec_num_accepted_tokens", spec["num_accepted_tokens"])
            for position, total in enumerate(spec["num_accepted_tokens_per_pos"]):
                self._advance(counters.num_accepted_tokens_per_pos[position], f"spec_accepted_pos_{position}", total)

        transfer = stats.get("kv_transfer")
        if transfer is not None:
            self._update_kv_transfer(transfer, stats["num_held_for_remote"])

    def _update_kv_transfer(self, transfer: dict[str, Any], num_held: int) -> None:
        if self.kv_transfer is None:
            self.kv_transfer = KVTransferMetrics(self.registry, self._labelnames, self._labelvalues)
        metrics = self.kv_transfer
        for name, counter in metrics.counters.items():
            self._advance(counter, f"kv_{name}", transfer[name])
        metrics.num_held_for_remote.set(num_held)

    def _advance(self, metric: Counter, key: str, total: float) -> None:
        """Bring ``metric`` up to the core's running ``total`` (``key`` names it among the totals seen)."""
        increase = total - self._last_totals.get(key, 0)
        if increase > 0:
            metric.inc(increase)
        self._last_totals[key] = total

    def record_iteration(self, stats: IterationStats) -> None:
        """One batch of outputs: its counters, then one observation per request it touched."""
        prompt = stats.prompt_tokens
        self.num_preemptions.inc(stats.num_preempted_reqs)
        self.prompt_tokens.inc(prompt.total)
        for source, source_counter in self.prompt_tokens_by_source.items():
            source_counter.inc(prompt.by_source(source))
        self.prompt_tokens_cached.inc(prompt.cached)
        self.generation_tokens.inc(stats.num_generation_tokens)
        # The work of the step that made this batch (prefill chunks are counted
        # when their request's first token arrives).
        self.iteration_tokens.observe(prompt.computed + stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for n, longest in zip(stats.n_params, stats.max_num_generation_tokens):
            self.request_params_n.observe(n)
            self.max_num_generation_tokens.observe(longest)
        for done in stats.finished_requests:
            self.request_success[done.finish_reason].inc()
            self.e2e_latency.observe(done.e2e_latency)
            self.queue_time.observe(done.queued_time)
            self.prefill_time.observe(done.prefill_time)
            self.inference_time.observe(done.inference_time)
            self.decode_time.observe(done.decode_time)
            self.time_per_output_token.observe(done.mean_time_per_output_token)
            self.request_num_preemptions.observe(done.num_preemptions)
            self.request_prompt_tokens.observe(done.num_prompt_tokens)
            self.request_generation_tokens.observe(done.num_generation_tokens)
            self.request_prefill_kv_computed.observe(max(done.num_prompt_tokens - done.num_cached_tokens, 0))
            if done.max_tokens_param:  # None: generate until the context is full
                self.request_params_max_tokens.observe(done.max_tokens_param)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpecDecodeCounters:
    """vLLM's speculative-decoding counter families (chapter 9), bound to one server's labels.

    Counters, so Prometheus shows each as ``<name>_total``. Per-position
    counts use ``position`` "0" for the first draft token, up to
    ``num_speculative_tokens - 1``; one series per position from the start.
    """

    def __init__(self, registry: CollectorRegistry, labelnames: list[str], values: list[str],
                 num_positions: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames, registry=registry).labels(*values)

        self.num_drafts = counter("vllm:spec_decode_num_drafts",
                                  "Verification steps of requests that had drafts (one per request and step).")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                           "Draft tokens the target model kept.")
        per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens kept, by position in the draft (0 = the first guess).",
                               [*labelnames, "position"], registry=registry)
        self.num_accepted_tokens_per_pos = [per_position.labels(*values, str(position))
                                            for position in range(num_positions)]


class KVTransferMetrics:
    """KV moved between a prefill and a decode engine (chapter 10), bound to one server's labels.

    vLLM reports the same figures per connector (``vllm:nixl_bytes_transferred``,
    ``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_num_failed_transfers``,
    ``vllm:nixl_num_kv_expired_reqs`` for NIXL, as histograms of each transfer);
    here they are running totals under a connector-neutral ``vllm:kv_transfer_``
    prefix, since the core sends totals. A producer counts what it sent, a
    consumer what it received.
    """

    def __init__(self, registry: CollectorRegistry, labelnames: list[str], values: list[str]) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames, registry=registry).labels(*values)

        # Keyed by the field of KVTransferStats each one follows.
        self.counters = {
            "num_transfers": counter("vllm:kv_transfer_num_transfers", "Block transfers completed."),
            "bytes_transferred": counter("vllm:kv_transfer_bytes", "Bytes of K/V moved."),
            "transfer_seconds": counter("vllm:kv_transfer_time_seconds", "Seconds spent in transfers, summed."),
            "num_failed_transfers": counter("vllm:kv_transfer_num_failed_transfers",
                                            "Transfers that failed (no answer, refused, wrong shape)."),
            "num_expired_holds": counter("vllm:kv_transfer_num_expired_reqs",
                                         "Held prefills freed because no decode engine read them in time."),
        }
        self.num_held_for_remote = Gauge("nanoengine:kv_transfer_held_requests",
                                         "Finished prefills whose blocks wait for a decode engine.",
                                         labelnames, registry=registry).labels(*values)
