"""The grader's checks for exercises 3.1 and 3.2 (chapter 3).

Each promise on the exercise pages has a check of its own, named in a
student's words, so a wrong answer is named by the behaviour it breaks. The
unit checks call the function directly and return labeled tables: each key
names the call and its inputs, each value is what came back. The end-to-end
runs come last.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from typing import Any

from chapters.grade_checks.common import (
    Check,
    e2e_chunked_prefill,
    e2e_preemption,
    e2e_priority_preemption,
    make_request,
)
from nanoengine.core.kv_cache_manager import KVCacheBlocks
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.core.sched.request_queue import SchedulingPolicy
from nanoengine.core.sched.step_plan import StepPlan
from nanoengine.core.sched.utils import select_preemption_victim
from nanoengine.request import Request


# ------------------------------------------------------------ 3.1 StepPlan.add
def blocks(*ids: int) -> KVCacheBlocks:
    """New blocks of a model with one KV cache group: one list."""
    return KVCacheBlocks(([KVCacheBlock(block_id) for block_id in ids],))


# Four bookings into a plan that starts with 100 tokens: (request, tokens, new blocks, is_new).
BOOKINGS = [("new", 7, (1, 2), True), ("decode", 1, (5, 9), False), ("chunk", 30, (3,), False),
            ("fits", 1, (), False)]


def label(request_id: str, num_tokens: int, block_ids: tuple[int, ...], is_new: bool) -> str:
    return f"add({request_id}, {num_tokens}, blocks {list(block_ids)}, is_new={is_new})"


def book(plan: StepPlan, request_id: str, num_tokens: int, block_ids: tuple[int, ...], is_new: bool) -> Request:
    request = make_request(request_id, 40)
    plan.add(request, num_tokens, blocks(*block_ids), is_new=is_new)
    return request


def names(requests: list[Any]) -> list[str]:
    """Request ids of a plan's list; anything else filed there is shown as it is."""
    return [r.request_id if isinstance(r, Request) else f"{r!r} (not a Request)" for r in requests]


def counts_by_request_id(model: str) -> dict[str, Any]:
    """Four bookings into a 100-token plan: "new" (7 tokens, `is_new=True`), then "decode"
    (1), "chunk" (30) and "fits" (1), running (`is_new=False`).
    """
    plan = StepPlan(token_budget=100)
    for booking in BOOKINGS:
        book(plan, *booking)
    return {"num_scheduled_tokens after the four adds": dict(plan.num_scheduled_tokens)}


def pays_from_budget(model: str) -> dict[str, Any]:
    """The same four bookings; `token_budget` after each."""
    plan = StepPlan(token_budget=100)
    table: dict[str, Any] = {}
    for booking in BOOKINGS:
        book(plan, *booking)
        table[f"token_budget after {label(*booking)}"] = plan.token_budget
    return table


def new_request_sent_in_full(model: str) -> dict[str, Any]:
    """`add(new, 7, blocks [1, 2], is_new=True)` into an empty plan: a request the worker has
    not seen (its blocks travel with it in full later).
    """
    plan = StepPlan(token_budget=100)
    book(plan, *BOOKINGS[0])
    return {"new_reqs": names(plan.new_reqs), "cached_reqs": names(plan.cached_reqs),
            "new_block_ids": dict(plan.new_block_ids)}


def running_request_sends_block_ids(model: str) -> dict[str, Any]:
    """`add(decode, 1, blocks [5, 9], is_new=False)`, then `add(fits, 1, no blocks,
    is_new=False)` (its token fits a block it already has), into an empty plan.
    """
    plan = StepPlan(token_budget=100)
    book(plan, *BOOKINGS[1])
    book(plan, *BOOKINGS[3])
    return {"new_reqs": names(plan.new_reqs), "cached_reqs": names(plan.cached_reqs),
            "new_block_ids": dict(plan.new_block_ids)}


def undo_cancels_add(model: str) -> dict[str, Any]:
    """The four bookings, then `undo` of "decode" and of "fits" (as when they are preempted
    later in the same step).
    """
    plan = StepPlan(token_budget=100)
    booked = {booking[0]: book(plan, *booking) for booking in BOOKINGS}
    plan.undo(booked["decode"])
    plan.undo(booked["fits"])
    assert plan.token_budget + sum(plan.num_scheduled_tokens.values()) == 100, (
        f"token_budget {plan.token_budget} plus the booked {dict(plan.num_scheduled_tokens)} is not 100"
    )
    return {"token_budget": plan.token_budget, "num_scheduled_tokens": dict(plan.num_scheduled_tokens),
            "new_reqs": names(plan.new_reqs), "cached_reqs": names(plan.cached_reqs),
            "new_block_ids": dict(plan.new_block_ids)}


