"""Messages that cross the boundary between the front end and the engine core.

Chapter 5 (engine skeleton) draws this boundary: ``LLMEngine`` lives on the user's
side, ``EngineCore`` on the other, and the ``EngineCoreClient`` carries these
messages between them (a direct call in-process, a socket in a multi-process
server, chapter 8). Keeping them plain dataclasses is what makes both transports
possible.

vLLM 0.32 counterpart: ``vllm/v1/engine/__init__.py`` (``EngineCoreRequest``,
``EngineCoreOutput``, ``EngineCoreOutputs``, ``FinishReason``, ``EngineCoreEventType``,
``EngineCoreEvent``, ``UtilityOutput``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from nanoengine.logprobs import LogprobsLists
from nanoengine.sampling_params import SamplingParams
from nanoengine.spec_decode.metrics import RequestSpecDecodeMetrics


class FinishReason(enum.IntEnum):
    """Why a request stopped, as the user sees it (``CompletionOutput.finish_reason``).

    Several internal states collapse into one reason: FINISHED_IGNORED and
    FINISHED_LENGTH_CAPPED both read as "length", exactly as in vLLM.
    """

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request inside the engine core (chapter 5's event log)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass
class EngineCoreEvent:
    """One timestamped event; the front end turns these into queue time and TTFT."""

    type: EngineCoreEventType
    timestamp: float  # time.monotonic(), the clock of arrival_time

    @classmethod
    def new_event(cls, event_type: EngineCoreEventType, timestamp: float | None = None) -> EngineCoreEvent:
        return cls(event_type, time.monotonic() if timestamp is None else timestamp)


@dataclass
class EngineCoreRequest:
    """A request after the front end has tokenized and validated it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # Streaming input: the prompt arrives in pieces (LLMEngine.append_prompt).
    streaming_input: bool = False


@dataclass
class EngineCoreOutput:
    """What one engine step produced for one request: new tokens and maybe an end."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id (int) that ended the request, or the stop string (str)
    # once the output processor finds one; None for other endings.
    stop_reason: int | str | None = None
    # How many prompt tokens the prefix cache supplied (for RequestOutput).
    num_cached_tokens: int = 0
    # A human-readable reason for FINISHED_IGNORED / FINISHED_ERROR.
    finish_message: str | None = None
    # Events since the request's previous output (queued, scheduled, preempted).
    events: list[EngineCoreEvent] | None = None
    # Prompt tokens whose KV a KV connector loaded (chapter 5).
    num_external_computed_tokens: int = 0
    # Chapter 8: one row per token of new_token_ids, when the request asked for
    # logprobs; plain lists, so msgpack carries them between processes.
    new_logprobs: LogprobsLists | None = None
    # One row per prompt token after the first; only in the request's first output.
    new_prompt_logprobs: LogprobsLists | None = None
    # Chapter 10: set in a producer's last output, where the KV blocks wait for
    # the decode engine (vLLM's kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None
    # Chapter 9: in a finished request's last output, its drafts and kept drafts.
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class UtilityOutput:
    """The answer to a utility call: a method of the core run by name (chapter 8).

    Only the multi-process clients need it: in one process the client simply
    calls the method. ``result`` is plain data (it crossed a socket).
    """

    call_id: int
    result: Any = None
    failure_message: str | None = None  # the exception the method raised, in words


@dataclass
class EngineCoreOutputs:
    """Everything one ``EngineCore.step()`` returns to the client."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = field(default_factory=time.monotonic)
    # Set instead of outputs when this message answers a utility call (chapter 8).
    utility_output: UtilityOutput | None = None
