"""What ``LLM.generate`` returns: RequestOutput with one CompletionOutput per sample.

Chapter 1 prints these; chapter 7 shows the output processor that builds them.
vLLM 0.32 counterpart: ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence (a request with ``n=2`` has two)."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error" (or "repetition"); None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence, if any.
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.monotonic``) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """Everything the user gets back for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # Prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int = 0
    # Why the engine ended it early (IGNORED / ERROR), in words.
    finish_message: str | None = field(default=None, repr=False)
