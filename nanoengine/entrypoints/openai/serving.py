"""OpenAIServing: what the completions and chat handlers share.

Chapter 8 (online serving). Both handlers follow the same four steps:

1. the request body (already parsed by FastAPI into a protocol model) becomes
   ``SamplingParams`` and rendered prompts -- any ``ValueError`` or
   ``TypeError`` here is the client's mistake and becomes a 400 (a
   ``ValidationError`` also names the field);
2. each prompt becomes one ``AsyncLLM.generate`` generator (``n`` samples ride
   in one request, as in vLLM);
3. without ``stream``, the engine sends each request's output once, when it
   has finished (``FINAL_ONLY``), and that becomes one JSON response;
4. with it, the engine sends only what is new at each step (``DELTA``), and
   every piece becomes a server-sent event, then ``data: [DONE]``.

This module holds what both need: the length rules, starting one request per
prompt (all or none), reading several requests' outputs as they arrive, and
the token counts for ``usage``. The two endpoints live in
``serving_completion.py`` and ``serving_chat.py``.

While a request streams, the detokenizer holds back text that might be the
start of a stop string until it is clear that it is not, so a client never
receives the first half of a stop string the engine then cuts away.

vLLM 0.32 counterpart: ``OpenAIServing`` in ``vllm/entrypoints/serve/engine/serving.py``,
the length rules of ``get_max_tokens`` (``vllm/entrypoints/serve/utils/api_utils.py``)
and ``TokenizeParams`` (``vllm/renderers/params.py``), and ``merge_async_iterators``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from nanoengine import __version__
from nanoengine.config import EngineConfig
from nanoengine.engine.async_llm import AsyncLLM
from nanoengine.entrypoints.openai.protocol import UsageInfo
from nanoengine.exceptions import ValidationError, request_error
from nanoengine.logprobs import Logprob, PromptLogprobs
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.renderers.hf import RenderedPrompt
from nanoengine.sampling_params import SamplingParams

# JSON has no -inf; vLLM sends this floor for a token the model rules out entirely.
LOGPROB_FLOOR = -9999.0
# Every route speaks text (prompts, chat messages, /tokenize), so a server
# refuses an engine built with skip_tokenizer_init (chapter 6).
NEEDS_TOKENIZER = (
    "nanoengine serve needs a tokenizer: skip_tokenizer_init works offline only "
    "(LLM(..., skip_tokenizer_init=True) with token-id prompts)."
)


class OpenAIServing:
    """Runs requests of one endpoint on one ``AsyncLLM``; subclassed per endpoint."""

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        if engine.tokenizer is None:
            raise ValueError(NEEDS_TOKENIZER)
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = engine.engine_config.model_config.max_model_len
        self.system_fingerprint = system_fingerprint(engine.engine_config)

    def check_max_tokens(self, requested: int | None, param: str) -> None:
        """More output tokens than the whole context holds is always a mistake (a 400).

        A smaller request that does not fit after a long prompt is not: as in
        vLLM, it runs until the context is full and ends with ``"length"``. The
        engine refuses a prompt longer than the context on its own.
        """
        if requested is not None and requested > self.max_model_len:
            raise ValidationError(
                f"{param}={requested} cannot be greater than max_model_len={self.max_model_len}. "
                "Please request fewer output tokens.", parameter=param)

    def check_grammar(self, params: SamplingParams) -> None:
        """A grammar that does not parse is a 400 now, not a request that ends in error later."""
        if params.structured_outputs is not None:
            # Imported here: a server that never sees a grammar never loads xgrammar.
            from nanoengine.structured_output.backend_xgrammar import validate_xgrammar_grammar

            validate_xgrammar_grammar(params.structured_outputs)

    def prompt_text(self, output: RequestOutput) -> str:
        """The prompt as text, for ``echo``; a token-id prompt is decoded first."""
        if output.prompt is not None:
            return output.prompt
        return str(self.tokenizer.decode(output.prompt_token_ids))

    def decoded(self, token_id: int, logprob: Logprob | None) -> str:
        """A candidate token's text: the one the engine decoded, or decoded here."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return str(self.tokenizer.decode([token_id]))

    def start_all(
        self, prompts: list[RenderedPrompt], params: SamplingParams, request_id: str, priority: int
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """One engine request per prompt, all or none: a refused prompt aborts those sent before it."""
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        generators: list[AsyncGenerator[RequestOutput, None]] = []
        try:
            for prompt, core_id in zip(prompts, ids):
                generators.append(self.engine.generate(prompt, params, core_id, priority=priority))
        except BaseException:
            self.engine.abort_request(ids[: len(generators)])
            raise
        return generators


def system_fingerprint(config: EngineConfig) -> str:
    """``nanoengine-<version>[-tp<N>]-<hash8>``: which engine build and configuration answered.

    OpenAI's field lets a client notice that the backend changed between two
    answers. Like vLLM's (``--fingerprint-mode full``), it names the version,
    any tensor parallelism, and 8 hex digits of a hash over the settings that
    change outputs: the weights, their dtype, the context length, the kernels.
    """
    model = config.model_config
    settings = (model.model_path, model.dtype, model.max_model_len, model.seed, model.attention_backend,
                model.linear_backend, config.cache_config.block_size, config.parallel_config.tensor_parallel_size)
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:8]
    tp = config.parallel_config.tensor_parallel_size
    return "-".join(["nanoengine", __version__, *([f"tp{tp}"] if tp > 1 else []), digest])


