"""scripts/diff_vs_vllm.py's comparison, on hand-made replies: no server, no vLLM."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "diff_vs_vllm.py"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("diff_vs_vllm", SCRIPT)
    assert spec is not None and spec.loader is not None, f"cannot load {SCRIPT}"
    module = importlib.util.module_from_spec(spec)
    sys.modules["diff_vs_vllm"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


dv = _load_script()
COMPLETION = dv.Case("completion", "POST", "/v1/completions", {"prompt": "x"})
CHAT_STREAM = dv.Case("chat stream", "POST", "/v1/chat/completions", {"messages": [], "stream": True})


def found(case: Any, ours: Any, theirs: Any, deliberate: tuple[Any, ...] = ()) -> dict[str, tuple[Any, Any]]:
    return {d.path: (d.nanoengine, d.vllm) for d in dv.compare_replies(case, ours, theirs, deliberate)}


def completion_body(completion_id: str, text: str, logprob: float, **choice: Any) -> dict[str, Any]:
    return {"id": completion_id, "created": 1, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": {"token_logprobs": [logprob]}, **choice}]}


def test_bodies_differ_in_shape_values_and_floats_but_not_in_ids() -> None:
    ours = dv.Reply(200, body=completion_body("cmpl-a", " Paris", -0.2500, finish_reason="stop"))
    theirs = dv.Reply(200, body=completion_body("cmpl-b", " Paris.", -0.2505, finish_reason="stop",
                                                stop_reason=None))
    assert found(COMPLETION, ours, theirs) == {
        "choices[0].text": (" Paris", " Paris."),
        "choices[0].stop_reason": (dv.MISSING, None),  # null is not the same as missing
    }
    theirs.body["choices"][0]["logprobs"]["token_logprobs"] = [-0.26]  # beyond 1e-3
    assert found(COMPLETION, ours, theirs)["choices[0].logprobs.token_logprobs[0]"] == (-0.25, -0.26)


def test_a_status_difference_reports_both_whole_bodies() -> None:
    error = {"error": {"message": "n must be 1", "type": "BadRequestError", "param": None, "code": 400}}
    differences = found(COMPLETION, dv.Reply(200, body={"choices": []}), dv.Reply(400, body=error))
    assert differences == {"status": (200, 400), "body": ({"choices": []}, error)}


def test_errors_compare_type_code_and_param_but_not_the_wording() -> None:
    def error(message: str, param: str | None) -> Any:
        return dv.Reply(400, body={"error": {"message": message, "type": "BadRequestError", "param": param,
                                             "code": 400}})

    assert found(COMPLETION, error("bad", "temperature"), error("wrong", "temperature")) == {}
    assert found(COMPLETION, error("bad", None), error("bad", "temperature")) == {"error.param": (None, "temperature")}


def chunk(content: str | None, role: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta = {"role": role} if role else {}
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, **({"finish_reason": finish} if finish else {})}
    return {"id": "x", "created": 1, "choices": [choice], **extra}


def test_streams_compare_chunking_role_finish_usage_and_fields() -> None:
    usage = {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    ours = dv.Reply(200, events=[chunk("Par", role="assistant"), chunk("is", finish="stop"), usage, "[DONE]"])
    vllm_role = chunk("", role="assistant")
    vllm_role["choices"][0]["finish_reason"] = None  # vLLM writes the null out
    theirs = dv.Reply(200, events=[vllm_role, chunk("Par"), chunk("is", finish="stop"), usage, "[DONE]"])
    differences = found(CHAT_STREAM, ours, theirs)
    assert differences == {
        "choices[0].chunks": (2, 3),
        "choices[0].first_chunk.choices[0].delta.content": ("Par", ""),
        "len(choices[0].logprobs_per_chunk)": (2, 3),
        'fields["choices[].finish_reason"]': ("string", "null|string"),
    }
    # The same text in other chunks, and a stream that never says [DONE]:
    theirs = dv.Reply(200, events=[chunk("Pa", role="assistant"), chunk("ris", finish="stop"), usage])
    differences = found(CHAT_STREAM, ours, theirs)
    assert differences["ends_with_done"] == (True, False)
    assert differences["choices[0].first_chunk.choices[0].delta.content"] == ("Par", "Pa")
    assert "choices[0].text" not in differences


def test_sse_lines_are_read_raw() -> None:
    reply = dv.read_events(200, ['data: {"choices": []}', "", ": keep-alive", "data: [DONE]"])
    assert reply.events == [{"choices": []}, "[DONE]"] and reply.other_lines == [": keep-alive"]


def test_deliberate_differences_are_reported_apart() -> None:
    ours = dv.Reply(200, body=completion_body("a", "x", 0.0))
    theirs = dv.Reply(200, body=completion_body("b", "x", 0.0, stop_reason=None))
    why = dv.Deliberate("compl*", "choices[].stop_reason", "left out when null")
    (difference,) = dv.compare_replies(COMPLETION, ours, theirs, (why,))
    assert difference.deliberate == "left out when null"
    assert dv.summary([COMPLETION], [difference]) == {
        "requests": 1, "requests_with_differences": 0, "differences": 0, "deliberate": 1}


def test_every_request_has_a_unique_name() -> None:
    names = [case.name for case in dv.CASES]
    assert len(names) == len(set(names))


def test_ignored_values_keep_their_presence_and_their_nulls() -> None:
    ours = dv.Reply(200, body={"id": "a", "system_fingerprint": None})
    theirs = dv.Reply(200, body={"id": "b", "system_fingerprint": "fp"})
    assert found(COMPLETION, ours, theirs) == {"system_fingerprint": (None, dv.IGNORED)}
    assert found(COMPLETION, dv.Reply(200, body={}), ours) == {"id": (dv.MISSING, dv.IGNORED),
                                                               "system_fingerprint": (dv.MISSING, None)}


def test_a_field_only_the_usage_chunk_has_is_still_missed_in_the_others() -> None:
    usage = {"object": "chat.completion.chunk", "choices": [], "usage": {"total_tokens": 1}}
    ours = dv.Reply(200, events=[chunk("x", role="assistant", finish="stop"), usage, "[DONE]"])
    theirs_chunk = {**chunk("x", role="assistant", finish="stop"), "object": "chat.completion.chunk"}
    theirs = dv.Reply(200, events=[theirs_chunk, usage, "[DONE]"])
    differences = found(CHAT_STREAM, ours, theirs)
    assert differences["fields.object"] == (dv.MISSING, "string")
    assert "choiceless_fields.object" not in differences
