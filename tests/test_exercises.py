"""The graded exercises stay honest: current stubs, a page each, graders that bite.

In CI (the default), for every exercise the reference passes its grader and the
generated stub fails every one of its checks -- so no check passes vacuously.
With ``NANOENGINE_STUDENT=1`` the same tests grade the student's code in
``chapters/exercises/`` instead (``-m exercise_4_1`` selects one exercise).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from exercise_mutants import (
    Mutant,
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
from mkdocs_config import load_mkdocs_config, nav_pages

import chapters.grade_checks.common
from chapters.exercise_stubs import check as check_stubs
from chapters.exercise_stubs import is_untouched, render_stub, reset_stub, write
from chapters.exercises import REPO_ROOT, find_exercises
from chapters.grade import _reference_result, grade, reference_function, student_function, swapped_in
from chapters.grade_checks import CHECKS

STUDENT = os.environ.get("NANOENGINE_STUDENT") == "1"
EXERCISES = find_exercises()
# The exercises the course promises; more may be added, none may disappear.
REQUIRED = {"1.1", "2.1", "3.1", "3.2", "4.1", "4.2", "4.3", "4.4", "4.5", "4.6", "5.1", "5.2", "6.1", "6.2", "7.1", "8.1", "8.2",
            "9.1", "10.1"}
MUTANTS: list[Mutant] = [*ch1.MUTANTS, *ch2.MUTANTS, *ch3.MUTANTS, *ch4.MUTANTS, *ch4_hybrid.MUTANTS, *ch4_sliding.MUTANTS,
                          *ch5.MUTANTS,
                          *ch6.MUTANTS, *ch6_tensor_parallel.MUTANTS, *ch7.MUTANTS, *ch8.MUTANTS, *ch9.MUTANTS,
                          *ch10.MUTANTS]
# Every exercise gets at least this many planted mistakes for its grader to catch.
MIN_MUTANTS = 3


def _nav_pages() -> set[str]:
    return {path for _, path in nav_pages(load_mkdocs_config()["nav"])}


def test_required_exercises_are_marked() -> None:
    assert REQUIRED <= set(EXERCISES), f"missing: {sorted(REQUIRED - set(EXERCISES))}"


def test_stubs_are_current() -> None:
    problems = check_stubs()
    assert problems == [], "run `python scripts/make_exercises.py`: " + "; ".join(problems)


def test_regenerating_keeps_an_answer_and_reset_restores_one_stub(monkeypatch: pytest.MonkeyPatch) -> None:
    exercise = EXERCISES["6.1"]
    path = exercise.stub_path
    untouched = render_stub(exercise)
    answer = untouched.replace('raise NotImplementedError("Exercise 6.1: see docs/exercises/6.1")',
                               "return 0")
    try:
        path.write_text(answer, encoding="utf-8")
        assert not is_untouched(path)
        assert write() == [path] and path.read_text(encoding="utf-8") == answer  # the answer survives
        reset_stub(exercise)
        assert path.read_text(encoding="utf-8") == untouched and is_untouched(path)
    finally:
        path.write_text(untouched, encoding="utf-8")


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_exercise_has_page_checks_and_marker(exercise_id: str, pytestconfig: pytest.Config) -> None:
    exercise = EXERCISES[exercise_id]
    page = REPO_ROOT / exercise.docs_page
    assert page.is_file(), f"{exercise.docs_page} is missing"
    assert f'{{{{ grader_checks("{exercise_id}") }}}}' in page.read_text(encoding="utf-8")
    assert f"exercises/{exercise_id}.md" in _nav_pages(), "the page is not in the mkdocs nav"
    assert CHECKS.get(exercise_id), "no checks in chapters/grade_checks.py"
    registered = {line.partition(":")[0] for line in pytestconfig.getini("markers")}
    assert exercise.marker in registered


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_stub_keeps_the_signature(exercise_id: str) -> None:
    exercise = EXERCISES[exercise_id]
    stub, reference = student_function(exercise), reference_function(exercise)
    assert list(inspect.signature(stub).parameters) == list(inspect.signature(reference).parameters)
    assert inspect.getdoc(stub) == inspect.getdoc(reference)
    # An ``async def`` exercise (8.2) stays one: the grader's caller awaits it.
    assert inspect.iscoroutinefunction(stub) == inspect.iscoroutinefunction(reference)
    if not STUDENT:  # in student mode the stub is the student's work
        with pytest.raises(NotImplementedError, match=f"Exercise {exercise_id}: see docs/exercises/{exercise_id}"):
            called = stub(*[None] * len(inspect.signature(stub).parameters))
            if inspect.iscoroutine(called):  # a coroutine's body runs when it is awaited
                asyncio.run(called)


def test_checks_explain_themselves() -> None:
    """Each check says what it feeds in (the docs list it), and no assert is silent."""
    silent = []
    for path in sorted((REPO_ROOT / "chapters" / "grade_checks").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        silent += [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
                   if isinstance(node, ast.Assert) and node.msg is None]
    assert not silent, f"asserts without a message print nothing when they fail: {silent}"
    undocumented = [c.name for checks in CHECKS.values() for c in checks if not inspect.getdoc(c.run)]
    assert not undocumented, f"checks without a docstring (their inputs, shown on the page): {undocumented}"


def test_swap_is_undone_afterwards() -> None:
    import nanoengine.core.kv_cache_sizing as sizing
    import nanoengine.request as request_module

    function_ex, method_ex = EXERCISES["6.1"], EXERCISES["5.1"]
    original_function = sizing.num_blocks_from_budget
    original_method = vars(request_module.RequestStatus)["is_finished"]
    with swapped_in(function_ex, student_function(function_ex)):
        assert sizing.num_blocks_from_budget is student_function(function_ex)
    with swapped_in(method_ex, student_function(method_ex)), pytest.raises(NotImplementedError):
        request_module.RequestStatus.is_finished(request_module.RequestStatus.RUNNING)
    assert sizing.num_blocks_from_budget is original_function
    assert vars(request_module.RequestStatus)["is_finished"] is original_method


def _graded(exercise_id: str) -> list[object]:
    return [pytest.param(exercise_id, marks=getattr(pytest.mark, EXERCISES[exercise_id].marker))]


@pytest.mark.parametrize("exercise_id", [p for e in sorted(EXERCISES) for p in _graded(e)])
def test_grader(exercise_id: str, tiny_llama: str) -> None:
    exercise = EXERCISES[exercise_id]
    if STUDENT:
        results = grade(exercise_id, student_function(exercise), tiny_llama)
        failed = [f"{r.name}: {r.detail}" for r in results if not r.passed]
        assert not failed, f"Exercise {exercise_id} is not solved yet:\n" + "\n".join(failed)
        return
    reference = grade(exercise_id, reference_function(exercise), tiny_llama)
    assert all(r.passed for r in reference), [(r.name, r.detail) for r in reference if not r.passed]
    for check in CHECKS[exercise_id]:  # labeled data, so a failure can name what differs
        result = _reference_result(exercise_id, check.name, tiny_llama)
        assert isinstance(result, dict) and all(isinstance(key, str) for key in result), (
            f"check {check.name!r} must return a dict keyed by labels, got {type(result).__name__}"
        )
    stub = grade(exercise_id, student_function(exercise), tiny_llama, every_check=True)
    vacuous = [r.name for r in stub if r.passed or "NotImplementedError" not in r.detail]
    assert not vacuous, f"these checks do not catch an unwritten {exercise.qualname}: {vacuous}"


@pytest.mark.exercise_6_2
def test_6_2_reference_ranks_give_hugging_faces_logits(tiny_llama: str) -> None:
    """6.2's two-rank check compares each rank's logits with Hugging Face's: the
    reference must match them, or a wrong answer that also missed would pass."""
    if STUDENT:
        pytest.skip("student mode grades the student's code; this checks the check")
    from chapters.grade_checks.ch6_tensor_parallel import e2e_two_ranks_match_hf

    name = next(check.name for check in CHECKS["6.2"] if check.run is e2e_two_ranks_match_hf)
    result = _reference_result("6.2", name, tiny_llama)
    matches = {label: value for label, value in result.items() if "of Hugging Face's" in label}
    assert len(matches) == 4 and all(matches.values()), matches


@pytest.mark.exercise_9_1
def test_9_1_reference_run_keeps_rejects_and_adds_bonus_tokens(tiny_llama: str) -> None:
    """9.1's end-to-end check compares the student's run with the reference's: the
    reference's must give plain greedy decoding's tokens and meet every case of the
    page (drafts kept, drafts rejected, a step that kept all its drafts), or a wrong
    answer could pass on a run that never reaches its mistake."""
    if STUDENT:
        pytest.skip("student mode grades the student's code; this checks the check")
    from chapters.grade_checks.ch9 import MAX_STEPS, e2e_same_as_plain, plain_run

    name = next(check.name for check in CHECKS["9.1"] if check.run is e2e_same_as_plain)
    result = _reference_result("9.1", name, tiny_llama)
    plain_steps = plain_run(tiny_llama).steps
    assert result[f"every request finished within {MAX_STEPS} engine steps"] is True, result
    assert result["every request's tokens are plain greedy decoding's"] is True, result
    assert 0 < result["drafts kept"] < result["drafted tokens verified"], result
    assert result["steps that kept all 3 drafts (and added a bonus token)"] > 0, result
    assert result[f"engine steps (plain decoding: {plain_steps})"] < plain_steps, result  # the point of it all


@pytest.mark.exercise_10_1
def test_10_1_reference_run_gives_one_engines_tokens_and_keeps_hits_home(tiny_llama: str) -> None:
    """10.1's end-to-end check compares the student's run with the reference's: the
    reference's must give one engine's tokens, and pull fewer tokens for the prompt whose
    first blocks the consumer holds, or an answer that pulls its hits too could pass."""
    if STUDENT:
        pytest.skip("student mode grades the student's code; this checks the check")
    from chapters.grade_checks.ch10 import E2E_PROMPTS, e2e_two_engines

    name = next(check.name for check in CHECKS["10.1"] if check.run is e2e_two_engines)
    result = _reference_result("10.1", name, tiny_llama)
    assert result["prompt 1: the same tokens as one engine alone"] is True, result
    assert result["prompt 2: the same tokens as one engine alone"] is True, result
    assert result["prompt 1: tokens pulled from the producer"] == len(E2E_PROMPTS[0]) - 1, result
    assert result["prompt 2: tokens pulled from the producer"] == len(E2E_PROMPTS[1]) - 1 - 16, result


def test_grade_cli_reports_pass_and_fail(tiny_llama: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import chapters.grade

    assert chapters.grade.main(["6.1", "--model", tiny_llama, "--reference"]) == 0
    # A wrong answer: every budget buys one block too many.
    monkeypatch.setattr(chapters.grade, "student_function",
                        lambda exercise: lambda available_bytes, spec: available_bytes // spec.page_size_bytes + 1)
    assert chapters.grade.main(["6.1", "--model", tiny_llama]) == 1
    out = capsys.readouterr().out
    assert "Exercise 6.1: PASS" in out and "Exercise 6.1: FAIL" in out and "[FAIL] blocks from a byte budget" in out


def test_grade_cli_speaks_chinese_with_lang_zh(tiny_llama: str, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import chapters.grade
    from chapters.grade_checks import chinese_check

    name = chinese_check("6.1", CHECKS["6.1"][0].name)[0]
    monkeypatch.setattr(chapters.grade, "student_function",
                        lambda exercise: lambda available_bytes, spec: available_bytes // spec.page_size_bytes + 1)
    assert chapters.grade.main(["6.1", "--model", tiny_llama, "--lang", "zh"]) == 1
    out = capsys.readouterr().out
    assert "练习 6.1：" in out and "个检查项" in out and "练习 6.1：未通过" in out
    assert f"[未通过] {name}" in out
    assert "：应为 " in out and "，实际为 " in out  # what differs, in the grader's Chinese words
    assert chapters.grade.main(["6.1", "--list", "--lang", "zh"]) == 0
    assert "[不用模型（单元检查）；最多 30 秒]" in capsys.readouterr().out


# Exercises whose checks label their data in both languages (``Label``).
BILINGUAL_LABELS = ("9.1",)


@pytest.mark.parametrize("exercise_id", BILINGUAL_LABELS)
def test_grade_lang_zh_names_every_check_and_label_in_chinese(exercise_id: str, tiny_llama: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The reference, graded with ``--lang zh``: every check title it prints, and every
    label a failure would print, holds Chinese (English words among them may stay)."""
    import re

    import chapters.grade
    from chapters.grade_messages import WORDING, describe_difference

    han = re.compile(r"[\u4e00-\u9fff]")
    zh = WORDING["zh"]
    assert chapters.grade.main([exercise_id, "--model", tiny_llama, "--reference", "--lang", "zh"]) == 0
    marks = f"  [{zh.check_ok}] "
    titles = [line.removeprefix(marks) for line in capsys.readouterr().out.splitlines() if line.startswith(marks)]
    assert len(titles) == len(CHECKS[exercise_id]), titles
    assert all(han.search(title) for title in titles), titles
    for check in CHECKS[exercise_id]:
        for label, value in _reference_result(exercise_id, check.name, tiny_llama).items():
            # As a student whose result lacks this entry would read it, less the grader's own words.
            (line,) = describe_difference({label: value}, {}, zh)
            shown = line.removesuffix(zh.missing.format(where="", expected=repr(value)))
            assert han.search(shown), (check.name, shown)


