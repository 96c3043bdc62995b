"""The live component tree: what an engine object is made of, and where in the source.

Chapter 5 (engine skeleton) opens with a "source map": ``LLM`` owns an ``LLMEngine``,
which owns an ``EngineCoreClient``, which owns an ``EngineCore``, which owns a
``Scheduler``, ... each with the file and line that defines its class and the line
where its owner creates it. Typed by hand, such a map goes stale with the first
edit. Here it is computed from the live objects every time it is printed:

* ``COMPONENTS`` says, as data, which attributes of each engine class are its
  components (and what short live detail to show beside it). The engine classes
  themselves carry nothing for the tree: the registry names them from here. An
  attribute holding a tuple or list of components (the KV cache coordinator's
  one manager per group) shows each of them, as ``name[i]``;
* ``defined_at`` is the ``class`` line, found through ``inspect``;
* ``created_at`` is the ``self.<attr> = ...`` line in the owner's class (or one of
  its base classes), found by parsing that source with ``ast``.

``tree_to_text(llm)`` gives plain text, ``render_component_tree(llm)`` a rich tree,
``build_component_tree(llm).to_dict()`` the same facts as JSON-ready data.
``install_tree_printing()`` (the ``LLM`` calls it) makes ``print(obj)`` and
``rich.print(obj)`` draw the tree for every registered class, from outside.

vLLM 0.32 counterpart: none. vLLM's objects print as ordinary reprs; this module
replaces the hand-made map in the study notes.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

import msgspec
from rich.console import Console
from rich.text import Text
from rich.tree import Tree

from nanoengine.instruments.source_locations import (  # noqa: F401
    PACKAGE_DIR,
    SourceLocation,
    attribute_created_at,
    class_defined_at,
    code_location,
    format_location,
)

# Re-exported: callers of the tree also use the source locations it shows.
from nanoengine.utils.system_utils import describe_exit_code

DEFAULT_MAX_DEPTH = 16
UNSET = "<unset>"  # shown in place of a class name when a component is still None
_GUIDE_WIDTH = 4  # rich draws each tree level as a 4-cell guide, e.g. "├── "
_COLUMN_GAP = "  "
_UNWRAPPED_WIDTH = 1_000  # a page no label line comes near, so nothing wraps


@dataclass
class ComponentNode:
    """One object in the tree, as plain data (chapter 5 emits it as JSON)."""

    attr: str | None  # the owner's attribute holding it; None for the root
    class_name: str  # the live object's class, or UNSET for a None component
    defined_at: SourceLocation | None  # the ``class`` line, when the source is known
    created_at: SourceLocation | None  # the owner's ``self.<attr> = ...`` line
    extra: str | None = None  # a short live detail, e.g. "num_blocks=1234"
    note: str | None = None  # set by the builder: repeated object, depth limit
    children: list[ComponentNode] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts and lists, ready for ``json.dumps``."""
        return asdict(self)


@dataclass(frozen=True)
class Component:
    """How the tree shows one class: its component attributes and a live detail."""

    children: tuple[str, ...] = ()  # attribute names, in display order
    detail: Callable[[Any], object] | None = None  # obj -> a short note, e.g. "free=12"
    # For a stand-in of an object in another process (chapter 8): fetches that
    # object's own tree, built there, as ``ComponentNode.to_dict()`` data.
    fetch: Callable[[Any], dict[str, Any]] | None = None


def _running_waiting(core: Any) -> str:
    running, waiting = core.scheduler.get_request_counts()
    return f"running={running} waiting={waiting}"


def _fetch_remote_tree(remote: Any) -> dict[str, Any]:
    tree: dict[str, Any] = remote.client.call_utility("component_tree")
    tree["note"] = f"in process {remote.pid}, reached over ZMQ; this side is process {os.getpid()}"
    return tree


def _worker_process(handle: Any) -> str:
    code = handle.process.poll()
    state = "" if code is None else f" ({describe_exit_code(code)})"
    return f"rank={handle.rank} pid={handle.process.pid}{state}"


