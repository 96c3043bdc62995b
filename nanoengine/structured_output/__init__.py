"""StructuredOutputManager: grammars that constrain which tokens may come next.

Chapter 5 (engine skeleton) shows where it sits -- a member of ``EngineCore``
beside the scheduler -- and why ``step()`` builds its bitmask *while* the
forward pass runs. Its life cycle for one request:

1. ``grammar_init`` (from ``EngineCore.add_request``) submits the compile to a
   thread pool; the request waits in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR and
   the scheduler promotes it once the future is done (or ends it as
   FINISHED_ERROR if compiling failed);
2. ``grammar_bitmask`` (each step, called by ``Scheduler.get_grammar_bitmask``
   with the structured requests that sample this step) stacks one packed mask
   row per request; the model runner masks its logits with it;
3. the scheduler feeds each accepted token back (``accept_tokens``).

vLLM 0.32 counterpart: ``vllm/v1/structured_output/__init__.py``
(``StructuredOutputManager``, backed by xgrammar).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from nanoengine.config import EngineConfig
from nanoengine.request import Request
from nanoengine.sampling_params import StructuredOutputsParams
from nanoengine.structured_output.request import StructuredOutputGrammar, StructuredOutputRequest

if TYPE_CHECKING:  # the backend imports xgrammar, which is loaded on first use only
    import torch

    from nanoengine.structured_output.backend_xgrammar import XgrammarBackend


class StructuredOutputManager:
    """Compiles grammars off the engine thread and produces per-step token bitmasks."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.model_path = engine_config.model_config.model_path
        # The bitmask has one bit per vocabulary entry of the model's logits.
        self.vocab_size = engine_config.model_config.vocab_size
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        # One thread: compiles are rare and short, and they must not steal the
        # forward pass's cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoengine-grammar")

    def grammar_init(self, request: Request) -> None:
        """Start compiling ``request``'s grammar; it stays blocked until done."""
        params = request.sampling_params.structured_outputs
        if params is None:
            raise ValueError(f"Request {request.request_id!r} asks for no structured output.")
        future = self._executor.submit(self._compile, params)
        request.structured_output_request = StructuredOutputRequest(params, future)

    def _compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        return self._get_backend().compile_grammar(params)

    def _get_backend(self) -> XgrammarBackend:
        """Load the tokenizer's vocabulary into xgrammar on first use (a fraction of a second)."""
        with self._backend_lock:
            if self._backend is None:
                from nanoengine.structured_output.backend_xgrammar import XgrammarBackend
                from nanoengine.transformers_utils.config import get_tokenizer

                self._backend = XgrammarBackend(get_tokenizer(self.model_path), self.vocab_size)
            return self._backend

    def grammar_bitmask(self, requests: dict[str, Request], structured_output_request_ids: list[str]) -> torch.Tensor:
        """One packed mask row per request id, in that order: int32 [rows, ceil(vocab/32)].

        The scheduler chooses the rows (``Scheduler.get_grammar_bitmask``): the
        structured requests that sample this step. Each one is running, so its
        grammar has compiled.
        """
        bitmask = self._get_backend().allocate_token_bitmask(len(structured_output_request_ids))
        for row, req_id in enumerate(structured_output_request_ids):
            structured = requests[req_id].structured_output_request
            assert structured is not None and structured.grammar is not None, f"{req_id} has no compiled grammar"
            # A grammar that has ended (it took its stop token, yet ignore_eos or
            # min_tokens keeps the request going) constrains nothing more: its row
            # stays all-allowed, as vLLM leaves it. Asking xgrammar for a mask would raise.
            if not structured.grammar.is_terminated():
                structured.grammar.fill_bitmask(bitmask, row)
        return bitmask

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
