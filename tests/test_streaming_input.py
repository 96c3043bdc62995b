"""Streaming input (chapter 5): the prompt arrives in pieces.

The engine prefills what has arrived (all but the last token, whose logits
would sample too early), waits in WAITING_FOR_STREAMING_REQ for more, and
decodes only once the input is closed -- with the same greedy tokens as if the
whole prompt had come at once.
"""

from __future__ import annotations

import pytest
from engine_helpers import add, make_engine, path, prompt_ids, run

from nanoengine.outputs import RequestOutput
from nanoengine.request import RequestStatus
from nanoengine.sampling_params import SamplingParams

S = RequestStatus
PROMPT = prompt_ids(70)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10)


def test_streamed_prompt_gives_the_same_tokens(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    add(engine, "whole", PROMPT, PARAMS)
    expected = run(engine)["whole"].outputs[0].token_ids

    request = add(engine, "s", PROMPT[:20], PARAMS, streaming=True)
    pieces = [PROMPT[20:45], PROMPT[45:]]
    tokens_before_close: list[int] = []

    def feed(step: int, outputs: list[RequestOutput]) -> None:
        if pieces:
            tokens_before_close.extend(t for o in outputs for t in o.outputs[0].token_ids)
        if request.status == S.WAITING_FOR_STREAMING_REQ and pieces:
            piece = pieces.pop(0)
            engine.append_prompt("s", piece, final=not pieces)

    output = run(engine, feed)["s"]
    assert tokens_before_close == []  # nothing is sampled before the input is closed
    assert output.outputs[0].token_ids == expected
    assert output.prompt_token_ids == PROMPT
    history = path(request)
    assert history.count(S.WAITING_FOR_STREAMING_REQ) == 2
    assert history[:3] == [S.WAITING, S.RUNNING, S.WAITING_FOR_STREAMING_REQ]
    assert history[-2:] == [S.RUNNING, S.FINISHED_LENGTH_CAPPED]


def test_an_empty_final_piece_closes_the_input(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    add(engine, "whole", PROMPT, PARAMS)
    expected = run(engine)["whole"].outputs[0].token_ids
    request = add(engine, "s", PROMPT, PARAMS, streaming=True)
    for _ in range(3):
        engine.step()
    assert request.status == S.WAITING_FOR_STREAMING_REQ
    assert request.num_computed_tokens == len(PROMPT) - 1  # the last token is held back
    engine.append_prompt("s", [], final=True)
    assert run(engine)["s"].outputs[0].token_ids == expected


def test_streaming_input_errors(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="n=1"):
        engine.add_request("n2", {"prompt_token_ids": PROMPT}, SamplingParams(n=2), streaming=True)
    with pytest.raises(ValueError, match="not a live request"):
        engine.append_prompt("nobody", [5])
    add(engine, "s", PROMPT[:10], PARAMS, streaming=True)
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.append_prompt("s", prompt_ids(250))
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.append_prompt("s", [10**6])
    with pytest.raises(ValueError, match="at least 1 token"):
        engine.append_prompt("s", [])
    engine.append_prompt("s", PROMPT[10:20], final=True)
    with pytest.raises(ValueError, match="open streaming input"):
        engine.append_prompt("s", [5])
    run(engine)
    assert not engine.engine_core.get_engine_core().scheduler.requests
