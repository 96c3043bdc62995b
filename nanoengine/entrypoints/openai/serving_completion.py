"""OpenAIServingCompletion: ``POST /v1/completions``, as JSON or as a stream.

Chapter 8 (online serving). A completion request may hold several prompts
(a list of strings or of token-id lists); each becomes its own engine request
and its ``n`` choices are numbered prompt by prompt (prompt 1's choices come
after prompt 0's). ``echo`` puts the prompt in front of the answer -- its
text, its token ids and, with ``logprobs``, its tokens' logprobs, which is why
an echoing request also asks the engine for prompt logprobs.

The legacy logprobs shape is four parallel lists. ``text_offset`` says where
each token starts in the returned text; in a stream it runs on from chunk to
chunk, counted from the tokens already reported (not from the text sent: text
held back for a possible stop string lags the tokens).

vLLM 0.32 counterpart: ``OpenAIServingCompletion`` in
``vllm/entrypoints/openai/completion/serving.py`` (``create_completion``,
``completion_stream_generator``, ``request_output_to_completion_response``,
``_create_completion_logprobs``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from nanoengine.entrypoints.openai.protocol_completion import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
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
from nanoengine.exceptions import ValidationError
from nanoengine.logprobs import Logprob
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.renderers.hf import RenderedPrompt
from nanoengine.sampling_params import SamplingParams

# One position's candidates; None for a prompt's first token (nothing precedes it).
PositionLogprobs = dict[int, Logprob] | None


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint."""

    def render_completion_request(self, request: CompletionRequest) -> tuple[SamplingParams, list[RenderedPrompt]]:
        """Validate everything before anything is queued (raises ValueError/TypeError).

        vLLM validates inside ``create_completion``; apart here, so that the
        route answers 400 before a stream has started.
        """
        self.check_max_tokens(request.requested_max_tokens(), request.max_tokens_param)
        params = request.to_sampling_params(request.requested_max_tokens())
        self.check_grammar(params)
        prompts = _prompt_list(request.prompt)
        if request.kv_transfer_params and len(prompts) != 1:
            raise ValidationError(f"kv_transfer_params needs one prompt, got {len(prompts)}.",
                                  parameter="kv_transfer_params")
        return params, [self.engine.renderer.render_prompt(p) for p in prompts]

    async def create_completion(
        self, request: CompletionRequest, params: SamplingParams, prompts: list[RenderedPrompt]
    ) -> CompletionResponse | AsyncIterator[str]:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generators = self.start_all(prompts, params, request_id, request.priority)
        if request.stream:
            return self.completion_stream_generator(request, request_id, generators)
        return self.request_output_to_completion_response(await last_outputs(generators), request, request_id)

    def request_output_to_completion_response(
        self, finals: list[RequestOutput], request: CompletionRequest, request_id: str
    ) -> CompletionResponse:
        """One response holding every prompt's ``n`` choices, numbered prompt by prompt."""
        choices: list[CompletionChoice] = []
        for final in finals:
            for output in final.outputs:
                text, token_ids, logprobs = self._with_echo(request, final, output)
                choices.append(CompletionChoice(
                    index=len(choices), text=text, logprobs=self._logprobs_if_asked(request, token_ids, logprobs),
                    finish_reason=output.finish_reason, stop_reason=output.stop_reason,
                    token_ids=list(output.token_ids) if request.return_token_ids else None,
                    prompt_logprobs=prompt_logprobs_out(final.prompt_logprobs),
                    prompt_token_ids=final.prompt_token_ids if request.return_token_ids else None))
        prompt_tokens = sum(len(final.prompt_token_ids) for final in finals)
        completion_tokens = sum(len(c.token_ids) for final in finals for c in final.outputs)
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                  system_fingerprint=self.system_fingerprint,
                                  usage=usage(prompt_tokens, completion_tokens),
                                  kv_transfer_params=finals[0].kv_transfer_params if finals else None)

    async def completion_stream_generator(
        self, request: CompletionRequest, request_id: str, generators: list[AsyncGenerator[RequestOutput, None]]
    ) -> AsyncIterator[str]:
        """One chunk per choice per step (the engine sends only what is new), then usage, then [DONE]."""
        num_choices = request.n * len(generators)
        next_text_offset = [0] * num_choices
        tokens_sent = [0] * num_choices
        prompt_sent = [False] * num_choices  # the echo (or prompt ids) goes with a choice's first chunk
        prompt_tokens = [0] * len(generators)
        created = int(time.time())
        include_usage = request.stream_options is not None and request.stream_options.include_usage
        try:
            async for prompt_index, output in merged(generators):
                prompt_tokens[prompt_index] = len(output.prompt_token_ids)
                for completion in output.outputs:
                    raise_if_error(output, completion)
                    i = prompt_index * request.n + completion.index
                    # The prompt (echo) or its ids (return_token_ids) ride on a choice's first chunk only.
                    first = not prompt_sent[i]
                    prompt_sent[i] = prompt_sent[i] or request.echo or request.return_token_ids
                    if first and request.echo:
                        text, token_ids, logprobs = self._with_echo(request, output, completion)
                    else:
                        text, token_ids, logprobs = completion.text, completion.token_ids, completion.logprobs
                        if not (text or token_ids or tokens_sent[i]):
                            continue  # a prefill step with nothing to say yet
                    chunk_logprobs = self._logprobs_if_asked(request, token_ids, logprobs, next_text_offset[i])
                    # The next chunk's offsets run on from this chunk's last token.
                    if chunk_logprobs is not None and chunk_logprobs.tokens:
                        next_text_offset[i] = chunk_logprobs.text_offset[-1] + len(chunk_logprobs.tokens[-1])
                    tokens_sent[i] += len(completion.token_ids)
                    choice = CompletionStreamChoice(
                        index=i, text=text, logprobs=chunk_logprobs, finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                        # An echo shows the prompt's ids with its text, as vLLM's does.
                        prompt_token_ids=output.prompt_token_ids if first and prompt_sent[i] else None,
                        token_ids=list(completion.token_ids) if request.return_token_ids else None)
                    chunk = CompletionStreamResponse(id=request_id, object="text_completion", created=created,
                                                     model=self.served_model_name, choices=[choice])
                    if completion.finish_reason is not None and not include_usage:
                        chunk.system_fingerprint = self.system_fingerprint  # the stream's last chunk
                    yield sse(chunk, exclude_unset=True)
            if include_usage:
                last = CompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                choices=[], usage=usage(sum(prompt_tokens), sum(tokens_sent)),
                                                system_fingerprint=self.system_fingerprint)
                yield sse(last, exclude_none=True)
        except Exception as error:  # noqa: BLE001 -- the headers are sent: report in-band
            yield sse_error(error)
        yield "data: [DONE]\n\n"

    def _with_echo(
        self, request: CompletionRequest, output: RequestOutput, completion: CompletionOutput
    ) -> tuple[str, list[int], Sequence[PositionLogprobs] | None]:
        """Text, token ids and logprobs of one choice, the prompt's in front when ``echo`` asks."""
        if not request.echo:
            return completion.text, completion.token_ids, completion.logprobs
        logprobs = None if request.logprobs is None else [*(output.prompt_logprobs or []),
                                                          *(completion.logprobs or [])]
        return (self.prompt_text(output) + completion.text, [*output.prompt_token_ids, *completion.token_ids],
                logprobs)

    def _logprobs_if_asked(
        self, request: CompletionRequest, token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs] | None,
        initial_text_offset: int = 0,
    ) -> CompletionLogProbs | None:
        if request.logprobs is None:
            return None
        return self._create_completion_logprobs(token_ids, logprobs or [], request.logprobs, initial_text_offset)

    def _create_completion_logprobs(
        self, token_ids: Sequence[int], top_logprobs: Sequence[PositionLogprobs], num_top: int,
        initial_text_offset: int,
    ) -> CompletionLogProbs:
        """The four parallel lists. Each position's top entries are the chosen token, then up
        to ``num_top`` of the most likely ones (the chosen token is not repeated if among them)."""
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        top: list[dict[str, float] | None] = []
        offset = initial_text_offset
        for token_id, position in zip(token_ids, top_logprobs):
            if position is None:  # a prompt's first token: nothing to score it against
                token = self.decoded(token_id, None)
                token_logprobs.append(None)
                top.append(None)
            else:
                token = self.decoded(token_id, position[token_id])
                token_logprobs.append(floored(position[token_id]))
                top.append({self.decoded(tid, lp): floored(lp)
                            for rank, (tid, lp) in enumerate(position.items()) if rank <= num_top})
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
        # Built whole, not filled in place: a stream chunk sends only the fields set at construction.
        return CompletionLogProbs(text_offset=text_offset, token_logprobs=token_logprobs, tokens=tokens,
                                  top_logprobs=top)


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]] | None) -> list[Any]:
    """OpenAI's four prompt shapes, as a list of nanoengine prompts."""
    if not prompt:
        raise ValidationError("prompt must be given and must not be empty.", parameter="prompt")
    if isinstance(prompt, str):
        return [prompt]
    items: list[Any] = list(prompt)
    if all(isinstance(item, int) for item in items):
        return [{"prompt_token_ids": items}]
    return [item if isinstance(item, str) else {"prompt_token_ids": list(item)} for item in items]
