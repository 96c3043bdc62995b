"""Speculative decoding seen from outside (chapter 9): the step tracer, ``/metrics`` and the CLI.

* The tracer: a traced engine with n-gram drafts records, per step and
  request, the drafts verified, accepted and rejected; the totals agree with
  the scheduler's ``SpecDecodingStats``, the next step starts where the
  roll-back left the request, and the table grows its three draft columns
  only for a trace that had drafts.
* ``/metrics``: ``nanoengine serve --speculative-config ...`` exports vLLM's
  four ``vllm:spec_decode_*`` counter families (greedy text unchanged by the
  drafts), a server without speculation exports none (test_server_metrics.py
  checks that on its own server), and the running totals from the core are
  turned into counter increments exactly once.
* A bad ``--speculative-config`` ends ``nanoengine serve`` with one line that
  names the bad value, before any engine process starts.

Prompts repeat themselves, so the n-gram proposer (``prompt_lookup_min=1``)
finds matches; on the tiny random model some drafts are accepted and many are not.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from server_helpers import API_KEY, NANOENGINE, metric, running_server, wait_until

from nanoengine import LLM, SamplingParams
from nanoengine.entrypoints.openai.metrics import ServerMetrics
from nanoengine.instruments.trace import EngineTrace, ScheduledChunk, StepTrace, trace_table
from nanoengine.instruments.trace.table import format_chunk, step_row

MAX_MODEL_LEN = 512
ENGINE_KWARGS: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 8 << 20, "block_size": 16}
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(8 << 20), "--block-size", "16")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["abc abc abc abc abc abc", "hello hello hello hello world hello hello"]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SPEC_FAMILIES = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


# ---- the step tracer -----------------------------------------------------------


def test_trace_records_drafts_accepted_and_rejected_per_step(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, trace=True, speculative_config=NGRAM, **ENGINE_KWARGS)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    trace = llm.trace
    assert trace is not None and trace.has_drafts
    stats = llm.llm_engine.engine_core.get_engine_core().scheduler.spec_decoding_stats
    assert stats is not None

    verified = [(step, chunk) for step in trace.steps for chunk in step.scheduled if chunk.num_draft_tokens]
    for _, chunk in verified:
        # A decode that carries its drafts: 1 + k tokens, of which 0..k kept.
        assert chunk.kind == "decode" and chunk.num_tokens == 1 + chunk.num_draft_tokens
        assert 0 <= chunk.num_accepted_tokens <= chunk.num_draft_tokens
        assert chunk.num_rejected_tokens == chunk.num_draft_tokens - chunk.num_accepted_tokens
        assert format_chunk(chunk) == f"r{chunk.request_id}:D+{chunk.num_draft_tokens}"
    # The trace and the scheduler's cumulative stats count the same verifications.
    assert len(verified) == stats.num_drafts
    assert sum(step.num_draft_tokens for step in trace.steps) == stats.num_draft_tokens
    assert sum(step.num_accepted_tokens for step in trace.steps) == stats.num_accepted_tokens
    assert sum(step.num_rejected_tokens for step in trace.steps) == stats.num_draft_tokens - stats.num_accepted_tokens
    # The tiny model repeats itself on "abc ...": some drafts kept, some thrown away.
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens

    # The roll-back: a request's next chunk starts after its own token and the kept drafts.
    for request_id in ("0", "1"):
        chunks = [chunk for _, chunk in trace.chunks_of(request_id)]
        for chunk, following in itertools.pairwise(chunks):
            assert following.start == chunk.start + chunk.num_tokens - chunk.num_rejected_tokens
        generated = sum(1 + chunk.num_accepted_tokens for chunk in chunks if chunk.kind == "decode") + 1
        assert generated >= MAX_TOKENS  # the prefill's token plus every decode's; a stop may drop extras

    # The table: three more columns, filled for the steps that verified drafts.
    console = Console(record=True, width=320)
    console.print(trace_table(trace))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "scheduled" in line)
    assert [name in header for name in ("drafts", "accepted", "rejected")] == [True, True, True]
    assert "D+k = decode verifying k draft tokens" in text
    step, chunk = verified[0]
    row = step_row(step, with_drafts=True)
    label = f"r{chunk.request_id}"
    assert f"{label}:{chunk.num_draft_tokens}" in row[3].split()
    assert f"{label}:{chunk.num_accepted_tokens}" in row[4].split()
    assert f"{label}:{chunk.num_rejected_tokens}" in row[5].split()


def test_a_trace_without_drafts_keeps_the_table_of_chapters_3_and_4() -> None:
    decode = ScheduledChunk("1", "decode", start=9, num_tokens=1, num_prompt_tokens=8, new_block_ids=[],
                            num_cached_tokens=0)
    trace = EngineTrace(block_size=16, num_blocks=8, steps=[StepTrace(step=0, scheduled=[decode])])
    assert not trace.has_drafts and format_chunk(decode) == "r1:D"
    console = Console(record=True, width=320)
    console.print(trace_table(trace))
    text = console.export_text()
    assert "drafts" not in text and "rejected" not in text and "D+k" not in text
    assert len(step_row(trace.steps[0])) == 11  # the eleven columns chapters 3 and 4 print


# ---- /metrics ------------------------------------------------------------------


def engine_stats(spec: dict[str, Any] | None) -> dict[str, Any]:
    """What ``EngineCoreProc.get_stats`` returns, with an idle scheduler."""
    return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_free_blocks": 8,
            "num_usable_blocks": 8, "prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
            "spec_decoding": spec}


def spec_totals(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> dict[str, Any]:
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "num_accepted_tokens_per_pos": per_pos}


def rendered(metrics: ServerMetrics) -> dict[str, float]:
    """``name{position}`` -> value of the spec-decode counters of one render (not their ``_created``)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode") and sample.name.endswith("_total"):
                assert (sample.labels["model_name"], sample.labels["engine"]) == ("m", "0")
                values[sample.name + sample.labels.get("position", "")] = sample.value
    return values


