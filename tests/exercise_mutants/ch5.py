"""Wrong answers to the chapter-5 exercises (see ``__init__.py``).

One mutant per promise of each page, so every check of ``chapters/grade_checks/ch5.py``
except the end-to-end runs has a mistake it must be the first to name.
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# The reference 5.1 is one comparison: ``return status > RequestStatus.PREEMPTED``.
_FINISHED_BY_HAND = ("RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED, "
                     "RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_IGNORED, "
                     "RequestStatus.FINISHED_ERROR")

MUTANTS: list[Mutant] = [
    # ----------------------------------------------------------- 5.1 is_finished
    Mutant(
        "5.1",
        "PREEMPTED counted as finished (>= instead of >)",
        mutate("5.1", ("status > RequestStatus.PREEMPTED", "status >= RequestStatus.PREEMPTED")),
        caught_by="WAITING*, RUNNING and PREEMPTED are not finished",
    ),
    Mutant(
        "5.1",
        "finished means after RUNNING (forgets that PREEMPTED sorts after RUNNING)",
        mutate("5.1", ("status > RequestStatus.PREEMPTED", "status > RequestStatus.RUNNING")),
        caught_by="WAITING*, RUNNING and PREEMPTED are not finished",
    ),
    Mutant(
        "5.1",
        "a hand-written set that misses FINISHED_REPETITION",
        mutate("5.1", ("status > RequestStatus.PREEMPTED", f"status in ({_FINISHED_BY_HAND})")),
        caught_by="every FINISHED_* state is finished",
    ),
    Mutant(
        "5.1",
        "only a stopped request counts as finished",
        mutate("5.1", ("status > RequestStatus.PREEMPTED", "status == RequestStatus.FINISHED_STOPPED")),
        caught_by="every FINISHED_* state is finished",
    ),
    # ------------------------------------------- 5.2 _handle_blocked_waiting_request
    Mutant(
        "5.2",
        "PREEMPTED treated as blocked (only WAITING passes)",
        mutate("5.2", ("    else:\n        return True\n",
                       ("    elif status == RequestStatus.WAITING:\n        return True\n"
                        "    else:\n        return False\n"))),
        caught_by="WAITING and PREEMPTED pass unchanged",
    ),
    Mutant(
        "5.2",
        "a grammar still compiling treated as ready",
        mutate("5.2", ("if structured is None or not structured.is_ready:", "if structured is None:")),
        caught_by="grammar still compiling: not ready",
    ),
    Mutant(
        "5.2",
        "a compiled grammar returns True but is left in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",
        mutate("5.2", ("RequestStatus.FINISHED_ERROR\n            return False\n",
                       "RequestStatus.FINISHED_ERROR\n            return False\n        return True\n")),
        caught_by="grammar compiled: promoted",
    ),
    Mutant(
        "5.2",
        "a failed grammar is promoted (compile_error never looked at)",
        mutate("5.2", ("if structured.compile_error is not None:", "if False:")),
        caught_by="grammar failed: FINISHED_ERROR, its message, False",
    ),
    Mutant(
        "5.2",
        "a failed grammar ends the request without a finish_message",
        mutate("5.2", ("request.finish_message = structured.compile_error", "pass")),
        caught_by="grammar failed: FINISHED_ERROR, its message, False",
    ),
    Mutant(
        "5.2",
        "a failed grammar returns True after FINISHED_ERROR",
        mutate("5.2", ("RequestStatus.FINISHED_ERROR\n            return False",
                       "RequestStatus.FINISHED_ERROR\n            return True")),
        caught_by="grammar failed: FINISHED_ERROR, its message, False",
    ),
    Mutant(
        "5.2",
        "remote KVs ready as soon as any load finished",
        mutate("5.2", ("if request.request_id not in self.finished_recving_kv_req_ids:",
                       "if not self.finished_recving_kv_req_ids:")),
        caught_by="remote KVs not loaded: not ready, set untouched",
    ),
    Mutant(
        "5.2",
        "a finished remote load stays in finished_recving_kv_req_ids",
        mutate("5.2", ("self.finished_recving_kv_req_ids.discard(request.request_id)", "pass")),
        caught_by="remote KVs loaded: promoted, only its id removed",
    ),
    Mutant(
        "5.2",
        "the whole finished_recving_kv_req_ids set cleared",
        mutate("5.2", ("self.finished_recving_kv_req_ids.discard(request.request_id)",
                       "self.finished_recving_kv_req_ids.clear()")),
        caught_by="remote KVs loaded: promoted, only its id removed",
    ),
    Mutant(
        "5.2",
        "stream ready when prefillable equals computed (< instead of <=)",
        mutate("5.2", ("request.num_prefillable_tokens <= request.num_computed_tokens",
                       "request.num_prefillable_tokens < request.num_computed_tokens")),
        caught_by="stream with nothing new to prefill: not ready",
    ),
    Mutant(
        "5.2",
        "stream compares num_tokens (forgets the held-back last token)",
        mutate("5.2", ("request.num_prefillable_tokens <= request.num_computed_tokens",
                       "request.num_tokens <= request.num_computed_tokens")),
        caught_by="stream with nothing new to prefill: not ready",
    ),
    Mutant(
        "5.2",
        "stream waits for two new tokens (off by one the other way)",
        mutate("5.2", ("request.num_prefillable_tokens <= request.num_computed_tokens",
                       "request.num_prefillable_tokens <= request.num_computed_tokens + 1")),
        caught_by="stream with more to prefill: promoted",
    ),
    Mutant(
        "5.2",
        "a promoted request always goes to WAITING (preemption ignored)",
        mutate("5.2", ("RequestStatus.PREEMPTED if request.num_preemptions > 0 else RequestStatus.WAITING",
                       "RequestStatus.WAITING")),
        caught_by="promoted to PREEMPTED if ever preempted, else WAITING",
    ),
]
