"""What the grader says when a check fails: only what differs, and where.

Chapters 1, 3-9 (the exercises). A check returns labeled data: a dict whose
keys name the call and its inputs (``"allocate_slots(first, 10 new tokens)"``)
and whose values are what came back. When the student's result is not the
reference's, ``describe_difference`` walks both and reports each place where
they part, by its label and index, with both values in full: nothing is cut
at a fixed length, and equal fields are left out. When the student's code
raises, ``describe_exception`` names the exception, its message (or, for a
bare ``assert``, the failing line itself) and the line of the student's file
it came from.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from chapters.exercises import REPO_ROOT

# The grader's checks and stand-ins: an exception raised there is described by its message.
_GRADER_CHECKS = REPO_ROOT / "chapters" / "grade_checks"

# A sequence whose text is this short is shown whole; a longer one element by element.
_SHOW_WHOLE_CHARS = 100
# Past this many differing places the rest are counted, not listed.
_MAX_DIFFERENCES = 12


def describe_difference(expected: Any, actual: Any) -> list[str]:
    """One line per place where ``actual`` differs from ``expected`` (empty when equal)."""
    lines = _differences(expected, actual, "")
    if len(lines) > _MAX_DIFFERENCES:
        hidden = len(lines) - _MAX_DIFFERENCES
        lines = [*lines[:_MAX_DIFFERENCES], f"... and {hidden} more differing place{'s' * (hidden > 1)}"]
    return lines


def _differences(expected: Any, actual: Any, path: str) -> list[str]:
    if expected == actual:
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        return _dict_differences(expected, actual, path)
    same_shape = type(expected) is type(actual) and isinstance(expected, list | tuple)
    if same_shape and len(expected) == len(actual) and len(repr(expected)) > _SHOW_WHOLE_CHARS:
        found: list[str] = []
        for index, (want, got) in enumerate(zip(expected, actual)):
            found += _differences(want, got, f"{path}[{index}]")
        return found
    return [f"{path or 'the result'}: expected {expected!r}, got {actual!r}"]


def _dict_differences(expected: dict[Any, Any], actual: dict[Any, Any], path: str) -> list[str]:
    found: list[str] = []
    for key, want in expected.items():
        label = _label(path, key)
        if key not in actual:
            found.append(f"{label}: missing (expected {want!r})")
        else:
            found += _differences(want, actual[key], label)
    found += [f"{_label(path, key)}: not expected (got {got!r})" for key, got in actual.items() if key not in expected]
    return found


def _label(path: str, key: Any) -> str:
    """Top-level string keys read as labels; deeper keys as subscripts."""
    if not path and isinstance(key, str):
        return key
    return f"{path}[{key!r}]"


def describe_exception(error: BaseException, candidate_file: Path | None) -> str:
    """The exception, its message (or the failing line), and where in the candidate it arose."""
    frames = traceback.extract_tb(error.__traceback__)
    raised_at = frames[-1] if frames else None
    message = str(error) or (raised_at.line.strip() if raised_at is not None and raised_at.line else "")
    if type(error).__module__.startswith("chapters.grade_checks"):
        # The grader's own exception (the loop of exercise 1.1 never ending):
        # its message says what happened; its class name would say nothing more.
        lines = [message]
    else:
        lines = [f"raised {type(error).__name__}: {message or '(no message)'}"]
    in_candidate = [f for f in frames if candidate_file is not None and Path(f.filename) == candidate_file]
    if in_candidate:
        lines.append(f"  in your code at {_where(in_candidate[-1])}")
    # Where it was raised, when that says something: an engine line your code
    # called, say. The grader's own stand-ins and checks are not shown: their
    # message already says what your code did.
    shown = raised_at is not None and not _is_grader_code(raised_at)
    if shown and raised_at is not None and (not in_candidate or raised_at is not in_candidate[-1]):
        lines.append(f"  raised at {_where(raised_at)}")
    return "\n".join(lines)


def _is_grader_code(frame: traceback.FrameSummary) -> bool:
    return Path(frame.filename).resolve().is_relative_to(_GRADER_CHECKS)


def _where(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    code = (frame.line or "").strip()
    return f"{shown}:{frame.lineno}" + (f": {code}" if code else "")
