"""What the grader says when a check fails: only what differs, and where.

Chapters 1, 3-10 (the exercises). A check returns labeled data: a dict whose
keys name the call and its inputs (``"allocate_slots(first, 10 new tokens)"``)
and whose values are what came back. When the student's result is not the
reference's, ``describe_difference`` walks both and reports each place where
they part, by its label and index, with both values in full: nothing is cut
at a fixed length, and equal fields are left out. When the student's code
raises, ``describe_exception`` names the exception, its message (or, for a
bare ``assert``, the failing line itself) and the line of the student's file
it came from.

The grader's own words come in two languages (``WORDING["en"]``,
``WORDING["zh"]``, picked by ``--lang``); the labels and values a check
returns are data and are shown as they are, except a ``Label``, which carries
its Chinese with it.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from chapters.exercises import REPO_ROOT

# The grader's checks and stand-ins: an exception raised there is described by its message.
_GRADER_CHECKS = REPO_ROOT / "chapters" / "grade_checks"

# A sequence whose text is this short is shown whole; a longer one element by element.
_SHOW_WHOLE_CHARS = 100
# Past this many differing places the rest are counted, not listed.
_MAX_DIFFERENCES = 12


@dataclass(frozen=True)
class Wording:
    """Everything the grader says in one language, as format strings."""

    differs: str  # {where} {expected} {got}
    missing: str  # {where} {expected}
    not_expected: str  # {where} {got}
    the_result: str
    one_more_place: str  # one differing place past the ones listed
    more_places: str  # {count}: differing places past the ones listed
    raised: str  # {name} {message}
    no_message: str
    in_your_code: str  # {where}
    raised_at: str  # {where}
    did_not_return: str  # {seconds}
    running_at: str  # {where}: where the code that did not return was running
    budget: str  # {seconds} {unit_s} {end_to_end_s}
    not_run_stopped: str  # {name}: the check that did not return
    not_run_budget: str  # {seconds}
    not_run_units_failed: str  # {count}
    not_run: str  # a check's mark when it did not run
    header: str  # {exercise} {count} {models}
    verdict: str  # {exercise} {verdict}
    passed: str  # an exercise's verdict, and one check's mark
    failed: str
    check_ok: str
    still_running: str  # {seconds}
    list_header: str  # {exercise} {count}
    list_line: str  # {name} {runs_on} {seconds}
    unit_check: str  # what a unit check runs on
    stub_reset: str  # {exercise} {path}
    list_separator: str  # between the names of a list in one line


WORDING = {
    "en": Wording(
        differs="{where}: expected {expected}, got {got}",
        missing="{where}: missing (expected {expected})",
        not_expected="{where}: not expected (got {got})",
        the_result="the result",
        one_more_place="... and 1 more differing place",
        more_places="... and {count} more differing places",
        raised="raised {name}: {message}",
        no_message="(no message)",
        in_your_code="  in your code at {where}",
        raised_at="  raised at {where}",
        did_not_return=("did not return within {seconds:.0f} s -- a blocking call? (a wait with no timeout, "
                        "or a synchronous call inside an async def, never returns; so does a loop that never ends)"),
        running_at="  it was still running at {where}",
        budget=("Your code gets {seconds:.0f} s in all ({unit_s:.0f} s for the unit checks, {end_to_end_s:.0f} s "
                "for each end-to-end run); the first check that does not return ends the grade."),
        not_run_stopped="not run: the grade ended when '{name}' did not return",
        not_run_budget="not run: your code used up the grade's {seconds:.0f} s",
        not_run_units_failed=("not run: {count} unit check(s) failed, and the end-to-end run would only repeat "
                              "their mistake, slowly; make those pass first"),
        not_run="not run",
        header="Exercise {exercise}: {count} checks, on {models}",
        verdict="Exercise {exercise}: {verdict}",
        passed="PASS",
        failed="FAIL",
        check_ok="ok",
        still_running="        ... still running ({seconds:.0f} s)",
        list_header="Exercise {exercise} ({count} checks):",
        list_line="  {name}  [{runs_on}; at most {seconds:.0f} s]",
        unit_check="no model (unit check)",
        stub_reset="Exercise {exercise}: {path} is the untouched stub again.",
        list_separator=", ",
    ),
    "zh": Wording(
        differs="{where}：应为 {expected}，实际为 {got}",
        missing="{where}：缺少这一项（应为 {expected}）",
        not_expected="{where}：多出这一项（得到 {got}）",
        the_result="结果",
        one_more_place="……另有 1 处不同",
        more_places="……另有 {count} 处不同",
        raised="抛出 {name}：{message}",
        no_message="（没有消息）",
        in_your_code="  出自你的代码：{where}",
        raised_at="  抛出位置：{where}",
        did_not_return=("{seconds:.0f} 秒内没有返回——是不是有阻塞调用？（没有超时的等待，"
                        "或者 async def 里的同步调用，都不会返回；永不结束的循环也一样）"),
        running_at="  当时仍在运行：{where}",
        budget=("你的代码一共有 {seconds:.0f} 秒（单元检查合计 {unit_s:.0f} 秒，每次端到端运行 {end_to_end_s:.0f} 秒）；"
                "第一个没有返回的检查会结束整次评分。"),
        not_run_stopped="未运行：检查“{name}”没有返回，评分到此结束",
        not_run_budget="未运行：你的代码已用完本次评分的 {seconds:.0f} 秒",
        not_run_units_failed="未运行：有 {count} 个单元检查未通过，端到端运行只会更慢地重复同样的错误；请先让它们通过",
        not_run="未运行",
        header="练习 {exercise}：{count} 个检查项，运行在 {models} 上",
        verdict="练习 {exercise}：{verdict}",
        passed="通过",
        failed="未通过",
        check_ok="通过",
        still_running="        ……仍在运行（{seconds:.0f} 秒）",
        list_header="练习 {exercise}（{count} 个检查项）：",
        list_line="  {name}  [{runs_on}；最多 {seconds:.0f} 秒]",
        unit_check="不用模型（单元检查）",
        stub_reset="练习 {exercise}：{path} 已恢复成未改动的 stub。",
        list_separator="、",
    ),
}
ENGLISH = WORDING["en"]


class Label(str):
    """A check's label in both languages. It compares and hashes as its English
    text, so the reference's result and the student's match key for key; the
    Chinese grader shows ``zh`` in its place."""

    zh: str

    def __new__(cls, english: str, zh: str) -> Self:
        label = super().__new__(cls, english)
        label.zh = zh
        return label

    def said(self, words: Wording) -> str:
        return self.zh if words is WORDING["zh"] else str(self)


def describe_difference(expected: Any, actual: Any, words: Wording = ENGLISH) -> list[str]:
    """One line per place where ``actual`` differs from ``expected`` (empty when equal)."""
    lines = _differences(expected, actual, "", words)
    if len(lines) > _MAX_DIFFERENCES:
        hidden = len(lines) - _MAX_DIFFERENCES
        more = words.one_more_place if hidden == 1 else words.more_places.format(count=hidden)
        lines = [*lines[:_MAX_DIFFERENCES], more]
    return lines


def _differences(expected: Any, actual: Any, path: str, words: Wording) -> list[str]:
    if expected == actual:
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        return _dict_differences(expected, actual, path, words)
    same_shape = type(expected) is type(actual) and isinstance(expected, list | tuple)
    if same_shape and len(expected) == len(actual) and len(repr(expected)) > _SHOW_WHOLE_CHARS:
        found: list[str] = []
        for index, (want, got) in enumerate(zip(expected, actual)):
            found += _differences(want, got, f"{path}[{index}]", words)
        return found
    return [words.differs.format(where=path or words.the_result, expected=repr(expected), got=repr(actual))]


def _dict_differences(expected: dict[Any, Any], actual: dict[Any, Any], path: str, words: Wording) -> list[str]:
    found: list[str] = []
    for key, want in expected.items():
        label = _label(path, key, words)
        if key not in actual:
            found.append(words.missing.format(where=label, expected=repr(want)))
        else:
            found += _differences(want, actual[key], label, words)
    found += [words.not_expected.format(where=_label(path, key, words), got=repr(got))
              for key, got in actual.items() if key not in expected]
    return found


def _label(path: str, key: Any, words: Wording) -> str:
    """Top-level string keys read as labels; deeper keys as subscripts."""
    if not path and isinstance(key, Label):
        return key.said(words)
    if not path and isinstance(key, str):
        return key
    return f"{path}[{key!r}]"


def describe_exception(error: BaseException, candidate_file: Path | None, words: Wording = ENGLISH) -> str:
    """The exception, its message (or the failing line), and where in the candidate it arose."""
    frames = traceback.extract_tb(error.__traceback__)
    raised_at = frames[-1] if frames else None
    message = str(error) or (raised_at.line.strip() if raised_at is not None and raised_at.line else "")
    if type(error).__module__.startswith("chapters.grade_checks"):
        # The grader's own exception (the loop of exercise 1.1 never ending):
        # its message says what happened; its class name would say nothing more.
        lines = [message]
    else:
        lines = [words.raised.format(name=type(error).__name__, message=message or words.no_message)]
    in_candidate = [f for f in frames if candidate_file is not None and Path(f.filename) == candidate_file]
    if in_candidate:
        lines.append(words.in_your_code.format(where=_where(in_candidate[-1])))
    # Where it was raised, when that says something: an engine line your code
    # called, say. The grader's own stand-ins and checks are not shown: their
    # message already says what your code did.
    shown = raised_at is not None and not _is_grader_code(raised_at)
    if shown and raised_at is not None and (not in_candidate or raised_at is not in_candidate[-1]):
        lines.append(words.raised_at.format(where=_where(raised_at)))
    return "\n".join(lines)


def describe_still_running(stack: list[traceback.FrameSummary], candidate_file: Path | None,
                           words: Wording = ENGLISH) -> str:
    """Where a check that did not return was running: the innermost line of the
    candidate's file when it was inside it (``while True:``), else the innermost
    line of all (a ``recv`` the candidate called, say)."""
    in_candidate = [f for f in stack if candidate_file is not None and Path(f.filename) == candidate_file]
    if in_candidate:
        return words.in_your_code.format(where=_where(in_candidate[-1]))
    return words.running_at.format(where=_where(stack[-1])) if stack else ""


def _is_grader_code(frame: traceback.FrameSummary) -> bool:
    return Path(frame.filename).resolve().is_relative_to(_GRADER_CHECKS)


def _where(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    code = (frame.line or "").strip()
    return f"{shown}:{frame.lineno}" + (f": {code}" if code else "")
