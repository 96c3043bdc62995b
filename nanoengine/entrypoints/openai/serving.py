"""OpenAIServing: from an OpenAI request body to AsyncLLM calls and back to JSON or SSE.

Chapter 8 (online serving). One handler per endpoint, all shaped alike:

1. the request body (already parsed by FastAPI into a protocol model) becomes
   ``SamplingParams`` and rendered prompts -- any ``ValueError`` or
   ``TypeError`` here is the client's mistake and becomes a 400;
2. each prompt becomes one ``AsyncLLM.generate`` generator (``n`` samples ride
   in one request, as in vLLM);
3. without ``stream``, the last output of every generator becomes one JSON
   response; with it, every output becomes a server-sent event holding only
   what is new since the previous one (the engine's outputs are cumulative),
   then ``data: [DONE]``.

While a request streams, the detokenizer holds back text that might be the
start of a stop string until it is clear that it is not, so a client never
receives the first half of a stop string the engine then cuts away.

vLLM 0.32 counterpart: ``vllm/entrypoints/openai/completion/serving.py`` and
``vllm/entrypoints/openai/chat_completion/serving.py`` (``OpenAIServingCompletion``,
``OpenAIServingChat``), with their shared base ``OpenAIServing``. The methods
keep vLLM's names (``create_completion``, ``request_output_to_completion_response``,
``create_chat_completion``, ``chat_completion_full_generator``); two things
differ on purpose. One class serves both endpoints: they share everything but
the response shapes. And one ``stream_generator`` stands for vLLM's
``completion_stream_generator`` and ``chat_completion_stream_generator``: the
two differ only in the chunk they build, which the caller passes in.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from nanoengine.engine.async_llm import AsyncLLM
from nanoengine.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.renderers.hf import RenderedPrompt
from nanoengine.sampling_params import SamplingParams


class OpenAIServing:
    """Runs completions and chat completions on one ``AsyncLLM``."""

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name

    # ---- /v1/completions ---------------------------------------------------------------

    def prepare_completion(self, request: CompletionRequest) -> tuple[SamplingParams, list[RenderedPrompt]]:
        """Validate everything before anything is queued (raises ValueError/TypeError).

        vLLM validates inside ``create_completion``; apart here, so that the
        route answers 400 before a stream has started.
        """
        params = request.to_sampling_params()
        return params, [self.engine.renderer.render_prompt(p) for p in _prompt_list(request.prompt)]

    async def create_completion(
        self, request: CompletionRequest, params: SamplingParams, prompts: list[RenderedPrompt]
    ) -> CompletionResponse | AsyncIterator[str]:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generators = self._start_all(prompts, params, request_id, request.priority)
        if request.stream:
            return self.stream_generator(request, request_id, generators, _completion_chunk)
        finals = await _last_outputs(generators)
        return self.request_output_to_completion_response(finals, request, request_id, params)

    def request_output_to_completion_response(
        self, finals: list[RequestOutput], request: CompletionRequest, request_id: str, params: SamplingParams
    ) -> CompletionResponse:
        """One response holding every prompt's ``n`` choices, numbered prompt by prompt."""
        choices = [
            CompletionChoice(index=i * params.n + c.index, text=_echoed(request, final, c),
                             logprobs=_completion_logprobs(c), finish_reason=c.finish_reason,
                             stop_reason=c.stop_reason)
            for i, final in enumerate(finals) for c in final.outputs
        ]
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=choices, usage=_usage(finals))

    # ---- /v1/chat/completions -------------------------------------------------------------

    def prepare_chat(self, request: ChatCompletionRequest) -> tuple[SamplingParams, RenderedPrompt]:
        params = request.to_sampling_params()
        return params, self.engine.renderer.render_chat(request.conversation())

    async def create_chat_completion(
        self, request: ChatCompletionRequest, params: SamplingParams, prompt: RenderedPrompt
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generators = self._start_all([prompt], params, request_id, request.priority)
        if request.stream:
            return self.stream_generator(request, request_id, generators, _chat_chunk)
        return await self.chat_completion_full_generator(request_id, generators)

    async def chat_completion_full_generator(
        self, request_id: str, generators: list[AsyncGenerator[RequestOutput, None]]
    ) -> ChatCompletionResponse:
        """The whole answer as one response, once the request has finished."""
        (final,) = await _last_outputs(generators)
        choices = [
            ChatChoice(index=c.index, message=ChatMessageOut(content=c.text), logprobs=_chat_logprobs(c),
                       finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in final.outputs
        ]
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                      usage=_usage([final]))

    def _start_all(
        self, prompts: list[RenderedPrompt], params: SamplingParams, request_id: str, priority: int
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """One engine request per prompt, all or none: a refused prompt aborts those sent before it."""
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        generators: list[AsyncGenerator[RequestOutput, None]] = []
        try:
            for prompt, core_id in zip(prompts, ids):
                generators.append(self.engine.generate(prompt, params, core_id, priority=priority))
        except BaseException:
            self.engine.abort_request(ids[: len(generators)])
            raise
        return generators

    # ---- streaming ----------------------------------------------------------------------------

    async def stream_generator(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        generators: list[AsyncGenerator[RequestOutput, None]],
        make_chunk: Any,
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per new piece of text, then usage, then [DONE]."""
        n = request.n
        sent: dict[int, int] = {}  # choice index -> characters already sent
        finals: dict[int, RequestOutput] = {}
        try:
            async for prompt_index, output in _merged(generators):
                for completion in output.outputs:
                    index = prompt_index * n + completion.index
                    start = sent.get(index, 0)
                    if len(completion.text) <= start and completion.finish_reason is None:
                        continue
                    sent[index] = max(len(completion.text), start)
                    chunk = make_chunk(request_id, self.served_model_name, index, completion,
                                       completion.text[start:], first=start == 0)
                    yield _sse(chunk)
                if output.finished:
                    finals[prompt_index] = output
            if request.stream_options is not None and request.stream_options.include_usage:
                usage_chunk = make_chunk(request_id, self.served_model_name, None, None, "", first=False)
                usage_chunk.usage = _usage(list(finals.values()))
                yield _sse(usage_chunk)
        except Exception as error:  # noqa: BLE001 -- the headers are sent: report in-band
            yield "data: " + json.dumps({"error": {"message": str(error), "type": type(error).__name__,
                                                   "param": None, "code": 500}}) + "\n\n"
        yield "data: [DONE]\n\n"


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Any]:
    """OpenAI's four prompt shapes, as a list of nanoengine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty.")
    items: list[Any] = list(prompt)
    if all(isinstance(item, int) for item in items):
        return [{"prompt_token_ids": items}]
    return [item if isinstance(item, str) else {"prompt_token_ids": list(item)} for item in items]


async def _last_outputs(generators: Sequence[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput]:
    """Run every generator to its end; a request the engine refused is the client's error."""
    finals: dict[int, RequestOutput] = {}
    async for index, output in _merged(generators):
        finals[index] = output
    for final in finals.values():
        refused = [c for c in final.outputs if not c.token_ids and c.finish_reason in ("length", "error")]
        if final.finish_message and refused:
            raise ValueError(final.finish_message)
    return [finals[index] for index in range(len(generators))]


async def _merged(
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


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def _completion_chunk(request_id: str, model: str, index: int | None, completion: CompletionOutput | None,
                      text: str, first: bool) -> CompletionResponse:
    if completion is None or index is None:
        return CompletionResponse(id=request_id, model=model, choices=[])
    return CompletionResponse(id=request_id, model=model, choices=[
        CompletionChoice(index=index, text=text, finish_reason=completion.finish_reason,
                         stop_reason=completion.stop_reason)])


def _chat_chunk(request_id: str, model: str, index: int | None, completion: CompletionOutput | None,
                text: str, first: bool) -> ChatCompletionChunk:
    if completion is None or index is None:
        return ChatCompletionChunk(id=request_id, model=model, choices=[])
    delta = ChatDelta(role="assistant" if first else None, content=text)
    return ChatCompletionChunk(id=request_id, model=model, choices=[
        ChatStreamChoice(index=index, delta=delta, finish_reason=completion.finish_reason)])


def _echoed(request: CompletionRequest, final: RequestOutput, completion: CompletionOutput) -> str:
    return (final.prompt or "") + completion.text if request.echo else completion.text


def _usage(finals: list[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
    completion_tokens = sum(len(c.token_ids) for final in finals for c in final.outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def _token_logprobs(completion: CompletionOutput) -> list[tuple[int, Any]]:
    """(sampled token id, its {token id: Logprob} dict) per generated token."""
    logprobs = getattr(completion, "logprobs", None) or []
    return list(zip(completion.token_ids, logprobs))


def _completion_logprobs(completion: CompletionOutput) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists of tokens, logprobs and top alternatives."""
    pairs = _token_logprobs(completion)
    if not pairs:
        return None
    return {
        "tokens": [ranked[token].decoded_token for token, ranked in pairs],
        "token_logprobs": [ranked[token].logprob for token, ranked in pairs],
        "top_logprobs": [{lp.decoded_token: lp.logprob for lp in ranked.values()} for _, ranked in pairs],
        "text_offset": [],
    }


def _chat_logprobs(completion: CompletionOutput) -> dict[str, Any] | None:
    """The chat shape: one entry per token, each with its top alternatives."""
    pairs = _token_logprobs(completion)
    if not pairs:
        return None
    content = []
    for token, ranked in pairs:
        chosen = ranked[token]
        top = sorted(ranked.values(), key=lambda lp: lp.rank if lp.rank is not None else len(ranked))
        content.append({
            "token": chosen.decoded_token, "logprob": chosen.logprob,
            "bytes": list((chosen.decoded_token or "").encode()),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                              "bytes": list((lp.decoded_token or "").encode())} for lp in top],
        })
    return {"content": content}
