"""Speculative decoding in the running engine (chapter 9): same greedy tokens, fewer steps.

The property every test here checks: with greedy sampling, the tokens an engine
writes with speculation on equal, token for token, the tokens it writes without,
whatever the proposer, the number of drafts (k = 1..5), prefix caching, chunked
prefill or preemption. Prompts are random token ids with a repeated stretch,
so the n-gram proposer finds matches and both accepted and rejected drafts
occur. The draft-model proposer runs with two tiny drafts: the target itself
(every draft accepted) and a tiny model of another architecture with the
same vocabulary (mostly rejected). Engine invariants are checked after every step (the conftest's autouse
fixture).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import make_engine as make_helper_engine
from engine_helpers import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoengine.config import SpeculativeConfig
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.entrypoints.llm import LLM
from nanoengine.metrics.stats import SchedulerStats
from nanoengine.sample.metadata import SamplingMetadata
from nanoengine.sample.rejection_sampler import RejectionSampler
from nanoengine.sample.sampler import Sampler
from nanoengine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def ngram(k: int, low: int = 1, high: int = 3) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low, "prompt_lookup_max": high}


def draft_model(k: int, model: str) -> dict[str, Any]:
    return {"method": "draft_model", "num_speculative_tokens": k, "model": model}


@pytest.fixture(scope="module")
def other_tiny(tiny_model_factory: Callable[..., str]) -> str:
    """A different random model with the tiny llama's tokenizer: a draft that is mostly wrong."""
    return tiny_model_factory("qwen2")


def methods(k: int, target: str, other: str) -> dict[str, dict[str, Any]]:
    """Every draft verified (draft_length="fixed"): the tiny random models keep few
    drafts, and the adaptive policy would cut most of what these tests check."""
    configs = {"ngram": ngram(k), "draft-self": draft_model(k, target), "draft-other": draft_model(k, other)}
    return {name: {**config, "draft_length": "fixed"} for name, config in configs.items()}


def repetitive_prompts(seed: int, count: int, vocab: int = 300) -> list[list[int]]:
    """Random ids with a stretch that repeats: the n-gram proposer has something to find."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        stretch = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
        noise = [rng.randrange(3, vocab) for _ in range(rng.randint(0, 20))]
        prompts.append(noise + stretch * rng.randint(2, 4))
    return prompts


def make_engine(model: str, **kwargs: Any) -> LLMEngine:
    """fp32: the claim is "same tokens up to rounding". In bf16 a verification
    step (several query positions at once) rounds differently from a one-token
    decode, which flips the argmax of near-ties; fp32 makes that vanishingly rare.
    """
    kwargs.setdefault("dtype", "float32")
    return make_helper_engine(model, **kwargs)


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    final = run(engine)
    return [final[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def stats(engine: LLMEngine) -> SchedulerStats:
    return engine.engine_core.get_engine_core().scheduler.make_stats()


_ENGINES: dict[tuple[str, tuple[tuple[str, Any], ...]], LLMEngine] = {}


def cached_engine(model: str, **kwargs: Any) -> LLMEngine:
    """One engine per configuration for the whole module (hypothesis reuses them)."""
    key = (model, tuple(sorted((name, repr(value)) for name, value in kwargs.items())))
    if key not in _ENGINES:
        _ENGINES[key] = make_engine(model, **kwargs)
    return _ENGINES[key]


# ---- greedy exactness -------------------------------------------------------


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000))
def test_greedy_tokens_equal_plain_decoding(tiny_llama: str, other_tiny: str, method: str, k: int, seed: int) -> None:
    """Every method, k = 1..5, prefix caching on, chunked prefill (a 32-token budget cuts the prompts)."""
    prompts = repetitive_prompts(seed, 6)
    common = {"max_num_batched_tokens": 32}
    plain = generate(cached_engine(tiny_llama, **common), prompts)
    engine = cached_engine(tiny_llama, speculative_config=methods(k, tiny_llama, other_tiny)[method], **common)
    before = stats(engine).spec_decoding_stats
    assert before is not None
    drafted = before.num_draft_tokens
    assert generate(engine, prompts) == plain
    after = stats(engine).spec_decoding_stats
    assert after is not None and after.num_draft_tokens > drafted  # drafts were really verified


@pytest.mark.parametrize("method", ["ngram", "draft-other"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_exact_with_and_without_prefix_caching_on_shared_prefixes(
    tiny_llama: str, other_tiny: str, prefix_caching: bool, method: str
) -> None:
    """Requests that share a prefix hit blocks other requests filled while speculating."""
    shared = repetitive_prompts(1, 1)[0][:40]
    prompts = [shared + tail for tail in repetitive_prompts(2, 6)]
    common = {"enable_prefix_caching": prefix_caching}
    plain = generate(make_engine(tiny_llama, **common), prompts)
    engine = make_engine(tiny_llama, speculative_config=methods(4, tiny_llama, other_tiny)[method], **common)
    assert generate(engine, prompts) == plain
    # A second round: now the prompts' blocks (and generated ones) are in the cache.
    assert generate(engine, prompts) == plain
    if prefix_caching:
        assert stats(engine).prefix_cache_hits > 0


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-other"])
def test_exact_under_preemption(tiny_llama: str, other_tiny: str, method: str) -> None:
    """A KV cache too small for the batch: requests are preempted, drafts dropped, recomputed
    (a draft model's KV too, from the first token)."""
    prompts = repetitive_prompts(3, 8)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    common = {"num_gpu_blocks_override": 12, "max_model_len": 128}
    plain = generate(make_engine(tiny_llama, **common), prompts, params)
    engine = make_engine(tiny_llama, speculative_config=methods(5, tiny_llama, other_tiny)[method], **common)
    assert generate(engine, prompts, params) == plain
    assert stats(engine).num_preemptions > 0


def test_exact_with_penalties_bias_and_min_tokens(tiny_llama: str) -> None:
    """Each verified position sees the drafts before it, as plain decoding would."""
    prompts = repetitive_prompts(4, 4)
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.2,
                            presence_penalty=0.1, logit_bias={7: 2.0}, min_tokens=10)
    plain = generate(make_engine(tiny_llama), prompts, params)
    assert generate(make_engine(tiny_llama, speculative_config=ngram(3)), prompts, params) == plain


