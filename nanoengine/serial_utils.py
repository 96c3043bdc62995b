"""Messages on the wire: msgpack encoding of the engine's dataclasses, with msgspec.

Chapter 8 (online serving). When the engine core runs in its own process
(``EngineCoreProc``), every ``EngineCoreRequest`` the front end sends and every
``EngineCoreOutputs`` the core answers crosses a ZMQ socket as bytes. msgspec
encodes the plain dataclasses of ``nanoengine/engine/__init__.py`` to msgpack
and, given the expected type, decodes them back into the same dataclasses
(nested ``SamplingParams``, enums and all), checking every field's type on the
way in. That is why those messages are kept as plain data: no tensors, no
open files, nothing a socket cannot carry.

vLLM 0.32 counterpart: ``vllm/v1/serial_utils.py`` (``MsgpackEncoder``,
``MsgpackDecoder``; vLLM adds zero-copy frames for tensors, which nanoengine's
messages never hold).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


def _encode_extra(value: Any) -> Any:
    """Types msgpack has no word for: a set travels as a sorted list."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise NotImplementedError(f"cannot encode a {type(value).__name__} for the engine core's socket")


class MsgpackEncoder:
    """Any message to msgpack bytes (one reusable encoder per thread, as msgspec wants)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)


class MsgpackDecoder(Generic[T]):
    """msgpack bytes back into a ``message_type`` (``Any``: plain lists, dicts and numbers)."""

    def __init__(self, message_type: type[T] | Any = Any) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type)

    def decode(self, data: bytes | memoryview) -> T:
        return self._decoder.decode(data)
