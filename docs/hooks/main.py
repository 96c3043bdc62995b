"""mkdocs hook: every code<->prose link of the site is computed at build time.

* Source pages: every file of ``nanoengine/`` and ``chapters/`` becomes a page
  ``source/<path>.md`` with numbered, anchored lines (``#__codelineno-0-<line>``).
* API reference: one mkdocstrings page per ``nanoengine`` module, added to the nav
  here, so a new module appears without editing ``mkdocs.yml``. Every "chapter N"
  in a rendered docstring becomes a link to that chapter's page.
* Macros in pages, all checked: ``{{ code("NAME") }}`` embeds a code region with
  its current line numbers and a link to those lines; ``{{ code_link("NAME") }}``
  is the link alone; ``{{ source_map() }}`` is the live component-tree table;
  ``{{ grader_checks("4.1") }}`` lists what the grader runs for an exercise: each
  check's behaviour, the first paragraph of its docstring (its inputs) and a
  link to its code; ``{{ tp_layer_diagram() }}`` is chapter 6's mermaid
  diagram of one decoder layer on two ranks, drawn from the model's slices
  (``chapters/ch06_layer_diagram.py``, two real ranks spawned at build time);
  ``{{ step_trace("ch03") }}`` embeds a replay of a run recorded from the
  engine at build time (``chapters/step_traces.py``), drawn by the live view's
  viewer (``nanoengine/instruments/live_view/static/``, copied into the site).
  An unknown name, macro, exercise or trace fails the build.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from mkdocs.utils import get_relative_url

sys.path.insert(0, str(Path(__file__).resolve().parent))
import code_regions
import source_map

ROOT = code_regions.ROOT
CHAPTER_PAGE = "chapters/ch{:02d}.md"
REFERENCE_DIR = "reference"
_MACRO = re.compile(r"\{\{\s*(\w+)\((?:\"([^\"]*)\")?\)\s*\}\}")
# "Chapter 5", "chapters 6 and 7", "chapters 1, 5-7", "chapter 10": every number gets a link.
_CHAPTER_MENTION = re.compile(r"\b([Cc]hapters?)(\s+\d+(?:\s*(?:,|-|–|and|or)\s*\d+)*)")
_TAG = re.compile(r"(<[^>]+>)")
_NO_LINK_INSIDE = ("a", "code", "pre")
# Repository path -> site URL of its source page, filled by on_files.
_SOURCE_URLS: dict[str, str] = {}
# Trace name -> site URL of its file in the edition being built, filled by on_files.
_TRACE_URLS: dict[str, str] = {}
# The step viewer's files (nanoengine/instruments/live_view/static/) -> where the site serves them.
_VIEWER_ASSETS = {"viewer.js": "javascripts/ne-viewer.js", "viewer.css": "stylesheets/ne-viewer.css"}


# ------------------------------------------------------------------ config / files
def _modules() -> list[str]:
    """Every module of the nanoengine package, dotted, in path order."""
    names = []
    for path in code_regions.source_files():
        if path.parts[0] != "nanoengine":
            continue
        parts = list(path.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def _glossary_words_for_search() -> None:
    """Teach jieba (which cuts Chinese text into words for the search index) the
    glossary's terms, so 调度器 is one word to search for, not 调度 + 器."""
    try:
        import jieba
    except ImportError:
        return  # no Chinese segmentation at all: nothing to teach
    from chapters.i18n import glossary_terms

    for chinese in glossary_terms().values():
        for word in re.findall(r"[\u4e00-\u9fff]{2,}", chinese):
            jieba.add_word(word)


@functools.cache
def _tp_layer_diagram() -> str:
    """Chapter 6's diagram, drawn once per mkdocs run: both editions show it
    (the i18n plugin builds each, calling on_config each time), and drawing it
    spawns two ranks. ``mkdocs serve`` draws it again when restarted."""
    from chapters.ch06_layer_diagram import layer_diagram

    return layer_diagram()


@functools.cache
def _step_traces() -> dict[str, str]:
    """Every chapter's step trace as JSON text, recorded once per mkdocs run
    (a few seconds: tiny engines, and SmolLM2 for chapter 9)."""
    import tempfile

    from chapters.step_traces import record_all

    with tempfile.TemporaryDirectory(prefix="nanoengine-traces-") as folder:
        return {path.stem: path.read_text(encoding="utf-8") for path in record_all(Path(folder))}


def _forget_the_other_editions_anchors(config: Any) -> None:
    """Start the autorefs registry afresh for each edition.

    The i18n plugin builds the Chinese edition with the same plugin objects
    after the English one, so autorefs would still hold every English API
    anchor and find two pages for each name. autorefs has no public reset: its
    maps are emptied here, as a new plugin object would have them.
    """
    autorefs = config.plugins.get("autorefs")
    if autorefs is None:
        return
    for registry in ("_primary_url_map", "_secondary_url_map", "_title_map", "_breadcrumbs_map", "_backlinks"):
        getattr(autorefs, registry).clear()