def test_logprobs_of_verified_tokens_match_plain_decoding(tiny_llama: str) -> None:
    prompts = repetitive_prompts(5, 3)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)

    def outputs(engine: LLMEngine) -> list[Any]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        final = run(engine)
        return [final[f"r{i}"].outputs[0] for i in range(len(prompts))]

    plain = outputs(make_engine(tiny_llama))
    spec = outputs(make_engine(tiny_llama, speculative_config=ngram(4)))
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None and len(b.logprobs) == len(b.token_ids)
        for row_a, row_b in zip(a.logprobs, b.logprobs):
            assert row_a.keys() == row_b.keys()
            for token_id, entry in row_a.items():
                assert row_b[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_stop_token_inside_accepted_drafts_ends_the_request_there(tiny_llama: str) -> None:
    """Tokens after a stop are dropped even when the target accepted them."""
    prompt = repetitive_prompts(6, 1)[0]
    plain = generate(make_engine(tiny_llama), [prompt])[0]
    stop_id = plain[len(plain) // 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_id])
    expected = generate(make_engine(tiny_llama), [prompt], params)
    assert generate(make_engine(tiny_llama, speculative_config=ngram(5)), [prompt], params) == expected
    assert expected[0][-1] == stop_id


@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_drafts_never_pass_max_model_len(tiny_llama: str, other_tiny: str, method: str) -> None:
    prompt = repetitive_prompts(7, 1)[0][:40]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    plain = generate(make_engine(tiny_llama, max_model_len=64), [prompt], params)
    config = methods(5, tiny_llama, other_tiny)[method]
    spec = generate(make_engine(tiny_llama, max_model_len=64, speculative_config=config), [prompt], params)
    assert spec == plain and len(prompt) + len(spec[0]) == 64


@pytest.fixture(scope="module")
def smollm2_first8(default_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SmolLM2 cut after 8 of its 30 layers (scripts/make_truncated_draft.py): an untrained draft."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_truncated_draft import truncate

    return str(truncate(Path(default_model_path), tmp_path_factory.mktemp("smollm2-first8"), num_layers=8))


_SMOLLM2_PLAIN: dict[tuple[str, ...], list[list[int]]] = {}


def _smollm2_plain(model: str, prompts: tuple[str, ...], max_tokens: int, common: dict[str, Any]) -> list[list[int]]:
    """SmolLM2's greedy tokens without speculation, built once for both methods."""
    if prompts not in _SMOLLM2_PLAIN:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outputs = LLM(model, **common).generate(list(prompts), params, use_tqdm=False)
        _SMOLLM2_PLAIN[prompts] = [o.outputs[0].token_ids for o in outputs]
    return _SMOLLM2_PLAIN[prompts]


@pytest.mark.parametrize("method", ["ngram", "draft-first8"])
def test_smollm2_greedy_text_is_the_same(default_model_path: str, smollm2_first8: str, method: str) -> None:
    """The real model on a copy task: same text, with n-gram drafts (most accepted) and with
    the layer-truncated SmolLM2 as a draft model (few accepted)."""
    text = ("The scheduler gives each running request its next tokens, then admits waiting requests "
            "while the token budget and the free blocks last.")
    prompts = [f"Repeat this sentence exactly: {text}\nRepeated:", f"Copy the text: {text}"]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    common: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
    plain = _smollm2_plain(default_model_path, tuple(prompts), params.max_tokens or 0, common)
    config = ngram(3, 2, 4) if method == "ngram" else draft_model(3, smollm2_first8)
    llm = LLM(default_model_path, speculative_config=config, **common)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == plain
    spec_stats = llm.llm_engine.engine_core.get_engine_core().scheduler.spec_decoding_stats
    assert spec_stats is not None and spec_stats.acceptance_rate is not None
    if method == "ngram":
        assert spec_stats.acceptance_rate > 0.5


# ---- sampling with temperature --------------------------------------------


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama: str) -> None:
    """With every draft verified (draft_length="fixed"); adaptive lengths follow
    measured step times, so their random draws may differ from run to run."""
    prompts = repetitive_prompts(8, 4)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=11, ignore_eos=True)
    fixed = {**ngram(3), "draft_length": "fixed"}
    first = generate(make_engine(tiny_llama, speculative_config=fixed), prompts, params)
    again = generate(make_engine(tiny_llama, speculative_config=fixed), prompts, params)
    assert first == again and all(len(tokens) == 24 for tokens in first)


def test_each_finished_request_reports_its_own_drafts(tiny_llama: str) -> None:
    """CompletionOutput.spec_decode_metrics (vLLM's field) adds up to the engine's counters."""
    llm_engine = make_engine(tiny_llama, speculative_config=ngram(3))
    prompts = repetitive_prompts(4, 4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm_engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = []
    while llm_engine.has_unfinished_requests():
        finished += [out for out in llm_engine.step() if out.finished]
    metrics = [out.outputs[0].spec_decode_metrics for out in finished]
    stats = llm_engine.engine_core.get_engine_core().scheduler.spec_decoding_stats
    assert stats is not None and all(m is not None for m in metrics) and len(metrics) == 4
    assert sum(m.num_draft_tokens for m in metrics if m) == stats.num_draft_tokens > 0
    assert sum(m.num_accepted_tokens for m in metrics if m) == stats.num_accepted_tokens
    assert sum(sum(m.histogram) for m in metrics if m) == stats.num_drafts


def test_rejection_sampler_draws_from_the_filtered_distribution() -> None:
    """With top-k and a temperature, the first emitted token follows the sampler's own
    distribution (``Sampler.compute_probs``), draft or no draft.

    Chi-square over 12,000 draws on an 8-token vocabulary; the critical value
    30.0 for 7 degrees of freedom fails a correct sampler with probability
    about 1e-4.
    """
    vocab, draws = 8, 12_000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -9.0], [0.0] * vocab])
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.7, 0.7]), top_p=torch.tensor([1.0, 1.0]), top_k=torch.tensor([5, 5]),
        greedy_mask=torch.tensor([False, False]), all_greedy=False, no_top_p=True, no_top_k=False,
    )
    expected = Sampler.compute_probs(logits, metadata)[0]
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab)
    sampler = RejectionSampler()
    for _ in range(draws):
        emitted = sampler([[1]], logits, metadata, [generator]).emitted_token_ids[0]
        counts[emitted[0]] += 1
    observed_outside_top_k = counts[expected == 0].sum()
    assert observed_outside_top_k == 0
    mask = expected > 0
    chi2 = float((((counts[mask] - draws * expected[mask]) ** 2) / (draws * expected[mask])).sum())
    assert chi2 < 30.0, (chi2, counts.tolist(), (draws * expected).tolist())


