"""OpenAIServingChat: ``POST /v1/chat/completions``, as JSON or as a stream.

Chapter 8 (online serving). The conversation goes through the model's chat
template (``add_generation_prompt`` opens the assistant's turn) and becomes
one engine request holding all ``n`` choices.

A stream opens, for every choice, with a chunk that only names the speaker
(``{"role": "assistant", "content": ""}``); then each step brings one chunk
per choice that moved, carrying its new text and, if asked, the logprobs of
its new tokens; a choice's last chunk carries its ``finish_reason``. With
``echo``, the conversation's last message, when the assistant wrote it, comes
back in front of the answer.

vLLM 0.32 counterpart: ``OpenAIServingChat`` in
``vllm/entrypoints/openai/chat_completion/serving.py`` (``create_chat_completion``,
``chat_completion_stream_generator``, ``chat_completion_full_generator``,
``_create_chat_logprobs``). vLLM's reasoning and tool-call parsers sit in the
same loops; this server has neither (``tools`` is refused by name).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from nanoengine.entrypoints.openai.protocol_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessageOut,
    ChatStreamChoice,
)
from nanoengine.entrypoints.openai.serving import (
    OpenAIServing,
    floored,
    last_outputs,
    merged,
    prompt_logprobs_out,
    raise_if_error,
    sse,
    sse_error,
    usage,
)
from nanoengine.logprobs import Logprob
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.renderers.hf import RenderedPrompt
from nanoengine.sampling_params import SamplingParams

ASSISTANT = "assistant"


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint."""

    def render_chat_request(self, request: ChatCompletionRequest) -> tuple[SamplingParams, RenderedPrompt]:
        """Validate everything and render the conversation before anything is queued."""
        self.check_max_tokens(request.requested_max_tokens(), request.max_tokens_param)
        params = request.to_sampling_params(request.requested_max_tokens())
        self.check_grammar(params)
        prompt = self.engine.renderer.render_chat(request.conversation(),
                                                  add_generation_prompt=request.add_generation_prompt,
                                                  chat_template_kwargs={"tools": request.tools} if request.tools else None)
        return params, prompt

    async def create_chat_completion(
        self, request: ChatCompletionRequest, params: SamplingParams, prompt: RenderedPrompt
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        # One engine request carries all n choices: the output processor splits
        # it into n samples and gathers them back (chapter 7).
        generator = self.engine.generate(prompt, params, request_id, priority=request.priority)
        if request.stream:
            return self.chat_completion_stream_generator(request, request_id, generator)
        return await self.chat_completion_full_generator(request, request_id, generator)

    async def chat_completion_full_generator(
        self, request: ChatCompletionRequest, request_id: str, generator: AsyncGenerator[RequestOutput, None]
    ) -> ChatCompletionResponse:
        """The whole answer as one response, once the request has finished."""
        (final,) = await last_outputs([generator])
        echoed = _echoed_text(request)
        # "stop" stands in for a missing reason: OpenAI's default, kept by vLLM.
        choices = [
            ChatChoice(index=c.index, message=ChatMessageOut(content=echoed + c.text),
                       logprobs=self._logprobs_if_asked(request, c), finish_reason=c.finish_reason or "stop",
                       stop_reason=c.stop_reason, token_ids=list(c.token_ids) if request.return_token_ids else None)
            for c in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices,
            system_fingerprint=self.system_fingerprint,
            usage=usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs)),
            prompt_logprobs=prompt_logprobs_out(final.prompt_logprobs),
            prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None,
            kv_transfer_params=final.kv_transfer_params)

    async def chat_completion_stream_generator(
        self, request: ChatCompletionRequest, request_id: str, generator: AsyncGenerator[RequestOutput, None]
    ) -> AsyncIterator[str]:
        """Role chunks, (echo chunks,) one chunk per moved choice per step, usage, [DONE]."""
        created = int(time.time())

        include_usage = request.stream_options is not None and request.stream_options.include_usage

        def chunk(choice: ChatStreamChoice, opening: bool = False) -> str:
            message = ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created,
                                          model=self.served_model_name, choices=[choice])
            if opening:  # set, even to null, so that it is sent: vLLM's opening chunks carry it
                message.prompt_token_ids = prompt_ids
            if choice.finish_reason is not None and not include_usage:
                message.system_fingerprint = self.system_fingerprint  # the stream's last chunk
            return sse(message, exclude_unset=True)

        tokens_sent = [0] * request.n  # per choice, for usage and to tell a first chunk
        finished = [False] * request.n  # a choice's finish chunk goes out once
        prompt_tokens = 0
        prompt_ids: list[int] | None = None
        try:
            async for _, output in merged([generator]):
                if prompt_tokens == 0:  # the first output: open every choice
                    prompt_tokens = len(output.prompt_token_ids)
                    prompt_ids = output.prompt_token_ids if request.return_token_ids else None
                    for i in range(request.n):
                        yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role=ASSISTANT, content=""),
                                                     logprobs=None, finish_reason=None), opening=True)
                    if echoed := _echoed_text(request):
                        for i in range(request.n):
                            yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(content=echoed), logprobs=None,
                                                         finish_reason=None))
                for completion in output.outputs:
                    raise_if_error(output, completion)
                    i = completion.index
                    # Nothing to show before the first token (a prefill step); after it, a chunk
                    # goes out even with no text (held back for a stop string), so that its
                    # tokens' logprobs are not lost.
                    if finished[i] or not (completion.text or completion.token_ids or tokens_sent[i]):
                        continue
                    tokens_sent[i] += len(completion.token_ids)
                    finished[i] = completion.finish_reason is not None
                    yield chunk(self._stream_choice(request, completion))
            if include_usage:
                last = ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created,
                                           model=self.served_model_name, choices=[],
                                           usage=usage(prompt_tokens, sum(tokens_sent)),
                                           system_fingerprint=self.system_fingerprint)
                yield sse(last, exclude_unset=True, exclude_none=True)
        except Exception as error:  # noqa: BLE001 -- the headers are sent: report in-band
            yield sse_error(error)
        yield "data: [DONE]\n\n"

    def _stream_choice(self, request: ChatCompletionRequest, completion: CompletionOutput) -> ChatStreamChoice:
        """One choice's new text; the last one also says why it ended."""
        token_ids = list(completion.token_ids) if request.return_token_ids else None
        delta = ChatDelta(content=completion.text)
        logprobs = self._logprobs_if_asked(request, completion)
        if completion.finish_reason is None:
            return ChatStreamChoice(index=completion.index, delta=delta, logprobs=logprobs, finish_reason=None,
                                    token_ids=token_ids)
        return ChatStreamChoice(index=completion.index, delta=delta, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                token_ids=token_ids)

    def _logprobs_if_asked(self, request: ChatCompletionRequest, completion: CompletionOutput) -> ChatLogProbs | None:
        if not request.logprobs:
            return None
        return self._create_chat_logprobs(completion.token_ids, completion.logprobs or [], request.top_logprobs or 0)

    def _create_chat_logprobs(
        self, token_ids: Sequence[int], positions: Sequence[dict[int, Logprob]], num_top: int
    ) -> ChatLogProbs:
        """One entry per token: its text, logprob and UTF-8 bytes, and the first ``num_top``
        candidates of its position (the chosen token first, then the most likely ones)."""
        content = []
        for token_id, position in zip(token_ids, positions):
            chosen = position[token_id]
            token = self.decoded(token_id, chosen)
            top = [ChatLogProb(token=(text := self.decoded(tid, lp)), logprob=floored(lp), bytes=_utf8(text))
                   for rank, (tid, lp) in enumerate(position.items()) if rank < num_top]
            content.append(ChatLogProbsContent(
                token=token, logprob=floored(chosen),
                bytes=None if chosen.decoded_token is None else _utf8(chosen.decoded_token), top_logprobs=top))
        return ChatLogProbs(content=content)


def _echoed_text(request: ChatCompletionRequest) -> str:
    """With ``echo``: the last message's text when the assistant wrote it (the answer continues it)."""
    last = request.messages[-1]
    return last.text() if request.echo and last.role == ASSISTANT else ""


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
