"""Helpers for the request-state tests: build a small engine, drive it, keep its Requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import RequestOutput
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_engine(model: str, **kwargs: Any) -> LLMEngine:
    """A tiny-model engine with a small, explicit KV cache (fast to build).

    16-token blocks (the CUDA default; the CPU's is 128): the tests' prompt
    lengths are chosen to fill, share and run out of blocks of that size."""
    kwargs.setdefault("block_size", 16)
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))


def add(
    engine: LLMEngine, request_id: str, prompt: Any, params: SamplingParams = GREEDY, **kwargs: Any
) -> Request:
    """Add through the public API and return the engine core's Request (its history)."""
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    engine.add_request(request_id, prompt, params, **kwargs)
    return engine.engine_core.get_engine_core().scheduler.requests[request_id]


def run(
    engine: LLMEngine,
    on_step: Callable[[int, list[RequestOutput]], None] | None = None,
    max_steps: int = 10_000,
) -> dict[str, RequestOutput]:
    """Step until every request is finished; the last output of each request by id."""
    final: dict[str, RequestOutput] = {}
    for step in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        outputs = engine.step()
        for output in outputs:
            final[output.request_id] = output
        if on_step is not None:
            on_step(step, outputs)
    raise AssertionError(f"engine did not finish within {max_steps} steps")


def path(request: Request) -> list[RequestStatus]:
    return [status for _, status in request.status_history]


def prompt_ids(n: int, start: int = 5) -> list[int]:
    """A deterministic token-id prompt of length n inside the tiny vocabulary."""
    return [start + (i * 7) % 200 for i in range(n)]