# ----------------------------------------------- 3.2 select_preemption_victim
def running(*shapes: tuple[int, float]) -> list[Request]:
    """Running requests r0, r1, ... with these ``(priority, arrival_time)``, in this order."""
    return [make_request(f"r{i}", 4, priority=p, arrival_time=t) for i, (p, t) in enumerate(shapes)]


def victims(policy: SchedulingPolicy, cases: list[tuple[tuple[int, float], ...]]) -> dict[str, Any]:
    """The victim's index for each list of running requests, labeled by the list."""
    table: dict[str, Any] = {}
    for shapes in cases:
        listing = ", ".join(f"(priority {p}, arrival {t})" for p, t in shapes)
        table[f"{policy.name}: [{listing}]"] = select_preemption_victim(running(*shapes), policy)
    return table


def fcfs_takes_the_last(model: str) -> dict[str, Any]:
    """FCFS over 1 to 4 running requests, the last one with the smallest priority value and the
    earliest arrival.
    """
    return victims(SchedulingPolicy.FCFS, [
        ((0, 1.0),),
        ((1, 2.0), (0, 1.0)),
        ((2, 5.0), (1, 3.0), (0, 1.0)),
        ((2, 5.0), (3, 4.0), (1, 3.0), (0, 1.0)),
    ])


def priority_takes_the_least_important(model: str) -> dict[str, Any]:
    """PRIORITY over requests of different priorities, the least important (largest value)
    neither last nor the latest to arrive.
    """
    return victims(SchedulingPolicy.PRIORITY, [
        ((2, 1.0), (0, 5.0), (1, 9.0)),
        ((0, 9.0), (3, 2.0), (1, 1.0), (2, 8.0)),
        ((1, 4.0),),
    ])


def priority_ties_take_the_latest_arrival(model: str) -> dict[str, Any]:
    """PRIORITY over requests sharing the largest priority value, arriving out of position order."""
    return victims(SchedulingPolicy.PRIORITY, [
        ((1, 7.0), (1, 2.0), (0, 9.0), (1, 3.0)),
        ((2, 1.0), (2, 6.0), (2, 4.0)),
    ])


def full_ties_take_the_later_position(model: str) -> dict[str, Any]:
    """PRIORITY over requests with the same `(priority, arrival_time)` at several positions."""
    return victims(SchedulingPolicy.PRIORITY, [
        ((1, 2.0), (1, 2.0), (0, 1.0)),
        ((1, 2.0), (1, 2.0), (1, 2.0)),
        ((0, 5.0), (1, 2.0), (1, 2.0), (0, 9.0)),
    ])


def empty_is_an_error(model: str) -> dict[str, Any]:
    """An empty `running` list, under FCFS and under PRIORITY."""
    table: dict[str, Any] = {}
    for policy in SchedulingPolicy:
        try:
            table[f"{policy.name}: []"] = f"returned {select_preemption_victim([], policy)!r}"
        except ValueError:
            table[f"{policy.name}: []"] = "ValueError"
    return table


CHECKS: dict[str, tuple[Check, ...]] = {
    "3.1": (Check("records each count under the request id", counts_by_request_id),
            Check("pays each booking from token_budget", pays_from_budget),
            Check("a new request is filed as new, with no new_block_ids entry", new_request_sent_in_full),
            Check("a running request is filed as cached, with its new block ids", running_request_sends_block_ids),
            Check("undo cancels what add booked", undo_cancels_add),
            Check("end to end: chunked prefill under an 8-token budget", e2e_chunked_prefill)),
    "3.2": (Check("FCFS: the last request, whatever the priorities", fcfs_takes_the_last),
            Check("priority: the largest priority value", priority_takes_the_least_important),
            Check("priority ties: the latest arrival", priority_ties_take_the_latest_arrival),
            Check("full ties: the later position", full_ties_take_the_later_position),
            Check("an empty list is a ValueError", empty_is_an_error),
            Check("end to end: preemption, FCFS", e2e_preemption),
            Check("end to end: preemption, priority", e2e_priority_preemption)),
}
