"""Logprobs, penalties and output kinds through the whole engine (chapter 8).

The tiny random Llama runs in nanoengine and in HF transformers on the same
weights: the engine's logprobs (of sampled tokens and of prompt tokens) must be
HF's log_softmax of the raw logits to 1e-4, through chunked prefill, prefix
caching, preemption and async scheduling; penalties and logit_bias must pick
the tokens a plain loop over HF's logits picks; DELTA outputs must add up to
the CUMULATIVE result; and a bad request must leave the others running.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from hf_reference import EXACT_DTYPE
from transformers import AutoModelForCausalLM

from nanoengine import LLM, RequestOutput, SamplingParams
from nanoengine.engine import EngineCoreOutput
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.logprobs import Logprob
from nanoengine.sample.penalties import PenaltyInputs, apply_penalties_reference
from nanoengine.sample.sampler import compute_logprobs, gather_logprobs
from nanoengine.sampling_params import RequestOutputKind
from nanoengine.worker.input_batch import CachedRequestState
from nanoengine.worker.prompt_logprobs import (
    collect_prompt_logprobs,
    find_prompt_logprob_targets,
    take_finished_prompt_logprobs,
)

TOLERANCE = 1e-4
# fp32: the logprobs are compared with HF's fp32 model to TOLERANCE.
BASE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, dtype=EXACT_DTYPE)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for length in lengths]


PROMPTS = _prompts([7, 19, 33, 1])


@pytest.fixture(scope="module")
def hf_model(tiny_llama: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, **BASE)


@torch.inference_mode()
def _hf_logprobs(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: row p is HF's log_softmax predicting token p + 1."""
    logits = hf_model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def _check_position(position: dict[int, Logprob], chosen: int, row: torch.Tensor, k: int) -> None:
    """The chosen token plus HF's top k, each with HF's logprob and rank."""
    top_ids = row.topk(k).indices.tolist()
    assert set(position) == {chosen, *top_ids}
    for token_id, logprob in position.items():
        assert abs(logprob.logprob - float(row[token_id])) < TOLERANCE, (
            token_id,
            logprob,
            float(row[token_id]),
        )
    for rank, token_id in enumerate(top_ids, start=1):
        assert position[token_id].rank == rank
    value = float(row[chosen])
    assert (
        int((row > value + TOLERANCE).sum()) < position[chosen].rank <= int((row >= value - TOLERANCE).sum())
    )


