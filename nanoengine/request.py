"""Request and its 12-state RequestStatus: the unit the scheduler moves around.

Chapter 5 (engine skeleton) walks the state machine; chapter 3 shows the scheduler
moving requests between the waiting and running queues.
vLLM 0.32 counterpart: ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).

The happy path is WAITING -> RUNNING -> FINISHED_*, with PREEMPTED as a detour
back to the waiting queue when KV blocks run out. The three WAITING_FOR_* states
are "blocked waiting": the request sits in the waiting queue but the scheduler
skips it until the thing it waits for (a grammar, remote KV, more prompt) is ready.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanoengine.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreRequest, FinishReason
from nanoengine.sampling_params import SamplingParams
from nanoengine.spec_decode.metrics import RequestSpecDecodeMetrics

if TYPE_CHECKING:  # annotation only: importing it would pull the grammar backend in
    from nanoengine.structured_output.request import StructuredOutputRequest

# A block hash is an opaque, hashable digest of one full block of tokens plus the
# hash of the block before it (see core/kv_cache_utils.py). bytes keeps it compact.
BlockHash = bytes


class RequestStatus(enum.IntEnum):
    """The 12 states of vLLM 0.32, in vLLM's order. The order is load-bearing:
    every FINISHED_* value sorts after PREEMPTED, so ``is_finished`` is one compare.
    """

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything below this line is a terminal state.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Finished means "ordered after PREEMPTED" -- no separate flag is kept."""
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        """The user-facing reason for a terminal state (None while still alive)."""
        return _FINISHED_REASONS.get(status)


# IGNORED (prompt too long) reads as "length" to the user, as in vLLM.
_FINISHED_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


class Request:
    """One request as the engine core tracks it: tokens so far, progress, state.

    ``num_computed_tokens`` counts tokens whose KV is (or, once the scheduled step
    runs, will be) in the cache. The scheduler advances it *when it schedules*,
    not when the model finishes -- the optimistic counting of chapter 3.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = priority

        # Every status change, timestamped (``time.monotonic``): chapter 5 prints
        # the transitions a request really went through. Set before ``status``.
        self.status_history: list[tuple[float, RequestStatus]] = []
        # Engine-core events (queued, scheduled, preempted) not yet sent to the
        # front end, which turns them into RequestMetrics (queue time, TTFT).
        self.events: list[EngineCoreEvent] = []
        # A grammar-constrained request starts blocked: its grammar compiles
        # on a thread pool and the scheduler promotes it once it is ready.
        self.structured_output_request: StructuredOutputRequest | None = None
        grammar_wanted = sampling_params.structured_outputs is not None
        self.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR if grammar_wanted else RequestStatus.WAITING
        # Streaming input: more prompt may still arrive (``append_prompt_token_ids``).
        self.streaming_input_open = False
        self.stop_reason: int | str | None = None
        # Set when the request ends as IGNORED or ERROR, so the user learns why.
        self.finish_message: str | None = None

        self.prompt_token_ids = list(prompt_token_ids)
        self._output_token_ids: list[int] = []
        # prompt + outputs in one list: the model runner and hasher read it often.
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling (chapter 7): tokens being sampled by steps still in
        # flight. They count as computed already, but their ids are unknown
        # until the step's output arrives; always 0 with the synchronous loop.
        self.num_output_placeholders = 0
        # Prompt tokens served by the prefix cache on first schedule (-1 = not yet known).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Prompt tokens whose KV a KV connector loaded instead (chapter 5).
        self.num_external_computed_tokens = 0
        # Chapter 10: what the client said about moving this request's KV between
        # engines (vLLM's kv_transfer_params). A copy: the connector updates it.
        params = (sampling_params.extra_args or {}).get("kv_transfer_params")
        self.kv_transfer_params: dict[str, Any] | None = dict(params) if params else None
        # Speculative decoding (chapter 9): the proposer's guesses for the next
        # tokens, set after each step, scheduled (and cleared) by the next one.
        # They are not part of ``all_token_ids`` until the target model keeps them.
        self.spec_token_ids: list[int] = []
        # Its verification steps, counted by the scheduler (None without speculation).
        self.spec_decode_metrics: RequestSpecDecodeMetrics | None = None

        # Hashes of every *full* block of this request's tokens, kept up to date
        # as tokens arrive so the prefix cache can look them up in O(1).
        self._block_hasher = block_hasher
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls,
        request: EngineCoreRequest,
        block_hasher: Callable[[Request], list[BlockHash]] | None,
    ) -> Request:
        req = cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            block_hasher=block_hasher,
        )
        req.streaming_input_open = request.streaming_input
        return req

    # ---- token bookkeeping -------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus the drafts waiting to be verified (vLLM's name)."""
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """prompt_logprobs need the logits of every prompt position (chapter 8), so
        none may come from the prefix cache; the request still writes its blocks
        into the cache for others.
        """
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Record newly sampled tokens and extend the block hashes they complete."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def append_prompt_token_ids(self, token_ids: list[int]) -> None:
        """Streaming input: the next piece of the prompt arrived (before any output)."""
        if self._output_token_ids:
            raise ValueError(f"Request {self.request_id!r} already generated tokens; its prompt is closed.")
        self.prompt_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    @property
    def num_prefillable_tokens(self) -> int:
        """Tokens the scheduler may compute now.

        All of them, except that an open streamed prompt holds back its last
        token: the forward pass that computes a prompt's last position also
        samples the first output, which must wait until the prompt is complete.
        The held-back token is computed with the next piece.
        """
        return self.num_tokens - 1 if self.streaming_input_open else self.num_tokens

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    # ---- state -------------------------------------------------------------

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, status: RequestStatus) -> None:
        # A property so that every transition is recorded wherever it happens;
        # re-setting the current status is no transition.
        if self.status_history and self.status_history[-1][1] == status:
            return
        self._status = status
        self.status_history.append((time.monotonic(), status))

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent.new_event(event_type))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """Hand the pending events to an output (None when there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
