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
(``Check.deadline_s``) fails, naming the line it was still running. A blocked
thread or event loop cannot hang the grader: the grader puts the reference
back, stops a spinning loop by raising ``CheckAbandoned`` inside it, and ends
the grade there -- a thread still blocked ends with the process.

One budget covers the whole grade (``grade_budget_s``, printed when it
starts): each check's deadline is cut to what is left of it. Unit checks come
first; the end-to-end checks run only when every unit check passed, since a
wrong function would only fail again, slowly (``every_check=True`` runs them
anyway: the tests use it to show that each check catches an unwritten stub).

Chapters 1, 3-10 (the exercises). vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib
import inspect
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chapters.exercise_stubs import reset_stub
from chapters.exercises import REPO_ROOT, Exercise, find_exercises
from chapters.grade_checks import CHECKS, Check, chinese_check
from chapters.grade_checks.common import END_TO_END_DEADLINE_S, UNIT_CHECKS_BUDGET_S, grade_budget_s
from chapters.grade_messages import (
    ENGLISH,
    WORDING,
    Wording,
    describe_difference,
    describe_exception,
    describe_still_running,
)

_SWAPPABLE_PACKAGES = ("nanoengine", "chapters")


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    detail: str  # empty when passed
    ran: bool = True  # False: the grade skipped it (``detail`` says why)
    timed_out: bool = False  # it did not return by its deadline: the grade ends here


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
    """A check ran past its deadline: the student's code is probably blocked, or loops for ever."""

    def __init__(self, deadline_s: float, stack: list[traceback.FrameSummary]) -> None:
        super().__init__(ENGLISH.did_not_return.format(seconds=deadline_s))
        self.deadline_s = deadline_s
        self.stack = stack  # where the check's thread was when the deadline passed


class CheckAbandoned(BaseException):
    """Raised by the grader inside a check's thread that ran past its deadline.

    A ``BaseException``, like ``KeyboardInterrupt``: an ``except Exception`` in
    the student's loop must not swallow it.
    """


# Seconds between two "still running" lines while a check runs.
_PROGRESS_EVERY_S = 10.0
# How long the grader waits for an abandoned check's thread to take its CheckAbandoned.
_ABANDON_WAIT_S = 1.0


