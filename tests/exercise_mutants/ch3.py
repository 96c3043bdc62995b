"""Wrong answers to the chapter-3 exercises (see ``__init__.py``)."""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------ 3.1 StepPlan.add
    Mutant(
        "3.1",
        "records the count under the Request object, not its id",
        mutate("3.1", ("self.num_scheduled_tokens[request.request_id]", "self.num_scheduled_tokens[request]")),
        caught_by="records each count under the request id",
    ),
    Mutant(
        "3.1",
        "never pays from the budget",
        mutate("3.1", ("    self.token_budget -= num_new_tokens\n", "")),
        caught_by="pays each booking from token_budget",
    ),
    Mutant(
        "3.1",
        "adds the tokens to the budget instead of paying",
        mutate("3.1", ("self.token_budget -= num_new_tokens", "self.token_budget += num_new_tokens")),
        caught_by="pays each booking from token_budget",
    ),
    Mutant(
        "3.1",
        "files every request as cached, ignoring is_new",
        mutate("3.1", ("if is_new:", "if False:")),
        caught_by="a new request is filed as new, with no new_block_ids entry",
    ),
    Mutant(
        "3.1",
        "records new_block_ids for new requests too",
        mutate("3.1", ("        self.new_block_ids[request.request_id]", "    self.new_block_ids[request.request_id]")),
        caught_by="a new request is filed as new, with no new_block_ids entry",
    ),
    Mutant(
        "3.1",
        "keeps the KVCacheBlock objects instead of their ids",
        mutate("3.1", ("new_blocks.get_block_ids()", "new_blocks.blocks")),
        caught_by="a running request is filed as cached, with its new block ids",
    ),
    Mutant(
        "3.1",
        "leaves out the new_block_ids entry of a running request that got no new block",
        mutate("3.1", ("        self.new_block_ids[request.request_id] = new_blocks.get_block_ids()",
                       ("        if any(new_blocks.blocks):\n"
                        "            self.new_block_ids[request.request_id] = new_blocks.get_block_ids()"))),
        caught_by="a running request is filed as cached, with its new block ids",
    ),
    # ----------------------------------------------- 3.2 select_preemption_victim
    Mutant(
        "3.2",
        "FCFS preempts the oldest request (the first in running)",
        mutate("3.2", ("return len(running) - 1", "return 0")),
        caught_by="FCFS: the last request, whatever the priorities",
    ),
    Mutant(
        "3.2",
        "compares the policy with the string 'fcfs' (an Enum member never equals it)",
        mutate("3.2", ("if policy is SchedulingPolicy.FCFS:", 'if policy == "fcfs":')),
        caught_by="FCFS: the last request, whatever the priorities",
    ),
    Mutant(
        "3.2",
        "ignores the policy: always the last request",
        mutate("3.2", ("if policy is SchedulingPolicy.FCFS:", "if True:")),
        caught_by="priority: the largest priority value",
    ),
    Mutant(
        "3.2",
        "priority: takes the smallest priority value (the most important request)",
        mutate("3.2", ("return max(", "return min(")),
        caught_by="priority: the largest priority value",
    ),
    Mutant(
        "3.2",
        "priority: compares arrival_time before priority",
        mutate("3.2", ("(running[index].priority, running[index].arrival_time, index)",
                       "(running[index].arrival_time, running[index].priority, index)")),
        caught_by="priority: the largest priority value",
    ),
    Mutant(
        "3.2",
        "priority: among equal priorities, the later position instead of the latest arrival",
        mutate("3.2", ("(running[index].priority, running[index].arrival_time, index)",
                       "(running[index].priority, index)")),
        caught_by="priority ties: the latest arrival",
    ),
    Mutant(
        "3.2",
        "priority: among equal priorities, the earliest arrival",
        mutate("3.2", ("running[index].arrival_time, index)", "-running[index].arrival_time, index)")),
        caught_by="priority ties: the latest arrival",
    ),
    Mutant(
        "3.2",
        "priority ties broken by the first position (max keeps the first of equal keys)",
        mutate("3.2", ("running[index].arrival_time, index)", "running[index].arrival_time)")),
        caught_by="full ties: the later position",
    ),
    Mutant(
        "3.2",
        "returns -1 for an empty list under FCFS (no ValueError)",
        mutate("3.2", (("    if not running:\n"
                        '        raise ValueError("Cannot pick a preemption victim: no request is running.")\n'), "")),
        caught_by="an empty list is a ValueError",
    ),
]
