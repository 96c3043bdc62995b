"""Fuzzing ``nanoengine serve`` with hypothesis: what to send, how to send it, what to expect back.

Chapter 8 (online serving). The server promises that no body, however wrong,
gets a 5xx: bad input is a 4xx carrying OpenAI's error JSON, and the server
goes on serving with every KV block free once its requests are gone. This
module holds the three pieces that the bounded pytest property
(``tests/test_server_fuzz.py``) and the long run (``scripts/fuzz_server.py``)
share:

* **strategies** -- ``fuzz_requests(target)`` draws one POST to
  ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` or
  ``/detokenize``. Bodies are built field by field from tables holding an
  in-range strategy for every field of the request models of
  ``protocol.py`` (``uncovered_fields()`` names a model field the tables
  lack, so a new field cannot go unfuzzed). A body is *valid* (every value in
  range: most get a 200 and run on the engine), *mutated* (one to three
  fields set to an edge value for that field -- out of range, huge, negative,
  the wrong type, a token outside the vocabulary, a prompt longer than
  ``max_model_len`` -- or to any JSON value, or removed, or an unknown field
  added) or *raw* (bytes that are no JSON object: binary, truncated JSON,
  ``NaN``, deep nesting);
* **send** -- one request through httpx under a deadline, a stream read to
  its ``data: [DONE]`` (or hung up on early, on purpose, to exercise aborts),
  and the checks: status < 500; a 4xx carries ``{"error": {"message",
  "type", "param", "code"}}``; a 200 has the route's shape, every choice
  finishing exactly once with ``stop`` or ``length`` (an error reported
  inside a 200, in a stream or not, is a bug: it should have been a 4xx
  before the stream started);
* **check_idle** -- after a run: ``/health`` is 200 and ``/metrics`` shows no
  request left and every KV block free (polled: aborts are asynchronous).

One kind of value is not sent, on purpose: ``n`` from ``MAX_FUZZ_N`` up to
the server's own limit ``MAX_N`` (16384, vLLM's): the server accepts it, and
that many samples of one fuzzed request tie the machine up for minutes -- see
``N_NOT_SENT``. Values above the limit are sent (they must be a 400).

vLLM 0.32 counterpart: ``tests/entrypoints/openai/test_openai_schema.py``
runs schemathesis over the server's ``/openapi.json`` and checks only that
no answer is a server error. Here the strategies are written from
``protocol.py`` instead: the OpenAPI schema knows the types but not the
engine's ranges (vocabulary size, ``max_model_len``), so schema-drawn bodies
are mostly refused at parsing and rarely reach the engine, where the
interesting failures are; and the answers are checked for their OpenAI
shape, streams included, not only for their status.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from hypothesis import strategies as st
from server_helpers import metric

from nanoengine.entrypoints.openai.protocol import (
    CHAT_ROLES,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanoengine.entrypoints.openai.protocol_chat import ChatCompletionRequest
from nanoengine.entrypoints.openai.protocol_completion import CompletionRequest
from nanoengine.sampling_params import MAX_N

Json = Any
Strategy = st.SearchStrategy[Any]

# Valid bodies ask for at most this many tokens: a request stays a few decode steps.
MAX_TOKENS = 8
# The largest n sent; see N_NOT_SENT.
MAX_FUZZ_N = 16
N_NOT_SENT = (
    f"n in ({MAX_FUZZ_N}, {MAX_N}] is not sent: the server accepts it (its limit is vLLM's "
    "VLLM_MAX_N_SEQUENCES), and so many samples tie the machine up for minutes"
)
DEADLINE_S = 30.0
# A 200 may end a choice only these ways; "error" or "abort" there is a failure reported as a success.
FINISH_REASONS = ("stop", "length")
COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
REQUEST_MODELS: dict[str, Any] = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest,
                                  TOKENIZE: TokenizeRequest, DETOKENIZE: DetokenizeRequest}
# The fields every valid body carries: the required ones; a small max_tokens, so that a valid
# request is a few decode steps, not a run to max_model_len (a mutation may drop it); and
# stream, true or false, so that half the generations stream.
ALWAYS = {COMPLETIONS: ("prompt", "max_tokens", "stream"), CHAT: ("messages", "max_completion_tokens", "stream"),
          TOKENIZE: (), DETOKENIZE: ("tokens",)}


# A short context, so that a prompt longer than max_model_len is cheap to send.
# (``--check-invariants`` would catch a request corrupting the KV cache at once, at
# several times the cost of a step; scripts/fuzz_server.py adds it.)
MAX_MODEL_LEN = 128
SERVER_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(32 << 20), "--block-size", "16")


@dataclass(frozen=True)
class Target:
    """What the strategies must know of the served model to aim inside and just outside its limits."""

    model: str
    vocab_size: int
    max_model_len: int


def target_of(model_dir: str, max_model_len: int = MAX_MODEL_LEN) -> Target:
    """The served model (its directory is its name on the server) and its vocabulary size."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab_size = config.get("vocab_size") or config["text_config"]["vocab_size"]
    return Target(model_dir, int(vocab_size), max_model_len)