def on_config(config: Any) -> Any:
    code_regions.clear_cache()
    _forget_the_other_editions_anchors(config)
    _glossary_words_for_search()
    nav = config["nav"]
    entry = next((item for item in nav if isinstance(item, dict) and "API reference" in item), None)
    if entry is None:
        raise PluginError("mkdocs.yml nav needs an 'API reference' section for the generated pages")
    entry["API reference"] = [{name: f"{REFERENCE_DIR}/{name}.md"} for name in _modules()]
    return config


def _source_page(path: Path) -> str:
    text = (ROOT / path).read_text(encoding="utf-8")
    fence = "`" * max(4, max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    # Left out of the search index: the API reference already indexes every
    # name, and parsing 130-odd highlighted files took most of the index's time.
    front_matter = "---\nsearch:\n  exclude: true\n---\n"
    return (f"{front_matter}# `{path.as_posix()}`\n\n"
            f"{fence}{code_regions.language_of(path)} linenums=\"1\"\n{text}\n{fence}\n")


_REFERENCE_FRONT_MATTER = "---\nsearch:\n  boost: 0.1\n---\n"


def _edition(config: Any) -> str:
    """The folder of the edition being built: "" for English, "zh/" for Chinese.

    mkdocs-static-i18n runs the whole build once per language, into one site
    folder; the Chinese build writes its pages under ``zh/``.
    """
    i18n = config.plugins.get("i18n")
    if i18n is None or i18n.current_language in (None, i18n.default_language):
        return ""
    return f"{i18n.current_language}/"


def _generated(config: Any, src_uri: str, content: str) -> File:
    """A page with no file in docs/, written into the edition being built.

    Its src_uri is the same in both editions (the nav names it so), while its
    address carries the edition's folder: each edition has its own copy, in its
    own language's interface, and neither build overwrites the other's.
    """
    page = File.generated(config, src_uri, content=content)
    page.dest_uri = _edition(config) + page.dest_uri  # before anything reads url or abs_dest_path
    return page


# After the i18n plugin (priority -100) has sorted the hand-written pages into
# their language: these generated pages have no source file, which it cannot take.
@event_priority(-200)
def on_files(files: Files, config: Any) -> Files:
    _SOURCE_URLS.clear()
    for path in code_regions.shown_files():
        source_file = _generated(config, f"source/{path.as_posix()}.md", _source_page(path))
        files.append(source_file)
        _SOURCE_URLS[path.as_posix()] = source_file.url
    for name in _modules():
        # The heading's id is the module's dotted name, so ``[text][nanoengine.serial_utils]``
        # links the module itself (the mkdocstrings root heading, hidden here, would not).
        # Ranked below the prose in search: both editions share one index, and the
        # hundreds of docstring sections that name "prefill" or "KV cache" would
        # otherwise push every chapter (the Chinese ones too) off the first page.
        page = f"{_REFERENCE_FRONT_MATTER}# `{name}` {{ #{name} }}\n\n::: {name}\n"
        files.append(_generated(config, f"{REFERENCE_DIR}/{name}.md", page))
    # Like the assets in docs/, one copy for both editions (each build writes the same files).
    _TRACE_URLS.clear()
    for name, text in _step_traces().items():
        trace_file = File.generated(config, f"traces/{name}.json", content=text)
        files.append(trace_file)
        _TRACE_URLS[name] = trace_file.url
    static = ROOT / "nanoengine" / "instruments" / "live_view" / "static"
    for name, site_path in _VIEWER_ASSETS.items():
        files.append(File.generated(config, site_path, content=(static / name).read_text(encoding="utf-8")))
    return files


def _is_generated(page: Page) -> bool:
    return page.file.src_uri.startswith(("source/", f"{REFERENCE_DIR}/"))


def on_page_context(context: Any, page: Page, config: Any, nav: Any) -> Any:
    """The language switcher of a generated page leads to its twin in the other edition.

    mkdocs-static-i18n points the switcher of each hand-written page at its
    translation, but leaves generated pages with whatever the previous page set.
    """
    i18n = config.plugins.get("i18n")
    if i18n is None or not _is_generated(page) or not i18n.extra_alternate:
        return context
    path = page.url.removeprefix(_edition(config))
    twins = [
        {**alternate, "link": ("" if alternate["lang"] == i18n.default_language else f"{alternate['lang']}/") + path}
        for alternate in i18n.extra_alternate
    ]
    # The i18n plugin sets the attribute, which the theme's template reads first.
    config.extra.alternate = twins
    return context


# ------------------------------------------------------------------------ macros
def _line_link(page: Page, path: str, line: int, end: int | None = None, label: str | None = None) -> str:
    """An HTML link to our source page at ``line`` (raw HTML: mkdocs cannot see
    the line anchors inside highlighted code, so the browser test checks them).
    ``label`` replaces the default ``path:line`` text."""
    if label is None:
        label = f"{path}:{line}" if end is None or end == line else f"{path}:{line}-{end}"
    target = _SOURCE_URLS.get(path)
    if target is None:
        return f"`{label}`"
    href = f"{get_relative_url(target, page.url)}#__codelineno-0-{line}"
    # Markdown still parses the text inside raw HTML: "__init__.py" would turn
    # bold, so underscores go in as character references.
    text = label.replace("_", "&#95;")
    return f'<a class="code-link" href="{href}" data-line="{line}"><code>{text}</code></a>'


def _code_block(page: Page, name: str) -> str:
    region = code_regions.find_region(name)
    link = _line_link(page, region.path, region.start, region.end)
    return f'{link}\n\n```{region.language} linenums="{region.start}"\n{region.text()}\n```\n'


def _grader_checks(page: Page, exercise_id: str) -> str:
    """One line per check: the behaviour it checks, what it feeds in, and a link to its code.

    An English page takes the check's name and the first paragraph of its
    docstring; a Chinese page takes both from ``chapters/grade_checks/zh.py``.
    """
    import inspect

    from chapters.grade_checks import CHECKS, chinese_check

    if exercise_id not in CHECKS:
        raise LookupError(f"exercise {exercise_id!r} has no checks in chapters/grade_checks/")
    chinese = page.file.src_uri.endswith(".zh.md")
    lines = []
    for check in CHECKS[exercise_id]:
        function = check.run
        region = code_regions.find_region(f"{function.__module__}.{function.__qualname__}")
        link = _line_link(page, region.path, region.start, region.end, label=function.__name__)
        if chinese:
            name, inputs = chinese_check(exercise_id, check.name)
            lines.append(f"- **{name}**：{inputs}（{link}）")
        else:
            inputs = (inspect.getdoc(function) or "").split("\n\n")[0].replace("\n", " ")
            lines.append(f"- **{check.name}**" + (f": {inputs}" if inputs else "") + f" ({link})")
    return "\n".join(lines)


def _expand(match: re.Match[str], page: Page) -> str:
    macro, argument = match[1], match[2]
    if macro == "code":
        return _code_block(page, argument)
    if macro == "code_link":
        region = code_regions.find_region(argument)
        return _line_link(page, region.path, region.start, region.end)
    if macro == "source_map":
        return source_map.render(lambda path, line, label: _line_link(page, path, line, label=label))
    if macro == "grader_checks":
        return _grader_checks(page, argument)
    if macro == "step_trace":
        if argument not in _TRACE_URLS:
            raise LookupError(f"no step trace {argument!r} (chapters/step_traces.py has {sorted(_TRACE_URLS)})")
        return f'<div class="ne-trace" data-trace="{get_relative_url(_TRACE_URLS[argument], page.url)}"></div>\n'
    if macro == "tp_layer_diagram":
        return f"```mermaid\n{_tp_layer_diagram()}\n```\n"
    raise LookupError(f"unknown macro {macro!r}")


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    if _is_generated(page):
        return markdown
    try:
        return _MACRO.sub(lambda match: _expand(match, page), markdown)
    except LookupError as exc:
        raise PluginError(f"{page.file.src_uri}: {exc}") from exc


# ------------------------------------------------------------- chapter links
def _link_chapters(text: str, page: Page) -> str:
    def link(match: re.Match[str]) -> str:
        def one(digit: re.Match[str]) -> str:
            target = CHAPTER_PAGE.format(int(digit[0]))
            if not (ROOT / "docs" / target).is_file():
                raise PluginError(f"{page.file.src_uri}: a docstring names chapter {digit[0]}, which has no page")
            url = get_relative_url(target.removesuffix(".md") + "/", page.url)
            return f'<a class="chapter-link" href="{url}">{digit[0]}</a>'

        return match[1] + re.sub(r"\d+", one, match[2])

    return _CHAPTER_MENTION.sub(link, text)


def on_page_content(html: str, page: Page, config: Any, files: Files) -> str:
    """In the API reference, "chapter N" in docstrings links to the chapter page."""
    if not page.file.src_uri.startswith(f"{REFERENCE_DIR}/"):
        return html
    pieces = _TAG.split(html)
    open_tags: list[str] = []
    for index, piece in enumerate(pieces):
        if piece.startswith("<"):
            tag = re.match(r"</?\s*(\w+)", piece)
            if tag and tag[1] in _NO_LINK_INSIDE:
                if piece.startswith("</"):
                    if tag[1] in open_tags:
                        open_tags.remove(tag[1])
                elif not piece.endswith("/>"):
                    open_tags.append(tag[1])
        elif piece and not open_tags:
            pieces[index] = _link_chapters(piece, page)
    return "".join(pieces)
