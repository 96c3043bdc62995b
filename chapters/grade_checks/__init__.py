"""What the grader runs for each exercise: unit checks and a short end-to-end generation.

Every check is a function of the model directory that returns plain data. The
grader (``chapters/grade.py``) runs it once with the reference code and once with
the student's function swapped into the engine, and the two results must be
equal. Checks also assert properties of their own (the budget adds up, the
engine really preempted, the prefix cache really hit), so the reference passes
for a reason and an end-to-end run cannot pass without exercising the code.

One module per chapter holds its exercises' checks (``ch2.py``: exercise 2.1; ``ch4.py``: exercises 4.1,
4.2 and 4.3; chapter 4's hybrid-model exercises 4.4 and 4.5 have
``ch4_hybrid.py``, its sliding-window exercise 4.6 ``ch4_sliding.py``; chapter 6's tensor-parallel exercise 6.2 has
``ch6_tensor_parallel.py``); ``common.py`` holds what they share,
``tiny_model.py`` writes the tiny models their end-to-end runs use (``tiny_gguf.py``: as a GGUF file),
``tp_ranks.py`` runs a function on spawned tensor-parallel ranks, and
``zh.py`` gives every check's name and inputs in Chinese.

Chapters 1-10. vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from chapters.grade_checks import (
    ch1,
    ch2,
    ch3,
    ch4,
    ch4_hybrid,
    ch4_sliding,
    ch5,
    ch6,
    ch6_tensor_parallel,
    ch7,
    ch8,
    ch9,
    ch10,
)
from chapters.grade_checks.common import Check
from chapters.grade_checks.zh import CHINESE

# Exercise id -> its checks, unit checks first (they are fast and say the most).
CHECKS: dict[str, tuple[Check, ...]] = {
    **ch1.CHECKS, **ch2.CHECKS, **ch3.CHECKS, **ch4.CHECKS, **ch4_hybrid.CHECKS, **ch4_sliding.CHECKS, **ch5.CHECKS, **ch6.CHECKS,
    **ch6_tensor_parallel.CHECKS, **ch7.CHECKS, **ch8.CHECKS, **ch9.CHECKS, **ch10.CHECKS,
}



def chinese_check(exercise_id: str, name: str) -> tuple[str, str]:
    """(Chinese name, Chinese description of its inputs) of one check, from ``zh.py``."""
    try:
        return CHINESE[exercise_id][name]
    except KeyError:
        raise KeyError(f"chapters/grade_checks/zh.py has no Chinese for check {name!r} of exercise "
                       f"{exercise_id}") from None


__all__ = ["CHECKS", "Check", "chinese_check"]