def run_with_deadline(
    run: Callable[[], Any], deadline_s: float, still_running: Callable[[float], None] | None = None
) -> Any:
    """``run()`` on a thread of its own; its result, or its exception, or ``DidNotReturn``.

    At the deadline the thread's stack is kept (for the message) and
    ``CheckAbandoned`` is raised inside it: a loop that spins ends at its next
    line, rather than taking the CPU from every later check. A thread blocked
    in a system call (a ``recv``, a ``queue.get()`` with no timeout) only sees
    it when the call returns; it is a daemon and ends with the process.
    ``still_running(seconds)`` is called every ``_PROGRESS_EVERY_S`` seconds.
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
            stack = _stack_of(worker)
            _raise_in(worker, CheckAbandoned)
            worker.join(_ABANDON_WAIT_S)  # a spinning loop ends at its next line
            raise DidNotReturn(deadline_s, stack)
        worker.join(min(_PROGRESS_EVERY_S, deadline_s - waited))
        if worker.is_alive() and still_running is not None and time.monotonic() - start < deadline_s:
            still_running(time.monotonic() - start)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def _stack_of(thread: threading.Thread) -> list[traceback.FrameSummary]:
    """Where ``thread`` is now, outermost call first (empty if it just ended)."""
    frame = sys._current_frames().get(thread.ident or -1)
    return list(traceback.extract_stack(frame)) if frame is not None else []


def _raise_in(thread: threading.Thread, exception: type[BaseException]) -> None:
    """Have ``exception`` raised in ``thread`` at its next Python line (CPython's async exception)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exception))


@functools.cache
def _reference_result(exercise_id: str, check_name: str, model: str) -> Any:
    check = next(c for c in CHECKS[exercise_id] if c.name == check_name)
    return check.run(model)


def _run_check(
    exercise: Exercise,
    check: Check,
    candidate: Callable[..., Any],
    model: str,
    deadline: float,
    still_running: Callable[[float], None] | None = None,
    words: Wording = ENGLISH,
) -> CheckResult:
    """One check: the reference's result (the grader's own time), then the candidate's by ``deadline``
    (``time.monotonic()``) or the check's own deadline, whichever comes first."""
    expected = _reference_result(exercise.exercise_id, check.name, model)
    allowed_s = min(check.deadline_s, deadline - time.monotonic())
    try:
        # The swap is undone here, on the grader's thread, even when the check's
        # own thread never comes back: later checks see the reference again.
        with swapped_in(exercise, candidate):
            actual = run_with_deadline(lambda: check.run(model), allowed_s, still_running)
    except DidNotReturn as exc:
        detail = words.did_not_return.format(seconds=exc.deadline_s)
        if where := describe_still_running(exc.stack, _source_file(candidate), words):
            detail += "\n" + where
        return CheckResult(check.name, False, detail, timed_out=True)
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
    every_check: bool = False,
) -> Iterator[CheckResult]:
    """Each check of one exercise in order, run with ``candidate`` swapped in, as it finishes.

    Within one budget (``grade_budget_s``): a check that does not return ends
    the grade, and the checks after it are reported as not run, saying why; so
    are the end-to-end checks after a failed unit check, unless ``every_check``.
    """
    exercises = find_exercises()
    if exercise_id not in exercises:
        raise ValueError(f"Unknown exercise {exercise_id!r}; known: {', '.join(exercises)}.")
    if exercise_id not in CHECKS:
        raise ValueError(f"Exercise {exercise_id} is named in EXERCISE_TARGETS but has no checks in "
                         "chapters/grade_checks/.")
    budget_s = grade_budget_s(CHECKS[exercise_id])
    # The budget is the candidate's: the reference's runs (the grader's own work) move the deadline on.
    deadline = time.monotonic() + budget_s
    stopped_by: str | None = None  # the check that did not return
    failed_unit_checks = 0
    for check in CHECKS[exercise_id]:
        if stopped_by is not None:
            yield _not_run(check, words.not_run_stopped.format(name=check_name(exercise_id, stopped_by, words)))
        elif check.is_end_to_end and failed_unit_checks and not every_check:
            yield _not_run(check, words.not_run_units_failed.format(count=failed_unit_checks))
        elif time.monotonic() >= deadline:
            yield _not_run(check, words.not_run_budget.format(seconds=budget_s))
        else:
            deadline += _reference_time(exercise_id, check, model)
            result = _run_check(exercises[exercise_id], check, candidate, model, deadline, still_running, words)
            failed_unit_checks += not result.passed and not check.is_end_to_end
            stopped_by = check.name if result.timed_out else None
            yield result


def _not_run(check: Check, why: str) -> CheckResult:
    return CheckResult(check.name, False, why, ran=False)


def _reference_time(exercise_id: str, check: Check, model: str) -> float:
    """Seconds the reference's run of ``check`` takes now (0 once it is cached)."""
    started = time.monotonic()
    _reference_result(exercise_id, check.name, model)
    return time.monotonic() - started


def grade(
    exercise_id: str, candidate: Callable[..., Any], model: str, stop_at_first_failure: bool = False,
    every_check: bool = False,
) -> list[CheckResult]:
    """Every check of one exercise, run with ``candidate`` swapped in, in order.

    ``stop_at_first_failure`` ends at the first failed check: unit checks come
    first, so a wrong answer is named by the behaviour it gets wrong without
    waiting for the end-to-end runs. ``every_check``: see ``iter_grade``.
    """
    results: list[CheckResult] = []
    for result in iter_grade(exercise_id, candidate, model, every_check=every_check):
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
    print(words.budget.format(seconds=grade_budget_s(CHECKS[exercise_id]), unit_s=UNIT_CHECKS_BUDGET_S,
                              end_to_end_s=END_TO_END_DEADLINE_S), flush=True)
    passed, said = True, ""
    for result in results:
        passed = passed and result.passed
        mark = words.check_ok if result.passed else words.failed if result.ran else words.not_run
        print(f"  [{mark}] {check_name(exercise_id, result.name, words)}", flush=True)
        if result.detail and result.detail != said:  # why the checks were not run: said once
            print("        " + result.detail.replace("\n", "\n        "), flush=True)
        said = result.detail if not result.ran else ""
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
