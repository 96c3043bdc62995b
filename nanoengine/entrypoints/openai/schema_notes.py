"""What ``/openapi.json`` says of the request fields beyond their types.

Chapter 8 (online serving). The server keeps its checks where vLLM keeps them
-- most ranges in ``SamplingParams`` (so the offline API refuses the same
values, with the same ``param``), a few in pydantic -- but a client generated
from the schema must see every range. ``documented`` adds a JSON-schema
keyword to a field's schema without a second check behind it; ``only``
replaces a field's schema (the fields the server declares just to refuse).

What no static schema can say is listed once, in ``SCHEMA_EXCEPTIONS``: the
rules that join two fields, or a field and the loaded model (its
``max_model_len``, its vocabulary, its name, its chat template). A request
the schema allows is accepted, or refused with a 4xx whose ``param`` is one of
the fields of such a rule; ``tests/test_openapi_schema.py`` holds the server
to that.

vLLM 0.32 counterpart: none as a module; vLLM's ``/openapi.json`` comes from
its pydantic models (``vllm/entrypoints/openai/*/protocol.py``) as they are,
with most ranges unstated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

JsonDict = dict[str, Any]


def documented(**keywords: Any) -> JsonDict:
    """JSON-schema keywords for a field whose check lives elsewhere (``SamplingParams``).

    Put beside an ``anyOf`` they constrain only the branch of their type
    (``minimum`` binds a number, not ``null``), which is what an optional field means.
    """
    return keywords


def only(schema: JsonDict) -> Callable[[JsonDict], None]:
    """A field's whole schema replaced by ``schema``: pydantic calls this with the one it made."""

    def replace(generated: JsonDict) -> None:
        generated.clear()
        generated.update(schema)

    return replace


def required(generated: JsonDict) -> None:
    """A field optional to pydantic (so that its absence gets the server's own 400) shown without ``null``."""
    generated["anyOf"] = [branch for branch in generated.get("anyOf", ()) if branch != {"type": "null"}]
    generated.pop("default", None)


@dataclass(frozen=True)
class SchemaException:
    """A refusal the schema cannot express: why, the ``param`` values its 4xx names, and words
    of its message for the refusals that name no ``param`` (the engine's own, past the server)."""

    rule: str
    params: tuple[str, ...]
    says: tuple[str, ...] = ()


# Every reason a schema-valid request may still be refused. Kept to these on purpose:
# a refusal outside them means the schema and the server disagree.
SCHEMA_EXCEPTIONS = (
    SchemaException("the prompt's tokens plus max_tokens (or min_tokens) exceed the model's max_model_len",
                    ("prompt", "messages", "input_tokens", "max_tokens", "max_completion_tokens", "min_tokens")),
    SchemaException("min_tokens above max_tokens", ("min_tokens",)),
    SchemaException("n > 1 with greedy sampling (temperature 0)", ("n",)),
    SchemaException("token ids at or above the model's vocabulary size (prompt, logit_bias, stop_token_ids, tokens)",
                    ("prompt", "logit_bias", "stop_token_ids", "tokens"), ("is out of vocabulary",)),
    SchemaException("top_logprobs without logprobs=true", ("top_logprobs",)),
    SchemaException("stream_options without stream=true; prompt_logprobs with stream=true",
                    ("stream_options", "prompt_logprobs")),
    SchemaException("structured_outputs with response_format, or with not exactly one of choice/regex/json, "
                    "or with a regex or JSON schema xgrammar cannot compile; response_format json_schema "
                    "without its schema", ("structured_outputs", "response_format")),
    SchemaException("kv_transfer_params on a server without a KV connector, or with n > 1",
                    ("kv_transfer_params",)),
    SchemaException("a model other than the served one (404)", ("model",)),
    SchemaException("a conversation the model's chat template refuses", ("messages",)),
)


def exception_for(param: str | None, message: str) -> SchemaException | None:
    """The documented exception a refusal naming ``param`` (or saying ``message``) falls under, if any."""
    for exception in SCHEMA_EXCEPTIONS:
        if param in exception.params or (param is None and any(words in message for words in exception.says)):
            return exception
    return None