def _grammars(manager: Any) -> str:
    # An instrument may read private state: it only looks.
    return f"backend={'xgrammar' if manager._backend else 'xgrammar (not loaded)'}"


def _group_detail(manager: Any) -> str:
    """A KV cache group's size; for a sliding window (chapter 4) also the window and
    how many table entries of running requests hold the null block: blocks given back."""
    detail = f"group={manager.kv_cache_group_id} layers={manager.num_layers} block_size={manager.block_size}"
    window = getattr(manager, "sliding_window", None)
    if window is None:
        return detail
    null = manager.block_pool.null_block
    given_back = sum(block is null for blocks in manager.req_to_blocks.values() for block in blocks)
    return f"{detail} sliding_window={window} given_back={given_back}"


def _tp_size(executor: Any) -> str:
    return f"tensor_parallel_size={executor.parallel_config.tensor_parallel_size}"


# Keyed by the class's module and name rather than by the class, so that this
# table imports no engine module (Ray's executor, say, is imported only when used).
# A subclass not listed takes its nearest listed base's entry (AsyncScheduler
# shows as a Scheduler would).
COMPONENTS: dict[str, Component] = {
    "nanoengine.entrypoints.llm.LLM": Component(("llm_engine",)),
    "nanoengine.engine.llm_engine.LLMEngine": Component(
        ("renderer", "input_processor", "output_processor", "engine_core")
    ),
    "nanoengine.renderers.hf.HfRenderer": Component(),
    "nanoengine.engine.input_processor.InputProcessor": Component(),
    "nanoengine.engine.output_processor.OutputProcessor": Component(
        detail=lambda processor: f"live requests={len(processor.parents)}"
    ),
    "nanoengine.engine.core_client.InprocClient": Component(("engine_core",)),
    "nanoengine.engine.core_client.MPClient": Component(("engine_core",)),
    "nanoengine.engine.core_client.RemoteEngineCore": Component(fetch=_fetch_remote_tree),
    "nanoengine.engine.core.EngineCore": Component(
        ("model_executor", "structured_output_manager", "scheduler"), _running_waiting
    ),
    "nanoengine.executor.abstract.Executor": Component(),
    "nanoengine.executor.uniproc_executor.UniProcExecutor": Component(("driver_worker",)),
    "nanoengine.executor.multiproc_executor.MultiprocExecutor": Component(("workers",), _tp_size),
    "nanoengine.executor.multiproc_executor.WorkerProcHandle": Component(detail=_worker_process),
    "nanoengine.executor.ray_executor.RayDistributedExecutor": Component(("workers",), _tp_size),
    "nanoengine.executor.ray_executor.RayWorkerHandle": Component(
        detail=lambda handle: f"rank={handle.rank} pid={handle.placement.pid} node={handle.placement.node_ip}"
    ),
    "nanoengine.worker.worker.Worker": Component(
        ("model_runner",), lambda worker: f"rank={worker.rank}/{worker.world_size}" if worker.world_size > 1 else None
    ),
    "nanoengine.worker.model_runner.ModelRunner": Component(("model", "kv_caches", "sampler")),
    "nanoengine.structured_output.StructuredOutputManager": Component(detail=_grammars),
    "nanoengine.core.sched.scheduler.Scheduler": Component(
        ("kv_cache_manager",),
        lambda s: f"policy={s.policy.value} running={len(s.running)} waiting={len(s.waiting)}",
    ),
    "nanoengine.core.kv_cache_manager.KVCacheManager": Component(("coordinator",)),
    "nanoengine.core.kv_cache_coordinator.KVCacheCoordinator": Component(("single_type_managers",)),
    "nanoengine.core.single_type_kv_cache_manager.SingleTypeKVCacheManager": Component(
        ("block_pool",), _group_detail
    ),
    "nanoengine.core.block_pool.BlockPool": Component(
        detail=lambda pool: f"num_blocks={pool.num_blocks} free={pool.get_num_free_blocks()}"
    ),
}


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_component(
    cls: type, children: tuple[str, ...] = (), detail: Callable[[Any], object] | None = None
) -> None:
    """Add (or replace) the entry of ``cls``: a class of your own shows in trees too."""
    if not isinstance(children, tuple) or not all(isinstance(name, str) for name in children):
        # The classic slip is ("scheduler") without the comma: a str, not a tuple.
        raise TypeError(f"{cls.__qualname__}: children must be a tuple of attribute names, got {children!r}")
    COMPONENTS[_qualified_name(cls)] = Component(children, detail)