# ---- values ------------------------------------------------------------------------------------------

# Printable text for valid bodies; ANY_TEXT adds control characters and lone
# surrogates (JSON can escape "\ud800", Python's parser accepts it, a tokenizer cannot encode it).
PLAIN_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=24)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=24)
WORD = st.text(st.characters(categories=("L", "Nd")), min_size=1, max_size=8)
HUGE_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30,
                             -(2**31), -(2**63) - 1, -(2**64), -(10**30)])
NAN_ISH = st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "inf", "1e999", "-0", "0x10", "", " ",
                           "null", "true", "1", "-1", "2.5"])
# Floats include NaN and +-inf: serialized with allow_nan they go out as the bare tokens NaN and Infinity.
WILD_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(), HUGE_INTS,
                         st.floats(), NAN_ISH, ANY_TEXT)
WILD: Strategy = st.recursive(
    WILD_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=8,
)
JSON_SCHEMAS = st.sampled_from([
    {"type": "object"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "maxLength": 4},
    {"type": "array", "items": {"type": "boolean"}},
    {"enum": ["yes", "no"]},
])
REGEXES = st.sampled_from(["[a-z]{1,5}", "(yes|no)", "\\d+", "[0-9]{2}-[0-9]{2}", "a*b?"])


def token_ids(target: Target, min_size: int = 1, max_size: int = 8) -> Strategy:
    return st.lists(st.integers(0, target.vocab_size - 1), min_size=min_size, max_size=max_size)


def prompts(target: Target) -> Strategy:
    """OpenAI's four prompt shapes: a string, token ids, a list of strings, a list of token-id lists."""
    ids = token_ids(target)
    return st.one_of(PLAIN_TEXT, ids, st.lists(PLAIN_TEXT, min_size=1, max_size=3),
                     st.lists(ids, min_size=1, max_size=3))


def messages() -> Strategy:
    """A conversation; content is a string, text parts, or (for an assistant turn, say) null."""
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": PLAIN_TEXT}), min_size=1, max_size=2)
    content = st.one_of(PLAIN_TEXT, parts, st.none())
    message = st.fixed_dictionaries({"role": st.sampled_from(CHAT_ROLES), "content": content})
    return st.lists(message, min_size=1, max_size=3)


def response_formats() -> Strategy:
    schema_format = JSON_SCHEMAS.map(lambda s: {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}})
    return st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), schema_format)


def structured_outputs() -> Strategy:
    return st.one_of(st.lists(WORD, min_size=1, max_size=3, unique=True).map(lambda c: {"choice": c}),
                     REGEXES.map(lambda r: {"regex": r}),
                     JSON_SCHEMAS.map(lambda s: {"json": s}),
                     JSON_SCHEMAS.map(lambda s: {"json": json.dumps(s)}))


def unit_floats(low: float, high: float) -> Strategy:
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


# ---- in-range fields, one table per route --------------------------------------------------------------


