"""Tests for the live component tree (nanoengine/instruments/component_tree.py, chapter 5).

The dummy classes below play an engine in miniature; ``register_component`` lists
them in the registry the tree printer reads, as ``COMPONENTS`` lists the engine's. Expected line numbers are never
typed in: ``line_of`` finds the marker comment in this very file, so the tests keep
passing when lines move, exactly as the tree itself does.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from rich.tree import Tree

from nanoengine.config import CacheConfig
from nanoengine.instruments.component_tree import (
    COMPONENTS,
    UNSET,
    ComponentNode,
    SourceLocation,
    build_component_tree,
    component_of,
    format_location,
    install_tree_printing,
    register_component,
    render_component_tree,
    tree_to_text,
)

THIS_FILE = Path(__file__).resolve()
REPO_ROOT = THIS_FILE.parents[1]  # the directory holding the nanoengine package
SHOWN_PATH = THIS_FILE.relative_to(REPO_ROOT).as_posix()  # "tests/test_component_tree.py"


def line_of(marker: str, path: Path = THIS_FILE) -> int:
    """The 1-based line of the only line in ``path`` that contains ``marker``."""
    hits = [i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text]
    assert len(hits) == 1, f"{marker!r} occurs on lines {hits}"
    return hits[0]


def here(marker: str) -> SourceLocation:
    """The line carrying the ``# @marker`` comment in this file."""
    return SourceLocation(SHOWN_PATH, line_of(f"# {marker}"))


# ------------------------------------------------------------------ the mini engine
class BlockPool:  # @def-block-pool
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks


class ManagerBase:  # @def-base
    def __init__(self) -> None:
        self.block_pool = BlockPool(8)  # @new-block-pool (made by the base class)


class Manager(ManagerBase):  # @def-manager
    def __init__(self) -> None:
        super().__init__()
        self.cache_config = CacheConfig()  # @new-cache-config
        self.model = torch.nn.Linear(4, 3)  # @new-model
        self.grammar = None  # @new-grammar
        self.backend = InprocClient  # @new-backend (a class, not an instance)

    def reset(self) -> None:
        self.block_pool = BlockPool(0)  # not __init__, so never the answer


class InprocClient:  # @def-inproc
    pass


class MPClient:  # @def-mp
    pass


class Engine:  # @def-engine
    def __init__(self, in_process: bool) -> None:
        self.manager: Manager = Manager()  # @new-manager (annotated)
        if in_process:
            self.client: InprocClient | MPClient = InprocClient()  # @new-inproc
        else:
            self.client = MPClient()  # @new-mp

    def start(self) -> None:
        self.stats = Stats()  # @new-stats (outside __init__)


@dataclass
class Stats:  # @def-stats (a decorated class)
    steps: int = 0


class Shelf:  # @def-shelf
    """Holds components in a tuple, as the KV cache coordinator holds one manager per group."""

    def __init__(self) -> None:
        self.pools = tuple(BlockPool(n) for n in (4, 8))  # @new-pools
        self.sizes = [4, 8]  # a plain list: one leaf


class Loop:
    def __init__(self) -> None:
        self.other: Loop | None = None


# The registry entries: the mini engine's classes carry nothing for the tree.
register_component(BlockPool, detail=lambda pool: f"num_blocks={pool.num_blocks}")
register_component(ManagerBase)
register_component(Manager, ("block_pool", "cache_config", "model", "grammar", "never_set", "backend"))
register_component(InprocClient)
register_component(MPClient)
register_component(Engine, ("manager", "client", "stats"))
register_component(Stats)
register_component(Shelf, ("pools", "sizes"))
register_component(Loop, ("other",))
install_tree_printing()  # str(obj) and rich's __rich__ for every class listed above


def child(node: ComponentNode, attr: str) -> ComponentNode:
    (found,) = [c for c in node.children if c.attr == attr]
    return found


# ------------------------------------------------------------------------ locations
def test_defined_and_created_at_match_the_source() -> None:
    engine = Engine(in_process=True)
    engine.start()
    root = build_component_tree(engine)
    assert (root.attr, root.class_name, root.created_at) == (None, "Engine", None)
    assert root.defined_at == here("@def-engine")

    manager = child(root, "manager")
    assert manager.defined_at == here("@def-manager")
    assert manager.created_at == here("@new-manager")
    stats = child(root, "stats")
    assert stats.defined_at == here("@def-stats")  # the class line, not @dataclass
    assert stats.created_at == here("@new-stats")

    pool = child(manager, "block_pool")
    assert pool.defined_at == here("@def-block-pool")
    assert pool.created_at == here("@new-block-pool")  # found in the base class's __init__
    assert pool.extra == "num_blocks=8"


def test_the_branch_that_built_the_live_object_wins() -> None:
    assert child(build_component_tree(Engine(True)), "client").created_at == here("@new-inproc")
    mp = child(build_component_tree(Engine(False)), "client")
    assert (mp.class_name, mp.created_at) == ("MPClient", here("@new-mp"))


def test_leaves_none_and_missing_attributes() -> None:
    manager = child(build_component_tree(Engine(True)), "manager")
    assert [c.attr for c in manager.children] == [
        "block_pool", "cache_config", "model", "grammar", "backend"  # never_set is skipped
    ]
    config = child(manager, "cache_config")  # a nanoengine class: its definition is shown
    config_file = REPO_ROOT / "nanoengine" / "config.py"
    assert config.defined_at == SourceLocation(
        "nanoengine/config.py", line_of("class CacheConfig", config_file)
    )
    model = child(manager, "model")  # torch's class: the type name and a parameter count
    assert (model.class_name, model.defined_at, model.extra) == ("Linear", None, "params=15")
    assert model.created_at == here("@new-model")
    grammar = child(manager, "grammar")
    assert (grammar.class_name, grammar.created_at) == (UNSET, here("@new-grammar"))
    backend = child(manager, "backend")
    assert (backend.class_name, backend.created_at) == ("InprocClient", here("@new-backend"))
    assert backend.extra == "the class itself"


