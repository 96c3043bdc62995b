"""Grade an exercise: swap the student's function into the real engine and compare.

    python -m chapters.grade 4.1 [--model DIR]     # grade chapters/exercises/ex4_1.py
    python -m chapters.grade --all
    python -m chapters.grade 4.1 --reset            # put back the untouched stub of 4.1
    python -m chapters.grade 4.1 --lang zh          # the grader's words and check names in Chinese

For the duration of grading, the student's function replaces the reference one
wherever the engine can reach it: a method is set on its class (re-wrapped in
``staticmethod`` when the reference is one); a module-level function is replaced
in its module and in every ``nanoengine``/``chapters`` module that imported it by
name. Each check of ``chapters/grade_checks/`` then runs with the reference and
with the student's code; the results must be equal, and a failure shows only
what differs (``chapters/grade_messages.py``). The same machinery backs
``tests/test_exercises.py`` (pytest marker ``exercise_4_1``; ``NANOENGINE_STUDENT=1``
grades the stubs instead of the reference).

Every check runs under a watchdog (``run_with_deadline``): the student's code
runs on a thread of its own, and a check that has not returned by its deadline
(``Check.deadline_s``) fails as a probable blocking call, while the grader puts
the reference back and goes on to the next check. A blocked thread or event
loop cannot hang the grader; it ends with the process.

Chapters 1, 3-9 (the exercises). vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chapters.exercise_stubs import reset_stub
from chapters.exercises import REPO_ROOT, Exercise, find_exercises
from chapters.grade_checks import CHECKS, Check, chinese_check
from chapters.grade_messages import ENGLISH, WORDING, Wording, describe_difference, describe_exception

_SWAPPABLE_PACKAGES = ("nanoengine", "chapters")


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str  # empty when passed


def _owner(exercise: Exercise) -> Any:
    """The class holding a method exercise (``Outer.Inner`` works too)."""
    owner: Any = importlib.import_module(exercise.module)
    for part in exercise.class_name.split(".") if exercise.class_name else ():
        owner = getattr(owner, part)
    return owner


def reference_function(exercise: Exercise) -> Callable[..., Any]:
    """The reference implementation, unwrapped from ``staticmethod`` if need be."""
    raw = vars(_owner(exercise))[exercise.function_name]
    return raw.__func__ if isinstance(raw, staticmethod) else raw  # type: ignore[no-any-return]


def student_function(exercise: Exercise) -> Callable[..., Any]:
    """The function in the exercise's stub module (the student's work)."""
    return getattr(importlib.import_module(exercise.stub_module), exercise.function_name)  # type: ignore[no-any-return]


# [anchor: grader-swap]
@contextmanager
def swapped_in(exercise: Exercise, candidate: Callable[..., Any]) -> Iterator[None]:
    """Run the enclosed code with ``candidate`` in place of the reference function."""
    owner, name = _owner(exercise), exercise.function_name
    original = vars(owner)[name]
    if exercise.class_name is not None:
        sites = [(owner, name)]
        replacement = staticmethod(candidate) if isinstance(original, staticmethod) else candidate
    else:
        # ``from m import f`` copies the binding, so every importer needs the swap.
        modules = [m for key, m in list(sys.modules.items())
                   if key.partition(".")[0] in _SWAPPABLE_PACKAGES and m is not None]
        sites = [(m, attr) for m in modules for attr, value in list(vars(m).items()) if value is original]
        replacement = candidate
    for site, attr in sites:
        setattr(site, attr, replacement)
    try:
        yield
    finally:
        for site, attr in sites:
            setattr(site, attr, original)
# [/anchor: grader-swap]


class DidNotReturn(Exception):
    """A check ran past its deadline: the student's code is probably blocked."""

    def __init__(self, deadline_s: float) -> None:
        super().__init__(ENGLISH.did_not_return.format(seconds=deadline_s))
        self.deadline_s = deadline_s


