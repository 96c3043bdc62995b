"""``nanoengine serve`` behaves like ``vllm serve`` where a client can tell (issue 26, chapter 8).

Each test asserts vLLM 0.32's behaviour, read from its OpenAI server: full
responses carry ``null`` fields, streams open every choice with a role chunk
and close it with one finish chunk, logprobs ride on every streamed chunk,
``echo`` brings the prompt's tokens and logprobs, the defaults and limits of
``max_tokens``, ``n`` and ``top_logprobs``, ``/tokenize``'s options,
``/version``, the model card, error ``param`` names, the access log and the
warning for ignored fields. Raw ``httpx`` where the JSON's shape is the
point, the official ``openai`` client where a client's view is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_helpers import API_KEY, running_server

MAX_MODEL_LEN = 128
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(8 << 20), "--block-size", "16")
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve") / "stderr.log"


@pytest.fixture(scope="module")
def server(tiny_llama: str, server_log: Path) -> Iterator[str]:
    with running_server(tiny_llama, *FLAGS, log=server_log) as (base_url, _):
        yield base_url


def post(server: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, headers=HEADERS, timeout=60)


def events(server: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's chunks as JSON, checked to end with ``data: [DONE]``."""
    reply = post(server, path, {**body, "stream": True})
    assert reply.status_code == 200, reply.text
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_full_responses_carry_null_fields(server: str) -> None:
    completion = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 3}).json()
    (choice,) = completion["choices"]
    assert {"logprobs", "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids"} <= set(choice)
    assert choice["logprobs"] is None and choice["stop_reason"] is None and choice["finish_reason"] == "length"
    assert completion["system_fingerprint"].startswith("nanoengine-") and "service_tier" in completion
    assert set(completion["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens",
                                        "prompt_tokens_details", "completion_tokens_details"}
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).json()
    message = chat["choices"][0]["message"]
    assert set(message) == {"role", "content", "refusal", "annotations", "audio", "function_call"}
    assert chat["choices"][0]["logprobs"] is None and chat["prompt_token_ids"] is None


def test_streamed_completion_logprobs_and_text_offsets_match_the_whole(server: str) -> None:
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0.0, "logprobs": 2, "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    stream = events(server, "/v1/completions", body)
    assert all(c["object"] == "text_completion" for c in stream)
    assert [c.get("system_fingerprint") is not None for c in stream] == [False] * (len(stream) - 1) + [True]
    chunks = [c["choices"][0] for c in stream if c["choices"]]
    assert all(c["logprobs"] is not None for c in chunks)  # vLLM sends them on every chunk
    joined: dict[str, list[Any]] = {key: [v for c in chunks for v in c["logprobs"][key]] for key in whole}
    assert joined["tokens"] == whole["tokens"] and joined["text_offset"] == whole["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(whole["token_logprobs"], abs=1e-5)
    # text_offset: each token starts where the previous one ended.
    offsets, tokens = whole["text_offset"], whole["tokens"]
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(tokens[i]) for i in range(len(tokens) - 1))
    assert all(len(top) <= 3 for top in whole["top_logprobs"])  # the chosen token and up to 2 more