def component_of(obj: object) -> Component | None:
    """The entry of ``obj``'s class or of its nearest listed base; None for a leaf."""
    for cls in _shown_class(obj).__mro__:
        entry = COMPONENTS.get(_qualified_name(cls))
        if entry is not None:
            return entry
    return None


def install_tree_printing() -> None:
    """Make ``print(obj)`` and ``rich.print(obj)`` draw the tree of every listed class.

    Only classes already imported are touched (importing the others, Ray's
    among them, would cost more than it shows). ``__repr__`` is left alone on
    purpose: debuggers and log lines want one short line.
    """
    for name in COMPONENTS:
        module_name, _, class_name = name.rpartition(".")
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type):
            cls.__str__ = tree_to_text  # type: ignore[assignment,method-assign]
            cls.__rich__ = render_component_tree  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- build
def _shown_class(obj: object) -> type:
    # A component may be a class rather than an instance (an attention backend is
    # chosen as a class); then the class itself is what the reader wants to find.
    return obj if isinstance(obj, type) else type(obj)


def _live_detail(obj: object, entry: Component | None) -> str | None:
    """The entry's detail of a node, or a size for well-known leaves."""
    if isinstance(obj, type):
        return "the class itself"
    if entry is not None and entry.detail is not None:
        try:
            detail = entry.detail(obj)
        except Exception as exc:  # noqa: BLE001 -- printing must never be what crashes the engine
            return f"detail raised {type(exc).__name__}: {exc}"
        return None if detail is None else str(detail)
    torch = sys.modules.get("torch")  # only if someone else already paid to import it
    if torch is not None and isinstance(obj, torch.nn.Module):
        return f"params={sum(p.numel() for p in obj.parameters()):,}"
    if isinstance(obj, (list, tuple, dict, set, frozenset)):
        return f"len={len(obj)}"
    return None


@dataclass
class _Builder:
    """Walks the live objects once; remembers what it showed to cut cycles and repeats."""

    max_depth: int
    shown: dict[int, str] = field(default_factory=dict)  # id(obj) -> its path in the tree

    def node(self, obj: object, attr: str | None, created_at: SourceLocation | None,
             path: str, depth: int) -> ComponentNode:
        if obj is None:
            return ComponentNode(attr, UNSET, None, created_at)
        entry = component_of(obj)
        if entry is not None and entry.fetch is not None:
            # A component in another process (chapter 8): its tree is built there.
            fetched = msgspec.convert(entry.fetch(obj), ComponentNode)
            fetched.attr, fetched.created_at = attr, created_at
            return fetched
        cls = _shown_class(obj)
        names = None if entry is None else entry.children
        # Leaves from torch or the stdlib need no address: their type name says enough.
        in_package = cls.__module__.partition(".")[0] == PACKAGE_DIR.name
        defined_at = class_defined_at(cls) if names is not None or in_package else None
        node = ComponentNode(attr, cls.__name__, defined_at, created_at, _live_detail(obj, entry))
        if names is None:
            return node
        if id(obj) in self.shown:
            node.note = f"same object as {self.shown[id(obj)]}"
            return node
        self.shown[id(obj)] = path
        if depth >= self.max_depth and names:
            node.note = "children hidden: depth limit"
            return node
        node.children = list(self.children(obj, names, path, depth + 1))
        return node

    def children(self, obj: object, names: tuple[str, ...], path: str,
                 depth: int) -> Iterator[ComponentNode]:
        missing = object()
        for name in names:
            child = getattr(obj, name, missing)
            if child is missing:  # not created yet (or never, in this configuration)
                continue
            if _is_component_sequence(child):
                # One line creates them all, so they share its location.
                created_at = attribute_created_at(type(obj), name)
                for index, element in enumerate(child):
                    label = f"{name}[{index}]"
                    yield self.node(element, label, created_at, f"{path}.{label}", depth)
                continue
            created_at = attribute_created_at(type(obj), name, _shown_class(child).__name__)
            yield self.node(child, name, created_at, f"{path}.{name}", depth)


