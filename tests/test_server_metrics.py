"""``/metrics`` of ``nanoengine serve``: vLLM's families, labels and buckets, and counts that add up.

One server on the tiny test model gets a known mix of requests (a greedy
completion, the same with a stop string, a chat request with ``n=2``, and a
stream the client closes after three chunks); then ``/metrics`` is scraped
and every number is checked against what the client saw. The aborted stream
counts as vLLM counts it: its tokens are in ``vllm:generation_tokens_total``,
but it never finished, so no ``vllm:request_success_total`` or per-request
histogram holds it. Quick in-process tests cover the rest: the output
processor's per-batch stats (preemptions, a sample that ends before its
sibling, an abort), the bucket series, and two servers' metrics in one process.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import API_KEY, metric, running_server, wait_until

from nanoengine.engine import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
)
from nanoengine.engine.output_processor import OutputProcessor, ParentRequest
from nanoengine.entrypoints.openai.metrics import REQUEST_LATENCY_BUCKETS, ServerMetrics, build_1_2_5_buckets
from nanoengine.metrics.stats import IterationStats
from nanoengine.outputs import RequestMetrics
from nanoengine.sampling_params import SamplingParams

MAX_MODEL_LEN = 512
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(8 << 20), "--block-size", "16")

# Every vLLM family the server exports, by the name of one sample it must have.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
            "vllm:prompt_tokens", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached",
            "vllm:generation_tokens", "vllm:request_success")
HISTOGRAMS = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:iteration_tokens_total",
              "vllm:request_max_num_generation_tokens", "vllm:request_params_n",
              "vllm:request_params_max_tokens", "vllm:request_num_preemptions",
              "vllm:request_prefill_kv_computed_tokens",
              "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds")
# Histograms with one observation per finished engine-core request (one per sample).
PER_REQUEST = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_num_preemptions",
               "vllm:request_prefill_kv_computed_tokens", "vllm:request_time_per_output_token_seconds",
               "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
               "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
               "vllm:request_decode_time_seconds", "vllm:request_params_max_tokens")

Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def server(tiny_llama: str) -> Iterator[str]:
    with running_server(tiny_llama, *FLAGS) as (base_url, _):
        yield base_url


def scrape(base_url: str) -> Samples:
    """Sample name -> [(labels, value)] of one ``/metrics`` scrape."""
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=5.0).text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the series of ``name`` whose labels include ``labels``."""
    return sum(v for found, v in samples[name] if labels.items() <= found.items())


def test_metrics_families_labels_and_counts(server: str, tiny_llama: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    prompt, ignore_eos = "hello metrics", {"ignore_eos": True}

    # 1. A stream the client hangs up on after three chunks: the aborted request.
    stream = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=400, stream=True,
                                       temperature=0.0, extra_body=ignore_eos)
    chunks_seen = 0
    for _ in stream:
        chunks_seen += 1
        if chunks_seen == 3:
            break
    stream.close()
    assert wait_until(lambda: metric(server, "vllm:num_requests_running") == 0, 5.0), "not aborted"

    # 2. Three requests that end on their own: length, stop, and length twice (n=2).
    plain = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=8, temperature=0.0,
                                      extra_body=ignore_eos)
    text = plain.choices[0].text
    stop = next((text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip()), None)
    assert stop is not None, f"the greedy text {text!r} has no piece to stop on"
    stopped = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=8, stop=[stop],
                                        temperature=0.0, extra_body=ignore_eos)
    conversation = [{"role": "user", "content": "two of them"}]
    chat = client.chat.completions.create(model=tiny_llama, messages=conversation,  # type: ignore[arg-type]
                                          max_tokens=3, n=2, temperature=1.0, seed=7, extra_body=ignore_eos)
    assert [plain.choices[0].finish_reason, stopped.choices[0].finish_reason] == ["length", "stop"]
    assert [choice.finish_reason for choice in chat.choices] == ["length", "length"]
    assert plain.usage and stopped.usage and chat.usage
    assert wait_until(lambda: metric(server, "vllm:num_requests_running") == 0
                      and metric(server, "vllm:num_requests_waiting") == 0, 5.0)
    samples = scrape(server)

    # Every family is there, and every series carries model_name and engine="0".
    names = [*GAUGES, *(f"{c}_total" for c in COUNTERS), *(f"{h}_count" for h in HISTOGRAMS),
             "nanoengine:kv_cache_free_blocks", "nanoengine:kv_cache_usable_blocks"]
    for name in names:
        assert samples[name], f"{name} is missing"
        for labels, _ in samples[name]:
            assert (labels.get("model_name"), labels.get("engine")) == (tiny_llama, "0"), (name, labels)
    # A server without speculative decoding has none of its families (chapter 9), as in vLLM.
    assert not [name for name in samples if name.startswith("vllm:spec_decode")]
    reasons = {labels["finished_reason"]: v for labels, v in samples["vllm:request_success_total"]}
    assert reasons == {"stop": 1, "length": 3, "abort": 0, "error": 0, "repetition": 0}

    # Tokens. Each engine-core request (a sample) counts its prompt once, the
    # aborted one included; the per-request histograms hold finished ones only.
    finished_prompts = plain.usage.prompt_tokens + stopped.usage.prompt_tokens + 2 * chat.usage.prompt_tokens
    finished_tokens = sum(reply.usage.completion_tokens for reply in (plain, stopped, chat) if reply.usage)
    assert value(samples, "vllm:request_prompt_tokens_sum") == finished_prompts
    assert value(samples, "vllm:request_generation_tokens_sum") == finished_tokens
    assert value(samples, "vllm:prompt_tokens_total") == finished_prompts + plain.usage.prompt_tokens
    aborted_tokens = value(samples, "vllm:generation_tokens_total") - finished_tokens
    assert chunks_seen <= aborted_tokens < 400, "the aborted stream's tokens are not counted"
    by_source = sum(v for _, v in samples["vllm:prompt_tokens_by_source_total"])
    cached = value(samples, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") + value(
        samples, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert by_source == value(samples, "vllm:prompt_tokens_total")
    assert cached == value(samples, "vllm:prompt_tokens_cached_total")
    computed = value(samples, "vllm:prompt_tokens_total") - cached
    total_generated = finished_tokens + aborted_tokens
    assert value(samples, "vllm:iteration_tokens_total_sum") == computed + total_generated
    assert value(samples, "vllm:prefix_cache_queries_total") >= value(samples, "vllm:prefix_cache_hits_total")

    # Observation counts: 4 finished samples of 3 user requests, 5 samples with a first token.
    for name in PER_REQUEST:
        assert value(samples, f"{name}_count") == 4, name
    assert value(samples, "vllm:request_params_max_tokens_sum") == 8 + 8 + 3 + 3
    assert value(samples, "vllm:request_params_n_count") == 3
    assert value(samples, "vllm:request_params_n_sum") == 1 + 1 + 2
    longest = 8 + stopped.usage.completion_tokens + 3
    assert value(samples, "vllm:request_max_num_generation_tokens_sum") == longest
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 5
    # One token per step, so one gap per token after each sample's first.
    assert value(samples, "vllm:inter_token_latency_seconds_count") == total_generated - 5
    assert value(samples, "vllm:num_preemptions_total") == 0

    # vLLM's buckets: 1-2-5 up to max_model_len for token counts, its latency list for phases.
    prompt_le = [labels["le"] for labels, _ in samples["vllm:request_prompt_tokens_bucket"]]
    assert prompt_le == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]
    e2e_le = [labels["le"] for labels, _ in samples["vllm:e2e_request_latency_seconds_bucket"]]
    assert e2e_le == [*(str(float(b)) for b in REQUEST_LATENCY_BUCKETS), "+Inf"]


