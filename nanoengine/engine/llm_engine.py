"""LLMEngine: the front end's engine -- renderer, input/output processors, core client.

Chapter 5 (engine skeleton) draws it as the node under ``LLM`` with four members;
chapter 7 follows ``add_request`` and ``step`` through them.
vLLM 0.32 counterpart: ``vllm/v1/engine/llm_engine.py`` (``LLMEngine``:
``renderer``, ``input_processor``, ``output_processor``, ``engine_core``).

Everything here is about text and users (prompts, stop strings, ``n`` samples);
everything below ``engine_core`` is about tokens and blocks.

Chapter 6: ``skip_tokenizer_init=True`` (vLLM's switch) loads no tokenizer.
The four members are built all the same, with ``tokenizer=None``: the
renderer accepts only token-id prompts, the input processor refuses what needs
text (stop strings, grammars), and the outputs carry token ids with empty
text. The EOS ids then come from the generation config alone. It is never
turned on behind the user's back (vLLM does not either): a model folder without
a tokenizer fails in ``get_tokenizer`` with an error that names the switch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nanoengine.config import EngineConfig
from nanoengine.distributed.kv_transfer.factory import create_connector_scheduler
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.core_client import EngineCoreClient
from nanoengine.engine.input_processor import InputProcessor
from nanoengine.engine.output_processor import OutputProcessor, ParentRequest
from nanoengine.outputs import RequestMetrics, RequestOutput
from nanoengine.renderers.hf import HfRenderer, PromptType, RenderedPrompt
from nanoengine.sampling_params import SamplingParams
from nanoengine.transformers_utils.config import get_tokenizer
from nanoengine.transformers_utils.tokenizer import get_generation_eos_ids


class LLMEngine:
    """Adds requests, steps the engine, returns RequestOutputs (vLLM's offline API)."""

    def __init__(self, engine_config: EngineConfig, multiprocess_mode: bool = False, asyncio_mode: bool = False) -> None:
        self.engine_config = engine_config
        model_config = engine_config.model_config
        self.tokenizer = None if model_config.skip_tokenizer_init else get_tokenizer(model_config.model_path)
        self.renderer = HfRenderer(self.tokenizer)
        eos_ids = get_generation_eos_ids(model_config.model_path, self.tokenizer, model_config.hf_config)
        transfer = engine_config.kv_transfer_config
        self.input_processor = InputProcessor(
            model_config, eos_ids, async_scheduling=engine_config.scheduler_config.async_scheduling,
            kv_connector=create_connector_scheduler(transfer, engine_config.cache_config.block_size,
                                                    engine_config.parallel_config.tensor_parallel_size)
            if transfer else None,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Building the client builds the EngineCore: weights, profiling, KV cache;
        # with multiprocess_mode, in a process of its own (chapter 8).
        self.engine_core = EngineCoreClient.make_client(engine_config, multiprocess_mode, asyncio_mode)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config(), multiprocess_mode=engine_args.use_multiprocessing())

    def get_tokenizer(self) -> Any:
        """The HF tokenizer; None with ``skip_tokenizer_init=True``."""
        return self.tokenizer

    # ---- requests ----------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        streaming: bool = False,
    ) -> None:
        """Render, validate and queue one prompt (``n`` engine-core requests).

        ``streaming=True``: ``prompt`` is only the first piece; send the rest
        with ``append_prompt`` (chapter 5's WAITING_FOR_STREAMING_REQ).
        """
        rendered = self.renderer.render_prompt(prompt)
        self.add_rendered_request(request_id, rendered, params, arrival_time, priority, streaming)

    def add_rendered_request(
        self,
        request_id: str,
        rendered: RenderedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        streaming: bool = False,
    ) -> None:
        """Queue an already rendered prompt. Every check runs before anything is
        queued, so a bad request leaves the engine exactly as it was.
        """
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use by a live request.")
        if streaming and params.n != 1:
            raise ValueError(f"Streaming input supports n=1 only, got n={params.n}.")
        if streaming and params.prompt_logprobs is not None:
            # The prompt's last token is unknown until the input closes (chapter 8).
            raise ValueError("prompt_logprobs cannot be combined with streaming input.")
        priority = priority or params.priority
        core_requests = [
            self.input_processor.process_inputs(
                _child_id(request_id, index, params.n),
                rendered,
                _child_params(params, index),
                arrival_time,
                priority,
            )
            for index in range(params.n)
        ]
        parent = ParentRequest(
            request_id=request_id,
            prompt=rendered["prompt"],
            prompt_token_ids=rendered["prompt_token_ids"],
            metrics=RequestMetrics(arrival_time=core_requests[0].arrival_time),
        )
        for index, core_request in enumerate(core_requests):
            core_request.streaming_input = streaming
            self.output_processor.add_request(parent, core_request, index)
            self.engine_core.add_request(core_request)

    def append_prompt(self, request_id: str, prompt_token_ids: list[int], final: bool = False) -> None:
        """Streaming input: the next piece of a prompt added with ``streaming=True``.

        The engine prefills what has arrived and waits for more; ``final=True``
        closes the input (an empty piece may close it) and decoding starts.
        """
        parent = self.output_processor.parents.get(request_id)
        if parent is None:
            raise ValueError(f"Request id {request_id!r} is not a live request.")
        if prompt_token_ids or not final:
            self.input_processor.validate_token_ids(prompt_token_ids)
        max_len = self.engine_config.model_config.max_model_len
        if len(parent.prompt_token_ids) + len(prompt_token_ids) > max_len:
            raise ValueError(
                f"The streamed prompt would be {len(parent.prompt_token_ids) + len(prompt_token_ids)} tokens "
                f"long, longer than max_model_len={max_len}."
            )
        self.engine_core.append_prompt(request_id, list(prompt_token_ids), final)
        parent.prompt_token_ids.extend(prompt_token_ids)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests (by the ids given to add_request) and free their blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---- the loop (chapter 7) ------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: core outputs -> RequestOutputs for the touched requests."""
        core_outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(core_outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _child_id(request_id: str, index: int, n: int) -> str:
    """Samples of a request with n > 1 run as "<index>_<id>" in the core, as in vLLM."""
    return request_id if n == 1 else f"{index}_{request_id}"


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each sample gets n=1 and, if seeded, its own seed so samples differ."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child
