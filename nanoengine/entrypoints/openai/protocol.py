"""The OpenAI API's bodies that every route shares, as pydantic models.

Chapter 8 (online serving). FastAPI parses each JSON body into a model before
a handler runs, so a wrong type, a missing field or a NaN is refused with a
400 that names the field, and the engine never sees it. ``SamplingFields``
holds what both generation endpoints accept and turns it into
``SamplingParams``; values pydantic cannot judge alone (``top_p`` in (0, 1],
``min_tokens`` no more than ``max_tokens``) are checked there, by
``SamplingParams`` itself, so the offline API and the server refuse exactly
the same inputs. The endpoints' own bodies are in ``protocol_completion.py``
and ``protocol_chat.py``.

Besides OpenAI's fields, vLLM's extras are accepted with vLLM's names
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``priority``,
``prompt_logprobs``, ``return_token_ids``). Structured output comes in either
of vLLM's two spellings, OpenAI's ``response_format`` (``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (``choice``, ``regex``,
``json``), and takes the same xgrammar path as offline
(``StructuredOutputsParams``). A field the server does not implement
(``tools`` unless ``tool_choice`` is ``"none"``, ``continue_final_message``,
``use_beam_search``, ``suffix``, the older ``guided_*``) is refused with a 400
that names it, never ignored; a field nobody declared is kept aside and named
in a warning in the log.

``/openapi.json`` shows every range a field must be in, including those
``SamplingParams`` checks: ``schema_notes.documented`` writes them into the
field's schema without a second check, so the refusal keeps vLLM's message
and ``param``. What no schema can say (a rule joining two fields, or a field
and the loaded model) is listed in ``schema_notes.SCHEMA_EXCEPTIONS``.

Responses carry every field vLLM's carry, ``null`` where there is nothing to
say (``"logprobs": null``, ``"stop_reason": null``), so a client reading the raw
JSON finds the keys it expects. Stream chunks hold only the fields their maker
set (pydantic's ``exclude_unset``), which is how vLLM builds its chunks too.

vLLM 0.32 counterpart: ``vllm/entrypoints/serve/engine/protocol.py``
(``OpenAIBaseModel``, ``ErrorResponse``, ``UsageInfo``, ``ModelCard``) and
``vllm/entrypoints/serve/tokenize/protocol.py``; the fields both endpoints
share are written twice there, once in each request class.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nanoengine.entrypoints.openai.schema_notes import documented, only
from nanoengine.exceptions import ValidationError
from nanoengine.sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_N,
    RequestOutputKind,
    StructuredOutputsParams,
)

# The most top logprobs one position may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# Seeds travel as C int64 in vLLM; the same range here.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# SamplingParams enforces the penalties' range; the schema only repeats it.
PENALTY_RANGE = documented(minimum=-MAX_ABS_PENALTY, maximum=MAX_ABS_PENALTY)
# The one kind of content part the server reads (text() refuses the others).
TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
             "required": ["type", "text"]}


class OpenAIModel(BaseModel):
    """Bodies refuse NaN and infinity: JSON has no such numbers, Python's parser accepts them anyway."""

    model_config = ConfigDict(allow_inf_nan=False)


class RequestModel(OpenAIModel):
    """A request body. Unknown fields are kept (``extra="allow"``) only so the
    server can name them in its warning; nothing reads their values."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class StructuredOutputsIn(OpenAIModel):
    """vLLM's ``structured_outputs`` field: exactly one of ``choice``, ``regex``, ``json``."""

    choice: list[str] | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")


class JsonSchemaFormat(OpenAIModel):
    """``response_format.json_schema``: a named JSON schema."""

    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Fields a client may send that this server does not implement: refused by name.
# (A value of None, or "none" for tool_choice, asks for nothing and passes.)
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call", "continue_final_message",
    "guided_choice", "guided_regex", "guided_json", "guided_grammar", "use_beam_search", "suffix",
)


