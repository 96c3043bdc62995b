"""Plausible wrong answers to every exercise, which the grader must reject.

Each ``Mutant`` is the reference solution with one planted mistake -- an
off-by-one, a missing all-or-nothing check, an ignored flag, a wrong
tie-break -- written as text edits of the reference's own source (``mutate``),
so a mutant can never drift from the code it mutates: an edit that no longer
matches the reference fails loudly. ``tests/test_exercises.py`` grades each
one and requires that the grader rejects it, that the first failing check is
the one named in ``caught_by`` (the behaviour the mistake breaks), and that
the failure message says what differs.

One module per chapter (``ch4.py``: exercises 4.1-4.3; ``ch4_hybrid.py``: 4.4, 4.5; ``ch4_sliding.py``: 4.6;
``ch6_tensor_parallel.py``: 6.2), as in ``chapters/grade_checks/``. vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import __future__
import importlib
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chapters.exercises import find_exercises


@dataclass(frozen=True)
class Mutant:
    """A wrong answer to one exercise, and the check that must catch it first."""

    exercise_id: str
    wrong_answer: str  # the mistake, as a student would make it
    function: Callable[..., Any]
    caught_by: str  # the name of the first check that must fail (see chapters/grade_checks/)


def mutate(exercise_id: str, *edits: tuple[str, str]) -> Callable[..., Any]:
    """The reference function of ``exercise_id`` with each ``(old, new)`` text edit applied.

    Every ``old`` must occur exactly once in the reference's source. The result
    is compiled in the reference module's namespace, so it sees the same names;
    a method comes back as a plain function taking ``self``, as a student's stub.
    """
    exercise = find_exercises()[exercise_id]
    lines = exercise.path.read_text(encoding="utf-8").splitlines()
    node = exercise.node
    # From the ``def`` line on: decorators (staticmethod) are re-applied by the grader.
    source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    for old, new in edits:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"mutant of {exercise_id}: {old!r} occurs {count} times in the reference, not once")
        source = source.replace(old, new)
    namespace = dict(vars(importlib.import_module(exercise.module)))
    flags = __future__.annotations.compiler_flag  # annotations stay strings, as in the reference module
    exec(compile(source, f"<mutant of exercise {exercise_id}>", "exec", flags=flags, dont_inherit=True), namespace)
    function: Callable[..., Any] = namespace[exercise.function_name]
    return function
