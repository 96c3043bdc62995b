"""Wrong answers to the chapter-5 exercises (see __init__.py)."""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

MUTANTS: list[Mutant] = []
