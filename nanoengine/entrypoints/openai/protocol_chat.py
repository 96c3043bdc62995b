"""The ``/v1/chat/completions`` request and response bodies.

Chapter 8 (online serving). A chat request holds a conversation that the
model's chat template renders into one prompt. Its response holds messages;
its stream chunks hold deltas (the speaker first, then pieces of text), and
its logprobs are one entry per token with that token's UTF-8 bytes.

vLLM 0.32 counterpart: ``vllm/entrypoints/openai/chat_completion/protocol.py``
(``ChatCompletionRequest``, ``ChatCompletionResponse``,
``ChatCompletionStreamResponse``, ``DeltaMessage`` and the logprob models).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from nanoengine.entrypoints.openai.protocol import (
    MAX_TOP_LOGPROBS,
    ChatMessage,
    OpenAIModel,
    PromptLogprobsOut,
    SamplingFields,
    UsageInfo,
    conversation,
)
from nanoengine.entrypoints.openai.schema_notes import documented
from nanoengine.exceptions import ValidationError
from nanoengine.sampling_params import SamplingParams


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: a conversation to answer."""

    # Not min_length=1 for pydantic: an empty list is refused in conversation(), as vLLM refuses it.
    messages: list[ChatMessage] = Field(json_schema_extra=documented(minItems=1))
    # None: until the context is full (vLLM's default for chat; completions default to 16).
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Chat asks for logprobs with a flag and counts alternatives apart; completions use one number.
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS, description="Only with logprobs=true.")
    # False leaves the assistant's turn unopened (the template's own argument).
    add_generation_prompt: bool = True

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        """OpenAI's newer name wins over the older one when both are given."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValidationError(f"top_logprobs={self.top_logprobs} needs logprobs=true.", parameter="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self._sampling_kwargs(max_tokens, logprobs))

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise ValidationError("messages must hold at least one message.", parameter="messages")
        return conversation(self.messages)


class ChatLogProb(OpenAIModel):
    """One candidate token. ``bytes`` lets a client rebuild text that a token cuts in the
    middle of a character (its ``token`` then shows the replacement character)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    """A generated token, with the first ``top_logprobs`` candidates of its position."""

    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[ChatLogProbsContent] | None = None


class ChatMessageOut(OpenAIModel):
    """An answer message. The four OpenAI fields after ``content`` belong to
    features this server has no part of (refusals, citations, audio, function
    calls); they are there, ``null``, because clients read them."""

    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsOut | None = None
    prompt_token_ids: list[int] | None = None
    # Chapter 10: from a prefill server, where the decode server finds the KV blocks.
    kv_transfer_params: dict[str, Any] | None = None


class ChatDelta(OpenAIModel):
    """What a stream chunk adds to a message: the speaker once, then pieces of text."""

    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    # Only on a stream's last chunk, as in vLLM: one stamp, not one per token.
    system_fingerprint: str | None = None
    # Only on the opening chunks (with return_token_ids): the rendered prompt's ids.
    prompt_token_ids: list[int] | None = None