def test_server_metrics_turn_running_totals_into_counter_increments() -> None:
    metrics = ServerMetrics("m", 512)
    metrics.update_engine_stats(engine_stats(None))  # speculation off: no family at all
    assert b"spec_decode" not in metrics.render() and metrics.spec_decode is None

    metrics.update_engine_stats(engine_stats(spec_totals(0, 0, 0, [0, 0, 0])))
    zero = rendered(metrics)  # registered at the first report, every series at zero
    assert zero == {"vllm:spec_decode_num_drafts_total": 0, "vllm:spec_decode_num_draft_tokens_total": 0,
                    "vllm:spec_decode_num_accepted_tokens_total": 0,
                    **{f"vllm:spec_decode_num_accepted_tokens_per_pos_total{p}": 0 for p in "012"}}

    totals = spec_totals(4, 10, 5, [3, 2, 0])
    metrics.update_engine_stats(engine_stats(totals))
    metrics.update_engine_stats(engine_stats(totals))  # a second scrape with nothing new adds nothing
    after = rendered(metrics)
    assert after["vllm:spec_decode_num_drafts_total"] == 4
    assert after["vllm:spec_decode_num_draft_tokens_total"] == 10
    assert after["vllm:spec_decode_num_accepted_tokens_total"] == 5
    assert [after[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{p}"] for p in "012"] == [3, 2, 0]
    metrics.update_engine_stats(engine_stats(spec_totals(6, 14, 8, [5, 2, 1])))
    assert rendered(metrics)["vllm:spec_decode_num_accepted_tokens_total"] == 8


@pytest.fixture(scope="module")
def spec_server(tiny_llama: str) -> Iterator[str]:
    with running_server(tiny_llama, *FLAGS, "--speculative-config", json.dumps(NGRAM)) as (base_url, _):
        yield base_url


def spec_samples(base_url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of the spec-decode families of one scrape, with the family types."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=5.0).text):
        if family.name in SPEC_FAMILIES:
            assert family.type == "counter", family.name
            for sample in family.samples:
                if sample.name.endswith("_created"):  # when the series was made, not a count
                    continue
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def total(samples: dict[str, list[tuple[dict[str, str], float]]], family: str) -> float:
    return sum(value for _, value in samples[f"{family}_total"])


def test_served_greedy_text_is_unchanged_and_metrics_count_the_drafts(spec_server: str, tiny_llama: str) -> None:
    client = openai.OpenAI(base_url=f"{spec_server}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    first = spec_samples(spec_server)  # registered before any request, at zero
    assert set(first) == {f"{family}_total" for family in SPEC_FAMILIES}
    assert all(value == 0 for series in first.values() for _, value in series)

    offline = LLM(tiny_llama, **ENGINE_KWARGS)  # no speculation: the reference text
    for prompt in PROMPTS:
        expected = offline.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].text
        served = client.completions.create(model=tiny_llama, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0.0, extra_body={"ignore_eos": True})
        assert served.choices[0].text == expected
        assert served.usage is not None and served.usage.completion_tokens == MAX_TOKENS
    assert wait_until(lambda: metric(spec_server, "vllm:num_requests_running") == 0, 5.0)

    samples = spec_samples(spec_server)
    for series in samples.values():
        for labels, _ in series:
            assert (labels["model_name"], labels["engine"]) == (tiny_llama, "0")
    drafts = total(samples, "vllm:spec_decode_num_drafts")
    draft_tokens = total(samples, "vllm:spec_decode_num_draft_tokens")
    accepted = total(samples, "vllm:spec_decode_num_accepted_tokens")
    per_pos = {labels["position"]: value
               for labels, value in samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"]}
    assert 0 < drafts <= draft_tokens <= NGRAM["num_speculative_tokens"] * drafts
    assert 0 < accepted <= draft_tokens
    # One series per draft position; a token at position p was kept only if p - 1 was.
    assert list(per_pos) == ["0", "1", "2"] and sum(per_pos.values()) == accepted
    assert per_pos["0"] >= per_pos["1"] >= per_pos["2"]
    assert spec_samples(spec_server) == samples  # scraping again adds nothing


# ---- the command line ----------------------------------------------------------


@pytest.mark.parametrize(("config", "named"), [('{"method": "nope"}', "'nope'"),
                                                ('{"method": "ngram", "lookahead": 2}', "'lookahead'")])
def test_a_bad_speculative_config_ends_serve_with_one_line(tiny_llama: str, config: str, named: str) -> None:
    done = subprocess.run([NANOENGINE, "serve", tiny_llama, "--port", "1", "--speculative-config", config],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoengine serve: error: ") and named in lines[0], done.stderr