def test_1_2_5_buckets_stop_at_the_bound() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4096)[-2:] == [1000, 2000]  # 5000 would pass the bound
    assert build_1_2_5_buckets(1) == [1]


def test_two_servers_in_one_process_keep_their_own_counters() -> None:
    first, second = ServerMetrics("m", 512), ServerMetrics("m", 512)  # one global registry would refuse this
    first.generation_tokens.inc(3)
    assert b'vllm:generation_tokens_total{engine="0",model_name="m"} 3.0' in first.render()
    assert b'vllm:generation_tokens_total{engine="0",model_name="m"} 0.0' in second.render()


def test_output_processor_counts_each_batch_and_never_an_abort_as_finished() -> None:
    processor = OutputProcessor(tokenizer=None)
    batches: list[IterationStats] = []
    processor.stat_loggers.append(batches.append)
    start = time.monotonic()
    for parent_id, n in (("pair", 2), ("gone", 1)):
        parent = ParentRequest(parent_id, None, [1, 2, 3, 4], RequestMetrics(arrival_time=start))
        for index in range(n):
            request_id = f"{index}_{parent_id}" if n > 1 else parent_id
            request = EngineCoreRequest(request_id, [1, 2, 3, 4], SamplingParams(max_tokens=3), None, start)
            processor.add_request(parent, request, index)
    queued, scheduled, preempted = (EngineCoreEvent(kind, start) for kind in EngineCoreEventType)

    def batch(*outputs: EngineCoreOutput) -> IterationStats:
        processor.process_outputs(list(outputs))
        return batches[-1]

    first = batch(EngineCoreOutput("0_pair", [5], events=[queued, scheduled], num_cached_tokens=2),
                  EngineCoreOutput("1_pair", [], events=[queued, scheduled, preempted]),
                  EngineCoreOutput("gone", [5], num_cached_tokens=4))
    assert (first.num_generation_tokens, first.num_preempted_reqs) == (2, 1)
    assert len(first.time_to_first_tokens) == 2
    assert (first.prompt_tokens.total, first.prompt_tokens.computed, first.prompt_tokens.cached) == (8, 2, 6)
    processor.abort_requests(["gone"])  # its token so far stays counted; it never finishes
    second = batch(EngineCoreOutput("0_pair", [6], FinishReason.LENGTH), EngineCoreOutput("1_pair", [6]),
                   EngineCoreOutput("gone", [6]))
    assert (second.num_generation_tokens, len(second.inter_token_latencies)) == (2, 1)
    assert [done.finish_reason for done in second.finished_requests] == [FinishReason.LENGTH]
    assert second.finished_requests[0].num_generation_tokens == 2 and second.n_params == []
    # The first sample's late token (it had ended) is not counted; the pair is done.
    third = batch(EngineCoreOutput("0_pair", [7]), EngineCoreOutput("1_pair", [7], FinishReason.STOP))
    assert third.num_generation_tokens == 1
    [done] = third.finished_requests
    assert (done.finish_reason, done.num_preemptions) == (FinishReason.STOP, 1)
    assert (third.n_params, third.max_num_generation_tokens) == ([2], [2])