# ---- what speculation refuses or leaves alone ---------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"async_scheduling": True}, "async_scheduling"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}}, "unknown key"),
        ({"speculative_config": {"method": "eagle"}}, "method must be"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"speculative_config": {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}}, "prompt_lookup"),
    ],
)
def test_refused_configurations_say_why(tiny_llama: str, kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("speculative_config", ngram(2))
    with pytest.raises((ValueError, TypeError), match=message):
        EngineArgs(model=tiny_llama, **kwargs).create_engine_config()


def test_hybrid_model_is_refused(tiny_model_factory: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="hybrid"):
        EngineArgs(model=tiny_model_factory("qwen3_5"), speculative_config=ngram(2)).create_engine_config()


def test_draft_model_acceptance_tells_a_good_draft_from_a_bad_one(tiny_llama: str, other_tiny: str) -> None:
    prompts = repetitive_prompts(11, 4)
    rates = {}
    for name, config in methods(3, tiny_llama, other_tiny).items():
        engine = make_engine(tiny_llama, speculative_config=config)
        generate(engine, prompts)
        spec_stats = stats(engine).spec_decoding_stats
        assert spec_stats is not None
        rates[name] = spec_stats.acceptance_rate
    assert rates["draft-self"] == 1.0
    assert rates["draft-other"] is not None and rates["draft-other"] < 0.5


def test_draft_model_blocks_pay_for_both_models(tiny_llama: str) -> None:
    """The KV cache spec counts the draft's layers, so the same budget gives fewer blocks."""
    budget = {"kv_cache_memory_bytes": 4 << 20, "num_gpu_blocks_override": None}
    plain = make_engine(tiny_llama, **budget).engine_core.get_engine_core().kv_cache_config.num_blocks
    spec = make_engine(tiny_llama, speculative_config=draft_model(2, tiny_llama), **budget)
    assert spec.engine_core.get_engine_core().kv_cache_config.num_blocks < plain


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama: str, tmp_path: Any) -> None:
    from tiny_models import tiny_config, write_random_model

    other = write_random_model(tmp_path / "other-vocab", tiny_config("llama", vocab_size=100))
    with pytest.raises(ValueError, match="vocab_size=100"):
        EngineArgs(model=tiny_llama, speculative_config=draft_model(2, str(other))).create_engine_config()