def test_file_outside_the_repo_shows_an_absolute_path(tmp_path: Path) -> None:
    source = tmp_path / "outside_module.py"
    source.write_text(
        "from nanoengine.instruments.component_tree import register_component\n\n"
        "class Outside:\n"
        "    def __init__(self):\n"
        "        self.part = 1\n\n"
        "register_component(Outside, ('part',))\n"
    )
    spec = importlib.util.spec_from_file_location("outside_module", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["outside_module"] = module  # inspect finds classes through sys.modules
    try:
        spec.loader.exec_module(module)
        root = build_component_tree(module.Outside())
    finally:
        del sys.modules["outside_module"]
    absolute = str(source.resolve())
    assert root.defined_at == SourceLocation(absolute, 3)
    assert root.children[0].created_at == SourceLocation(absolute, 5)


def test_format_location() -> None:
    location = SourceLocation("nanoengine/engine/core.py", 7)
    assert format_location(location) == str(location) == "nanoengine/engine/core.py:7"


def test_a_tuple_of_components_shows_each_of_them() -> None:
    first, second, sizes = build_component_tree(Shelf()).children
    assert [(n.attr, n.class_name, n.extra) for n in (first, second)] == [
        ("pools[0]", "BlockPool", "num_blocks=4"), ("pools[1]", "BlockPool", "num_blocks=8")
    ]
    assert first.created_at == second.created_at == here("@new-pools")
    assert first.defined_at == here("@def-block-pool")
    assert (sizes.attr, sizes.class_name, sizes.extra, sizes.children) == ("sizes", "list", "len=2", [])


# ------------------------------------------------------------------ cycles and limits
def test_cycles_are_cut_and_named() -> None:
    first, second = Loop(), Loop()
    first.other, second.other = second, first
    back = build_component_tree(first).children[0].children[0]
    assert (back.class_name, back.children, back.note) == ("Loop", [], "same object as Loop")
    assert "(same object as Loop)" in str(first)


def test_depth_limit() -> None:
    manager = build_component_tree(Engine(True), max_depth=1).children[0]
    assert manager.children == [] and manager.note == "children hidden: depth limit"
    with pytest.raises(ValueError, match="max_depth must be >= 0, got -1"):
        build_component_tree(Engine(True), max_depth=-1)


def test_bad_children_and_failing_detail() -> None:
    class Forgot:
        pass

    with pytest.raises(TypeError, match="Forgot: children must be a tuple"):
        register_component(Forgot, ("comma"))  # type: ignore[arg-type]  # the slip being tested

    class Broken:
        def explode(self) -> str:
            raise RuntimeError("boom")

    register_component(Broken, detail=Broken.explode)
    assert build_component_tree(Broken()).extra == "detail raised RuntimeError: boom"


def test_a_subclass_takes_its_nearest_listed_base() -> None:
    class Unlisted(Manager):
        pass

    assert component_of(Unlisted()) is component_of(Manager())
    assert component_of(object()) is None


def test_every_engine_class_in_the_registry_exists() -> None:
    """A renamed or moved engine class must not silently drop out of the tree."""
    import importlib

    engine_entries = {name: entry for name, entry in COMPONENTS.items() if name.startswith("nanoengine.")}
    assert len(engine_entries) >= 20, sorted(engine_entries)
    for name, entry in engine_entries.items():
        module_name, _, class_name = name.rpartition(".")
        cls = getattr(importlib.import_module(module_name), class_name)
        assert isinstance(cls, type), name
        assert all(isinstance(child, str) for child in entry.children), name


# --------------------------------------------------------------------------- output
def test_str_draws_the_tree_with_aligned_columns() -> None:
    engine = Engine(True)
    text = str(engine)
    lines = text.splitlines()
    assert lines[0].split() == ["Engine", format_location(here("@def-engine"))]
    column = lines[0].index(SHOWN_PATH)  # where the definition sites start
    heads = [line[:column].rstrip() for line in lines]
    assert heads == [
        "Engine",
        "├── manager: Manager",
        "│   ├── block_pool: BlockPool",
        "│   ├── cache_config: CacheConfig",
        "│   ├── model: Linear",
        f"│   ├── grammar: {UNSET}",
        "│   └── backend: InprocClient",
        "└── client: InprocClient",
    ]
    assert f"created at {format_location(here('@new-block-pool'))}  num_blocks=8" in lines[2]
    # The locations form columns: every "created at" starts in the same place.
    assert len({line.index("created at") for line in lines[1:]}) == 1
    assert "\x1b[" not in text and all(line == line.rstrip() for line in lines)
    assert repr(engine).startswith("<") and "\n" not in repr(engine)  # repr stays short


def test_width_wraps_and_rich_and_json_views() -> None:
    engine = Engine(True)
    assert max(map(len, tree_to_text(engine, width=60).splitlines())) <= 60
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        tree_to_text(engine, width=0)
    assert isinstance(engine.__rich__(), Tree)
    root = build_component_tree(engine)
    assert isinstance(render_component_tree(root), Tree)
    assert tree_to_text(root) == str(engine)  # a node built earlier renders the same
    data = json.loads(json.dumps(root.to_dict()))
    assert data["children"][0]["created_at"] == {
        "path": SHOWN_PATH, "line": here("@new-manager").line
    }