class SamplingFields(RequestModel):
    """The fields both request kinds share, mapped one to one onto ``SamplingParams``."""

    model: str | None = None
    # The ranges below are SamplingParams' own, only repeated for the schema's readers.
    n: int = Field(default=1, json_schema_extra=documented(minimum=1, maximum=MAX_N))
    temperature: float | None = Field(default=None, json_schema_extra=documented(minimum=0))
    top_p: float | None = Field(default=None, json_schema_extra=documented(exclusiveMinimum=0, maximum=1))
    # An empty stop string would stop before the first token; SamplingParams refuses it.
    stop: str | list[str] | None = Field(default=None, json_schema_extra=documented(
        minLength=1, items={"minLength": 1}))
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(default=0.0, json_schema_extra=PENALTY_RANGE)
    frequency_penalty: float = Field(default=0.0, json_schema_extra=PENALTY_RANGE)
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (a decimal string, below the model's vocabulary size) to bias.",
        json_schema_extra=documented(propertyNames={"pattern": "^[0-9]{1,9}$"}, additionalProperties={
            "type": "number", "minimum": -MAX_ABS_LOGIT_BIAS, "maximum": MAX_ABS_LOGIT_BIAS}))
    stream: bool = False
    stream_options: StreamOptions | None = Field(default=None, description="Only with stream=true.")
    echo: bool = False
    # vLLM's extras.
    # JSON Schema has no "-1 or at least 1"; "not 0" beside minimum -1 says it.
    top_k: int | None = Field(default=None, description="-1 disables top-k; 0 is refused.",
                              json_schema_extra=documented(minimum=-1, maximum=INT64_MAX, **{"not": {"const": 0}}))
    min_p: float | None = Field(default=None, json_schema_extra=documented(minimum=0, maximum=1))
    repetition_penalty: float | None = Field(default=None, json_schema_extra=documented(exclusiveMinimum=0))
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, description="At most max_tokens, and prompt + min_tokens within max_model_len.",
                            json_schema_extra=documented(minimum=0, maximum=INT64_MAX))
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = Field(
        default=None, description="Token ids below the model's vocabulary size.",
        json_schema_extra=documented(items={"minimum": 0, "maximum": INT64_MAX}))
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description="Not with stream=true.")
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = Field(default=None, description="Not with response_format.")
    # Chapter 10: prefill on one server, decode on another (vLLM's field; the
    # proxy sets it, nanoengine/entrypoints/disagg_proxy.py).
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, description="Only for a server with a KV connector (chapter 10); needs n=1.")
    # Not implemented here; declared so that asking for them is refused, not ignored,
    # and documented as the only values that pass: null, or what asks for nothing.
    tools: list[Any] | None = Field(default=None, json_schema_extra=only({"type": "null"}))
    tool_choice: Any = Field(default=None, json_schema_extra=only({"enum": [None, "none"]}))
    functions: list[Any] | None = Field(default=None, json_schema_extra=only({"type": "null"}))
    function_call: Any = Field(default=None, json_schema_extra=only({"type": "null"}))
    continue_final_message: bool | None = Field(default=None, json_schema_extra=only({"enum": [None, False]}))
    guided_choice: Any = Field(default=None, json_schema_extra=only({"type": "null"}))
    guided_regex: Any = Field(default=None, json_schema_extra=only({"type": "null"}))
    guided_json: Any = Field(default=None, json_schema_extra=only({"type": "null"}))
    guided_grammar: Any = Field(default=None, json_schema_extra=only({"type": "null"}))
    use_beam_search: bool | None = Field(default=None, json_schema_extra=only({"enum": [None, False]}))
    suffix: str | None = Field(default=None, json_schema_extra=only({"type": "null"}))

    def _refuse_unsupported(self) -> None:
        asked = [name for name in UNSUPPORTED_FIELDS
                 if getattr(self, name) not in (None, False, [], "none")]
        if self.tool_choice == "none" and "tools" in asked:
            # Tools the model may not call only describe them: the chat template shows
            # them to the model (as vLLM does) and no call is ever parsed.
            asked.remove("tools")
        if asked:
            raise ValidationError(f"{', '.join(asked)}: not supported by this server (nanoengine serve); "
                                  "leave them out. Structured output: response_format or structured_outputs.",
                                  parameter=asked[0])

    def _refuse_stream_only_mistakes(self) -> None:
        """Two combinations vLLM refuses before anything runs, with the same parameter names."""
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options can only be given with stream=true.", parameter="stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise ValidationError("prompt_logprobs are not available when stream=true.", parameter="prompt_logprobs")

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` or ``response_format`` as the engine's grammar request."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "text":
            fmt = None  # plain text asks for no grammar
        if self.structured_outputs is not None:
            if fmt is not None:
                raise ValidationError("structured_outputs and response_format both ask for a format: give one.",
                                      parameter="structured_outputs")
            given = self.structured_outputs
            return StructuredOutputsParams(choice=given.choice, regex=given.regex, json=given.json_schema)
        if fmt is None:
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json={"type": "object"})
        schema = fmt.json_schema
        if schema is None or schema.json_schema is None:
            raise ValidationError("response_format of type json_schema needs json_schema.schema.",
                                  parameter="response_format")
        return StructuredOutputsParams(json=schema.json_schema)

    def _sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        self._refuse_unsupported()
        self._refuse_stream_only_mistakes()
        if self.kv_transfer_params and self.n != 1:
            # One prompt's KV goes to one decode request (as in vLLM's proxy).
            raise ValidationError(f"kv_transfer_params needs n=1, got n={self.n}.", parameter="kv_transfer_params")
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "stop": self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "structured_outputs": self._structured_outputs(),
            "extra_args": {"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None,
            # A stream sends what is new at each step; a whole answer needs only the end.
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        }
        # Unset means "the default", exactly as SamplingParams defines it.
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}
        kwargs.update({name: value for name, value in optional.items() if value is not None})
        if self.logit_bias:
            kwargs["logit_bias"] = {_token_id(key): bias for key, bias in self.logit_bias.items()}
        return kwargs


def _token_id(key: str) -> int:
    """OpenAI sends logit_bias keys as strings ("50256"); they name token ids."""
    try:
        return int(key)
    except ValueError:
        raise ValidationError(f"logit_bias keys must be token ids, got {key!r}.", parameter="logit_bias") from None


class ChatMessage(OpenAIModel):
    role: str = Field(json_schema_extra=documented(enum=list(CHAT_ROLES)))
    content: str | list[dict[str, Any]] | None = Field(default=None, json_schema_extra=documented(items=TEXT_PART))

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        return role

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValidationError(f"only text content parts are supported, got {part.get('type')!r}.",
                                      parameter="messages")
            parts.append(part["text"])
        return "".join(parts)


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and plain text."""
    return [{"role": message.role, "content": message.text()} for message in messages]


# ---- the parts of responses both endpoints share, and the other routes' bodies ----------------------


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    # OpenAI's breakdowns (cached prompt tokens, reasoning tokens): not counted here.
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None


# A prompt position's candidates as vLLM sends them: {token id: {logprob, rank, decoded_token}}.
PromptLogprobsOut = list[dict[int, dict[str, Any]] | None]


class TokenizeRequest(RequestModel):
    """``POST /tokenize``: a prompt, or messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    # An empty conversation is refused by the chat template's renderer.
    messages: list[ChatMessage] | None = Field(default=None, json_schema_extra=documented(minItems=1))
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIModel):
    prompt: str


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(description="Token ids below the model's vocabulary size.",
                              json_schema_extra=documented(items={"type": "integer", "minimum": 0}))


class ModelPermission(OpenAIModel):
    """The permission card OpenAI's model objects once carried; vLLM still sends one."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIModel):
    """One entry of ``/v1/models``: the served name, where its weights came from, its context length."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "nanoengine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)
