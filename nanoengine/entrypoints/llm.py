"""LLM: the offline entry point -- ``LLM(model)`` prepares, ``generate(...)`` runs.

Chapter 1 (quickstart) uses it; chapter 5 starts the source map here; chapter 6
is what ``LLM(...)`` builds and chapter 7 what ``generate(...)`` drives.
vLLM 0.32 counterpart: ``vllm/entrypoints/llm.py`` (``LLM``: ``generate``, ``chat``,
``_validate_and_add_requests``, ``_run_engine``).

A vLLM offline script that uses this subset runs by changing only its import.

This class is where the teaching instruments meet the engine from outside
(``nanoengine/instruments/``): ``print(llm)`` draws the component tree, and
``llm.trace`` reads the step tracer that the instruments' plugin attached to
the engine core, and ``llm.serve_ui()`` opens the live view of chapters 3-5
and 9 in a browser. Nothing under ``engine/`` or ``core/`` imports them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.instruments.component_tree import install_tree_printing
from nanoengine.instruments.trace import EngineTrace, trace_of
from nanoengine.outputs import RequestOutput
from nanoengine.plugins import PLUGINS_ENV
from nanoengine.renderers.hf import ChatMessage, PromptType, RenderedPrompt
from nanoengine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from nanoengine.instruments.live_view.offline import LiveViewServer


class LLM:
    """Builds the whole engine at construction; each call runs it to completion."""

    def __init__(self, model: str = "SmolLM2-135M-Instruct", **kwargs: Any) -> None:
        engine_args = EngineArgs.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()
        install_tree_printing()  # print(llm), print(llm.llm_engine): the tree of chapter 5

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    @property
    def trace(self) -> EngineTrace | None:
        """What each engine step scheduled, allocated and preempted (chapters 3-4).

        None unless built with ``trace=True`` (or ``NANOENGINE_TRACE=1``). The
        recorder watches the in-process engine core's scheduler from outside.
        """
        if not self.llm_engine.engine_config.observability_config.trace:
            return None
        trace = trace_of(self.llm_engine.engine_core.get_engine_core())
        if trace is None:
            raise RuntimeError(
                "trace=True, but no step recorder was attached: the engine core plugin 'instruments' "
                f"did not run (it is not installed, or {PLUGINS_ENV} leaves it out). Install the package "
                "(pip install -e .) and leave NANOENGINE_PLUGINS unset, or list 'instruments' in it."
            )
        return trace

    def serve_ui(self, port: int = 0, allow_control: bool = True) -> LiveViewServer:
        """The live view of this engine, served on 127.0.0.1 (``port`` 0: a free one).

        Open the returned ``.url`` in a browser, then call ``generate`` as
        usual: the page draws every step. With ``allow_control`` its buttons
        pause the engine and let it run one ``EngineCore.step()`` per click
        (``generate`` waits meanwhile). ``.close()`` stops the page's server.
        """
        from nanoengine.instruments.live_view.offline import serve_live_view  # uvicorn: only when asked

        return serve_live_view(self.llm_engine.engine_core, port, allow_control)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        ``priority`` (one int per prompt; else each ``SamplingParams.priority``)
        matters with ``LLM(scheduling_policy="priority")``: lower values are
        admitted first and preempted last, ties go by arrival (chapter 3).
        """
        prompt_list = _as_prompt_list(prompts)
        renderer = self.llm_engine.renderer
        rendered = [renderer.render_prompt(p) for p in prompt_list]
        return self._run(rendered, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them), then generate."""
        conversations = _as_conversation_list(messages)
        renderer = self.llm_engine.renderer
        rendered = [
            renderer.render_chat(conv, add_generation_prompt, chat_template_kwargs) for conv in conversations
        ]
        return self._run(rendered, sampling_params, use_tqdm, None)

    # ---- internals -----------------------------------------------------------

    def _run(
        self,
        rendered: list[RenderedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        request_ids = self._validate_and_add_requests(rendered, sampling_params, priority)
        return self._run_engine(request_ids, use_tqdm)

    def _validate_and_add_requests(
        self,
        rendered: list[RenderedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[str]:
        """Add every request, or none: if one fails validation, the ones already
        added are aborted so the engine is left exactly as it was.
        """
        params_list = _broadcast("sampling_params", sampling_params or SamplingParams(), len(rendered))
        priorities = list(priority) if priority is not None else [0] * len(rendered)
        if len(priorities) != len(rendered):
            raise ValueError(f"priority has {len(priorities)} entries for {len(rendered)} prompts.")
        added: list[str] = []
        try:
            for prompt, params, prio in zip(rendered, params_list, priorities):
                request_id = str(next(self._request_counter))
                self.llm_engine.add_rendered_request(request_id, prompt, _final_only(params), priority=prio)
                added.append(request_id)
        except (ValueError, TypeError):
            self.llm_engine.abort_request(added)
            raise
        return added

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is finished; keep only final outputs."""
        finished: dict[str, RequestOutput] = {}
        progress = _progress_bar(len(request_ids)) if use_tqdm else None
        while self.llm_engine.has_unfinished_requests():
            for output in self.llm_engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]  # type: ignore[list-item]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}.")
    return list(prompts)


def _as_conversation_list(
    messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
) -> list[Sequence[ChatMessage]]:
    """One conversation is a list of dicts; a batch is a list of such lists."""
    if messages and isinstance(messages[0], Mapping):
        return [messages]  # type: ignore[list-item]
    return list(messages)  # type: ignore[arg-type]


def _broadcast(name: str, value: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    """One SamplingParams for all prompts, or exactly one per prompt."""
    if isinstance(value, SamplingParams):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries for {count} prompts; give one or one per prompt.")
    return values


def _final_only(params: SamplingParams) -> SamplingParams:
    """A copy that asks for one output per request, at the end: ``_run_engine`` keeps
    nothing else, so per-step outputs would be built only to be dropped. (vLLM's
    ``LLM`` sets the user's own object to FINAL_ONLY; a copy leaves it as given.)
    """
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    copy = params.clone()
    copy.output_kind = RequestOutputKind.FINAL_ONLY
    return copy


def _progress_bar(total: int) -> Any:
    from tqdm.auto import tqdm  # transformers depends on tqdm, so it is present

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
