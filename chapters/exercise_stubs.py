"""The student stubs of the graded exercises: render them, check them, write them back.

Chapters 1, 3-10 (the exercises). Each exercise names one function or method of
the reference code (``EXERCISE_TARGETS`` in ``chapters/exercises/``). Its stub
keeps the signature and docstring and replaces the body with
``raise NotImplementedError("Exercise <id>: see docs/exercises/<id>")``. A
method becomes a module-level function whose ``self`` is annotated with its
class, which is how the grader can swap it into the class. An ``async def``
stays one: its stub raises when it is awaited.

A stub a student has written in is never overwritten by accident: ``write``
skips it (``--force`` in ``scripts/make_exercises.py`` overrides), and
``reset_stub`` (``python -m chapters.grade 4.1 --reset``) restores one
exercise only.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import sys
import textwrap
import types
from pathlib import Path

from chapters.exercises import EXERCISES_DIR, REPO_ROOT, Exercise, FunctionNode, find_exercises

# Decorators make no sense on the module-level stub; the grader re-applies
# staticmethod itself when the reference attribute is one.
_SELF = re.compile(r"\bself\b(?=\s*[,)])")


def _annotation_names(node: FunctionNode) -> set[str]:
    """Top-level names the signature mentions (``torch`` for ``torch.Tensor``)."""
    args = node.args
    parts: list[ast.AST | None] = [node.returns, *args.defaults, *args.kw_defaults]
    every_arg = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    parts += [arg.annotation for arg in every_arg if arg is not None]
    names: set[str] = set()
    for part in parts:
        if part is not None:
            names |= {n.id for n in ast.walk(part) if isinstance(n, ast.Name)}
    return names


def _import_line(name: str, reference: types.ModuleType) -> str | None:
    """How the stub imports ``name`` so that it means what it means in the reference."""
    if name not in vars(reference):
        if hasattr(builtins, name):
            return None
        raise ValueError(f"{reference.__name__} uses {name!r} in a signature but does not define it.")
    value = vars(reference)[name]
    if isinstance(value, types.ModuleType):
        package, _, leaf = value.__name__.rpartition(".")
        if value.__name__ == name:
            return f"import {name}"
        # ``from torch import nn``, as ruff prefers to ``import torch.nn as nn``.
        return f"from {package} import {name}" if leaf == name else f"import {value.__name__} as {name}"
    home = getattr(value, "__module__", None)
    if home and getattr(value, "__qualname__", None) == name:
        return f"from {home} import {name}"
    return f"from {reference.__name__} import {name}"  # an alias such as ``BlockHash = bytes``


def _imports(exercise: Exercise, reference: types.ModuleType) -> list[str]:
    names = _annotation_names(exercise.node)
    if exercise.class_name is not None and not _is_static(exercise):
        names.add(exercise.class_name.partition(".")[0])
    lines = {line for name in names if (line := _import_line(name, reference)) is not None}
    # Group ``from m import a`` and ``from m import b`` into one line.
    merged: dict[str, set[str]] = {}
    plain = set()
    for line in lines:
        if line.startswith("from "):
            module, _, name = line[len("from "):].partition(" import ")
            merged.setdefault(module, set()).add(name)
        else:
            plain.add(line)
    froms = {f"from {module} import {', '.join(sorted(names))}" for module, names in merged.items()}
    return _isort_layout(plain | froms)


def extra_imports(exercise: Exercise) -> list[str]:
    """The imports the reference body needs beyond the stub's own (its signature's).

    Every exercise page names these (tests/test_exercises.py checks it): a
    student should not have to guess where a constant or a helper lives.
    """
    node, reference = exercise.node, importlib.import_module(exercise.module)
    loaded = {n.id for statement in node.body[1:] for n in ast.walk(statement)
              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    stub_names = _annotation_names(node) | {exercise.class_name or ""}
    wanted = sorted(name for name in loaded - stub_names if name in vars(reference))
    return [line for name in wanted if (line := _import_line(name, reference)) is not None]


def _isort_layout(lines: set[str]) -> list[str]:
    """Standard library, third party, first party, blank-line separated, as isort (and ruff) want."""
    def section(line: str) -> int:
        top = line.split()[1].partition(".")[0]
        return 0 if top in sys.stdlib_module_names else 2 if top in ("nanoengine", "chapters") else 1

    blocks = []
    for number in range(3):
        chosen = [line for line in lines if section(line) == number]
        # Within a section, ``import x`` lines come before ``from x import y`` lines.
        ordered = sorted(chosen, key=lambda line: (line.startswith("from "), line.split()[1]))
        if ordered:
            blocks.append("\n".join(ordered))
    return blocks


def _is_static(exercise: Exercise) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in exercise.node.decorator_list)


def render_stub(exercise: Exercise) -> str:
    """The full text of one stub module."""
    node = exercise.node
    if ast.get_docstring(node) is None:
        raise ValueError(f"Exercise {exercise.exercise_id}: {exercise.qualname} needs a docstring.")
    docstring = node.body[0]
    lines = exercise.path.read_text(encoding="utf-8").splitlines()
    header = textwrap.dedent("\n".join(lines[node.lineno - 1 : docstring.lineno - 1]))
    if exercise.class_name is not None and not _is_static(exercise):
        header = _SELF.sub(f"self: {exercise.class_name}", header, count=1)
    body = textwrap.dedent("\n".join(lines[docstring.lineno - 1 : docstring.end_lineno]))
    body = textwrap.indent(body, "    ")
    relpath = exercise.path.relative_to(REPO_ROOT).as_posix()
    chapter = exercise.exercise_id.partition(".")[0]
    imports = "\n\n".join(_imports(exercise, importlib.import_module(exercise.module)))
    # Two blank lines before the ``def``, as isort wants, whether or not anything is imported.
    import_block = f"{imports}\n\n\n" if imports else "\n"
    exercise_id = exercise.exercise_id
    return (
        f'"""Exercise {exercise_id} (chapter {chapter}): write ``{exercise.qualname}``.\n\n'
        f"Generated by ``scripts/make_exercises.py`` from ``{exercise.qualname}`` in\n"
        f"``{relpath}``; keep the signature. The task and hints are on\n"
        f"``{exercise.docs_page}``. Replace the ``raise`` with your code, then grade it:\n"
        f"``python -m chapters.grade {exercise_id}``; to start over,\n"
        f"``python -m chapters.grade {exercise_id} --reset``.\n"
        '"""\n\n'
        "from __future__ import annotations\n\n"
        f"{import_block}"
        f"{header}\n{body}\n"
        f'    raise NotImplementedError("Exercise {exercise_id}: see docs/exercises/{exercise_id}")\n'
    )


