"""Where a class, a function or an attribute assignment lives in the source.

Chapter 5 (engine skeleton): the component tree shows, for every node, the line
that defines its class and the line where its owner creates it; chapter 1's and
chapter 5's "where do the three roles live" tables use ``code_location``. All of
it is computed from the live code with ``inspect`` and ``ast``, so no line number
is ever typed by hand.

vLLM 0.32 counterpart: none (the study notes typed these file:line facts by hand).
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

# The directory holding the ``nanoengine`` package: paths are shown relative to it,
# so they read ``nanoengine/engine/core.py:<line>`` wherever the checkout lives.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
_PATH_ROOT = PACKAGE_DIR.parent
_INIT_METHODS = frozenset({"__init__", "__post_init__"})


@dataclass(frozen=True)
class SourceLocation:
    """A line of source; ``path`` is already in display form (see ``format_location``)."""

    path: str
    line: int

    def __str__(self) -> str:
        return format_location(self)


def format_location(location: SourceLocation) -> str:
    """``path:line``, the form editors and terminals turn into a link."""
    return f"{location.path}:{location.line}"


def _display_path(filename: str) -> str:
    """Relative to the directory holding ``nanoengine`` when inside it, else absolute."""
    path = Path(filename).resolve()
    if path.is_relative_to(_PATH_ROOT):
        return path.relative_to(_PATH_ROOT).as_posix()
    return str(path)


@dataclass(frozen=True)
class _AssignmentSite:
    """One ``self.<attr> = ...`` statement inside a class body."""

    location: SourceLocation
    in_init: bool  # __init__ (or __post_init__) is where components are normally made
    called: str | None  # "Scheduler" for ``self.scheduler = Scheduler(...)``


@dataclass(frozen=True)
class _ClassSource:
    """What one class's source says: its ``class`` line, and its attribute assignments."""

    location: SourceLocation
    sites: Mapping[str, tuple[_AssignmentSite, ...]]  # attr -> sites, in source order


@functools.cache
def _parse_file(filename: str) -> ast.Module | None:
    # linecache is where inspect reads source from too, so line numbers agree.
    try:
        return ast.parse("".join(linecache.getlines(filename)), filename)
    except (SyntaxError, ValueError):
        return None


def _find_class_def(module: ast.Module, name: str, first_line: int) -> ast.ClassDef | None:
    """The ClassDef that ``inspect`` located; its first line is a decorator when decorated."""
    for node in ast.walk(module):
        if not isinstance(node, ast.ClassDef) or node.name != name:
            continue
        if min([d.lineno for d in node.decorator_list] + [node.lineno]) == first_line:
            return node
    return None


@functools.cache
def _read_class_source(cls: type) -> _ClassSource | None:
    """Parse ``cls``'s source once; None for builtins and classes without a file."""
    try:
        filename = inspect.getsourcefile(cls)
        _, first_line = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return None
    module = _parse_file(filename) if filename else None
    class_def = _find_class_def(module, cls.__name__, first_line) if module else None
    if filename is None or class_def is None:
        return None
    path = _display_path(filename)
    sites: dict[str, list[_AssignmentSite]] = {}
    for method in class_def.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for attr, site in _self_assignments(method, path):
                sites.setdefault(attr, []).append(site)
    # ast.walk is breadth-first, so a nested `if` branch may come out of line order.
    ordered = {a: tuple(sorted(found, key=lambda s: s.location.line)) for a, found in sites.items()}
    return _ClassSource(SourceLocation(path, class_def.lineno), ordered)


def _self_assignments(
    method: ast.FunctionDef | ast.AsyncFunctionDef, path: str
) -> Iterator[tuple[str, _AssignmentSite]]:
    """Every ``self.<attr> = ...`` (plain, annotated or unpacked) inside one method."""
    decorators = {d.id for d in method.decorator_list if isinstance(d, ast.Name)}
    positional = method.args.posonlyargs + method.args.args
    if not positional or decorators & {"staticmethod", "classmethod"}:
        return
    self_name = positional[0].arg  # "self" by convention, but not by rule
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            for leaf in _flatten_target(target):
                if (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id == self_name
                ):
                    location = SourceLocation(path, leaf.lineno)
                    in_init = method.name in _INIT_METHODS
                    yield leaf.attr, _AssignmentSite(location, in_init, _called_name(value))


def _flatten_target(target: ast.expr) -> Iterator[ast.expr]:
    """``self.a, (self.b, *rest) = ...`` assigns several names; yield each of them."""
    if isinstance(target, (ast.Tuple, ast.List)):
        for element in target.elts:
            yield from _flatten_target(element)
    elif isinstance(target, ast.Starred):
        yield from _flatten_target(target.value)
    else:
        yield target


def _called_name(value: ast.expr) -> str | None:
    """``Scheduler`` for ``Scheduler(...)`` and ``mod.Scheduler(...)``; None otherwise."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return value.func.id
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        return value.func.attr
    return None


def class_defined_at(cls: type) -> SourceLocation | None:
    """The line holding ``class <Name>`` (after any decorators), or None without source."""
    source = _read_class_source(cls)
    return source.location if source else None


def code_location(obj: object) -> SourceLocation | None:
    """Where a class or function is defined (its ``class``/``def`` line), or None."""
    if isinstance(obj, type):
        return class_defined_at(obj)
    try:
        filename = inspect.getsourcefile(obj)  # type: ignore[arg-type]
        _, first_line = inspect.getsourcelines(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    return SourceLocation(_display_path(filename), first_line) if filename else None


def attribute_created_at(
    owner: type, attr: str, child_class: str | None = None
) -> SourceLocation | None:
    """Where ``owner`` (or a base class) runs ``self.<attr> = ...``.

    ``__init__`` wins over other methods, the subclass over its bases. When several
    statements qualify, e.g. one per ``if`` branch, the one that calls ``child_class``
    (the live object's class) is preferred, so the answer matches what actually ran.
    """
    sources = [s for s in map(_read_class_source, owner.__mro__) if s is not None]
    # A stable sort keeps the MRO order (subclass first) within each of the two groups.
    sites = sorted((site for s in sources for site in s.sites.get(attr, ())),
                   key=lambda site: not site.in_init)
    for site in sites:
        if child_class is not None and site.called == child_class:
            return site.location
    return sites[0].location if sites else None