def sampling_fields(target: Target) -> dict[str, Strategy]:
    """Both generation routes' fields (``SamplingFields``), each within its range."""
    no = st.none()
    return {
        "model": st.just(target.model),
        "n": st.integers(1, 3),
        "temperature": no | st.just(0.0) | unit_floats(0.0, 2.0),
        "top_p": unit_floats(0.05, 1.0),
        "top_k": st.just(-1) | st.integers(1, 50),
        "min_p": unit_floats(0.0, 1.0),
        "max_tokens": st.integers(1, MAX_TOKENS),
        "min_tokens": st.integers(0, MAX_TOKENS),
        "stop": st.one_of(no, PLAIN_TEXT, st.lists(PLAIN_TEXT, max_size=3)),
        "stop_token_ids": no | token_ids(target, min_size=0, max_size=3),
        "seed": no | st.integers(0, 2**32),
        "presence_penalty": unit_floats(-2.0, 2.0),
        "frequency_penalty": unit_floats(-2.0, 2.0),
        "repetition_penalty": unit_floats(0.5, 2.0),
        "logit_bias": st.dictionaries(st.integers(0, target.vocab_size - 1).map(str), unit_floats(-100, 100),
                                      max_size=3),
        "stream": st.booleans(),
        "stream_options": no | st.fixed_dictionaries({"include_usage": st.booleans()}),
        "echo": st.booleans(),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "priority": st.integers(-10, 10),
        "prompt_logprobs": no | st.integers(0, 3),
        "return_token_ids": st.booleans(),
        "response_format": response_formats(),
        "structured_outputs": structured_outputs(),
        "user": PLAIN_TEXT,
        # On a server with no KV connector vLLM's disaggregation fields are carried and ignored.
        "kv_transfer_params": no | st.fixed_dictionaries({"do_remote_decode": st.booleans()}),
        # Fields the server refuses when used; their in-range value asks for nothing.
        "tools": no | st.just([]),
        "tool_choice": no | st.just("none"),
        "functions": no,
        "function_call": no,
        "continue_final_message": no | st.just(False),
        "guided_choice": no,
        "guided_regex": no,
        "guided_json": no,
        "guided_grammar": no,
        "use_beam_search": no | st.just(False),
        "suffix": no,
    }


def completion_fields(target: Target) -> dict[str, Strategy]:
    return {**sampling_fields(target), "prompt": prompts(target), "logprobs": st.none() | st.integers(0, 5)}


