"""Chapter 5's source map: nanoengine's live component tree beside vLLM's.

Every node of ``print(llm)`` has a vLLM counterpart; chapter 5 of the study notes
typed their file:line by hand for vLLM 0.30. ``chapters/data/vllm_0_32_map.json`` records
them for vLLM 0.32 (and keeps the notes' 0.30 numbers, so the drift between
releases is computed, not remembered). When the ``vllm`` package is importable
the 0.32 column is recomputed live from it with ``inspect`` and says which
version it read; otherwise the recorded facts are used.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.table import Table

from nanoengine.instruments.component_tree import (
    ComponentNode,
    attribute_created_at,
    build_component_tree,
    code_location,
)

DATA_FILE = Path(__file__).resolve().parent / "data" / "vllm_0_32_map.json"


@dataclass(frozen=True)
class VllmNode:
    """vLLM's counterpart of one tree node: the class, and the line creating it."""

    tree_path: str  # attribute path from the LLM root, "" for the root itself
    vllm_class: str | None = None
    owner: str | None = None  # the class whose __init__ runs ``self.<attr> = ...``
    attr: str | None = None
    defined_at: str | None = None
    created_at: str | None = None
    seed_defined_at: str | None = None
    seed_created_at: str | None = None


@dataclass(frozen=True)
class VllmSymbol:
    """A function or class the chapter names that is not a tree node.

    ``nanoengine`` is the dotted name of our counterpart; a symbol without one
    says in ``absent_because`` why nanoengine has none, so the table never
    shows a bare gap a reader would take for a missing piece.
    """

    name: str
    vllm: str
    at: str
    nanoengine: str | None = None
    seed_at: str | None = None
    note: str | None = None
    absent_because: str | None = None


@dataclass
class VllmMap:
    version: str  # the vLLM version the 0.32 column describes
    seed_version: str
    live: bool  # True when read from an installed vllm package
    nodes: dict[str, VllmNode]
    symbols: list[VllmSymbol]
    file_sizes: dict[str, int] = field(default_factory=dict)


def load_vllm_map(prefer_installed: bool = True) -> VllmMap:
    """The recorded map, recomputed from the installed ``vllm`` when there is one
    (and ``prefer_installed``)."""
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    recorded = VllmMap(
        version=data["vllm_version"],
        seed_version=data["seed_version"],
        live=False,
        nodes={node["tree_path"]: VllmNode(**node) for node in data["nodes"]},
        symbols=[VllmSymbol(**symbol) for symbol in data["symbols"]],
        file_sizes=data["file_sizes_0_32"],
    )
    if not prefer_installed:
        return recorded
    try:
        vllm: Any = importlib.import_module("vllm")
    # Not installed, or a build that fails to import (its C ops): use the record.
    except Exception:  # noqa: BLE001
        return recorded
    return _recompute_live(recorded, vllm)


def _recompute_live(recorded: VllmMap, vllm: Any) -> VllmMap:
    root = Path(vllm.__file__).resolve().parent
    nodes = {}
    for path, node in recorded.nodes.items():
        cls = _resolve(node.vllm_class)
        owner = _resolve(node.owner)
        created = attribute_created_at(owner, node.attr) if isinstance(owner, type) and node.attr else None
        nodes[path] = VllmNode(
            tree_path=path,
            vllm_class=node.vllm_class,
            owner=node.owner,
            attr=node.attr,
            defined_at=_location(cls, root) if cls is not None else None,
            created_at=_relative(f"{created.path}:{created.line}", root) if created else None,
            seed_defined_at=node.seed_defined_at,
            seed_created_at=node.seed_created_at,
        )
    symbols = [replace(s, at=_symbol_location(s.vllm, root) or "(not found)") for s in recorded.symbols]
    return VllmMap(str(getattr(vllm, "__version__", "unknown")), recorded.seed_version, True, nodes, symbols)


def _resolve(dotted: str | None) -> Any:
    """Import ``a.b.C.method`` by trying the longest importable module prefix."""
    if dotted is None:
        return None
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name, None)
        return obj
    return None


