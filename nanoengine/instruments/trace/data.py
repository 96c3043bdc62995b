"""What the step tracer records: plain dataclasses, one ``StepTrace`` per engine step.

Chapters 3 (scheduler) and 4 (KV cache manager). A learner reads a run as a
list of steps: in step 7 the budget of 64 tokens went to three decodes and a
61-token prefill chunk, request 4 got blocks [12, 13], request 2 was preempted
for lack of blocks, KV usage was 94%. These classes hold exactly that, with no
rendering attached, so tests and notebooks can assert on them;
``nanoengine/instruments/trace/table.py`` prints them and ``nanoengine/instruments/trace/timeline.py``
draws them.

``EngineTrace.request_timelines()`` folds the steps into one row per request
(waiting, prefill, decode, recompute, preempted, stalled; then finished), the
shape of the timeline picture.

With speculative decoding (chapter 9) a decode chunk also carries the draft
tokens it verified, and how many of them the target model accepted: a
decode of ``1 + k`` tokens that moved the request on by ``1 + accepted``.

vLLM 0.32 counterpart: none (see ``nanoengine/instruments/trace/recorder.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Row states of a request's timeline, in the order a legend lists them.
TIMELINE_STATES = ("waiting", "prefill", "recompute", "decode", "stalled", "preempted")


@dataclass
class ScheduledChunk:
    """One request's share of one step: tokens [start, start + num_tokens)."""

    request_id: str
    kind: str  # "prefill", "decode" or "recompute" (see recorder._chunk_kind)
    start: int  # num_computed_tokens when scheduled (after any prefix-cache hit)
    num_tokens: int
    num_prompt_tokens: int
    # Blocks allocated for this chunk (a new request: its whole new table). The
    # pool's view: with several KV cache groups, theirs follow in group order.
    new_block_ids: list[int]
    num_cached_tokens: int  # prefix-cache hit on admission; 0 for a request already running
    # Speculative decoding (chapter 9): draft tokens among num_tokens, and how
    # many the target kept (read off the step's sampled tokens). 0 without drafts.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_rejected_tokens(self) -> int:
        """Drafts thrown away: the request's computed-token count was rolled back over them."""
        return self.num_draft_tokens - self.num_accepted_tokens


@dataclass
class Preemption:
    """A running request that lost its KV so another one could have blocks."""

    victim_id: str
    reason: str  # "out of KV blocks" or "priority"
    for_request_id: str  # whose allocation (or admission) needed the blocks


@dataclass
class StepTrace:
    """Everything one engine step decided, and the state it left."""

    step: int
    scheduled: list[ScheduledChunk] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    arrived: list[str] = field(default_factory=list)  # added since the previous step
    finished: dict[str, str] = field(default_factory=dict)  # request id -> FINISHED_* status
    # request id -> the blocks it gave back (finished or preempted requests), every
    # KV cache group's table in group order.
    freed_block_ids: dict[str, list[int]] = field(default_factory=dict)
    # Cached free blocks reused for new contents, in the order the LRU queue gave them.
    evicted_block_ids: list[int] = field(default_factory=list)
    kv_usage: float = 0.0  # after scheduling: fraction of usable blocks held
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    prefix_cache_queries: int = 0  # cumulative tokens looked up
    prefix_cache_hits: int = 0  # cumulative tokens found
    schedule_s: float = 0.0
    execute_s: float = 0.0
    update_s: float = 0.0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.scheduled)

    @property
    def new_block_ids(self) -> list[int]:
        return [block_id for chunk in self.scheduled for block_id in chunk.new_block_ids]

    @property
    def num_draft_tokens(self) -> int:
        return sum(chunk.num_draft_tokens for chunk in self.scheduled)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(chunk.num_accepted_tokens for chunk in self.scheduled)

    @property
    def num_rejected_tokens(self) -> int:
        return sum(chunk.num_rejected_tokens for chunk in self.scheduled)

    def chunk_for(self, request_id: str) -> ScheduledChunk | None:
        return next((chunk for chunk in self.scheduled if chunk.request_id == request_id), None)


