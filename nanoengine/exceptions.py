"""The error a request's bad value raises, carrying the parameter it came from.

Chapters 7 and 8. Offline, ``SamplingParams(temperature=-1)`` raises it and the
message names the value and the limit. Online, the server turns it into
OpenAI's error body with ``"param": "temperature"``, so a client can tell which
field to fix without parsing the message. It is a ``ValueError``, so code that
catches ``ValueError`` keeps working.

vLLM 0.32 counterpart: ``VLLMValidationError`` in ``vllm/exceptions.py``.
"""

from __future__ import annotations

from typing import Any


class ValidationError(ValueError):
    """A value the engine refuses; ``parameter`` names the request field it came from."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


# The words that open the finish_message of a request whose KV load failed
# (chapter 10, kv_load_failure_policy="fail"): the server's fault, not the client's.
KV_LOAD_FAILED = "Loading the KV cache from the prefill engine failed"


class KVTransferError(RuntimeError):
    """A request ended because its KV could not be loaded from the prefill engine (a 500 online)."""


def request_error(message: str) -> Exception:
    """The exception for a request the engine ended in error: the client's mistake, or a failed KV load."""
    return KVTransferError(message) if message.startswith(KV_LOAD_FAILED) else ValueError(message)