# Seconds between two "still running" lines while a check runs.
_PROGRESS_EVERY_S = 10.0


def run_with_deadline(
    run: Callable[[], Any], deadline_s: float, still_running: Callable[[float], None] | None = None
) -> Any:
    """``run()`` on a thread of its own; its result, or its exception, or ``DidNotReturn``.

    The thread is a daemon: if it never returns (a ``queue.get()`` with no
    timeout, an event loop blocked by a synchronous call), it is left behind
    and ends with the process. ``still_running(seconds)`` is called every
    ``_PROGRESS_EVERY_S`` seconds while it runs.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = run()
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller's thread as it is
            outcome["error"] = exc

    worker = threading.Thread(target=target, name="grader-check", daemon=True)
    start = time.monotonic()
    worker.start()
    while worker.is_alive():
        waited = time.monotonic() - start
        if waited >= deadline_s:
            raise DidNotReturn(deadline_s)
        worker.join(min(_PROGRESS_EVERY_S, deadline_s - waited))
        if worker.is_alive() and still_running is not None:
            still_running(time.monotonic() - start)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


@functools.cache
def _reference_result(exercise_id: str, check_name: str, model: str) -> Any:
    check = next(c for c in CHECKS[exercise_id] if c.name == check_name)
    return check.run(model)


def _run_check(
    exercise: Exercise,
    check: Check,
    candidate: Callable[..., Any],
    model: str,
    still_running: Callable[[float], None] | None = None,
    words: Wording = ENGLISH,
) -> CheckResult:
    expected = _reference_result(exercise.exercise_id, check.name, model)
    try:
        # The swap is undone here, on the grader's thread, even when the check's
        # own thread never comes back: later checks see the reference again.
        with swapped_in(exercise, candidate):
            actual = run_with_deadline(lambda: check.run(model), check.deadline_s, still_running)
    except DidNotReturn as exc:
        return CheckResult(check.name, False, words.did_not_return.format(seconds=exc.deadline_s))
    except Exception as exc:  # noqa: BLE001 -- any failure of the candidate is a failed check
        return CheckResult(check.name, False, describe_exception(exc, _source_file(candidate), words))
    differences = describe_difference(expected, actual, words)
    return CheckResult(check.name, not differences, "\n".join(differences))


def _source_file(function: Callable[..., Any]) -> Path | None:
    """Where ``function`` is written, so an error can point into the student's file."""
    try:
        found = inspect.getsourcefile(function)
    except TypeError:  # a builtin has no source file
        return None
    return Path(found).resolve() if found else None


def iter_grade(
    exercise_id: str,
    candidate: Callable[..., Any],
    model: str,
    still_running: Callable[[float], None] | None = None,
    words: Wording = ENGLISH,
) -> Iterator[CheckResult]:
    """Each check of one exercise in order, run with ``candidate`` swapped in, as it finishes."""
    exercises = find_exercises()
    if exercise_id not in exercises:
        raise ValueError(f"Unknown exercise {exercise_id!r}; known: {', '.join(exercises)}.")
    if exercise_id not in CHECKS:
        raise ValueError(f"Exercise {exercise_id} is named in EXERCISE_TARGETS but has no checks in "
                         "chapters/grade_checks/.")
    for check in CHECKS[exercise_id]:
        yield _run_check(exercises[exercise_id], check, candidate, model, still_running, words)


def grade(
    exercise_id: str, candidate: Callable[..., Any], model: str, stop_at_first_failure: bool = False
) -> list[CheckResult]:
    """Every check of one exercise, run with ``candidate`` swapped in, in order.

    ``stop_at_first_failure`` ends at the first failed check: unit checks come
    first, so a wrong answer is named by the behaviour it gets wrong without
    waiting for the end-to-end runs.
    """
    results: list[CheckResult] = []
    for result in iter_grade(exercise_id, candidate, model):
        results.append(result)
        if stop_at_first_failure and not result.passed:
            break
    return results