def chat_fields(target: Target) -> dict[str, Strategy]:
    return {**sampling_fields(target), "messages": messages(), "max_completion_tokens": st.integers(1, MAX_TOKENS),
            "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "add_generation_prompt": st.booleans()}


def tokenize_fields(target: Target) -> dict[str, Strategy]:
    return {"model": st.just(target.model), "prompt": PLAIN_TEXT, "messages": messages(),
            "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
            "return_token_strs": st.booleans()}


def detokenize_fields(target: Target) -> dict[str, Strategy]:
    return {"model": st.just(target.model), "tokens": token_ids(target, min_size=0, max_size=16)}


FIELD_TABLES: dict[str, Callable[[Target], dict[str, Strategy]]] = {
    COMPLETIONS: completion_fields, CHAT: chat_fields, TOKENIZE: tokenize_fields, DETOKENIZE: detokenize_fields,
}


def uncovered_fields(target: Target) -> dict[str, list[str]]:
    """Per route, the request model's fields (by their JSON name) that no strategy draws."""
    missing = {}
    for route, model in REQUEST_MODELS.items():
        names = {info.alias or name for name, info in model.model_fields.items()}
        if lacking := sorted(names - set(FIELD_TABLES[route](target))):
            missing[route] = lacking
    return missing


# ---- edge values: just outside each field's range ----------------------------------------------------


def edge_values(target: Target) -> dict[str, Strategy]:
    """Per field, values a careless or hostile client sends; a field without an entry gets ``WILD``."""
    vocab, long_len = target.vocab_size, target.max_model_len + 1
    bad_ids = st.sampled_from([-1, vocab, vocab + 1000, 2**63, 2**64 + 1, -(2**63) - 1])
    ids_with_a_bad_one = st.tuples(token_ids(target, 0, 3), bad_ids).map(lambda t: [*t[0], t[1]])
    too_long_ids = st.just([1] * long_len)
    long_text = st.integers(long_len, 8 * long_len).map(lambda k: "hello " * k)
    counts = st.sampled_from([-1, 0, 21, 1000, 2**63, 2**64 + 1, 1.5, "3", True])
    not_a_schema: list[Json] = [{"type": "bogus"}, {"properties": 5}, "{not json", "", 5, [], {"$ref": "#/nope"}]
    refused = st.sampled_from([
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "auto"),
        ("guided_json", {"type": "object"}), ("guided_choice", ["a"]), ("use_beam_search", True), ("suffix", "x"),
        ("continue_final_message", True), ("functions", [{"name": "f"}])])
    return {
        "model": st.sampled_from(["", "gpt-4", target.model + "x", 5, None]),
        "n": st.sampled_from([0, -1, -(2**63), -(2**64), 1.5, "2", True, MAX_FUZZ_N, MAX_N + 1, 2**63]),
        "temperature": st.sampled_from([-0.1, -1e308, 1e308, 2**64, 0, 1e-320]),
        "top_p": st.sampled_from([0, -0.5, 1.0000001, 2, 1e-320, 2**64]),
        "top_k": st.sampled_from([0, -2, vocab + 1, 2**63, 2**64 + 1, -(2**64)]),
        "min_p": st.sampled_from([-0.1, 1.1, 1e308]),
        "max_tokens": st.sampled_from([0, -1, 10**9, 2**63, 2**64 + 1, long_len]),
        "max_completion_tokens": st.sampled_from([0, -1, 10**9, 2**63, 2**64 + 1, long_len]),
        "min_tokens": st.sampled_from([-1, MAX_TOKENS + 1, long_len, 10**9, 2**63, 2**64 + 1]),
        "seed": st.sampled_from([-1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 1, -(2**63) - 1, 10**30]),
        "priority": st.sampled_from([2**63 - 1, 2**63, 2**64 + 1, -(2**63) - 1, 10**30]),
        "presence_penalty": st.sampled_from([2.0000001, -3, 1e308, -1e308]),
        "frequency_penalty": st.sampled_from([2.0000001, -3, 1e308, -1e308]),
        "repetition_penalty": st.sampled_from([0, -1, 1e-300, 1e308]),
        "logit_bias": st.sampled_from([{"-1": 1}, {"abc": 1}, {str(vocab): 1}, {str(2**64): 1}, {"1": 1e308},
                                       {"1.5": 1}, {"": 0}, {"1": 101}]),
        "kv_transfer_params": st.sampled_from(["x", 5, [], {"do_remote_prefill": True, "remote_block_ids": "x"},
                                               {"do_remote_prefill": True, "remote_port": -1}]),
        "stop": st.sampled_from(["", [""], ["a", ""], ["\ud800"], "x" * 5000, ["a"] * 500]),
        "stop_token_ids": ids_with_a_bad_one,
        "logprobs": counts,
        "top_logprobs": counts,
        "prompt_logprobs": counts,
        "prompt": st.one_of(long_text, too_long_ids, ids_with_a_bad_one, ids_with_a_bad_one.map(lambda i: [i]),
                            st.sampled_from(["", [], [[]], [""], ["a", 1], [[1], "a"], [1.5], [True]]),
                            st.lists(too_long_ids, min_size=1, max_size=2)),
        "messages": st.one_of(long_text.map(lambda t: [{"role": "user", "content": t}]), st.sampled_from([
            [], [{"role": "user"}], [{"role": "bogus", "content": "x"}], [{"content": "x"}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
            [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            [{"role": "user", "content": [{}]}], [{"role": "user", "content": [5]}], [{"role": "user", "content": ""}],
            [{"role": "assistant", "content": None}], [{"role": "user", "content": "{{ raise_exception('x') }}"}]])),
        "tokens": st.one_of(ids_with_a_bad_one, st.just([]), st.integers(0, vocab - 1).map(lambda t: [t] * 5000)),
        "response_format": st.sampled_from([*({"type": "json_schema", "json_schema": {"schema": s}} for s in not_a_schema),
                                            {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}},
                                            {"type": "xml"}, {}, "json_object"]),
        "structured_outputs": st.sampled_from([
            *({"json": s} for s in not_a_schema), {}, {"regex": "[("}, {"regex": ""}, {"regex": "a{99999999}"},
            {"choice": []}, {"choice": [""]}, {"regex": "a", "choice": ["b"]}, {"choice": ["\ud800"]}]),
        "stream_options": st.sampled_from([{"include_usage": "yes"}, [], {"include_usage": None}]),
        "refused": refused,
    }


# Some edges bite only together with another field, which a random mutation would
# rarely set too: out-of-vocabulary stop ids are indexed only while min_tokens holds
# them back; a min_tokens beyond the context matters only when max_tokens is left to
# the engine ("until the context is full"); a seed near the top of int64 is exceeded
# only by the seeds of n > 1 samples (seed + index); a grammar that fails to compile
# must be refused before a stream's 200 goes out. Half the time an edge brings these along.
ABSENT = object()
COMPANIONS: dict[str, dict[str, Json]] = {
    "stop_token_ids": {"min_tokens": 1},
    "structured_outputs": {"stream": True},
    "response_format": {"stream": True},
    "min_tokens": {"max_tokens": ABSENT, "max_completion_tokens": ABSENT},
    "seed": {"n": 2, "temperature": 1.0},
    "max_tokens": {"ignore_eos": True},
    "max_completion_tokens": {"ignore_eos": True},
}


def _bounded_effort(name: str, value: Json) -> bool:
    """False for the values ``N_NOT_SENT`` explains."""
    return not (name == "n" and isinstance(value, int) and MAX_FUZZ_N < value <= MAX_N)


# ---- bodies ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzRequest:
    """One drawn request. ``hang_up_after``: SSE events read before the client disconnects on purpose."""

    route: str
    body: bytes
    kind: str  # "valid", "mutated" or "raw"
    hang_up_after: int | None = None

    def json(self) -> Json:
        """The body as the server parses it, or None if it is no JSON."""
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):
            return None

    def __str__(self) -> str:
        text = self.body.decode("utf-8", "backslashreplace")
        shown = text if len(text) <= 600 else f"{text[:400]} ...[{len(text)} chars]... {text[-150:]}"
        hang_up = "" if self.hang_up_after is None else f", hanging up after {self.hang_up_after} events"
        return f"POST {self.route} ({self.kind}{hang_up}) {shown}"


