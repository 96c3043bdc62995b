"""Structured output (chapter 5): grammars compiled off the engine thread, masks in the sampler.

A grammar-constrained request starts in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
is promoted when its compile finishes, and every sampled token obeys the
grammar; a grammar that does not compile ends its own request as
FINISHED_ERROR while the rest of the batch carries on.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from engine_helpers import add, make_engine, path, prompt_ids, run

from nanoengine import LLM
from nanoengine.core.sched.output import GrammarOutput
from nanoengine.request import RequestStatus
from nanoengine.sampling_params import SamplingParams, StructuredOutputsParams
from nanoengine.structured_output.utils import apply_grammar_bitmask

S = RequestStatus


def _params(max_tokens: int = 40, **kwargs: object) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kwargs)
    )  # type: ignore[arg-type]


def test_choice_regex_and_json_schema_constrain_the_output(tiny_llama: str) -> None:
    engine = make_engine(tiny_llama)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    requests = {
        "choice": add(engine, "choice", "Hello", _params(choice=["yes", "no way"])),
        "regex": add(engine, "regex", "Hello", _params(regex=r"[0-9]{3}-[a-z]{2}")),
        "json": add(engine, "json", "Hello", _params(max_tokens=64, json=schema)),
    }
    outputs = run(engine)
    for name, request in requests.items():
        assert path(request) == [
            S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
            S.WAITING,
            S.RUNNING,
            S.FINISHED_STOPPED,
        ]
        assert outputs[name].outputs[0].finish_reason == "stop", name
    assert outputs["choice"].outputs[0].text in ("yes", "no way")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outputs["regex"].outputs[0].text)
    assert isinstance(json.loads(outputs["json"].outputs[0].text)["a"], int)


def test_unconstrained_output_differs(tiny_llama: str) -> None:
    """Control: without the grammar the tiny model writes something else."""
    engine = make_engine(tiny_llama)
    add(engine, "free", "Hello", SamplingParams(temperature=0.0, max_tokens=6))
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2}", run(engine)["free"].outputs[0].text)


def test_bad_grammar_is_finished_error_and_the_batch_continues(tiny_llama: str) -> None:
    llm = LLM(model=tiny_llama, max_model_len=256, num_gpu_blocks_override=64)
    outputs = llm.generate(
        ["Hello", "Hello", "Hello"],
        [_params(regex="("), SamplingParams(temperature=0.0, max_tokens=5), _params(json="{not json")],
        use_tqdm=False,
    )
    bad_regex, plain, bad_json = outputs
    assert bad_regex.outputs[0].finish_reason == "error" and bad_regex.outputs[0].token_ids == []
    assert bad_regex.finish_message is not None and "failed to compile" in bad_regex.finish_message
    assert bad_json.outputs[0].finish_reason == "error"
    assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == 5


def test_an_ended_grammar_leaves_the_rest_unconstrained(tiny_llama: str) -> None:
    """ignore_eos keeps a request going after its grammar took the stop token (found by fuzzing
    the server: asking xgrammar for the next mask then raised and killed the engine core)."""
    llm = LLM(model=tiny_llama, max_model_len=256, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["0"]))
    (output,) = llm.generate(["Hello"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 6
    assert completion.text.startswith("0")


def test_grammar_compiles_off_the_engine_thread(tiny_llama: str) -> None:
    """The first step after add_request runs the plain request while the grammar compiles."""
    engine = make_engine(tiny_llama)
    grammar = add(engine, "g", prompt_ids(8), _params(choice=["yes", "no"]))
    plain = add(engine, "p", prompt_ids(8, start=11), SamplingParams(temperature=0.0, max_tokens=3))
    compile_threads = [t for t in threading.enumerate() if t.name.startswith("nanoengine-grammar")]
    assert compile_threads and threading.current_thread() not in compile_threads
    engine.step()
    assert plain.status == S.RUNNING and grammar.structured_output_request is not None
    run(engine)
    assert path(grammar)[-1] == S.FINISHED_STOPPED


def test_apply_grammar_bitmask_unpacks_32_tokens_per_word() -> None:
    vocab = 70
    logits = torch.zeros(2, vocab)
    allowed_tokens = [0, 31, 33, 69]  # 31: the sign bit of word 0
    packed = torch.zeros(1, 3, dtype=torch.int32)
    for token in allowed_tokens:
        word, bit = divmod(token, 32)
        packed[0, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    grammar_output = GrammarOutput(structured_output_request_ids=["b"], bitmask=packed)
    masked = apply_grammar_bitmask(logits, ["a", "b"], grammar_output)
    assert torch.all(masked[0] == 0)  # row "a" has no grammar
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == allowed_tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({}, "exactly one"), ({"choice": ["a"], "regex": "a"}, "exactly one"), ({"choice": []}, "non-empty")],
)
def test_structured_outputs_params_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_rejects_a_dict_for_structured_outputs() -> None:
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"choice": ["a"]})  # type: ignore[arg-type]
