"""Graded exercises: where each one lives in the reference code, and its student stub.

An exercise id such as ``4.1`` ties four things together:

* a region of the reference code between ``# BEGIN EXERCISE 4.1`` and
  ``# END EXERCISE 4.1`` comments, holding exactly one function or method
  (``async def`` too: exercise 8.2 is a coroutine method);
* the student stub ``chapters/exercises/ex4_1.py``, written by
  ``scripts/make_exercises.py``: same signature and docstring, body replaced by
  ``raise NotImplementedError``;
* the pytest marker ``exercise_4_1`` on its grading test (tests/test_exercises.py);
* the docs page ``docs/exercises/4.1.md`` (task, hints, what the grader checks).

Nothing here is typed by hand per exercise: the registry is found by scanning the
sources for the markers, so adding an exercise means adding markers, a page and
its checks in ``chapters/grade_checks/``. No line number is stored anywhere;
every location is recomputed from the current source.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
EXERCISES_DIR = Path(__file__).resolve().parent
# Reference code lives in these packages; the stubs' own directory is not searched.
_SEARCHED_PACKAGES = ("nanoengine", "chapters")
_BEGIN = re.compile(r"^\s*# BEGIN EXERCISE (\d+\.\d+)\s*$")
_END = re.compile(r"^\s*# END EXERCISE (\d+\.\d+)\s*$")
# A marked definition: a plain function or method, or a coroutine one (``async def``).
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Exercise:
    """One exercise as the markers define it (``qualname`` is ``Class.method`` for methods)."""

    exercise_id: str  # "4.1"
    path: Path  # the reference source file
    module: str  # "nanoengine.core.kv_cache_manager"
    qualname: str  # "KVCacheManager.allocate_slots"
    node: FunctionNode  # the marked definition, parsed from the current source

    @property
    def slug(self) -> str:
        """``4_1``: the id as it appears in module names and pytest markers."""
        return self.exercise_id.replace(".", "_")

    @property
    def stub_module(self) -> str:
        return f"chapters.exercises.ex{self.slug}"

    @property
    def stub_path(self) -> Path:
        return EXERCISES_DIR / f"ex{self.slug}.py"

    @property
    def marker(self) -> str:
        return f"exercise_{self.slug}"

    @property
    def docs_page(self) -> str:
        """Where the task is explained, relative to the repository root."""
        return f"docs/exercises/{self.exercise_id}.md"

    @property
    def function_name(self) -> str:
        return self.qualname.rpartition(".")[2]

    @property
    def class_name(self) -> str | None:
        owner = self.qualname.rpartition(".")[0]
        return owner or None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _definitions(tree: ast.Module) -> list[tuple[str, FunctionNode]]:
    """Every function and method (``async def`` included) with its qualified name (classes may nest)."""
    found: list[tuple[str, FunctionNode]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((prefix + node.name, node))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return found


def first_line(node: FunctionNode) -> int:
    """The definition's first line: its first decorator when it has any."""
    return min([d.lineno for d in node.decorator_list] + [node.lineno])


def _marked_regions(lines: list[str], path: Path) -> list[tuple[str, int, int]]:
    """(id, begin line, end line) of every marked region in one file, 1-based."""
    regions: list[tuple[str, int, int]] = []
    open_id: str | None = None
    open_line = 0
    for number, text in enumerate(lines, start=1):
        if begin := _BEGIN.match(text):
            if open_id is not None:
                raise ValueError(f"{path}: EXERCISE {begin[1]} begins inside EXERCISE {open_id}.")
            open_id, open_line = begin[1], number
        elif end := _END.match(text):
            if end[1] != open_id:
                raise ValueError(f"{path}: END EXERCISE {end[1]} does not close {open_id or 'anything'}.")
            regions.append((end[1], open_line, number))
            open_id = None
    if open_id is not None:
        raise ValueError(f"{path}: EXERCISE {open_id} is never closed by '# END EXERCISE {open_id}'.")
    return regions


def _exercises_in(path: Path) -> list[Exercise]:
    source = path.read_text(encoding="utf-8")
    if "# BEGIN EXERCISE" not in source:
        return []
    tree = ast.parse(source, str(path))
    definitions = _definitions(tree)
    found = []
    for exercise_id, begin, end in _marked_regions(source.splitlines(), path):
        inside = [(name, node) for name, node in definitions
                  if begin < first_line(node) and node.end_lineno is not None and node.end_lineno < end]
        # A method of a marked class would also be "inside"; keep the outermost ones.
        outermost = [(name, node) for name, node in inside
                     if not any(other is not node and name.startswith(other_name + ".")
                                for other_name, other in inside)]
        if len(outermost) != 1:
            raise ValueError(
                f"{path}: EXERCISE {exercise_id} must hold exactly one function or method, "
                f"found {[name for name, _ in outermost]}."
            )
        qualname, node = outermost[0]
        found.append(Exercise(exercise_id, path, _module_name(path), qualname, node))
    return found


def find_exercises() -> dict[str, Exercise]:
    """Every marked exercise in the reference code, by id, in id order."""
    found: dict[str, Exercise] = {}
    for package in _SEARCHED_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if EXERCISES_DIR in path.parents:
                continue
            for exercise in _exercises_in(path):
                if exercise.exercise_id in found:
                    other = found[exercise.exercise_id].path
                    raise ValueError(f"EXERCISE {exercise.exercise_id} is marked twice: {other} and {path}.")
                found[exercise.exercise_id] = exercise
    return dict(sorted(found.items(), key=lambda item: tuple(map(int, item[0].split(".")))))