@st.composite
def valid_body(draw: st.DrawFn, table: dict[str, Strategy], always: tuple[str, ...]) -> dict[str, Json]:
    """The ``ALWAYS`` fields and a handful of others (a client rarely sends them all)."""
    optional = sorted(set(table) - set(always))
    names = [*always, *draw(st.lists(st.sampled_from(optional), max_size=8, unique=True))]
    return {name: draw(table[name]) for name in names}


@st.composite
def mutated_body(draw: st.DrawFn, table: dict[str, Strategy], always: tuple[str, ...],
                 edges: dict[str, Strategy]) -> Json:
    """A valid body with one to three things wrong with it (sometimes no object at all).

    Most mutations are edge values of the route's own fields, so each field's
    edges come up some dozens of times in a run of a few thousand requests.
    """
    body: Json = draw(valid_body(table, always))
    edged = sorted(set(edges) & set(table))
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(("edge",) * 4 + ("wild", "drop", "unknown", "refused", "not an object")))
        if how == "not an object":
            return draw(WILD)
        if how == "edge":
            name = draw(st.sampled_from(edged))
            body[name] = draw(edges[name])
            if name in COMPANIONS and draw(st.booleans()):
                _apply(body, COMPANIONS[name])
        elif how == "wild":
            name = draw(st.sampled_from(sorted(table)))
            body[name] = draw(WILD.filter(partial(_bounded_effort, name)))
        elif how == "drop":
            body.pop(draw(st.sampled_from(sorted(table))), None)
        elif how == "unknown":
            body[draw(ANY_TEXT)] = draw(WILD)
        else:
            refused_name, value = draw(edges["refused"])
            body[refused_name] = value
    return body


def _apply(body: dict[str, Json], changes: dict[str, Json]) -> None:
    for name, value in changes.items():
        if value is ABSENT:
            body.pop(name, None)
        else:
            body[name] = value