def test_every_check_has_a_chinese_name_and_inputs() -> None:
    import re

    from chapters.grade_checks import chinese_check
    from chapters.grade_checks.zh import CHINESE

    han = re.compile(r"[\u4e00-\u9fff]")
    for exercise_id, checks in CHECKS.items():
        for check in checks:
            name, inputs = chinese_check(exercise_id, check.name)
            assert han.search(name) and han.search(inputs), (exercise_id, check.name, name, inputs)
            assert name.startswith("端到端：") == check.name.startswith("end to end"), (exercise_id, name)
        stale = set(CHINESE.get(exercise_id, {})) - {check.name for check in checks}
        assert not stale, f"chapters/grade_checks/zh.py names checks exercise {exercise_id} lacks: {stale}"
    assert set(CHINESE) == set(CHECKS)


def test_a_target_that_names_no_function_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import chapters.exercises

    targets = {**chapters.exercises.EXERCISE_TARGETS, "9.9": "nanoengine.core.kv_cache_manager:KVCacheManager.nope"}
    monkeypatch.setattr(chapters.exercises, "EXERCISE_TARGETS", targets)
    with pytest.raises(ValueError, match=r"exercise 9.9: nanoengine/core/kv_cache_manager.py defines no function "
                                         r"'KVCacheManager.nope'"):
        find_exercises()


