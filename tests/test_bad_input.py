"""Bad input gets a clear error naming the value and the limit, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from nanoengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=1 << 22)


def _tokens(llm: LLM, prompt: Any = "Hello world") -> list[int]:
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(max_tokens=0), r"max_tokens must be at least 1, got 0"),
        (dict(max_tokens=-3), r"max_tokens must be at least 1, got -3"),
        (dict(temperature=-0.5), r"temperature must be non-negative, got -0.5"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), r"top_k must be -1 \(disable\) or at least 1, got -2"),
        (dict(top_k=0), r"top_k must be -1 \(disable\) or at least 1, got 0"),
        (dict(n=0), r"n must be in \[1, 16384\], got 0"),
        (dict(min_tokens=5, max_tokens=2), r"min_tokens must be at most max_tokens=2, got 5"),
    ],
)
def test_sampling_params_errors(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_wrong_types_are_type_errors() -> None:
    with pytest.raises(TypeError, match="max_tokens must be an int, got float 2.5"):
        SamplingParams(max_tokens=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n="2")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "prompt,pattern",
    [
        ("", r"prompt is empty \(0 tokens\)"),
        ({"prompt_token_ids": []}, r"prompt is empty \(0 tokens\)"),
        ({"prompt_token_ids": [5] * 65}, r"65 tokens long, longer than max_model_len=64"),
        ({"prompt_token_ids": [1, 99999]}, r"Token id 99999 is out of vocabulary \(valid ids are 0\.\.319\)"),
        ({"prompt_token_ids": [1, -1]}, r"Token id -1 is out of vocabulary"),
    ],
)
def test_bad_prompts_leave_the_engine_serving(llm: LLM, prompt: Any, pattern: str) -> None:
    before = _tokens(llm)
    with pytest.raises(ValueError, match=pattern):
        # A good prompt first: it must be withdrawn when the bad one fails.
        llm.generate(["Hello world", prompt], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _tokens(llm) == before


def test_bad_request_while_others_run(llm: LLM) -> None:
    """Requests already in flight finish with the tokens they would have had."""
    expected = _tokens(llm, "The quick brown fox")
    engine = llm.llm_engine
    engine.add_request("good", "The quick brown fox", GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request("bad", {"prompt_token_ids": [10**6]}, GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert finished[0].outputs[0].token_ids == expected


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="Unknown model 'no/such-model-anywhere'"):
        LLM("no/such-model-anywhere")


def test_unsupported_architecture(tiny_llama: str, tmp_path: Path) -> None:
    model_dir = tmp_path / "gpt2-like"
    shutil.copytree(tiny_llama, model_dir)
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        LLM(str(model_dir))


def test_kv_budget_too_small_says_what_is_needed(tiny_llama: str) -> None:
    # tiny llama: 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes (fp32, named: "auto"
    # may be bf16) = 512 bytes per token; 64 tokens are 4 blocks of 16, plus the null
    # block: 5 x 16 x 512 = 40960 bytes.
    with pytest.raises(ValueError, match=r"too small for one request of max_model_len=64 tokens, which needs") as err:
        LLM(tiny_llama, dtype="float32", max_model_len=64, block_size=16, kv_cache_memory_bytes=4096)
    assert "40960 bytes" in str(err.value) and "kv_cache_memory_bytes" in str(err.value)


def test_unknown_keyword_is_a_type_error(tiny_llama: str) -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        LLM(tiny_llama, max_num_sequences=4)