def _symbol_location(dotted: str, root: Path) -> str | None:
    """Where ``a.b.Class.method`` is defined, even behind a wrapper without ``functools.wraps``."""
    obj = _resolve(dotted)
    owner_path, _, name = dotted.rpartition(".")
    owner = _resolve(owner_path)
    if callable(obj) and getattr(inspect.unwrap(obj), "__name__", name) != name and isinstance(owner, type):
        # The wrapper hides the method: find its ``def`` inside the class body.
        lines, first = inspect.getsourcelines(owner)
        for offset, text in enumerate(lines):
            if text.lstrip().startswith((f"def {name}(", f"async def {name}(")):
                return _relative(f"{inspect.getsourcefile(owner)}:{first + offset}", root)
    return _location(obj, root)


def _location(obj: Any, root: Path) -> str | None:
    """The ``def``/``class`` line, past decorators (vLLM wraps some methods for tracing)."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    try:
        filename = inspect.getsourcefile(obj)
        lines, line = inspect.getsourcelines(obj)
    except (OSError, TypeError):
        return None
    decorators = 0
    while decorators < len(lines) and lines[decorators].lstrip().startswith("@"):
        decorators += 1
    return _relative(f"{filename}:{line + decorators}", root) if filename else None


def _relative(location: str, root: Path) -> str:
    filename, _, line = location.rpartition(":")
    path = Path(filename).resolve()
    shown = path.relative_to(root).as_posix() if path.is_relative_to(root) else filename
    return f"{shown}:{line}"


# ---------------------------------------------------------------------- tree + map


def walk_with_paths(node: ComponentNode, path: str = "") -> Iterator[tuple[ComponentNode, str, int]]:
    """(node, attribute path from the root, depth) for every node, depth first."""
    yield node, path, path.count(".") + (1 if path else 0)
    for child in node.children:
        yield from walk_with_paths(child, f"{path}.{child.attr}" if path else str(child.attr))


def source_map_table(llm: object, vllm_map: VllmMap) -> Table:
    """One row per tree node: nanoengine's live file:line beside vLLM's."""
    origin = "read live from the installed vllm" if vllm_map.live else "recorded in chapters/data"
    table = Table(
        title=f"Source map: nanoengine (live) vs vLLM {vllm_map.version} ({origin})"
        f" vs the study notes' {vllm_map.seed_version}"
    )
    notes_column = f"study notes {vllm_map.seed_version}"
    for column in ("component", "nanoengine", f"vLLM {vllm_map.version}", notes_column):
        table.add_column(column)
    for node, path, depth in walk_with_paths(build_component_tree(llm)):
        counterpart = vllm_map.nodes.get(path)
        label = "  " * depth + (node.class_name if node.attr is None else f"{node.attr}: {node.class_name}")
        ours = node.created_at or node.defined_at
        table.add_row(
            label,
            str(ours) if ours else "",
            _pair(counterpart.created_at, counterpart.defined_at) if counterpart else "",
            _pair(counterpart.seed_created_at, counterpart.seed_defined_at) if counterpart else "",
        )
    return table


def _pair(created_at: str | None, defined_at: str | None) -> str:
    """ "created at -> class at", either part optional."""
    return " -> ".join(part for part in (created_at, defined_at) if part)


def tree_json(llm: object, vllm_map: VllmMap) -> dict[str, Any]:
    """The component tree as JSON data, each node with its vLLM counterpart (or null)."""
    root = build_component_tree(llm)
    counterparts = {path: vllm_map.nodes.get(path) for _, path, _ in walk_with_paths(root)}

    def convert(node: ComponentNode, path: str) -> dict[str, Any]:
        data = node.to_dict()
        counterpart = counterparts.get(path)
        data["vllm"] = (
            None
            if counterpart is None
            else {
                "version": vllm_map.version,
                "live": vllm_map.live,
                "class": counterpart.vllm_class,
                "defined_at": counterpart.defined_at,
                "created_at": counterpart.created_at,
                f"study_notes_{vllm_map.seed_version}": (
                    counterpart.seed_created_at or counterpart.seed_defined_at
                ),
            }
        )
        data["children"] = [
            convert(child, f"{path}.{child.attr}" if path else str(child.attr)) for child in node.children
        ]
        return data

    return {"vllm_version": vllm_map.version, "vllm_live": vllm_map.live, "tree": convert(root, "")}


# ---------------------------------------------------------------------- drift


@dataclass(frozen=True)
class Drift:
    """How far one line moved between the study notes' release (0.30) and 0.32."""

    name: str
    seed: str
    now: str

    @property
    def delta(self) -> int | None:
        """Lines moved, when both point into the same file."""
        seed_file, _, seed_line = self.seed.rpartition(":")
        now_file, _, now_line = self.now.rpartition(":")
        return int(now_line) - int(seed_line) if seed_file == now_file else None