def test_chat_stream_opens_and_closes_every_choice_once(server: str) -> None:
    body = {"messages": CHAT, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": True,
            "top_logprobs": 1, "stream_options": {"include_usage": True}}
    chunks = events(server, "/v1/chat/completions", body)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c.get("system_fingerprint") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    openings = chunks[:2]
    assert [c["choices"][0]["delta"] for c in openings] == [{"role": "assistant", "content": ""}] * 2
    assert sorted(c["choices"][0]["index"] for c in openings) == [0, 1]
    middle = [c["choices"][0] for c in chunks[2:-1]]
    for index in (0, 1):
        finishes = [c for c in middle if c["index"] == index and c["finish_reason"] is not None]
        assert len(finishes) == 1 and finishes[0]["finish_reason"] == "length"
    assert all(c["logprobs"] is not None and c["logprobs"]["content"] is not None for c in middle)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_echo_returns_the_prompt_with_its_logprobs_whole_and_streamed(server: str, tiny_llama: str) -> None:
    prompt_ids = post(server, "/tokenize", {"prompt": "hello world"}).json()["tokens"]
    body = {"prompt": "hello world", "max_tokens": 3, "temperature": 0.0, "logprobs": 1, "echo": True,
            "ignore_eos": True}
    (choice,) = post(server, "/v1/completions", body).json()["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith("hello world")
    assert len(logprobs["tokens"]) == len(prompt_ids) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(prompt_ids)
    first = events(server, "/v1/completions", body)[0]["choices"][0]
    assert first["text"].startswith("hello world") and first["logprobs"]["tokens"][:len(prompt_ids)] == \
        logprobs["tokens"][:len(prompt_ids)]
    assert first["prompt_token_ids"] == prompt_ids  # vLLM's echo sends the prompt's ids with its text


def test_chat_max_tokens_defaults_to_the_rest_of_the_context(server: str) -> None:
    reply = post(server, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True, "temperature": 0.0}).json()
    usage = reply["usage"]
    assert usage["total_tokens"] == MAX_MODEL_LEN and reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10_000}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2, "temperature": 0.0}, "n"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 1)}, "input_tokens"),
        ("/v1/completions", {"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
        # Found by fuzzing: each of these crashed, killed or hung something before.
        ("/v1/completions", {"prompt": "x", "top_k": 2**64 + 1}, "top_k"),
        ("/v1/completions", {"prompt": "x", "priority": 2**70}, "body.priority"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6], "min_tokens": 1}, "stop_token_ids"),
        ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 10**9}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 20_000}, "n"),
        ("/v1/completions", {"prompt": "x", "stream": True, "structured_outputs": {"regex": "[("}},
         "structured_outputs"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": True, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "structured_outputs"),
    ],
)
def test_limits_are_400s_naming_the_parameter(server: str, path: str, body: dict[str, Any], param: str) -> None:
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_tools_the_model_may_not_call_are_accepted(server: str) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "tools": tools,
                                                 "tool_choice": "none"}).status_code == 200
    refused = post(server, "/v1/chat/completions", {"messages": CHAT, "tools": tools, "tool_choice": "auto"})
    assert refused.status_code == 400 and "tools" in refused.json()["error"]["message"]


def test_stop_token_ids_end_the_text_without_the_stop_token(server: str) -> None:
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    free = post(server, "/v1/completions", body).json()["choices"][0]
    stop_at = next(i for i, token in enumerate(free["token_ids"]) if token not in free["token_ids"][:i])
    stop_id = free["token_ids"][stop_at]
    stopped = post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop_id
    assert stopped["token_ids"] == free["token_ids"][: stop_at + 1]  # the token is counted ...
    detok = post(server, "/detokenize", {"tokens": free["token_ids"][:stop_at]}).json()["prompt"]
    assert stopped["text"] == detok  # ... but its text is not shown
    kept = post(server, "/v1/completions", {**body, "stop_token_ids": [stop_id], "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"].startswith(stopped["text"])


def test_tokenize_options_version_and_model_card(server: str, tiny_llama: str) -> None:
    with_prompt = post(server, "/tokenize", {"messages": CHAT}).json()
    without = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False,
                                         "return_token_strs": True}).json()
    assert with_prompt["count"] > without["count"] and with_prompt["token_strs"] is None
    assert len(without["token_strs"]) == without["count"] and all(isinstance(s, str) for s in without["token_strs"])
    assert post(server, "/tokenize", {"prompt": "x", "model": "gpt-4"}).status_code == 404
    assert isinstance(httpx.get(f"{server}/version").json()["version"], str)
    card = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY).models.list().data[0]
    raw = card.model_dump()
    assert raw["root"] == tiny_llama and raw["max_model_len"] == MAX_MODEL_LEN and isinstance(card.created, int)
    assert raw["permission"][0]["object"] == "model_permission"


def test_access_log_and_a_warning_for_ignored_fields(server: str, server_log: Path) -> None:
    reply = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "frobnicate": 1, "user": "me"})
    assert reply.status_code == 200
    log = server_log.read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert "ignores: frobnicate, user" in log


@pytest.mark.parametrize(
    ("path", "raw", "status"),
    [
        ("/v1/completions", b"\x9b\xf6", 400),  # not UTF-8 (found by fuzzing: FastAPI's own {"detail": ...})
        ("/v1/completions", b'{"a":' * 2000 + b"1" + b"}" * 2000, 400),  # nested deeper than the parser goes
        ("/v1/nothing-here", b"{}", 404),
    ],
)
def test_what_the_framework_refuses_gets_openai_error_bodies(server: str, path: str, raw: bytes,
                                                             status: int) -> None:
    reply = httpx.post(f"{server}{path}", content=raw, headers={**HEADERS, "Content-Type": "application/json"})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
