"""Wrong answers to the chapter-9 exercise (see ``__init__.py``).

Exercise 9.1, greedy verification: the classic mistakes of a first
speculative decoder. Every unit check of ``chapters/grade_checks/ch9.py`` has
at least one of them to be the first to name.
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# The reference's three moves: the target's choices, the matching prefix, the emitted tokens.
CHOICES = "choices = rows.argmax(dim=-1).tolist()"
MATCH = "drafts[kept] == choices[kept]"
PREFIX = "    kept = 0\n    while kept < len(drafts) and drafts[kept] == choices[kept]:\n        kept += 1\n"
EMIT = "return [*drafts[:kept], choices[kept]]"

MUTANTS: list[Mutant] = [
    Mutant(
        "9.1",
        "returns the target's token as a 0-d tensor (argmax without .tolist())",
        mutate("9.1", (CHOICES, "choices = rows.argmax(dim=-1)")),
        caught_by="returns a list of Python ints",
    ),
    Mutant(
        "9.1",
        "keeps every draft without checking it",
        mutate("9.1", (f" and {MATCH}", "")),
        caught_by="a rejected draft: the target's token takes its place, and the step ends there",
    ),
    Mutant(
        "9.1",
        "emits the rejected draft instead of the target's token",
        mutate("9.1", (EMIT, "return [*drafts[:kept], drafts[kept] if kept < len(drafts) else choices[kept]]")),
        caught_by="a rejected draft: the target's token takes its place, and the step ends there",
    ),
    Mutant(
        "9.1",
        "does not stop at a rejected draft: emits the target's token at every position",
        mutate("9.1", (EMIT, "return [d if d == c else c for d, c in zip(drafts, choices)] + [choices[len(drafts)]]")),
        caught_by="a rejected draft: the target's token takes its place, and the step ends there",
    ),
    Mutant(
        "9.1",
        "off by one: compares draft d_j with row j + 1",
        mutate("9.1", (MATCH, "drafts[kept] == choices[kept + 1]")),
        caught_by="draft d_j is judged by row j, not row j + 1",
    ),
    Mutant(
        "9.1",
        "counts every draft that matches its row, not the matching prefix",
        mutate("9.1", (PREFIX, "    kept = sum(d == c for d, c in zip(drafts, choices))\n")),
        caught_by="only the matching prefix is kept: a later draft that matches does not count",
    ),
    Mutant(
        "9.1",
        "forgets the bonus token when every draft is kept",
        mutate("9.1", (EMIT, f"{EMIT} if kept < len(drafts) else list(drafts)")),
        caught_by="every draft kept: the drafts, then the bonus token of the last row",
    ),
    Mutant(
        "9.1",
        "a request without drafts emits nothing (there was nothing to verify)",
        mutate("9.1", (CHOICES, f"if not drafts:\n        return []\n    {CHOICES}")),
        caught_by="no drafts: the target's own token alone",
    ),
    Mutant(
        "9.1",
        "keeps a draft whose score equals the best, though the argmax is a lower token",
        mutate("9.1", (MATCH, "rows[kept, drafts[kept]] == rows[kept].max()")),
        caught_by="a tie goes to the lowest token id, as the sampler's argmax",
    ),
]
