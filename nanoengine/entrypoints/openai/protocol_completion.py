"""The ``/v1/completions`` request and response bodies.

Chapter 8 (online serving). A completion request continues a prompt: a
string, a list of strings, token ids, or a list of token-id lists (one engine
request each). Its response carries OpenAI's legacy logprobs shape, four
parallel lists; its stream chunks hold only the fields their maker set.

vLLM 0.32 counterpart: ``vllm/entrypoints/openai/completion/protocol.py``
(``CompletionRequest``, ``CompletionResponse``, ``CompletionStreamResponse``
and their choices and logprobs).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import ConfigDict, Field

from nanoengine.entrypoints.openai.protocol import (
    MAX_TOP_LOGPROBS,
    OpenAIModel,
    PromptLogprobsOut,
    SamplingFields,
    UsageInfo,
)
from nanoengine.entrypoints.openai.schema_notes import documented, required
from nanoengine.sampling_params import SamplingParams


def _prompt_schema(schema: dict[str, Any]) -> None:
    """Required, and no empty string or list at either level (``_prompt_list`` refuses them)."""
    required(schema)
    schema.update(documented(minLength=1, minItems=1, items={"minLength": 1, "minItems": 1, "minimum": 0,
                                                             "items": {"minimum": 0}}))


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a text prompt (or token ids) to continue."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow", json_schema_extra={"required": ["prompt"]})

    # Optional to pydantic so that a missing prompt gets the same 400 as an empty one.
    prompt: str | list[int] | list[str] | list[list[int]] | None = Field(
        default=None, description="Required and non-empty; token ids below the model's vocabulary size, "
        "and its tokens plus max_tokens within max_model_len.",
        json_schema_extra=_prompt_schema)
    # OpenAI's default for completions; chat has none (the rest of the context).
    max_tokens: int | None = Field(default=16, ge=1, description="With the prompt, within max_model_len.")
    # How many alternatives per position besides the chosen token (so up to logprobs + 1 entries).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        kwargs = self._sampling_kwargs(max_tokens, self.logprobs)
        if self.echo and kwargs["prompt_logprobs"] is None:
            # Echoed prompt tokens need logprobs of their own (the first has none).
            kwargs["prompt_logprobs"] = self.logprobs
        return SamplingParams(**kwargs)


class CompletionLogProbs(OpenAIModel):
    """The legacy completions shape: four parallel lists, one entry per token."""

    # Where each token starts in the returned text (characters).
    text_offset: list[int] = Field(default_factory=list)
    # None for an echoed prompt's first token: nothing precedes it to score it against.
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    # Keyed by the candidates' text, so two tokens that decode alike share one entry.
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    """One choice of a whole answer; prompt i's n choices are numbered i*n .. i*n + n - 1."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsOut | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    # Chapter 10: from a prefill server, where the decode server finds the KV blocks.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionStreamChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    # Only on a stream's last chunk, as in vLLM: one stamp, not one per token.
    system_fingerprint: str | None = None