def test_no_exercise_marker_is_left_in_the_engine() -> None:
    """The engine's sources describe the code; the exercises name their functions from outside."""
    marked = [path for path in (REPO_ROOT / "nanoengine").rglob("*.py") if "EXERCISE" in path.read_text()]
    assert not marked, marked


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_every_exercise_has_mutants_named_by_a_check(exercise_id: str) -> None:
    mutants = [m for m in MUTANTS if m.exercise_id == exercise_id]
    assert len(mutants) >= MIN_MUTANTS, f"exercise {exercise_id}: {len(mutants)} mutants, want {MIN_MUTANTS}"
    names = {check.name for check in CHECKS[exercise_id]}
    assert {m.caught_by for m in mutants} <= names, "a mutant names a check that does not exist"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.exercise_id}: {m.wrong_answer}")
def test_grader_rejects_each_mutant_and_names_the_behaviour(mutant: Mutant, tiny_llama: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if STUDENT:
        pytest.skip("student mode grades the student's code, not the planted mistakes")
    if "must not hang" in mutant.wrong_answer:
        # A mutant that blocks is failed by the watchdog at the deadline; a unit
        # check returns well within 5 s, so the test need not wait the full 30.
        monkeypatch.setattr(chapters.grade_checks.common, "UNIT_CHECK_DEADLINE_S", 5.0)
    results = grade(mutant.exercise_id, mutant.function, tiny_llama, stop_at_first_failure=True)
    first_failure = results[-1]
    assert not first_failure.passed, f"the grader passed a wrong answer: {mutant.wrong_answer}"
    assert first_failure.name == mutant.caught_by, (
        f"caught by {first_failure.name!r}, not {mutant.caught_by!r}:\n{first_failure.detail}"
    )
    assert first_failure.detail.strip(), "the failure says nothing about what differs"
    # It speaks of the student's code, never of the grader's own stand-ins.
    internal = ("_Scripted", "grade_checks", "LoopNeverEnds")
    assert not any(name in first_failure.detail for name in internal), (
        first_failure.detail
    )


def test_a_check_that_never_returns_fails_by_its_deadline_and_the_grader_goes_on() -> None:
    """The watchdog itself, on toy checks: a blocked call, a loop that spins (stopped, so it
    takes no CPU from later checks), then a normal one."""
    import threading

    from chapters.grade import DidNotReturn, run_with_deadline

    never = threading.Event()
    ticks: list[float] = []
    with pytest.raises(DidNotReturn, match=r"did not return within 1 s -- a blocking call\?") as blocked:
        run_with_deadline(never.wait, 1.0, ticks.append)
    assert blocked.value.stack and blocked.value.stack[-1].name == "wait"  # where it was, for the message
    spins = 0

    def spin() -> None:
        nonlocal spins
        while True:
            spins += 1

    with pytest.raises(DidNotReturn):
        run_with_deadline(spin, 0.5)
    spinning = [thread for thread in threading.enumerate() if thread.name == "grader-check" and _runs(thread, "spin")]
    assert not spinning and spins > 0, "the spinning loop was not stopped"
    assert run_with_deadline(lambda: 42, 1.0) == 42
    with pytest.raises(ZeroDivisionError):
        run_with_deadline(lambda: 1 / 0, 1.0)
    never.set()  # the blocked thread ends too


def _runs(thread: object, function_name: str) -> bool:
    import sys
    import traceback

    frame = sys._current_frames().get(getattr(thread, "ident", None) or -1)
    return frame is not None and any(f.name == function_name for f in traceback.extract_stack(frame))


# Grades 10.1 three times in a process of its own: an answer that spins, one that blocks
# on a socket, then the reference. The unit checks' deadline is cut to 2 s: what is
# tested is that the first check that does not return ends the grade, naming its line.
_GRADE_RUNNER = '''
import socket, sys, threading
import chapters.grade as grade
import chapters.grade_checks.common as common
common.UNIT_CHECK_DEADLINE_S = 2.0

def spins(self, request, blocks, num_computed_tokens, num_external_tokens):
    while True:
        pass

def blocks_on_a_socket(self, request, blocks, num_computed_tokens, num_external_tokens):
    ours, _ = socket.socketpair()
    ours.recv(1)

for answer in (spins, blocks_on_a_socket, None):
    grade.student_function = lambda exercise: answer or grade.reference_function(exercise)
    status = grade.main(["10.1"])
    alive = [t.name for t in threading.enumerate() if t.name == "grader-check"]
    print(f"exit {status}, checks still running: {len(alive)}", flush=True)
'''


def test_an_answer_that_spins_or_blocks_ends_the_grade_at_once_naming_its_line(tmp_path: Path) -> None:
    """Exercise 10.1 on a slow machine (NANOENGINE_INJECT_DELAY): ``while True: pass`` and a
    blocking ``recv`` each fail at the first check, which names the line, and the rest are
    reported as not run, within the budget stated at the start; then the reference passes."""
    runner = tmp_path / "grade_runner.py"
    runner.write_text(_GRADE_RUNNER, encoding="utf-8")
    env = {**os.environ, "NANOENGINE_INJECT_DELAY": "step=0.02"}
    done = subprocess.run([sys.executable, str(runner)], check=False, capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO_ROOT)
    grades = done.stdout.split("Exercise 10.1: 8 checks")[1:]
    assert len(grades) == 3, done.stdout + done.stderr
    for grade_output, line in zip(grades[:2], ("while True:", "ours.recv(1)")):
        assert "Your code gets 120 s in all" in grade_output
        assert "[FAIL] no local hits" in grade_output and "did not return within 2 s" in grade_output
        assert f"in your code at {runner}:" in grade_output and line in grade_output
        assert grade_output.count("[not run]") == 7 and grade_output.count("the grade ended when") == 1
        assert "Exercise 10.1: FAIL" in grade_output
    assert "exit 1, checks still running: 0" in grades[0]  # the spinning loop was stopped
    assert "exit 1, checks still running: 1" in grades[1]  # the blocked recv cannot be: it ends with the process
    assert "Exercise 10.1: PASS" in grades[2] and "[not run]" not in grades[2]


def test_list_names_every_check_and_what_it_really_runs_on(capsys: pytest.CaptureFixture[str]) -> None:
    import chapters.grade

    assert chapters.grade.main(["--all", "--list", "--model", "SmolLM2-135M-Instruct"]) == 0
    out = capsys.readouterr().out
    for exercise_id, exercise in EXERCISES.items():
        assert f"Exercise {exercise_id} (" in out, exercise.qualname
    assert "end to end: greedy tokens on a tiny hybrid model  [the grader's tiny Qwen3.5; at most 90 s]" in out
    assert "[no model (unit check); at most 30 s]" in out and "[SmolLM2-135M-Instruct; at most 90 s]" in out
    assert chapters.grade.models_used("4.4", "SmolLM2-135M-Instruct") == (
        "no model (unit check), the grader's tiny Qwen3.5"
    )


@pytest.mark.parametrize("exercise_id", sorted(EXERCISES))
def test_every_page_names_the_imports_its_stub_lacks(exercise_id: str) -> None:
    from chapters.exercise_stubs import extra_imports

    exercise = EXERCISES[exercise_id]
    page = (REPO_ROOT / exercise.docs_page).read_text(encoding="utf-8")
    # "from m import n" is told when the page names both n and m (one line may import several).
    missing = [line for line in extra_imports(exercise)
               if not all(part in page for part in line.removeprefix("from ").split(" import "))]
    assert not missing, f"{exercise.docs_page} should tell the student to add: {missing}"