async def last_outputs(generators: Sequence[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput]:
    """Run every generator to its end; a request the engine refused is the client's error."""
    finals: dict[int, RequestOutput] = {}
    async for index, output in merged(generators):
        finals[index] = output
    for final in finals.values():
        refused = [c for c in final.outputs if not c.token_ids and c.finish_reason in ("length", "error")]
        if final.finish_message and refused:
            raise request_error(final.finish_message)
    return [finals[index] for index in range(len(generators))]


async def merged(
    generators: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(generator index, output) from several generators, in arrival order.

    One request per prompt is the common case; for several prompts each
    generator is read by its own task, and all are closed (aborting their
    requests) if the consumer stops early.
    """
    if len(generators) == 1:
        try:
            async for output in generators[0]:
                yield 0, output
        finally:
            await generators[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, generator: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in generator:
                queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except BaseException as error:  # noqa: BLE001 -- handed to the consumer
            queue.put_nowait((index, error))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for generator in generators:
            await generator.aclose()


def raise_if_error(output: RequestOutput, completion: CompletionOutput) -> None:
    """A request the engine ended in error: a stream reports it in-band instead of just stopping."""
    if completion.finish_reason == "error":
        raise request_error(output.finish_message or "The engine ended the request with an error.")


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def sse(chunk: BaseModel, *, exclude_unset: bool = False, exclude_none: bool = False) -> str:
    """One server-sent event, leaving out the fields nobody set, or the null ones, when asked."""
    return f"data: {chunk.model_dump_json(exclude_unset=exclude_unset, exclude_none=exclude_none)}\n\n"


def sse_error(error: Exception) -> str:
    """An error after the stream's headers went out can only be reported in-band, as vLLM does."""
    body = {"error": {"message": str(error), "type": "BadRequestError" if isinstance(error, ValueError)
                      else "InternalServerError", "param": getattr(error, "parameter", None),
                      "code": 400 if isinstance(error, ValueError) else 500}}
    return f"data: {json.dumps(body)}\n\n"


def floored(logprob: Logprob) -> float:
    return max(logprob.logprob, LOGPROB_FLOOR)


def prompt_logprobs_out(prompt_logprobs: PromptLogprobs | None) -> list[dict[int, dict[str, Any]] | None] | None:
    """Prompt logprobs as vLLM serialises its ``Logprob`` objects: {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if position is None else
            {token: {"logprob": floored(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token, lp in position.items()}
            for position in prompt_logprobs]