def encode(body: Json, ascii_only: bool) -> bytes:
    """JSON as a sloppy client writes it: NaN and Infinity as bare tokens, lone surrogates passed through."""
    return json.dumps(body, allow_nan=True, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def raw_bodies(valid: Strategy) -> Strategy:
    """Bytes that are not a JSON object: garbage, cut-off JSON, bare NaN, nesting deeper than a parser recurses."""
    truncated = st.tuples(valid.map(lambda b: encode(b, True)), st.floats(0, 1)).map(
        lambda t: t[0][: int(len(t[0]) * t[1])])
    fixed = st.sampled_from([
        b"", b"null", b"[]", b"{}", b'"x"', b"0", b"{\"prompt\": NaN}", b"{\"prompt\": \"a\",}", b"\xff\xfe{}",
        b"{\"prompt\": \"\xc3\x28\"}", b"[" * 100_000 + b"]" * 100_000, b"{\"a\":" * 5000 + b"1" + b"}" * 5000,
        b"{\"prompt\": 1e999999}", b"{\"tokens\": [1e400]}", b"{\"n\": 00}",
    ])
    return st.one_of(st.binary(max_size=64), truncated, fixed, WILD.map(lambda b: encode(b, True)))


def route_requests(route: str, target: Target) -> Strategy:
    """Every kind of request to one route: valid and mutated bodies four times as often as raw ones."""
    table, always = FIELD_TABLES[route](target), ALWAYS[route]
    valid = valid_body(table, always)
    mutated = mutated_body(table, always, edge_values(target))

    def bodies(kind: str) -> Strategy:
        if kind == "raw":
            return raw_bodies(valid)
        # Non-ASCII text goes out escaped or as UTF-8, as clients differ.
        return st.tuples(valid if kind == "valid" else mutated, st.booleans()).map(lambda b: encode(*b))

    kinds = st.sampled_from(("valid",) * 4 + ("mutated",) * 4 + ("raw",) * 2)
    hang_ups = st.sampled_from((None,) * 8 + (1, 2, 3))
    return st.builds(lambda kind_body, hang_up: FuzzRequest(route, kind_body[1], kind_body[0], hang_up),
                     kinds.flatmap(lambda kind: bodies(kind).map(lambda body: (kind, body))), hang_ups)


def fuzz_requests(target: Target) -> Strategy:
    """A request to any of the four routes, the two generation routes three times as often."""
    return st.one_of(*(route_requests(route, target) for route in (COMPLETIONS, CHAT, COMPLETIONS, CHAT,
                                                                    COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE)))


# ---- sending and checking ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request got: its status (None if it never came), its time, and what was wrong."""

    request: FuzzRequest
    status: int | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"{self.request}", f"  -> status {self.status} after {self.seconds:.2f} s"]
        return "\n".join(lines + [f"  !! {problem}" for problem in self.problems])


class Hang(Exception):
    """The request's deadline passed before its answer was complete."""


def fuzz_client(base_url: str, api_key: str | None) -> httpx.Client:
    """A client that opens a connection per request: a server resets the connection
    of a request that crashed it (a 500), and the next request must not pay for that."""
    headers = {"content-type": "application/json"}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    return httpx.Client(base_url=base_url, headers=headers, limits=httpx.Limits(max_keepalive_connections=0))


def send(client: httpx.Client, request: FuzzRequest, target: Target, deadline_s: float = DEADLINE_S) -> Outcome:
    """Send one request, read its whole answer before ``deadline_s``, and check it.

    httpx's timeout bounds each read, not the whole answer, so a stream that
    keeps trickling is also stopped, between two events, once the deadline passes.
    """
    outcome = Outcome(request)
    start = time.monotonic()
    try:
        with client.stream("POST", request.route, content=request.body,
                           timeout=httpx.Timeout(deadline_s)) as response:
            outcome.status = response.status_code
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                outcome.problems = read_and_check_stream(response, request, target, start + deadline_s)
            else:
                outcome.problems = check_body(response.status_code, response.read(), request, target)
    except (httpx.TimeoutException, Hang):
        outcome.problems = [f"hang: no complete answer within {deadline_s:.0f} s"]
    except httpx.TransportError as error:
        outcome.problems = [f"transport: {type(error).__name__}: {error}"]
    outcome.seconds = time.monotonic() - start
    return outcome


def check_body(status: int, raw: bytes, request: FuzzRequest, target: Target) -> list[str]:
    if status >= 500:
        return [f"server error {status}: {raw[:300]!r}"]
    try:
        body = json.loads(raw)
    except ValueError:
        return [f"status {status} with a body that is no JSON: {raw[:200]!r}"]
    if status != 200:
        return check_error(status, body)
    return SHAPE_CHECKS[request.route](body, request, target)


