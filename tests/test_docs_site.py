"""The docs site, built strictly and driven in a real browser (headless Chromium).

One strict ``mkdocs build`` (any broken reference, anchor, macro or symbol fails
it), then the built site is served on localhost and every page is opened in
headless Chromium through the Chrome DevTools protocol: no console error, no
failed request, every internal link resolves (to an existing page *and* id), the
mermaid diagrams render offline, a code link on a chapter page lands on the
lines it shows, and the source-map table reads whole on a 1400 px laptop screen.
Screenshots of the chapter-5 page and of the source map are written next to the
built site for review (docs/images/screenshots/ch05.png is a committed copy).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from base64 import b64decode
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest
from browser_helpers import Browser, serving_folder, wait_for_js

ROOT = Path(__file__).resolve().parents[1]
# For each <code> in the source-map table: is it on one line? And does the table
# fit the text column, or would the reader have to scroll it sideways?
SOURCE_MAP_LAYOUT_JS = (
    "(() => { const table = document.querySelector('.source-map table');"
    " if (table === null) return null;"
    " const codes = Array.from(table.querySelectorAll('code'));"
    " const column = table.closest('.md-typeset__scrollwrap') || table.parentElement;"
    " return {codes: codes.length,"
    "   broken: codes.filter(c => c.getClientRects().length !== 1).map(c => c.textContent),"
    "   scrollWidth: column.scrollWidth, columnWidth: column.clientWidth}; })()"
)
# A laptop screen: the source map must read whole at this size.
LAPTOP_VIEWPORT = (1400, 900)
# Generated pages share one template each: source pages carry only highlighted
# code, API reference pages only mkdocstrings' rendering of a module. The link
# check covers all of them; the browser opens one of each kind plus every
# hand-written page (opening all 130-odd reference pages cost CI ~90 s).
BROWSER_SKIPS_PREFIX = ("source/", "reference/", "zh/source/", "zh/reference/")


# ------------------------------------------------------------------ build + serve
@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, check=False, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return out


@pytest.fixture(scope="module")
def base_url(site: Path) -> Iterator[str]:
    with serving_folder(site) as url:
        yield url


# -------------------------------------------------------------- static link check
class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for key in ("id", "name"):
            if values.get(key):
                self.ids.add(str(values[key]))
        if tag == "a" and values.get("href"):
            self.hrefs.append(str(values["href"]))


@functools.cache
def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _pages(site: Path) -> list[Path]:
    return sorted(site.rglob("index.html"))


def _page_url(site: Path, base_url: str, page: Path) -> str:
    return base_url + page.parent.relative_to(site).as_posix().removeprefix(".") + ("/" if page.parent != site else "")


def _target_file(site: Path, url_path: str) -> Path:
    path = site / unquote(url_path).lstrip("/")
    return path / "index.html" if url_path.endswith("/") or path.is_dir() else path


# ------------------------------------------------------------------------ tests
def test_every_internal_link_resolves(site: Path, base_url: str) -> None:
    broken = []
    pages = _pages(site)
    assert len(pages) > 20, "the site is suspiciously small"
    for page in pages:
        page_url = _page_url(site, base_url, page)
        for href in _parse(page).hrefs:
            absolute = urljoin(page_url, href)
            parts = urlsplit(absolute)
            if not absolute.startswith(base_url):
                continue  # external links are not ours to check
            target = _target_file(site, parts.path)
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {href} (no such file)")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in _parse(target).ids:
                broken.append(f"{page.relative_to(site)}: {href} (no id {parts.fragment!r})")
    assert not broken, "broken links:\n" + "\n".join(broken[:40])


def test_every_page_loads_without_console_errors(site: Path, base_url: str, browser: Browser) -> None:
    failures = {}
    pages = [p for p in _pages(site) if not p.relative_to(site).as_posix().startswith(BROWSER_SKIPS_PREFIX)]
    # One page of each generated kind stands for the rest (same template, same assets).
    pages.append(site / "source" / "nanoengine" / "engine" / "core.py" / "index.html")
    pages.append(site / "reference" / "nanoengine.engine.core" / "index.html")
    assert all(page.is_file() for page in pages[-2:]), pages[-2:]
    for page in pages:
        errors = browser.open(_page_url(site, base_url, page))
        if errors:
            failures[str(page.relative_to(site))] = errors
    assert not failures, json.dumps(failures, indent=1)[:4000]


def test_diagrams_render_offline(base_url: str, browser: Browser) -> None:
    assert browser.open(base_url + "chapters/ch05/") == []
    hosts = browser.evaluate("document.querySelectorAll('.mermaid').length")
    assert hosts >= 1, "chapter 5 should show the state machine as a diagram"
    # Chapter 6's decoder layer on two ranks is drawn at build time from the model's slices.
    assert browser.open(base_url + "chapters/ch06/") == []
    assert browser.evaluate("document.querySelectorAll('.mermaid').length") >= 1, "chapter 6 lost its layer diagram"


def test_ch06_layer_diagram_shows_each_ranks_slices(site: Path) -> None:
    page = (site / "chapters" / "ch06" / "index.html").read_text(encoding="utf-8")
    # Qwen3-0.6B's shapes at N = 2: q/k/v rows halved, o_proj's input columns halved.
    for text in ("rank 0: qkv_proj [2048, 1024]", "rank 1: o_proj [1024, 1024]", "rank 1: down_proj [1024, 1536]",
                 "attention over its 8 query heads, 4 KV heads", "all-reduce"):
        assert text in page, text


def test_code_link_lands_on_the_right_lines(base_url: str, browser: Browser) -> None:
    assert browser.open(base_url + "chapters/ch05/") == []
    link = browser.evaluate(
        "(() => { const a = document.querySelector('a.code-link');"
        " const block = a.closest('p').nextElementSibling;"
        " const first = block.querySelector('code > span[id^=__span]');"
        " return {href: a.href, line: a.dataset.line, text: first.textContent}; })()"
    )
    assert re.search(r"#__codelineno-0-\d+$", link["href"])
    assert browser.open(link["href"]) == []
    landed = browser.evaluate(
        f"(() => {{ const id = location.hash.slice(1);"
        f" const anchor = document.getElementById(id);"
        f" const line = document.getElementById('__span-0-{link['line']}');"
        f" return {{found: anchor !== null, text: line && line.textContent}}; }})()"
    )
    assert landed["found"], f"{link['href']} has no such line anchor"
    assert landed["text"] == link["text"], f"the link shows {link['text']!r} but lands on {landed['text']!r}"


def test_chapter_five_screenshot(site: Path, base_url: str, browser: Browser) -> None:
    assert browser.open(base_url + "chapters/ch05/") == []
    shot = site.parent / "screenshots" / "ch05.png"
    shot.parent.mkdir(exist_ok=True)
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    print(f"chapter-5 screenshot: {shot}")


def test_api_reference_links_docstring_chapters(site: Path) -> None:
    html = (site / "reference" / "nanoengine.core.sched.scheduler" / "index.html").read_text(encoding="utf-8")
    assert re.search(r'<a class="chapter-link" href="\.\./\.\./chapters/ch03/">3</a>', html)


def test_source_map_reads_on_a_laptop_screen(site: Path, base_url: str, browser: Browser) -> None:
    """At 1400x900 no identifier in the source-map table is broken across lines
    ("nanoengin / e/engine/...") and the table fits its column without a
    sideways scroll. A screenshot at that size is written for review."""
    with browser.viewport(*LAPTOP_VIEWPORT):
        assert browser.open(base_url + "source-map/") == []
        layout = browser.evaluate(SOURCE_MAP_LAYOUT_JS)
        shot = site.parent / "screenshots" / "source-map-1400.png"
        shot.parent.mkdir(exist_ok=True)
        shot.write_bytes(b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    assert layout is not None, "the source-map page has no table inside <div class=\"source-map\">"
    assert layout["codes"] > 30, f"only {layout['codes']} code elements: is the table complete?"
    assert layout["broken"] == [], f"identifiers broken across lines: {layout['broken']}"
    assert layout["scrollWidth"] <= layout["columnWidth"], (
        f"the table is {layout['scrollWidth']} px wide in a {layout['columnWidth']} px column")
    print(f"source-map screenshot at {LAPTOP_VIEWPORT[0]} px: {shot}")


# ------------------------------------------------------------ the Chinese edition
SEARCH_RESULTS_JS = (
    "new Promise(resolve => {"
    " const input = document.querySelector('input.md-search__input');"
    " input.value = %s; input.dispatchEvent(new Event('input', {bubbles: true}));"
    " let tries = 0; const poll = () => {"
    "  const links = [...document.querySelectorAll('.md-search-result__item a')].map(a => a.href);"
    "  if (links.length || ++tries > 100) resolve(links); else setTimeout(poll, 100); };"
    " poll(); })"
)


def test_language_switcher_leads_to_the_same_page_in_the_other_edition(base_url: str, browser: Browser) -> None:
    assert browser.open(base_url + "chapters/ch03/") == []
    switch = "[...document.querySelectorAll('a[hreflang]')].map(a => [a.hreflang, a.href])"
    targets = dict(browser.evaluate(switch))
    assert targets.get("zh", "").endswith("/zh/chapters/ch03/"), targets
    assert browser.open(targets["zh"]) == []
    assert browser.evaluate("document.documentElement.lang").startswith("zh")
    assert "调度器" in browser.evaluate("document.querySelector('article').textContent")
    back = dict(browser.evaluate(switch))
    assert back.get("en", "").rstrip("/").endswith("/chapters/ch03"), back


def test_each_edition_writes_its_own_pages_in_its_own_language(site: Path) -> None:
    """Every page outside zh/ is English, every page under it Chinese: the
    generated API reference and source pages too, which both editions once
    wrote to the same addresses (the Chinese build won)."""
    wrong = []
    for page in _pages(site):
        lang = re.search(r'<html lang="([^"]+)"', page.read_text(encoding="utf-8"))
        want = "zh" if page.relative_to(site).parts[0] == "zh" else "en"
        if lang is None or lang[1] != want:
            wrong.append(f"{page.relative_to(site)}: lang={lang and lang[1]!r}, want {want!r}")
    assert not wrong, "\n".join(wrong[:20])
    for kind in ("reference/nanoengine.engine.core", "source/nanoengine/engine/core.py"):
        assert (site / "zh" / kind / "index.html").is_file(), f"the Chinese edition has no {kind} page"


def test_a_generated_pages_switcher_leads_to_its_twin(base_url: str, browser: Browser) -> None:
    switch = "Object.fromEntries([...document.querySelectorAll('a.md-select__link')].map(a => [a.hreflang, a.href]))"
    for english, chinese in (("reference/nanoengine.engine.core/", "zh/reference/nanoengine.engine.core/"),
                             ("source/nanoengine/engine/core.py/", "zh/source/nanoengine/engine/core.py/")):
        assert browser.open(base_url + english) == []
        assert browser.evaluate("document.documentElement.lang") == "en"
        assert browser.evaluate(switch) == {"en": base_url + english, "zh": base_url + chinese}
        assert browser.open(base_url + chinese) == []
        assert browser.evaluate(switch) == {"en": base_url + english, "zh": base_url + chinese}


def test_a_chinese_page_renders_its_mermaid_diagram(base_url: str, browser: Browser) -> None:
    # open() reports any diagram left unrendered, and any console error.
    assert browser.open(base_url + "zh/chapters/ch05/") == []
    assert browser.evaluate("document.querySelectorAll('.mermaid').length") >= 1


@pytest.mark.parametrize("edition", ["", "zh/"])
@pytest.mark.parametrize("trace", ["ch03", "ch04", "ch05", "ch09", "ch10-producer"])
def test_a_chapter_replays_its_step_trace(trace: str, edition: str, site: Path, base_url: str,
                                          browser: Browser) -> None:
    """A page's first replay loads the trace recorded at build time, in its edition's language, and scrubs."""
    frames = json.loads((site / "traces" / f"{trace}.json").read_text())["frames"]
    chapter = trace.split("-")[0]
    assert browser.open(f"{base_url}{edition}chapters/{chapter}/") == []
    shown = wait_for_js(browser, "document.querySelector('.ne-trace').dataset.frames", "the replay")
    assert int(shown) == len(frames)
    last = len(frames) - 1
    browser.evaluate(f"(() => {{ const s = document.querySelector('.ne-trace [data-k=scrub]'); s.value = {last};"
                     " s.dispatchEvent(new Event('input')); })()")
    assert browser.evaluate("Number(document.querySelector('.ne-trace').dataset.step)") == frames[-1]["step"]
    heading = browser.evaluate("document.querySelector('.ne-trace h4').textContent")
    assert heading == ("KV block" if edition else "KV blocks")


def test_chinese_search_finds_the_scheduler_on_chapter_three(base_url: str, browser: Browser) -> None:
    assert browser.open(base_url + "zh/") == []
    results = browser.evaluate(SEARCH_RESULTS_JS % json.dumps("调度器"))
    assert any("/zh/chapters/ch03/" in href for href in results), results


@pytest.mark.parametrize("query", ["prefill", "KV cache", "调度器"])
def test_chinese_search_finds_a_chapter_for_the_notes_words(query: str, base_url: str, browser: Browser) -> None:
    """The notes' own words, English ones included, lead a Chinese reader to a Chinese chapter page."""
    assert browser.open(base_url + "zh/") == []
    results = browser.evaluate(SEARCH_RESULTS_JS % json.dumps(query))
    assert any("/zh/chapters/" in href for href in results), results


