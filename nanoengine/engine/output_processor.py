"""OutputProcessor: engine-core outputs (token ids) -> RequestOutputs (text, reasons).

Chapter 7 (``generate(...)``) ends each step here: new token ids are detokenized,
stop strings are checked (a match asks the engine core to abort the request),
and the ``n`` samples of one prompt are gathered into one RequestOutput.
vLLM 0.32 counterpart: ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``,
``RequestState``) and ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nanoengine.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from nanoengine.engine.detokenizer import IncrementalDetokenizer
from nanoengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoengine.utils.component_tree import TreeNode


@dataclass
class RequestState:
    """The front end's view of one engine-core request (one of the ``n`` samples)."""

    request_id: str
    parent: ParentRequest
    index: int  # which of the parent's n samples this is
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=list(self.token_ids),
            finish_reason=str(self.finish_reason) if self.finish_reason is not None else None,
            stop_reason=self.stop_reason,
        )


@dataclass
class ParentRequest:
    """One user request; its ``n`` samples run as separate engine-core requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    children: list[RequestState] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_external_computed_tokens: int = 0
    finish_message: str | None = None

    @property
    def finished(self) -> bool:
        return all(child.finish_reason is not None for child in self.children)

    def make_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[child.completion() for child in self.children],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            finish_message=self.finish_message,
            num_external_computed_tokens=self.num_external_computed_tokens,
        )


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # Requests that hit a stop string: the engine core must stop computing them.
    reqs_to_abort: list[str]


class OutputProcessor(TreeNode):
    """Tracks every live request on the front-end side."""

    tree_children = ()

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def tree_label_extra(self) -> str | None:
        return f"live requests={len(self.parents)}"

    def add_request(self, parent: ParentRequest, request: EngineCoreRequest, index: int) -> None:
        """Register one sample of ``parent`` (call once per child, in index order)."""
        state = RequestState(
            request_id=request.request_id,
            parent=parent,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.sampling_params),
        )
        parent.children.append(state)
        self.request_states[request.request_id] = state
        self.parents[parent.request_id] = parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Fold one step's outputs in; one RequestOutput per touched parent."""
        touched: dict[str, ParentRequest] = {}
        reqs_to_abort: list[str] = []
        now = time.monotonic()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted by the user while the step ran
                continue
            parent = state.parent
            parent.metrics.record_engine_output(output.events, len(output.new_token_ids), now)
            parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
            parent.num_external_computed_tokens = max(
                parent.num_external_computed_tokens, output.num_external_computed_tokens
            )
            state.token_ids.extend(output.new_token_ids)
            stop_string = state.detokenizer.update(output.new_token_ids)
            if stop_string is not None and output.finish_reason is None:
                # The text matched a stop string the engine core cannot see.
                state.finish_reason, state.stop_reason = FinishReason.STOP, stop_string
                reqs_to_abort.append(output.request_id)
            elif output.finish_reason is not None:
                state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason
                parent.finish_message = parent.finish_message or output.finish_message
            touched[parent.request_id] = parent
        for parent in touched.values():
            if parent.finished:
                parent.metrics.record_finished(now)
                self._forget(parent)
        return OutputProcessorOutput([p.make_output() for p in touched.values()], reqs_to_abort)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget user requests (parent ids); return their engine-core ids."""
        core_ids: list[str] = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            if parent is not None:
                core_ids.extend(child.request_id for child in parent.children)
                self._forget(parent)
        return core_ids

    def _forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.request_states.pop(child.request_id, None)
