"""The source-map table: the live component tree, our file:line, vLLM 0.32's.

The tree comes from a real engine built on a tiny random model (tests/tiny_models.py
writes one in a temporary directory in about a second), so the docs build needs
neither the real model nor the network. Each node's vLLM counterpart comes from
two places: the file:line facts in ``docs/data/vllm-0.32.0-map.md`` (a copy of the
shared reference map) and the "vLLM 0.32 counterpart" sentence of the module
docstring that defines the node's class.
"""

from __future__ import annotations

import ast
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MAP_FILE = ROOT / "docs" / "data" / "vllm-0.32.0-map.md"
_ROW = re.compile(r"^\|\s*([^|]+?)\s*\|\s*`([^`]+)`\s*\|")
_COUNTERPART = re.compile(r"vLLM 0\.32 counterpart:\s*(.+?)(?:\n\s*\n|\Z)", re.DOTALL)


@cache
def vllm_map() -> dict[str, str]:
    """``component -> file:line`` from the map table (``EngineCore.step()`` -> ``EngineCore.step``)."""
    facts: dict[str, str] = {}
    for line in MAP_FILE.read_text(encoding="utf-8").splitlines():
        row = _ROW.match(line)
        if row is None or row[1] == "component":
            continue
        key = row[1].split()[0].removesuffix("()")
        facts[key] = row[2]
    return facts


@cache
def module_counterpart(path: str) -> str:
    """The "vLLM 0.32 counterpart: ..." sentence of a module docstring, on one line."""
    docstring = ast.get_docstring(ast.parse((ROOT / path).read_text(encoding="utf-8"))) or ""
    match = _COUNTERPART.search(docstring)
    text = " ".join(match[1].split()) if match else ""
    # The list a closing "...:" sentence introduces is not part of the match;
    # without it the sentence would read as cut off.
    return re.sub(r"(?<=\.)\s[^.]*:$", "", text)


@lru_cache(maxsize=1)
def live_tree() -> Any:
    """The component tree of an engine built on a tiny random Llama."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from tiny_models import make_tiny_model_dir
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from nanoengine import LLM
    from nanoengine.instruments.component_tree import build_component_tree

    with tempfile.TemporaryDirectory(prefix="nanoengine-docs-") as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "tiny-llama", "llama")
        # A fixed, small block count: sizing the cache from RAM would take seconds.
        llm = LLM(model=str(model_dir), max_model_len=128, num_gpu_blocks_override=64)
        tree = build_component_tree(llm)
        llm.llm_engine.shutdown()
    return tree


def _walk(node: Any, parent: str | None = None, depth: int = 0) -> Iterator[tuple[Any, str | None, int]]:
    yield node, parent, depth
    for child in node.children:
        yield from _walk(child, node.class_name, depth + 1)


def _vllm_cell(class_name: str, parent: str | None, attr: str | None, counterpart: str) -> str:
    facts = vllm_map()
    lines = []
    if class_name in facts:
        lines.append(f"class&nbsp;`{facts[class_name]}`")
    if parent is not None and f"{parent}.{attr}" in facts:
        lines.append(f"created&nbsp;`{facts[f'{parent}.{attr}']}`")
    # A block of its own (extra.css), set off from the file:line facts above it.
    prose = f'<span class="counterpart">{counterpart.replace("|", "/")}</span>' if counterpart else ""
    return "<br>".join(lines) + prose


def render(link: Callable[[str, int, str], str]) -> str:
    """The Markdown table; ``link(path, line, label)`` links to our source at a line.

    Four columns, so that a laptop screen can show every path whole: our
    "defined at" and "created at" share one cell, as vLLM's do, and the module
    docstring's counterpart sentence goes under vLLM's file:line. Paths are
    relative to each package (``nanoengine/`` and ``vllm/``), as the header says.
    """
    rows = [
        ("| component | class | nanoengine file:line "
         "| vLLM 0.32.0 file:line, and the module docstring's counterpart |"),
        "|---|---|---|---|",
    ]
    for node, parent, depth in _walk(live_tree()):
        # Non-breaking throughout, so the tree mark never parts from its name.
        indent = "&nbsp;" * 2 * depth + ("└&nbsp;" if depth else "")
        name = f"{indent}`{node.attr}`" if node.attr else f"`{node.class_name}`"
        ours = []
        for kind, where in (("class", node.defined_at), ("created", node.created_at)):
            if where is not None:
                label = f"{where.path.removeprefix('nanoengine/')}:{where.line}"
                ours.append(f"{kind}&nbsp;{link(where.path, where.line, label)}")
        counterpart = module_counterpart(node.defined_at.path) if node.defined_at else ""
        rows.append(f"| {name} | `{node.class_name}` | {'<br>'.join(ours)} | "
                    f"{_vllm_cell(node.class_name, parent, node.attr, counterpart)} |")
    return "\n".join(rows)
