"""Wrong answers to the chapter-1 exercises (see ``__init__.py``)."""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

MUTANTS: list[Mutant] = [
    Mutant(
        "1.1",
        "returns the first output of the request, finished or not",
        mutate("1.1", (" and output.finished:", ":")),
        caught_by="returns your request's output once it is finished",
    ),
    Mutant(
        "1.1",
        "returns the first finished output, whichever request it belongs to",
        mutate("1.1", ("if output.request_id == request_id and output.finished:", "if output.finished:")),
        caught_by="skips the outputs of other requests, even finished ones",
    ),
    Mutant(
        "1.1",
        "returns the output of the last request in each step's list (assumes yours comes last)",
        mutate("1.1", ("for output in engine.step():", "for output in engine.step()[-1:]:")),
        caught_by="skips the outputs of other requests, even finished ones",
    ),
    Mutant(
        "1.1",
        "stops stepping at the first step that returns no output",
        mutate("1.1", ("    while engine.has_unfinished_requests():\n        for output in engine.step():",
                       "    while outputs := engine.step():\n        for output in outputs:")),
        caught_by="keeps stepping after a step with no output",
    ),
    Mutant(
        "1.1",
        "steps until its request finishes, never asking has_unfinished_requests()",
        mutate("1.1", ("while engine.has_unfinished_requests():", "while True:")),
        caught_by="never loops forever on an engine that has run dry",
    ),
    Mutant(
        "1.1",
        "returns None when the engine runs dry",
        mutate("1.1", ('raise RuntimeError(f"The engine ran out of work before request {request_id!r} finished.")',
                       "return None  # type: ignore[return-value]")),
        caught_by="raises RuntimeError naming the request id when the engine runs dry",
    ),
    Mutant(
        "1.1",
        "raises RuntimeError without saying which request",
        mutate("1.1", ('f"The engine ran out of work before request {request_id!r} finished."',
                       '"The engine ran out of work."')),
        caught_by="raises RuntimeError naming the request id when the engine runs dry",
    ),
]
