"""Find a named piece of source code and its current line range.

A page names code in one of three ways, and the line numbers are always
recomputed from today's source (none is ever typed into a page):

* a dotted Python name: ``nanoengine.engine.core.EngineCore.step`` (a class,
  function or method, decorators included) or a whole module;
* a named anchor: a region between ``# [anchor: NAME]`` and ``# [/anchor: NAME]``;
* an exercise: ``exercise-4.1`` is the function the exercise asks for
  (``EXERCISE_TARGETS`` in ``chapters/exercises/``).

An unknown or ambiguous name raises ``LookupError``; the hook turns it into a
failed build.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("nanoengine", "chapters")
# The C++ kernels are shown too (source pages and anchored excerpts), but they
# are not Python modules: they get no API reference page.
KERNEL_DIR = "nanoengine/csrc"
_KERNEL_SUFFIXES = (".cpp", ".h")
# "# [anchor: NAME]" in Python, "// [anchor: NAME]" in C++.
_ANCHOR_OPEN = re.compile(r"(?:#|//)\s*\[anchor:\s*([\w.-]+)\s*\]")
_ANCHOR_CLOSE = re.compile(r"(?:#|//)\s*\[/anchor:\s*([\w.-]+)\s*\]")


@dataclass(frozen=True)
class CodeRegion:
    """Lines ``start``..``end`` (1-based, inclusive) of ``path`` (relative to the repo)."""

    name: str
    path: str
    start: int
    end: int

    def text(self) -> str:
        lines = (ROOT / self.path).read_text(encoding="utf-8").splitlines()
        return "\n".join(lines[self.start - 1 : self.end])

    @property
    def language(self) -> str:
        return language_of(Path(self.path))


def language_of(path: Path) -> str:
    """The code fence language of a shown file: "cpp" for the kernels, else "python"."""
    return "cpp" if path.suffix in _KERNEL_SUFFIXES else "python"


def source_files() -> list[Path]:
    """Every Python file the site shows, relative to the repository root."""
    return sorted(p.relative_to(ROOT) for pkg in SOURCE_PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def shown_files() -> list[Path]:
    """Every file with a source page: the Python files and the C++ kernels."""
    kernels = (p.relative_to(ROOT) for p in (ROOT / KERNEL_DIR).rglob("*") if p.suffix in _KERNEL_SUFFIXES)
    return source_files() + sorted(kernels)


@cache
def _marked_regions() -> dict[str, CodeRegion]:
    """Named anchors of every source file."""
    found: dict[str, CodeRegion] = {}
    for path in shown_files():
        opened: dict[str, int] = {}
        for number, line in enumerate((ROOT / path).read_text(encoding="utf-8").splitlines(), start=1):
            for pattern, is_open in ((_ANCHOR_OPEN, True), (_ANCHOR_CLOSE, False)):
                match = pattern.search(line)
                if match is None:
                    continue
                name = match[1]
                if is_open:
                    opened[name] = number
                elif name not in opened:
                    raise LookupError(f"{path}: region {name!r} is closed but never opened")
                else:
                    if name in found:
                        raise LookupError(f"code region {name!r} is defined twice ({found[name].path}, {path})")
                    found[name] = CodeRegion(name, path.as_posix(), opened.pop(name) + 1, number - 1)
        if opened:
            raise LookupError(f"{path}: region(s) {sorted(opened)} never closed")
    return found


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _find_definition(tree: ast.Module, qualname: list[str]) -> ast.AST | None:
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname:
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body  # type: ignore[attr-defined]
    return node


def _dotted_region(name: str) -> CodeRegion | None:
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        module_file = _module_file(parts[:split])
        if module_file is None:
            continue
        rel = module_file.relative_to(ROOT).as_posix()
        source = module_file.read_text(encoding="utf-8")
        if split == len(parts):
            return CodeRegion(name, rel, 1, len(source.splitlines()))
        node = _find_definition(ast.parse(source), parts[split:])
        if node is None:
            return None
        decorators = getattr(node, "decorator_list", [])
        start = min([d.lineno for d in decorators] + [node.lineno])  # type: ignore[attr-defined]
        return CodeRegion(name, rel, start, node.end_lineno)  # type: ignore[attr-defined]
    return None


def _exercise_region(name: str) -> CodeRegion | None:
    """``exercise-4.1``: the reference function of that exercise, by its dotted name."""
    from chapters.exercises import EXERCISE_TARGETS

    target = EXERCISE_TARGETS.get(name.removeprefix("exercise-"))
    if target is None:
        return None
    region = _dotted_region(target.replace(":", "."))
    return None if region is None else CodeRegion(name, region.path, region.start, region.end)


def find_region(name: str) -> CodeRegion:
    """The region called ``name`` in the current source, or LookupError."""
    if name.partition(".")[0] in SOURCE_PACKAGES:
        region = _dotted_region(name)
    elif name.startswith("exercise-"):
        region = _exercise_region(name)
    else:
        region = _marked_regions().get(name)
    if region is None:
        raise LookupError(
            f"unknown code reference {name!r}: not a dotted name in {SOURCE_PACKAGES}, "
            "a '# [anchor: NAME]' region or an 'exercise-N.M' region"
        )
    return region


def clear_cache() -> None:
    """Forget the anchors: ``mkdocs serve`` rebuilds after the source changes."""
    _marked_regions.cache_clear()