def check_error(status: int, body: Json) -> list[str]:
    """OpenAI's error body, the status repeated as ``code``."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return [f"status {status} without OpenAI's error body: {json.dumps(body)[:300]}"]
    wrong = [key for key, ok in (("message", isinstance(error.get("message"), str) and error["message"]),
                                 ("type", isinstance(error.get("type"), str)),
                                 ("param", "param" in error and isinstance(error["param"], str | None)),
                                 ("code", error.get("code") == status)) if not ok]
    return [f"status {status}: error field(s) {wrong} missing or wrong in {json.dumps(body)[:300]}"] if wrong else []


def expected_choices(request: FuzzRequest) -> int | None:
    """How many choices a 200 must hold, when the body says so plainly (None: not checked)."""
    body = request.json()
    if not isinstance(body, dict):
        return None
    n = body.get("n", 1)
    if type(n) is not int:  # a coerced "2" or 2.0 is the parser's business, not counted here
        return None
    if request.route == CHAT:
        return n
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(type(p) is int for p in prompt)):
        return n
    return n * len(prompt) if isinstance(prompt, list) else None


def check_choices(choices: Json, request: FuzzRequest) -> list[str]:
    """Choices numbered 0..k-1, each finished with stop or length, as many as asked for."""
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        return [f"choices is not a list of objects: {choices!r}"[:300]]
    problems = []
    if sorted(c.get("index") for c in choices) != list(range(len(choices))):
        problems.append(f"choice indices {[c.get('index') for c in choices]} are not 0..{len(choices) - 1}")
    if (wanted := expected_choices(request)) is not None and len(choices) != wanted:
        problems.append(f"{len(choices)} choices, {wanted} asked for")
    finishes = [c.get("finish_reason") for c in choices]
    if any(reason not in FINISH_REASONS for reason in finishes):
        problems.append(f"finish reasons {finishes} in a 200 (only {FINISH_REASONS} are a success)")
    return problems


def check_usage(usage: Json) -> list[str]:
    if not isinstance(usage, dict) or not all(type(usage.get(k)) is int for k in
                                              ("prompt_tokens", "completion_tokens", "total_tokens")):
        return [f"usage is not three token counts: {usage!r}"]
    if usage["prompt_tokens"] + usage["completion_tokens"] != usage["total_tokens"]:
        return [f"usage does not add up: {usage}"]
    return []


def check_completion(body: Json, request: FuzzRequest, target: Target) -> list[str]:
    problems = _check_envelope(body, "text_completion", target)
    if problems:
        return problems
    problems = check_choices(body["choices"], request) + check_usage(body.get("usage"))
    return problems + [f"choice text is not a string: {c!r}"[:300] for c in body["choices"]
                       if not isinstance(c.get("text"), str)]


def check_chat(body: Json, request: FuzzRequest, target: Target) -> list[str]:
    problems = _check_envelope(body, "chat.completion", target)
    if problems:
        return problems
    problems = check_choices(body["choices"], request) + check_usage(body.get("usage"))
    for choice in body["choices"]:
        message = choice.get("message")
        if not (isinstance(message, dict) and message.get("role") == "assistant"
                and isinstance(message.get("content"), str | None)):
            problems.append(f"not an assistant message: {message!r}"[:300])
    return problems


def check_tokenize(body: Json, request: FuzzRequest, target: Target) -> list[str]:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < target.vocab_size for t in tokens)):
        return [f"/tokenize answered no token list: {json.dumps(body)[:300]}"]
    return [] if body.get("count") == len(tokens) else [f"count {body.get('count')} != {len(tokens)} tokens"]


def check_detokenize(body: Json, request: FuzzRequest, target: Target) -> list[str]:
    ok = isinstance(body, dict) and isinstance(body.get("prompt"), str)
    return [] if ok else [f"/detokenize answered no prompt text: {json.dumps(body)[:300]}"]


def _check_envelope(body: Json, kind: str, target: Target) -> list[str]:
    if not isinstance(body, dict) or body.get("object") != kind or not isinstance(body.get("id"), str):
        return [f"not a {kind} object: {json.dumps(body)[:300]}"]
    if body.get("model") != target.model:
        return [f"model {body.get('model')!r}, not the served {target.model!r}"]
    return []


SHAPE_CHECKS: dict[str, Callable[[Json, FuzzRequest, Target], list[str]]] = {
    COMPLETIONS: check_completion, CHAT: check_chat, TOKENIZE: check_tokenize, DETOKENIZE: check_detokenize,
}
# A chunk's "object" may be missing: vLLM leaves out the fields it did not set (exclude_unset),
# "object" of a completion chunk among them; when present it must be the route's.
CHUNK_OBJECTS = {COMPLETIONS: "text_completion", CHAT: "chat.completion.chunk"}


def read_and_check_stream(response: httpx.Response, request: FuzzRequest, target: Target,
                          deadline: float) -> list[str]:
    """Read server-sent events up to ``data: [DONE]`` (or the planned hang-up) and check them."""
    if response.status_code != 200:
        return [f"status {response.status_code} sent as an event stream"]
    events: list[str] = []
    for line in response.iter_lines():
        if time.monotonic() > deadline:
            raise Hang()
        if line.startswith("data: "):
            events.append(line.removeprefix("data: "))
        elif line.strip() and not line.startswith(":"):
            return [f"a stream line that is no SSE field: {line[:200]!r}"]
        if request.hang_up_after is not None and len(events) >= request.hang_up_after:
            return []  # leaving the `with` block disconnects: the server must abort the request
    return check_stream(events, request, target)


def _is_chunk(chunk: Json, kind: str | None) -> bool:
    return isinstance(chunk, dict) and chunk.get("object", kind) == kind and isinstance(chunk.get("choices"), list)


def check_stream(events: list[str], request: FuzzRequest, target: Target) -> list[str]:
    """Chunks of the route's kind, no error among them, each choice finishing once, then [DONE]."""
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return [f"the stream does not end with exactly one data: [DONE] (last: {events[-1:]})"]
    finished: dict[int, Json] = {}
    problems: list[str] = []
    for event in events[:-1]:
        try:
            chunk = json.loads(event)
        except ValueError:
            return [f"a stream event that is no JSON: {event[:200]!r}"]
        if isinstance(chunk, dict) and "error" in chunk:
            return [f"an error inside a 200 stream (should have been a 4xx): {event[:300]}"]
        if not _is_chunk(chunk, CHUNK_OBJECTS.get(request.route)):
            return [f"not a {CHUNK_OBJECTS.get(request.route)} chunk: {event[:300]}"]
        for choice in chunk["choices"]:
            index = choice.get("index")
            if index in finished:
                problems.append(f"choice {index} has a chunk after its finish: {event[:300]}")
            if choice.get("finish_reason") is not None:
                finished[index] = choice.get("finish_reason")
    if (wanted := expected_choices(request)) is not None and sorted(finished) != list(range(wanted)):
        problems.append(f"choices {sorted(finished)} finished; {wanted} asked for")
    if bad := {i: r for i, r in finished.items() if r not in FINISH_REASONS}:
        problems.append(f"finish reasons {bad} in a 200 stream (only {FINISH_REASONS} are a success)")
    return problems


