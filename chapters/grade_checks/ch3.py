"""The grader's checks for exercises 3.1 and 3.2 (chapter 3).

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


# ------------------------------------------------------------ 3.1 StepPlan.add
def budget_bookings(model: str) -> dict[str, Any]:
    plan = StepPlan(token_budget=100)
    new, decode, chunk = make_request("new", 7), make_request("decode", 9), make_request("chunk", 40)
    plan.add(new, 7, KVCacheBlocks(), is_new=True)
    plan.add(decode, 1, KVCacheBlocks([KVCacheBlock(5), KVCacheBlock(9)]), is_new=False)
    plan.add(chunk, 30, KVCacheBlocks([KVCacheBlock(3)]), is_new=False)
    after_add = plan.token_budget
    plan.undo(decode)  # undo relies on what add recorded
    assert plan.token_budget + sum(plan.num_scheduled_tokens.values()) == 100, "budget does not add up"
    return {"after_add": after_add, "after_undo": plan.token_budget,
            "num_scheduled_tokens": dict(plan.num_scheduled_tokens),
            "new_reqs": [r.request_id for r in plan.new_reqs],
            "cached_reqs": [r.request_id for r in plan.cached_reqs],
            "new_block_ids": dict(plan.new_block_ids)}


# ----------------------------------------------- 3.2 select_preemption_victim
def victim_choices(model: str) -> dict[str, Any]:
    shapes = [(0, 1.0), (2, 0.5), (2, 3.0), (1, 9.0), (2, 3.0)]
    running = [make_request(f"r{i}", 4, priority=p, arrival_time=t) for i, (p, t) in enumerate(shapes)]
    choices: dict[str, Any] = {}
    for policy in SchedulingPolicy:
        choices[policy.value] = [select_preemption_victim(running[:n], policy) for n in range(1, len(running) + 1)]
    assert choices["fcfs"] == list(range(len(running))), "FCFS preempts the newest request"
    try:
        select_preemption_victim([], SchedulingPolicy.FCFS)
        choices["empty"] = "no error"
    except ValueError:
        choices["empty"] = "ValueError"
    return choices


CHECKS: dict[str, tuple[Check, ...]] = {
    "3.1": (Check("add books tokens and pays from the budget", budget_bookings),
            Check("end to end: chunked prefill under an 8-token budget", e2e_chunked_prefill)),
    "3.2": (Check("victims under FCFS and priority", victim_choices),
            Check("end to end: preemption, FCFS", e2e_preemption),
            Check("end to end: preemption, priority", e2e_priority_preemption)),
}