def _check_against_hf(hf_model: Any, prompt: list[int], output: RequestOutput, k: int, prompt_k: int) -> None:
    completion = output.outputs[0]
    reference = _hf_logprobs(hf_model, prompt + completion.token_ids)
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    for i, (token_id, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
        _check_position(position, token_id, reference[len(prompt) - 1 + i], k)
    expected_sum = sum(float(reference[len(prompt) - 1 + i, t]) for i, t in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(
        expected_sum, abs=TOLERANCE * len(completion.token_ids)
    )
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        position = output.prompt_logprobs[j]
        assert position is not None
        _check_position(position, prompt[j], reference[j - 1], prompt_k)


def _generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_greedy_logprobs_equal_hf(llm: LLM, hf_model: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # Requests without logprobs share the batch and are left as they were.
    outputs = _generate(llm, PROMPTS + PROMPTS[:2], [params] * len(PROMPTS) + [plain, plain])
    for prompt, output in zip(PROMPTS, outputs):
        _check_against_hf(hf_model, prompt, output, k=5, prompt_k=3)
        assert all(
            position[t].rank == 1
            for t, position in zip(output.outputs[0].token_ids, output.outputs[0].logprobs or [])
        )
    for with_logprobs, without in zip(outputs, outputs[len(PROMPTS) :]):
        assert without.outputs[0].token_ids == with_logprobs.outputs[0].token_ids
        assert without.outputs[0].logprobs is None and without.prompt_logprobs is None
        assert without.outputs[0].cumulative_logprob is None


def test_logprobs_zero_is_the_sampled_token_alone(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    output = _generate(llm, PROMPTS[:1], params)[0]
    completion = output.outputs[0]
    assert [list(position) for position in completion.logprobs or []] == [[t] for t in completion.token_ids]
    assert [list(p) if p else None for p in output.prompt_logprobs or []] == [
        None,
        *[[t] for t in PROMPTS[0][1:]],
    ]
    assert all(
        isinstance(p.decoded_token, str) for position in completion.logprobs or [] for p in position.values()
    )


def test_sampled_logprobs_are_the_raw_models(llm: LLM, hf_model: Any) -> None:
    """Temperature, bias and penalties pick the tokens; the logprobs still describe the model."""
    params = SamplingParams(
        temperature=1.3,
        top_k=40,
        min_p=0.02,
        seed=7,
        max_tokens=10,
        logprobs=4,
        prompt_logprobs=2,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        logit_bias={100: 3.0},
        ignore_eos=True,
    )
    for prompt, output in zip(PROMPTS, _generate(llm, PROMPTS, params)):
        _check_against_hf(hf_model, prompt, output, k=4, prompt_k=2)


SCENARIOS: dict[str, dict[str, Any]] = {
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "prefix_caching": dict(enable_prefix_caching=True),
    "preemption": dict(num_gpu_blocks_override=18, block_size=4, max_num_batched_tokens=16, max_model_len=64),
    "async_scheduling": dict(async_scheduling=True),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_logprobs_survive_the_scheduler(tiny_llama: str, hf_model: Any, scenario: str) -> None:
    llm = LLM(tiny_llama, **{**BASE, **SCENARIOS[scenario]})
    prompt_outputs: list[EngineCoreOutput] = []
    engine: LLMEngine = llm.llm_engine
    process = engine.output_processor.process_outputs

    def record(outputs: list[EngineCoreOutput]) -> Any:
        prompt_outputs.extend(o for o in outputs if o.new_prompt_logprobs is not None)
        return process(outputs)

    engine.output_processor.process_outputs = record  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    # Twice: the second run finds the prompts in the prefix cache, which it must not use.
    for _ in range(2):
        prompt_outputs.clear()
        outputs = _generate(llm, PROMPTS, params)
        for prompt, output in zip(PROMPTS, outputs):
            _check_against_hf(hf_model, prompt, output, k=3, prompt_k=2)
        # Each request's prompt logprobs leave the engine core once, even if it was preempted.
        assert sorted(o.request_id for o in prompt_outputs) == sorted(o.request_id for o in outputs)
    if scenario == "preemption":
        core = engine.engine_core.get_engine_core()
        assert core.scheduler.make_stats().num_preemptions > 0, (
            "the tiny KV cache was meant to force preemption"
        )


def test_worker_collects_prompt_logprobs_over_chunks_and_sends_them_once() -> None:
    """Chunks append rows; a prefill restarted at position 0 (preemption) starts over."""
    prompt = [11, 12, 13, 14, 15, 16]
    state = CachedRequestState("r", list(prompt), len(prompt), SamplingParams(prompt_logprobs=2), ([],), 0)
    position_logits = torch.randn(len(prompt), 20)  # row p scores prompt token p + 1

    def run_chunk(num_tokens: int) -> None:
        targets = find_prompt_logprob_targets([state], [num_tokens], [0])
        if targets is not None:
            rows = targets.hidden_rows + state.num_computed_tokens
            collect_prompt_logprobs({"r": state}, targets, position_logits[rows])
        state.num_computed_tokens += num_tokens

    run_chunk(4)
    state.num_computed_tokens = 0  # preempted mid-prefill: recomputed from the start
    run_chunk(3)
    run_chunk(3)  # the last chunk: its last position samples, it scores no prompt token
    sent = take_finished_prompt_logprobs([state])
    expected = gather_logprobs(compute_logprobs(position_logits[:-1]), 2, torch.tensor(prompt[1:]))
    assert sent["r"] == expected.tolists(0, len(prompt) - 1, 2)
    assert take_finished_prompt_logprobs([state]) == {}  # sent once, even if it runs again
    assert find_prompt_logprob_targets([state], [1], [0]) is None

    out_of_step = CachedRequestState("q", list(prompt), len(prompt), SamplingParams(prompt_logprobs=0), ([],), 2)
    targets = find_prompt_logprob_targets([out_of_step], [2], [0])
    assert targets is not None
    with pytest.raises(RuntimeError, match="collected for 0 positions, but this chunk starts at position 2"):
        collect_prompt_logprobs({"q": out_of_step}, targets, position_logits[:2])


@torch.inference_mode()
def _hf_penalized_greedy(
    hf_model: Any, prompt: list[int], params: SamplingParams, num_tokens: int
) -> list[int]:
    """Greedy decoding over HF's logits with the reference penalties and bias, one token at a time."""
    vocab_size = hf_model.config.vocab_size
    output: list[int] = []
    for _ in range(num_tokens):
        logits = hf_model(input_ids=torch.tensor([prompt + output])).logits[0, -1:].float()  # [1, V]
        for token_id, bias in (params.logit_bias or {}).items():
            logits[0, token_id] += bias
        inputs = PenaltyInputs(
            prompt_token_ids=torch.tensor([prompt]),
            output_token_ids=torch.tensor([output or [vocab_size]]),
            presence_penalties=torch.tensor([params.presence_penalty]),
            frequency_penalties=torch.tensor([params.frequency_penalty]),
            repetition_penalties=torch.tensor([params.repetition_penalty]),
        )
        output.append(int(apply_penalties_reference(logits, inputs).argmax()))
    return output


@pytest.mark.parametrize(
    "penalties",
    [
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0, logit_bias={49: -5.0, 120: 4.0}),
        dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.5),
    ],
)
def test_penalties_and_bias_pick_what_the_reference_picks(
    llm: LLM, hf_model: Any, penalties: dict[str, Any]
) -> None:
    # 24 tokens: long enough for the tiny model to repeat itself, so the penalties bite.
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalties)
    outputs = _generate(llm, PROMPTS[:3], params)
    plain = _generate(llm, PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        assert output.outputs[0].token_ids == _hf_penalized_greedy(hf_model, prompt, params, 24)
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


def test_seeded_sampling_with_new_params_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0.9,
        top_p=0.95,
        min_p=0.05,
        seed=1234,
        max_tokens=16,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={7: 2.0},
        logprobs=2,
        ignore_eos=True,
    )
    neutral = SamplingParams(
        temperature=0.9,
        seed=99,
        max_tokens=16,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        min_p=0.0,
        logit_bias={},
        ignore_eos=True,
    )
    alone = _generate(llm, PROMPTS[:1], params)[0].outputs[0]
    again = _generate(llm, PROMPTS[:1], params)[0].outputs[0]
    # With neighbours (one of them at neutral values, in a batch that runs the penalties).
    crowded = _generate(llm, PROMPTS[1:3] + PROMPTS[:1], [neutral, neutral, params])
    assert alone.token_ids == again.token_ids == crowded[2].outputs[0].token_ids
    assert alone.logprobs == again.logprobs
    neutral_alone = _generate(
        llm, PROMPTS[1:2], SamplingParams(temperature=0.9, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert crowded[0].outputs[0].token_ids == neutral_alone[0].outputs[0].token_ids


def _run(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def _with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    copy = params.clone()
    copy.output_kind = kind
    return copy


def _stop_string(llm: LLM, prompt: list[int]) -> str:
    """A short piece from the middle of the greedy text: a stop string that will match."""
    text = (
        _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    middle = len(text) // 2
    return text[middle : middle + 3]


@pytest.mark.parametrize("case", ["greedy_stop_string", "seeded_n2"])
def test_delta_outputs_add_up_to_the_cumulative_result(llm: LLM, case: str) -> None:
    prompt = PROMPTS[1]
    if case == "greedy_stop_string":
        params = SamplingParams(
            temperature=0.0,
            max_tokens=12,
            logprobs=2,
            prompt_logprobs=1,
            stop=[_stop_string(llm, prompt)],
            ignore_eos=True,
        )
    else:
        params = SamplingParams(
            n=2, temperature=1.0, seed=5, max_tokens=12, logprobs=1, prompt_logprobs=1, ignore_eos=True
        )
    engine = llm.llm_engine
    cumulative = _run(engine, "cumulative", prompt, _with_kind(params, RequestOutputKind.CUMULATIVE))
    delta = _run(engine, "delta", prompt, _with_kind(params, RequestOutputKind.DELTA))
    final_only = _run(engine, "final", prompt, _with_kind(params, RequestOutputKind.FINAL_ONLY))

    final = cumulative[-1]
    assert final.finished and not any(o.finished for o in cumulative[:-1])
    assert len(final_only) == 1 and final_only[0].finished
    assert final_only[0].outputs == final.outputs and final_only[0].prompt_logprobs == final.prompt_logprobs
    # Every cumulative output's text is a prefix of the final text: nothing shown is taken back.
    for output in cumulative:
        for completion in output.outputs:
            assert final.outputs[completion.index].text.startswith(completion.text)
    for completion in final.outputs:
        pieces = [c for o in delta for c in o.outputs if c.index == completion.index]
        assert "".join(c.text for c in pieces) == completion.text
        assert [t for c in pieces for t in c.token_ids] == completion.token_ids
        assert [p for c in pieces for p in c.logprobs or []] == completion.logprobs
        assert pieces[-1].finish_reason == completion.finish_reason
        assert pieces[-1].cumulative_logprob == completion.cumulative_logprob
    if case == "greedy_stop_string":
        assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == params.stop[0]  # type: ignore[index]
    # The prompt's logprobs come once in a DELTA stream.
    assert [o.prompt_logprobs for o in delta if o.prompt_logprobs is not None] == [final.prompt_logprobs]


def test_generate_returns_what_cumulative_would(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    via_llm = _generate(llm, PROMPTS[:1], params)[0]
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the user's object is left as given
    via_engine = _run(llm.llm_engine, "step-by-step", PROMPTS[0], params)[-1]
    assert via_llm.outputs == via_engine.outputs


@pytest.mark.parametrize(
    "params,pattern",
    [
        (
            SamplingParams(logit_bias={320: 1.0}),
            r"logit_bias token id 320 is out of vocabulary \(vocab size 320",
        ),
        (
            SamplingParams(logit_bias={-1: 1.0}),
            r"logit_bias token id -1 is out of vocabulary \(vocab size 320",
        ),
    ],
)
def test_bad_logit_bias_leaves_the_engine_serving(llm: LLM, params: SamplingParams, pattern: str) -> None:
    good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = _generate(llm, PROMPTS[:1], good)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=pattern):
        _generate(llm, PROMPTS[:2], [good, params])
    assert not llm.llm_engine.has_unfinished_requests()
    assert _generate(llm, PROMPTS[:1], good)[0].outputs[0].token_ids == before


def test_bad_chat_leaves_the_engine_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="has no 'role'"):
        llm.chat([{"content": "hi"}], use_tqdm=False)
    out = llm.chat(
        [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_prompt_logprobs_refuse_streaming_input(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs cannot be combined with streaming input"):
        llm.llm_engine.add_request(
            "s", {"prompt_token_ids": [5, 6]}, SamplingParams(prompt_logprobs=1), streaming=True
        )
    assert not llm.llm_engine.has_unfinished_requests()