class _ProseText(HTMLParser):
    """The text of a page's prose (paragraphs, list items, table cells, headings inside
    the article), each piece of code standing as one mark, the site's menus left out."""

    PROSE = frozenset({"p", "li", "td", "th", "h1", "h2", "h3", "h4", "h5", "h6"})
    CODE = frozenset({"code", "pre", "script", "style"})

    def __init__(self) -> None:
        super().__init__()
        self.article_depth = self.prose_depth = self.code_depth = 0
        self.pieces: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.article_depth += tag == "article"
        self.prose_depth += tag in self.PROSE
        if tag in self.CODE:
            self.code_depth += 1
            self.pieces.append("\1")  # code stands between the words around it
        if tag in self.PROSE:
            self.pieces.append("\0")  # two blocks side by side are not one line of text

    def handle_endtag(self, tag: str) -> None:
        self.article_depth -= tag == "article" and self.article_depth > 0
        self.prose_depth -= tag in self.PROSE and self.prose_depth > 0
        self.code_depth -= tag in self.CODE and self.code_depth > 0
        if tag in self.PROSE:
            self.pieces.append("\0")

    def handle_data(self, data: str) -> None:
        if self.article_depth and self.prose_depth and not self.code_depth:
            self.pieces.append(data)


HAN_SPACE_HAN = re.compile(r"[\u4e00-\u9fff\u3000-\u303f\uff00-\uffef]\s+[\u4e00-\u9fff\u3000-\u303f\uff00-\uffef]")


def test_no_chinese_paragraph_shows_a_space_between_two_characters(site: Path) -> None:
    """A line break inside a Chinese paragraph renders as a space; none may be left."""
    found = []
    for page in _pages(site / "zh"):
        parser = _ProseText()
        parser.feed(page.read_text(encoding="utf-8"))
        text = "".join(parser.pieces)
        found += [f"{page.relative_to(site)}: ...{text[max(m.start() - 12, 0):m.end() + 12]!r}..."
                  for m in HAN_SPACE_HAN.finditer(text)]
    assert not found, f"{len(found)} spaces between Chinese characters:\n" + "\n".join(found[:40])
