"""Fast checks of what the docs site is built from (no mkdocs build needed).

Every nanoengine module docstring names a chapter whose page exists (the API
reference turns that mention into a link), and the docs hook refuses unknown
code references instead of rendering them.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "docs" / "hooks"
CHAPTER = re.compile(r"\b[Cc]hapters?\s+(\d(?:\s*(?:,|-|–|and|or)\s*\d)*)")


def _hook_module(name: str) -> ModuleType:
    sys.path.insert(0, str(HOOKS))
    try:
        spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", HOOKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(HOOKS))


def _modules() -> list[Path]:
    return sorted((ROOT / "nanoengine").rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_docstring_names_a_chapter_with_a_page(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    mentions = CHAPTER.findall(docstring)
    assert mentions, f"{path.relative_to(ROOT)}: the module docstring names no chapter"
    for mention in mentions:
        for digit in re.findall(r"\d", mention):
            page = ROOT / "docs" / "chapters" / f"ch{int(digit):02d}.md"
            assert page.is_file(), f"{path.relative_to(ROOT)} names chapter {digit}, which has no page"


def test_code_regions_resolve_to_current_lines() -> None:
    regions = _hook_module("code_regions")
    step = regions.find_region("nanoengine.engine.core.EngineCore.step")
    lines = (ROOT / step.path).read_text(encoding="utf-8").splitlines()
    assert lines[step.start - 1].lstrip().startswith("def step(")
    assert step.end > step.start
    exercise = regions.find_region("exercise-6.1")
    assert "def num_blocks_from_budget" in exercise.text() and "EXERCISE" not in exercise.text()
    named = regions.find_region("grader-swap")  # a "# [anchor: NAME]" region, markers excluded
    assert named.path == "chapters/grade.py" and named.text().startswith("@contextmanager")
    with pytest.raises(LookupError, match="unknown code reference"):
        regions.find_region("nanoengine.engine.core.EngineCore.no_such_method")
    with pytest.raises(LookupError, match="unknown code reference"):
        regions.find_region("no-such-anchor")


@pytest.mark.parametrize("markdown, message", [
    ('{{ code("no-such-anchor") }}', "unknown code reference"),
    ('{{ code("nanoengine.core.block_pool.NoSuchClass") }}', "unknown code reference"),
    ('{{ not_a_macro("x") }}', "unknown macro"),
    ('{{ grader_checks("9.9") }}', "no checks"),
])
def test_hook_fails_the_build_on_unknown_references(markdown: str, message: str) -> None:
    hook = _hook_module("main")
    page = SimpleNamespace(file=SimpleNamespace(src_uri="chapters/ch01.md"), url="chapters/ch01/")
    with pytest.raises(PluginError, match=message):
        hook.on_page_markdown(markdown, page, {}, None)


def test_hook_embeds_code_with_a_link_to_its_lines() -> None:
    hook = _hook_module("main")
    regions = _hook_module("code_regions")
    hook._SOURCE_URLS["nanoengine/core/block_pool.py"] = "source/nanoengine/core/block_pool.py/"
    page = SimpleNamespace(file=SimpleNamespace(src_uri="chapters/ch04.md"), url="chapters/ch04/")
    out = hook.on_page_markdown('{{ code("nanoengine.core.block_pool.BlockPool") }}', page, {}, None)
    region = regions.find_region("nanoengine.core.block_pool.BlockPool")
    assert f'href="../../source/nanoengine/core/block_pool.py/#__codelineno-0-{region.start}"' in out
    assert f'```python linenums="{region.start}"' in out and "class BlockPool" in out


def _reading_path_items(markdown: str) -> list[str]:
    """The numbered items of the "A reading path through the code" section."""
    section = markdown.split("\n## A reading path through the code\n", 1)[1].split("\n## ", 1)[0]
    return re.split(r"\n(?=\d+\. )", section.split("\n1. ", 1)[1].split("\n\n", 1)[0])


def test_reading_paths_name_existing_files_in_the_same_order() -> None:
    """README.md lists the reading path by file, the docs home by symbol (linked to
    its lines at build time); both must name the same files, in the same order."""
    readme = [re.match(r"\[`([^`]+)`\]\(\1\)", item.lstrip("0123456789. "))
              for item in _reading_path_items((ROOT / "README.md").read_text(encoding="utf-8"))]
    assert all(readme), "every README reading-path item starts with a link to its file"
    readme_files = [match[1] for match in readme if match]
    missing = [path for path in readme_files if not (ROOT / path).is_file()]
    assert not missing, f"README reading path names files that do not exist: {missing}"

    regions = _hook_module("code_regions")
    docs_files = []
    for item in _reading_path_items((ROOT / "docs" / "index.md").read_text(encoding="utf-8")):
        paths = {regions.find_region(name).path for name in re.findall(r'code_link\("([^"]+)"\)', item)}
        assert len(paths) == 1, f"a docs reading-path item should point into one file: {item[:80]!r}"
        docs_files.append(paths.pop())
    assert readme_files == docs_files
