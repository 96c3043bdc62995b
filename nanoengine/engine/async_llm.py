"""AsyncLLM: the engine a server drives -- one async generator per request.

Chapter 8 (online serving). ``LLM.generate`` takes every prompt at once and
returns when all are done. A server gets requests one by one, at any time, and
must stream each one's tokens while the others run. ``AsyncLLM`` does that on
top of the same front end as ``LLMEngine`` (renderer, input processor, output
processor) with the engine core in its own process (``AsyncMPClient``):

* ``generate(prompt, params, request_id)`` sends the request at once (a bad
  one raises there) and returns an async generator; each ``RequestOutput`` the
  engine makes for it is yielded as it arrives, the last with ``finished=True``;
* one **output handler** task, started with the first request, pulls batches of
  ``EngineCoreOutputs`` from the client, runs them through the output processor
  (detokenizing, stop strings, ``n > 1``) and puts each ``RequestOutput`` into
  the queue of the request it belongs to (vLLM's ``RequestOutputCollector``);
* a consumer that stops listening -- an HTTP client that disconnects -- closes
  its generator, and the request is aborted in the core at once, freeing its
  KV blocks;
* if the core process dies, every waiting generator raises ``EngineDeadError``.

vLLM 0.32 counterpart: ``vllm/v1/engine/async_llm.py`` (``AsyncLLM``:
``generate``, ``abort``, ``output_handler``, ``shutdown``). vLLM's class holds
the same four members as ``LLMEngine`` side by side; here it inherits them from
``LLMEngine``, so the path of a request into the engine is written once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any

from nanoengine.config import EngineConfig
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.core_client import AsyncMPClient
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import RequestOutput
from nanoengine.renderers.hf import PromptType, RenderedPrompt
from nanoengine.sampling_params import SamplingParams


class AsyncLLM(LLMEngine):
    """``LLMEngine``'s front end, an engine-core process, and a generator per request."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config, asyncio_mode=True)
        assert isinstance(self.engine_core, AsyncMPClient)
        self.client: AsyncMPClient = self.engine_core
        # request id -> the queue its generator reads (vLLM's RequestOutputCollector).
        self.collectors: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.output_handler: asyncio.Task[None] | None = None
        self.dead_error: BaseException | None = None
        # Called with every finished RequestOutput: a caller's own hooks (chapter 8's
        # walkthrough). A server's /metrics counts from output_processor.stat_loggers.
        self.finished_listeners: list[Callable[[RequestOutput], None]] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.create_engine_config())

    @property
    def errored(self) -> bool:
        """True once the engine core is gone: no request can finish any more."""
        return self.dead_error is not None

    def generate(
        self,
        prompt: PromptType | RenderedPrompt,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Send one request now; return the async generator of its ``RequestOutput``s.

        A bad request raises here, before anything is queued (a server answers
        400 before it starts a stream). A ``RenderedPrompt`` (a chat conversation
        already rendered, say) goes in as it is; anything else is rendered first.
        Closing the generator before the last output aborts the request in the
        engine core. Call it from the event loop that will read the outputs.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self.collectors:
            raise ValueError(f"Request id {request_id!r} is already in use by a live request.")
        rendered = prompt if _is_rendered(prompt) else self.renderer.render_prompt(prompt)  # type: ignore[arg-type]
        self.add_rendered_request(request_id, rendered, sampling_params, priority=priority)  # type: ignore[arg-type]
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.collectors[request_id] = queue
        self._start_output_handler()
        return self._outputs_of(request_id, queue)

    async def _outputs_of(
        self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.collectors.pop(request_id, None)
            if not finished and self.dead_error is None:
                # The consumer went away: free the request's KV blocks now.
                self.abort_request(request_id)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort in the engine core, and end the generators still reading these requests."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        super().abort_request(ids)
        for request_id in ids:
            queue = self.collectors.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(asyncio.CancelledError(f"request {request_id!r} was aborted"))

    async def abort(self, request_id: str) -> None:
        """vLLM's spelling: ``await engine.abort(request_id)``."""
        self.abort_request(request_id)

    async def get_stats(self) -> dict[str, Any]:
        """The scheduler's counters, from the core process (for ``/metrics``)."""
        stats: dict[str, Any] = await self.client.call_utility_async("get_stats")
        return stats

    def _start_output_handler(self) -> None:
        if self.output_handler is None or self.output_handler.done():
            self.output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        """Pull the core's outputs and route each to its request's queue, until the core dies.

        The one task that feeds every request's generator. Stop strings are
        found only here, on the text, so their requests are aborted in the core
        too; a finished output also goes to every ``finished_listeners`` entry
        (a caller's hooks), queue or no queue. Any exception (a dead core's
        ``EngineDeadError`` above all) is kept in ``dead_error`` and put into
        every queue, so no generator waits forever; ``shutdown`` cancelling the
        task ends it quietly.
        """
        try:
            while True:
                core_outputs = await self.client.get_output_async()
                processed = self.output_processor.process_outputs(core_outputs.outputs)
                if processed.reqs_to_abort:  # stop strings the core cannot see
                    self.client.abort_requests(processed.reqs_to_abort)
                for output in processed.request_outputs:
                    queue = self.collectors.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                    if output.finished:
                        for listener in self.finished_listeners:
                            listener(output)
        except Exception as error:  # noqa: BLE001 -- EngineDeadError above all: tell every request
            self.dead_error = error
            for queue in self.collectors.values():
                queue.put_nowait(error)

    def shutdown(self) -> None:
        if self.output_handler is not None:
            self.output_handler.cancel()
        super().shutdown()


def _is_rendered(prompt: object) -> bool:
    return isinstance(prompt, dict) and "prompt_token_ids" in prompt and "prompt" in prompt