def compute_drift(vllm_map: VllmMap) -> list[Drift]:
    """Every fact known for both releases, in map order."""
    drifts: list[Drift] = []
    for node in vllm_map.nodes.values():
        if node.attr and node.seed_created_at and node.created_at:
            owner = node.owner.rpartition(".")[2] if node.owner else ""
            drifts.append(Drift(f"{owner}.{node.attr}", node.seed_created_at, node.created_at))
        if node.vllm_class and node.seed_defined_at and node.defined_at:
            drifts.append(
                Drift(f"class {node.vllm_class.rpartition('.')[2]}", node.seed_defined_at, node.defined_at)
            )
    for symbol in vllm_map.symbols:
        if symbol.seed_at:
            drifts.append(Drift(symbol.name, symbol.seed_at, symbol.at))
    return drifts


def drift_table(vllm_map: VllmMap) -> Table:
    table = Table(title=f"Drift: the study notes' vLLM {vllm_map.seed_version} lines vs {vllm_map.version}")
    for column in ("what", f"{vllm_map.seed_version}", f"{vllm_map.version}", "moved"):
        table.add_column(column, justify="right" if column == "moved" else "left")
    for drift in compute_drift(vllm_map):
        delta = drift.delta
        table.add_row(drift.name, drift.seed, drift.now, "other file" if delta is None else f"{delta:+d}")
    return table


def symbols_table(vllm_map: VllmMap) -> Table:
    """Functions the chapter names, with nanoengine's live counterpart where there is one.

    The notes go under the table, numbered: a fourth column would leave too
    little width for the file:line columns, and a cut path cannot be opened.
    """
    table = Table(title=f"Named functions: vLLM {vllm_map.version} and nanoengine", caption_justify="left")
    for column in ("vLLM", f"vLLM {vllm_map.version}"):
        table.add_column(column, no_wrap=True)
    table.add_column("nanoengine")
    table.add_column("note", justify="right")
    notes: list[str] = []
    for symbol in vllm_map.symbols:
        if symbol.note:
            notes.append(f"{len(notes) + 1}. {symbol.name}: {symbol.note}")
        table.add_row(
            symbol.name, symbol.at, nanoengine_counterpart(symbol), str(len(notes)) if symbol.note else ""
        )
    table.caption = "\n".join(notes) or None
    return table


def nanoengine_counterpart(symbol: VllmSymbol) -> str:
    """Where our counterpart is defined, or why there is none.

    A recorded name that no longer imports is a stale map, not an absence:
    it is shown as such, so a rename in nanoengine cannot pass for a gap.
    """
    if symbol.nanoengine is None:
        return f"(no counterpart: {symbol.absent_because or 'no reason recorded'})"
    location = _location_of_ours(symbol.nanoengine)
    return location or f"(stale map: {symbol.nanoengine} not found)"


def _location_of_ours(dotted: str) -> str | None:
    obj = _resolve(dotted)
    if callable(obj):
        obj = inspect.unwrap(obj)  # past decorators such as torch.inference_mode
    location = code_location(obj) if obj is not None else None
    return str(location) if location else None
