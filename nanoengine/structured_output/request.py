"""StructuredOutputRequest: one request's grammar, compiling or compiled.

Chapter 5 (engine skeleton): the object the scheduler looks at to decide
whether a request in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR may be promoted
(``is_ready``), and whose grammar advances with each accepted token. It holds a
``Future`` because compiling runs on a thread pool, off the engine thread.
No torch and no grammar library here: ``nanoengine/core`` reads this object.
vLLM 0.32 counterpart: ``vllm/v1/structured_output/request.py``
(``StructuredOutputRequest``) and ``backend_types.py`` (``StructuredOutputGrammar``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from nanoengine.sampling_params import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """A compiled grammar plus the matcher state of one request."""

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance past sampled tokens; False if the grammar rejects one."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed-next-token mask into ``bitmask[row]`` (packed bits)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has reached its end (only a stop token may follow)."""


class StructuredOutputRequest:
    """The grammar side of one request; created by ``StructuredOutputManager.grammar_init``."""

    def __init__(
        self, params: StructuredOutputsParams, grammar_future: Future[StructuredOutputGrammar]
    ) -> None:
        self.params = params
        self._future = grammar_future

    @property
    def is_ready(self) -> bool:
        """Compiling has ended, successfully or not (see ``compile_error``)."""
        return self._future.done()

    @property
    def compile_error(self) -> str | None:
        """Why compiling failed, in words; None while compiling or on success."""
        if not self._future.done():
            return None
        error = self._future.exception()
        return None if error is None else f"The grammar failed to compile: {error}".strip()

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        """The compiled grammar, or None while compiling or after a failure."""
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()

    def accept_tokens(self, token_ids: list[int]) -> None:
        grammar = self.grammar
        if grammar is not None and not grammar.is_terminated():
            grammar.accept_tokens(token_ids)