@dataclass
class Segment:
    """``num_steps`` consecutive steps a request spent in one timeline state."""

    state: str  # one of TIMELINE_STATES
    start_step: int
    num_steps: int


@dataclass
class RequestTimeline:
    request_id: str
    segments: list[Segment]
    finished_step: int | None  # the step whose output finished it, if it did
    finish_status: str | None


@dataclass
class EngineTrace:
    """All steps of an engine, in order (``llm.trace``)."""

    block_size: int
    num_blocks: int
    steps: list[StepTrace] = field(default_factory=list)
    # Called with each StepTrace as its step ends (the live table redraws here).
    listeners: list[Callable[[StepTrace], None]] = field(default_factory=list, repr=False, compare=False)

    @property
    def num_preemptions(self) -> int:
        return sum(len(step.preemptions) for step in self.steps)

    @property
    def has_drafts(self) -> bool:
        """Whether any step verified draft tokens (the table then shows its draft columns)."""
        return any(step.num_draft_tokens for step in self.steps)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / looked-up tokens over the whole run (0.0 before any lookup)."""
        if not self.steps or not self.steps[-1].prefix_cache_queries:
            return 0.0
        return self.steps[-1].prefix_cache_hits / self.steps[-1].prefix_cache_queries

    def chunks_of(self, request_id: str) -> list[tuple[int, ScheduledChunk]]:
        """(step, chunk) for every step that ran tokens of ``request_id``."""
        return [
            (step.step, chunk)
            for step in self.steps
            for chunk in step.scheduled
            if chunk.request_id == request_id
        ]

    def clear(self) -> None:
        """Forget the steps so far (e.g. between two experiments on one engine)."""
        self.steps.clear()

    def request_timelines(self) -> list[RequestTimeline]:
        """One row per request, in arrival order, as the timeline picture draws it."""
        order: list[str] = []
        states: dict[str, list[tuple[int, str]]] = {}
        finished: dict[str, tuple[int, str]] = {}
        live: set[str] = set()  # arrived and not finished yet
        preempted: set[str] = set()  # preempted and not rescheduled yet
        for step in self.steps:
            for request_id in step.arrived:
                order.append(request_id)
                states[request_id] = []
                live.add(request_id)
            victims = {p.victim_id for p in step.preemptions}
            for request_id in list(live):
                chunk = step.chunk_for(request_id)
                if request_id in victims:
                    state = "preempted"
                    preempted.add(request_id)
                elif chunk is not None:
                    state = chunk.kind
                    preempted.discard(request_id)
                else:
                    # Never admitted, or preempted earlier: in the waiting queue.
                    # Otherwise it is running but got no tokens (budget spent).
                    is_waiting = request_id in preempted or not any(
                        s != "waiting" for _, s in states[request_id]
                    )
                    state = "waiting" if is_waiting else "stalled"
                states[request_id].append((step.step, state))
            for request_id, status in step.finished.items():
                if request_id in live:
                    finished[request_id] = (step.step, status)
                    live.discard(request_id)
        return [
            RequestTimeline(
                request_id=request_id,
                segments=_merge(states[request_id]),
                finished_step=finished[request_id][0] if request_id in finished else None,
                finish_status=finished[request_id][1] if request_id in finished else None,
            )
            for request_id in order
        ]


def _merge(step_states: list[tuple[int, str]]) -> list[Segment]:
    """Collapse per-step states into runs of equal consecutive states."""
    segments: list[Segment] = []
    for step, state in step_states:
        last = segments[-1] if segments else None
        if last is not None and last.state == state and last.start_step + last.num_steps == step:
            last.num_steps += 1
        else:
            segments.append(Segment(state, step, 1))
    return segments
