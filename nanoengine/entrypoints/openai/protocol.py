"""The OpenAI API's request and response bodies, as pydantic models.

Chapter 8 (online serving). FastAPI parses each JSON body into one of these
models before a handler runs, so a wrong type, a missing field or a NaN is
refused with a 400 that names the field, and the engine never sees it. Each
request model turns itself into ``SamplingParams`` (``to_sampling_params``);
values pydantic cannot judge alone (``top_p`` in (0, 1], ``min_tokens`` no
more than ``max_tokens``) are checked there, by ``SamplingParams`` itself, so
the offline API and the server refuse exactly the same inputs.

Besides OpenAI's fields, vLLM's extras are accepted with vLLM's names
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``priority``).
Structured output comes in either of vLLM's two spellings, OpenAI's
``response_format`` (``json_object``, ``json_schema``) or vLLM's
``structured_outputs`` (``choice``, ``regex``, ``json``), and takes the same
xgrammar path as offline (``StructuredOutputsParams``). A field the server
does not implement (``tools``, ``tool_choice``, ``continue_final_message``,
the older ``guided_*``) is refused with a 400 that names it, never ignored.

vLLM 0.32 counterpart: ``vllm/entrypoints/openai/completion/protocol.py``
(``CompletionRequest`` and its response and stream-chunk models),
``vllm/entrypoints/openai/chat_completion/protocol.py``
(``ChatCompletionRequest`` and its) and
``vllm/entrypoints/serve/engine/protocol.py`` (``ErrorResponse``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nanoengine.sampling_params import SamplingParams, StructuredOutputsParams

# The most top logprobs one position may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


class OpenAIModel(BaseModel):
    """Bodies refuse NaN and infinity: JSON has no such numbers, Python's parser accepts them anyway."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


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
    "guided_choice", "guided_regex", "guided_json", "guided_grammar",
)


class SamplingFields(OpenAIModel):
    """The fields both request kinds share, mapped one to one onto ``SamplingParams``."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    # Not implemented here; declared so that asking for them is refused, not ignored.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    continue_final_message: bool | None = None
    guided_choice: Any = None
    guided_regex: Any = None
    guided_json: Any = None
    guided_grammar: Any = None

    def _refuse_unsupported(self) -> None:
        asked = [name for name in UNSUPPORTED_FIELDS
                 if getattr(self, name) not in (None, False, [], "none")]
        if asked:
            raise ValueError(f"{', '.join(asked)}: not supported by this server (nanoengine serve); "
                             "leave them out. Structured output: response_format or structured_outputs.")

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """``structured_outputs`` or ``response_format`` as the engine's grammar request."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "text":
            fmt = None  # plain text asks for no grammar
        if self.structured_outputs is not None:
            if fmt is not None:
                raise ValueError("structured_outputs and response_format both ask for a format: give one.")
            given = self.structured_outputs
            return StructuredOutputsParams(choice=given.choice, regex=given.regex, json=given.json_schema)
        if fmt is None:
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json={"type": "object"})
        schema = fmt.json_schema
        if schema is None or schema.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema.schema.")
        return StructuredOutputsParams(json=schema.json_schema)

    def _sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        self._refuse_unsupported()
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens if max_tokens is not None else 16,
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
            "structured_outputs": self._structured_outputs(),
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
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt (or token ids) to continue."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self._sampling_kwargs(self.max_tokens, self.logprobs))


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None

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
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}.")
            parts.append(part["text"])
        return "".join(parts)


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and plain text."""
    return [{"role": message.role, "content": message.text()} for message in messages]


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: a conversation to answer."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=true.")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self._sampling_kwargs(max_tokens, logprobs))

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages)


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(OpenAIModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(OpenAIModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]