def test_speculative_config_object_is_accepted(tiny_llama: str) -> None:
    config = EngineArgs(model=tiny_llama, speculative_config=SpeculativeConfig(num_speculative_tokens=2))
    assert config.create_engine_config().speculative_config == SpeculativeConfig(num_speculative_tokens=2)


def test_structured_output_request_decodes_without_drafts(tiny_llama: str) -> None:
    """A grammar request gets no drafts; the others in the batch still speculate."""
    from nanoengine.sampling_params import StructuredOutputsParams

    grammar = SamplingParams(temperature=0.0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex="(ab|cd){1,5}"))
    prompts = repetitive_prompts(9, 3)

    def outputs(engine: LLMEngine) -> list[list[int]]:
        engine.add_request("g", {"prompt_token_ids": prompts[0]}, grammar)
        for i, prompt in enumerate(prompts[1:]):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
        final = run(engine)
        return [final[rid].outputs[0].token_ids for rid in ("g", "r0", "r1")]

    assert outputs(make_engine(tiny_llama, speculative_config=ngram(3))) == outputs(make_engine(tiny_llama))


def test_soak_with_aborts_loses_nothing(tiny_llama: str) -> None:
    """200 requests over a small KV cache with speculation on, one in five aborted midway.

    Every request that is not aborted finishes with all its tokens; at the end
    no request is left and every block is free. Bounded by its request count.
    """
    rng = random.Random(0)
    engine = make_engine(tiny_llama, speculative_config=ngram(4), num_gpu_blocks_override=24, max_num_seqs=16)
    prompts = repetitive_prompts(10, 200)
    lengths = {f"s{i}": rng.randint(1, 40) for i in range(200)}
    to_abort = {rid for rid in lengths if rng.random() < 0.2}
    pending = list(lengths)
    aborted: set[str] = set()
    finished: dict[str, list[int]] = {}
    for _ in range(20_000):
        while pending and rng.random() < 0.5:
            rid = pending.pop(0)
            params = SamplingParams(temperature=rng.choice([0.0, 0.9]), max_tokens=lengths[rid], ignore_eos=True)
            engine.add_request(rid, {"prompt_token_ids": prompts[int(rid[1:])]}, params)
        if not pending and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
            elif output.request_id in to_abort and rng.random() < 0.3:
                engine.abort_request([output.request_id])
                aborted.add(output.request_id)
    assert not pending and not engine.has_unfinished_requests()
    completed = set(lengths) - aborted
    assert len(completed) >= 150
    for rid in completed:
        assert len(finished[rid]) == lengths[rid], rid
    scheduler = engine.engine_core.get_engine_core().scheduler
    assert not scheduler.requests
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_layer_truncated_draft_runs_and_keeps_the_text(tiny_llama: str, tmp_path: Any) -> None:
    """scripts/make_truncated_draft.py: the target's first layer as a (poor) draft."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_truncated_draft import truncate

    folder = truncate(Path(tiny_llama), tmp_path / "first1", num_layers=1)
    prompts = repetitive_prompts(12, 3)
    plain = generate(make_engine(tiny_llama), prompts)
    assert generate(make_engine(tiny_llama, speculative_config=draft_model(3, str(folder))), prompts) == plain
    with pytest.raises(ValueError, match="--layers must be between 1 and"):
        truncate(Path(tiny_llama), tmp_path / "too-many", num_layers=99)