def expected_stubs() -> dict[Path, str]:
    return {exercise.stub_path: render_stub(exercise) for exercise in find_exercises().values()}


def stale_stubs(expected: dict[Path, str]) -> list[Path]:
    """Stub files whose exercise no longer exists."""
    return sorted(path for path in EXERCISES_DIR.glob("ex*.py") if path not in expected)


def check() -> list[str]:
    """What ``--check`` complains about; empty when every stub is current."""
    expected = expected_stubs()
    problems = [f"{path.name}: no exercise of EXERCISE_TARGETS has it any more" for path in stale_stubs(expected)]
    for path, text in expected.items():
        if not path.exists():
            problems.append(f"{path.name}: missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{path.name}: out of date")
    return problems


def is_untouched(path: Path) -> bool:
    """True when the stub still raises its ``NotImplementedError``: nobody has written in it."""
    return 'raise NotImplementedError("Exercise ' in path.read_text(encoding="utf-8")


def write(force: bool = False) -> list[Path]:
    """Bring every stub up to date; returns the stubs skipped because a student wrote in them."""
    expected = expected_stubs()
    for path in stale_stubs(expected):
        path.unlink()
        print(f"removed {path.relative_to(REPO_ROOT)}")
    skipped: list[Path] = []
    for path, text in expected.items():
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        if path.exists() and not force and not is_untouched(path):
            skipped.append(path)
            print(f"kept {path.relative_to(REPO_ROOT)}: it holds your answer (--force overwrites it)")
            continue
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return skipped


def reset_stub(exercise: Exercise) -> Path:
    """Write the untouched stub of one exercise back, whatever its file holds now."""
    exercise.stub_path.write_text(render_stub(exercise), encoding="utf-8")
    return exercise.stub_path