# ---- after a run ---------------------------------------------------------------------------------------------

IDLE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "nanoengine:kv_cache_free_blocks", "nanoengine:kv_cache_usable_blocks")


def idle_problems(base_url: str) -> list[str]:
    """Health 200; no request running or waiting; every KV block free (usage 0, free == usable)."""
    try:
        health = httpx.get(f"{base_url}/health", timeout=5.0).status_code
        if health != 200:
            return [f"/health is {health}"]
        running, waiting, usage, free, usable = (metric(base_url, name) for name in IDLE_METRICS)
    except (httpx.HTTPError, KeyError) as error:
        return [f"the server did not answer /health and /metrics: {error!r}"]
    if running or waiting or usage or free != usable:
        state = f"{running:g} running, {waiting:g} waiting, KV usage {usage:g}, {free:g} of {usable:g} blocks free"
        return [f"not idle: {state}"]
    return []


def check_idle(base_url: str, seconds: float = 15.0) -> list[str]:
    """``idle_problems`` polled for a while: an abort reaches the engine core a moment after the hang-up."""
    deadline = time.monotonic() + seconds
    while (problems := idle_problems(base_url)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return problems


def tracebacks(log: str) -> Iterator[str]:
    """Each traceback in a server log, as its last line (the exception)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            rest = lines[i + 1:]
            yield next((r for r in rest if r and not r.startswith((" ", "Traceback"))), "(cut off)")
