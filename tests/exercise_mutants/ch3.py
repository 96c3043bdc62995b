"""Wrong answers to the chapter-3 exercises (see ``__init__.py``)."""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

MUTANTS: list[Mutant] = [
    Mutant(
        "3.2",
        "priority ties broken by the first position (max keeps the first of equal keys)",
        mutate("3.2", ("running[index].arrival_time, index)", "running[index].arrival_time)")),
        caught_by="victims under FCFS and priority",
    ),
]
