"""StepPlan: what one ``schedule()`` call has decided so far, and its token budget.

Chapter 3 (scheduler). A step starts with ``max_num_batched_tokens`` to spend.
Each request the scheduler books pays for its tokens from that budget; a
running request preempted later in the *same* step (to free blocks for one after
it) is unbooked and its tokens are refunded. Keeping these few lines of
accounting in one object is what lets ``Scheduler.schedule()`` read as the
policy alone.

vLLM 0.32 counterpart: the local variables of ``Scheduler.schedule()`` in
``vllm/v1/core/sched/scheduler.py`` (``token_budget``, ``num_scheduled_tokens``,
``req_to_new_blocks``, ``scheduled_running_reqs``, ``preempted_reqs``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanoengine.core.kv_cache_manager import KVCacheBlocks
from nanoengine.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from nanoengine.request import Request


@dataclass
class StepPlan:
    """The decisions of one ``schedule()`` call while it is being built.

    Every booking pays for its tokens from ``token_budget`` and every undo
    refunds them, so at any moment ``token_budget`` plus the sum of
    ``num_scheduled_tokens`` equals ``max_num_batched_tokens``.
    """

    token_budget: int  # tokens still available this step
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Sent in full: first schedule, or resumed after preemption.
    new_reqs: list[Request] = field(default_factory=list)
    # Known to the worker: only newly allocated block ids travel.
    cached_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    preempted_reqs: list[Request] = field(default_factory=list)
    # Speculative decoding (chapter 9): the drafts booked with a request's tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request: Request, num_new_tokens: int, new_blocks: KVCacheBlocks, is_new: bool) -> None:
        """Book ``num_new_tokens`` of ``request`` into this step, paying from the budget."""
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.token_budget -= num_new_tokens
        if is_new:
            self.new_reqs.append(request)
        else:
            self.cached_reqs.append(request)
            self.new_block_ids[request.request_id] = new_blocks.get_block_ids()

    def undo(self, request: Request) -> None:
        """Cancel the booking of a running request preempted later in the same step.

        Its tokens return to the budget so the requests after it can use them.
        (Only running requests can be preempted, and they are booked as cached.)
        """
        self.token_budget += self.num_scheduled_tokens.pop(request.request_id)
        self.cached_reqs.remove(request)
        del self.new_block_ids[request.request_id]
        self.scheduled_spec_decode_tokens.pop(request.request_id, None)

    def make_scheduler_output(
        self, get_block_ids: Callable[[str], tuple[list[int], ...]], finished_req_ids: set[str]
    ) -> SchedulerOutput:
        """The finished plan as the message the worker receives (chapter 7).

        Must run before the scheduler advances ``num_computed_tokens``: the
        worker needs where this step's tokens start.
        """
        new_reqs_data = [
            NewRequestData(
                req_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
            )
            for request in self.new_reqs
        ]
        cached_reqs_data = CachedRequestData(
            req_ids=[request.request_id for request in self.cached_reqs],
            new_block_ids=[self.new_block_ids[request.request_id] for request in self.cached_reqs],
            num_computed_tokens=[request.num_computed_tokens for request in self.cached_reqs],
            num_output_tokens=[
                request.num_output_tokens + request.num_output_placeholders for request in self.cached_reqs
            ],
        )
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids={request.request_id for request in self.preempted_reqs},
            scheduled_spec_decode_tokens=self.scheduled_spec_decode_tokens,
        )