def models_used(exercise_id: str, model: str, words: Wording = ENGLISH) -> str:
    """What the exercise's checks run on, in words: "no model (unit check), ..."."""
    return words.list_separator.join(dict.fromkeys(check.runs_on(model, words.unit_check) for check in CHECKS[exercise_id]))


def check_name(exercise_id: str, name: str, words: Wording = ENGLISH) -> str:
    """A check's name in the grader's language."""
    return chinese_check(exercise_id, name)[0] if words is WORDING["zh"] else name


def list_checks(exercise_id: str, model: str, words: Wording = ENGLISH) -> list[str]:
    """One line per check: its name, what it runs on, its deadline (``--list``)."""
    return [words.list_line.format(name=check_name(exercise_id, check.name, words),
                                   runs_on=check.runs_on(model, words.unit_check), seconds=check.deadline_s)
            for check in CHECKS[exercise_id]]


def _report(exercise_id: str, results: Iterator[CheckResult], model: str, words: Wording) -> bool:
    """Print each check's result the moment it is known (an end-to-end check builds an engine)."""
    print(words.header.format(exercise=exercise_id, count=len(CHECKS[exercise_id]),
                              models=models_used(exercise_id, model, words)), flush=True)
    passed = True
    for result in results:
        passed = passed and result.passed
        mark = words.check_ok if result.passed else words.failed
        print(f"  [{mark}] {check_name(exercise_id, result.name, words)}", flush=True)
        if result.detail:
            print("        " + result.detail.replace("\n", "\n        "), flush=True)
    print(words.verdict.format(exercise=exercise_id, verdict=words.passed if passed else words.failed))
    return passed


def main(argv: list[str] | None = None) -> int:
    from chapters._common import DEFAULT_MODEL  # the CLI grades on the real model by default

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercise", nargs="?", help="an exercise id such as 4.1")
    parser.add_argument("--all", action="store_true", help="grade every exercise")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model for the end-to-end checks")
    parser.add_argument("--reference", action="store_true", help="grade the reference itself (sanity check)")
    parser.add_argument("--list", action="store_true", help="list the checks (what each runs on), grade nothing")
    parser.add_argument("--reset", action="store_true",
                        help="put back the untouched stub of this one exercise (your code in it is lost)")
    parser.add_argument("--lang", choices=tuple(WORDING), default="en",
                        help="zh: the grader's words, the check names and the labels of the cases in Chinese "
                             "(token ids, code and type names stay as they are)")
    args = parser.parse_args(argv)
    words = WORDING[args.lang]
    exercises = find_exercises()
    if args.all == (args.exercise is not None):
        parser.error(f"give one exercise id or --all; exercises: {', '.join(exercises)}")
    if args.exercise is not None and args.exercise not in exercises:
        parser.error(f"unknown exercise {args.exercise!r}; exercises: {', '.join(exercises)}")
    if args.reset:
        if args.all:
            parser.error("--reset takes one exercise id, so that no other answer is lost")
        path = reset_stub(exercises[args.exercise])
        print(words.stub_reset.format(exercise=args.exercise, path=path.relative_to(REPO_ROOT)))
        return 0
    ids = list(exercises) if args.all else [args.exercise]
    if args.list:
        for exercise_id in ids:
            print(words.list_header.format(exercise=exercise_id, count=len(CHECKS[exercise_id])))
            print("\n".join(list_checks(exercise_id, args.model, words)))
        return 0
    def still_running(seconds: float) -> None:
        print(words.still_running.format(seconds=seconds), flush=True)

    ok = True
    for exercise_id in ids:
        exercise = exercises[exercise_id]
        candidate = reference_function(exercise) if args.reference else student_function(exercise)
        results = iter_grade(exercise_id, candidate, args.model, still_running, words)
        ok = _report(exercise_id, results, args.model, words) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
