"""SamplingParams' OpenAI-style fields (chapter 8): ranges, types, the wire, the renderer's checks.

Every bad value is refused where it is written, with a message naming the value
and the limit; a SamplingParams with every new field crosses the engine core's
socket (msgpack) unchanged; chat messages are checked before the template runs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from transformers import AutoTokenizer

from nanoengine import SamplingParams
from nanoengine.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from nanoengine.logprobs import LogprobsLists
from nanoengine.renderers.hf import HfRenderer
from nanoengine.sampling_params import MAX_LOGPROBS, RequestOutputKind
from nanoengine.serial_utils import MsgpackDecoder, MsgpackEncoder

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(temperature=NAN), r"temperature must be a finite number, got nan"),
        (dict(temperature=INF), r"temperature must be a finite number, got inf"),
        (dict(top_p=NAN), r"top_p must be a finite number, got nan"),
        (dict(min_p=NAN), r"min_p must be a finite number, got nan"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
        (dict(presence_penalty=-INF), r"presence_penalty must be a finite number, got -inf"),
        (dict(frequency_penalty=-2.01), r"frequency_penalty must be in \[-2, 2\], got -2.01"),
        (dict(frequency_penalty=NAN), r"frequency_penalty must be a finite number, got nan"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be greater than 0, got 0.0"),
        (dict(repetition_penalty=-1.0), r"repetition_penalty must be greater than 0, got -1.0"),
        (dict(repetition_penalty=INF), r"repetition_penalty must be a finite number, got inf"),
        (dict(logprobs=-1), rf"logprobs must be in \[0, {MAX_LOGPROBS}\], got -1"),
        (
            dict(logprobs=MAX_LOGPROBS + 1),
            rf"logprobs must be in \[0, {MAX_LOGPROBS}\], got {MAX_LOGPROBS + 1}",
        ),
        (dict(prompt_logprobs=-2), rf"prompt_logprobs must be in \[0, {MAX_LOGPROBS}\], got -2"),
        (dict(prompt_logprobs=100), rf"prompt_logprobs must be in \[0, {MAX_LOGPROBS}\], got 100"),
        (dict(logit_bias={7: 100.5}), r"logit_bias\[7\] must be in \[-100, 100\], got 100.5"),
        (dict(logit_bias={7: NAN}), r"logit_bias\[7\] must be a finite number, got nan"),
    ],
)
def test_out_of_range_values_name_value_and_limit(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(temperature="hot"), r"temperature must be a number, got str 'hot'"),
        (dict(presence_penalty=None), r"presence_penalty must be a number, got NoneType"),
        (dict(min_p=True), r"min_p must be a number, got bool"),
        (dict(logprobs=2.0), r"logprobs must be an int, got float 2.0"),
        (dict(prompt_logprobs=True), r"prompt_logprobs must be an int, got bool"),
        (dict(logit_bias=[(1, 2.0)]), r"logit_bias must be a dict of token id to bias, got list"),
        (dict(logit_bias={"12": 1.0}), r"logit_bias token id must be an int, got str '12'"),
        (dict(logit_bias={12: "up"}), r"logit_bias\[12\] must be a number, got str 'up'"),
        (dict(output_kind="delta"), r"output_kind must be a RequestOutputKind, got str"),
    ],
)
def test_wrong_types_are_type_errors(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        SamplingParams(**kwargs)


def test_defaults_are_vllms() -> None:
    params = SamplingParams()
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (params.min_p, params.logit_bias, params.logprobs, params.prompt_logprobs) == (
        0.0,
        None,
        None,
        None,
    )
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert [kind.value for kind in RequestOutputKind] == [0, 1, 2]


def test_limits_themselves_are_accepted() -> None:
    SamplingParams(
        presence_penalty=-2.0, frequency_penalty=2, min_p=1.0, logprobs=MAX_LOGPROBS, prompt_logprobs=0
    )
    assert SamplingParams(logit_bias={3: -100, 4: 100}).logit_bias == {3: -100.0, 4: 100.0}


def _every_new_field() -> SamplingParams:
    return SamplingParams(
        temperature=0.7,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias={0: -100.0, 17: 2.5, 300: 7},
        logprobs=3,
        prompt_logprobs=0,
        output_kind=RequestOutputKind.DELTA,
        seed=11,
    )


def test_every_new_field_crosses_the_engine_core_socket() -> None:
    params = _every_new_field()
    params.all_stop_token_ids.update({2, 5})
    request = EngineCoreRequest("r", [1, 2, 3], params, eos_token_id=2)
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert decoded == request
    got = decoded.sampling_params
    assert got.output_kind is RequestOutputKind.DELTA
    assert got.logit_bias == {0: -100.0, 17: 2.5, 300: 7.0}
    assert all(type(token_id) is int for token_id in got.logit_bias)  # int keys, not strings


def test_logprobs_cross_the_socket_back() -> None:
    rows = LogprobsLists([[5, 5, 9]], [[-0.5, -0.5, -1.25]], [1])
    prompt_rows = LogprobsLists([[4, 1], [7, 7]], [[-3.0, -1.0], [-float("inf"), -0.1]], [12, 1])
    outputs = EngineCoreOutputs(
        [EngineCoreOutput("r", [5], new_logprobs=rows, new_prompt_logprobs=prompt_rows)]
    )
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decoded.outputs[0].new_logprobs == rows
    assert decoded.outputs[0].new_prompt_logprobs == prompt_rows


def test_tokens_prompt_is_importable_where_vllm_has_it() -> None:
    import nanoengine
    from nanoengine.inputs import PromptType, TextPrompt, TokensPrompt
    from nanoengine.renderers import hf

    assert hf.TokensPrompt is TokensPrompt and hf.TextPrompt is TextPrompt and hf.PromptType is PromptType
    assert nanoengine.TokensPrompt is TokensPrompt and nanoengine.TextPrompt is TextPrompt


@pytest.fixture(scope="module")
def renderer(tiny_llama: str) -> HfRenderer:
    return HfRenderer(AutoTokenizer.from_pretrained(tiny_llama))


@pytest.mark.parametrize(
    "messages,pattern",
    [
        ([], r"needs at least one message, got \[\]"),
        ([{"content": "hi"}], r"Chat message 0 has no 'role'"),
        (
            [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}],
            r"message 1 has an unknown role 'robot'",
        ),
        ([{"role": "user"}], r"Chat message 0 content must be a str, got NoneType"),
        ([{"role": "user", "content": ["hi"]}], r"Chat message 0 content must be a str, got list"),
        (["hello"], r"Chat message 0 must be a dict"),
    ],
)
def test_bad_chat_messages_fail_before_the_template(
    renderer: HfRenderer, messages: list[Any], pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        renderer.render_chat(messages)


def test_good_chat_still_renders(renderer: HfRenderer) -> None:
    rendered = renderer.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert rendered["prompt"] is not None and "<|im_start|>user\nHi" in rendered["prompt"]
