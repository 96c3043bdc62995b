"""Wrong answers to the chapter-10 exercise (see ``__init__.py``).

Exercise 10.1, the decode engine's pull plan: the mistakes of a first KV
connector. Every unit check of ``chapters/grade_checks/ch10.py`` has at least
one of them to be the first to name.
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# The reference's moves: once only, the first and last block, the two slices, the plan.
ONCE = '    params["do_remote_prefill"] = False  # once: a later admission must not pull again\n'
FIRST = "first = num_computed_tokens // self.block_size"
LAST = "last = -(-(num_computed_tokens + num_external_tokens) // self.block_size) if num_external_tokens else first"
REMOTE = 'params["remote_block_ids"][first:last]'
PLAN = "self._plan(request.request_id, params, local, "

MUTANTS: list[Mutant] = [
    Mutant(
        "10.1",
        "pulls from block 0, the local prefix-cache hits too",
        mutate("10.1", (FIRST, "first = 0")),
        caught_by="local prefix-cache hits stay home: only the blocks after them are pulled",
    ),
    Mutant(
        "10.1",
        "the producer's blocks counted from 0, not from the first block pulled",
        mutate("10.1", (REMOTE, 'params["remote_block_ids"][: last - first]')),
        caught_by="local prefix-cache hits stay home: only the blocks after them are pulled",
    ),
    Mutant(
        "10.1",
        "the last block rounded down: a block the remote tokens fill in part is not pulled",
        mutate("10.1", (LAST, "last = (num_computed_tokens + num_external_tokens) // self.block_size")),
        caught_by="a block the remote tokens fill only in part is pulled too (round up)",
    ),
    Mutant(
        "10.1",
        "the last block counted from the prompt, not from the remote tokens",
        mutate("10.1", (LAST, LAST.replace("(num_computed_tokens + num_external_tokens)", "request.num_prompt_tokens"))),
        caught_by="no local hits: every block the remote tokens fill is pulled",
    ),
    Mutant(
        "10.1",
        "nothing to pull, nothing planned: the producer holds its blocks until they expire",
        mutate("10.1", (ONCE, ONCE + "    if not num_external_tokens:\n        return\n")),
        caught_by="nothing to pull: one plan with no blocks, so the producer frees them",
    ),
    Mutant(
        "10.1",
        "do_remote_prefill left set: a second admission pulls again",
        mutate("10.1", (ONCE, "")),
        caught_by="once only: do_remote_prefill is cleared, a second call plans nothing",
    ),
    Mutant(
        "10.1",
        "a prefill-side request pulled too (only do_remote_decode looked at)",
        mutate("10.1", ('if not params or not params.get("do_remote_prefill"):',
                        'if not params or params.get("do_remote_decode"):')),
        caught_by="a request that is not to be pulled is left alone",
    ),
    Mutant(
        "10.1",
        "the plan names the producer's request id as this engine's",
        mutate("10.1", (PLAN, 'self._plan(params["remote_request_id"], params, local, ')),
        caught_by="the plan names the producer's request, engine, host and port",
    ),
]