def _is_component_sequence(value: object) -> TypeGuard[tuple[object, ...] | list[object]]:
    """A non-empty tuple or list whose every element is a component (has an entry)."""
    return isinstance(value, (tuple, list)) and bool(value) and all(component_of(e) is not None for e in value)


def build_component_tree(obj: object, *, max_depth: int = DEFAULT_MAX_DEPTH) -> ComponentNode:
    """The component tree of ``obj`` as data; ``max_depth`` levels below the root at most."""
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    return _Builder(max_depth).node(obj, None, None, type(obj).__name__, depth=0)


# --------------------------------------------------------------------------- render
def _head_text(node: ComponentNode) -> str:
    return node.class_name if node.attr is None else f"{node.attr}: {node.class_name}"


def _walk(node: ComponentNode, depth: int = 0) -> Iterator[tuple[ComponentNode, int]]:
    yield node, depth
    for child in node.children:
        yield from _walk(child, depth + 1)


def _measure(root: ComponentNode) -> tuple[int, int]:
    """Column widths that line the locations up: (guides + "attr: Class", definition site)."""
    rows = list(_walk(root))
    head = max(_GUIDE_WIDTH * depth + len(_head_text(node)) for node, depth in rows)
    return head, max(len(str(node.defined_at or "")) for node, _ in rows)


def _label(node: ComponentNode, depth: int, widths: tuple[int, int]) -> Text:
    """One line: ``attr: Class  defined_at  created at ...  extra  (note)``."""
    label = Text()
    if node.attr is not None:
        label.append(node.attr, style="bold")
        label.append(": ")
    label.append(node.class_name, style="dim italic" if node.class_name == UNSET else "cyan")
    head_width, defined_width = widths
    label.pad_right(head_width - _GUIDE_WIDTH * depth - len(label))
    label.append(_COLUMN_GAP)
    label.append(str(node.defined_at or "").ljust(defined_width), style="blue")
    if node.created_at is not None:
        label.append(_COLUMN_GAP + "created at ", style="dim")
        label.append(str(node.created_at), style="blue")
    if node.extra:
        label.append(_COLUMN_GAP + node.extra, style="green")
    if node.note:
        label.append(f"{_COLUMN_GAP}({node.note})", style="yellow")
    label.rstrip()
    return label


def _to_rich(node: ComponentNode, depth: int, widths: tuple[int, int], tree: Tree | None) -> Tree:
    label = _label(node, depth, widths)
    branch = Tree(label, guide_style="dim") if tree is None else tree.add(label)
    for child in node.children:
        _to_rich(child, depth + 1, widths, branch)
    return branch


def render_component_tree(obj: object, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Tree:
    """A rich Tree of ``obj``'s components; pass a ComponentNode to render one built earlier."""
    root = obj if isinstance(obj, ComponentNode) else build_component_tree(obj, max_depth=max_depth)
    return _to_rich(root, 0, _measure(root), None)


def tree_to_text(
    obj: object, *, width: int | None = None, max_depth: int = DEFAULT_MAX_DEPTH
) -> str:
    """The tree as plain text; ``width=None`` leaves every line whole, however long."""
    if width is not None and width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    buffer = io.StringIO()
    console = Console(file=buffer, width=width or _UNWRAPPED_WIDTH, color_system=None)
    console.print(render_component_tree(obj, max_depth=max_depth))
    # rich pads every line to the page width; the padding is noise in a log.
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())
