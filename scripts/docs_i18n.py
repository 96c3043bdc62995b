"""Keep the Chinese edition of the docs in step with the English one.

Every English page ``docs/<path>.md`` has a Chinese page ``docs/<path>.zh.md``
(mkdocs-static-i18n's suffix layout). The Chinese page opens with a stamp,

    <!-- i18n: translated from sha256 0123456789abcdef of the English page; this page 0123456789abcdef -->

the first 16 hex digits of the English file's SHA-256 when it was last
translated, and of the Chinese page itself (without the stamp line) when it
was stamped. ``check`` fails when:

* an English page has no Chinese page;
* either page changed after the stamp: the English one (bring the
  translation up to date), or the Chinese one alone (check it still says what
  the English page says); then ``stamp`` it;
* the two differ in what must be the same in both: the heading structure
  (each heading's level and id: a Chinese heading carries the English
  heading's id as ``{#id}``), the other explicit anchors (``{#id}``), the
  macros that compute excerpts (``{{ code("...") }}`` ...), in order, and every
  fenced code block except mermaid diagrams, whose labels may be translated.

    python scripts/docs_i18n.py check             # every page; exit 1 on a problem
    python scripts/docs_i18n.py stamp docs/chapters/ch03.zh.md
    python scripts/docs_i18n.py headings docs/chapters/ch03.md   # the ids to copy

``make test`` runs ``check`` (tests/test_docs_i18n.py). Chapter: none (a
tool of the docs site); vLLM 0.32 counterpart: none.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from markdown.extensions.toc import slugify

DOCS = Path(__file__).resolve().parents[1] / "docs"
NOT_PAGES = ("hooks", "data")  # build inputs, not pages (mkdocs.yml exclude_docs)
ZH_SUFFIX = ".zh.md"
STAMP = re.compile(
    r"<!-- i18n: translated from sha256 ([0-9a-f]{16}) of the English page; this page ([0-9a-f]{16}) -->\n?"
)
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_EXPLICIT_ID = re.compile(r"\{\s*#([\w-]+)[^}]*\}")
_MACRO = re.compile(r"\{\{.*?\}\}")


@dataclass
class PageShape:
    """What the two editions of a page must share."""

    headings: list[tuple[int, str]] = field(default_factory=list)  # (level, id)
    anchors: list[str] = field(default_factory=list)  # explicit {#id} outside headings
    macros: list[str] = field(default_factory=list)
    code_blocks: list[str] = field(default_factory=list)  # fenced, mermaid left out
    mermaid_blocks: int = 0
    front_matter: str = ""  # the YAML block that opens a page (page settings: the same in both)


def english_pages() -> list[Path]:
    """Every English page of the site, in path order."""
    return sorted(
        path for path in DOCS.rglob("*.md")
        if not path.name.endswith(ZH_SUFFIX) and path.relative_to(DOCS).parts[0] not in NOT_PAGES
    )


def chinese_page(english: Path) -> Path:
    return english.with_name(english.name.removesuffix(".md") + ZH_SUFFIX)


def source_hash(english: Path) -> str:
    return hashlib.sha256(english.read_bytes()).hexdigest()[:16]


def translation_hash(chinese_text: str) -> str:
    """The Chinese page's own hash, its stamp line left out (stamping must not change it)."""
    return hashlib.sha256(STAMP.sub("", chinese_text).encode("utf-8")).hexdigest()[:16]


def heading_id(text: str) -> str:
    """The id Python-Markdown's toc gives a heading: its explicit ``{#id}``, else its slug."""
    explicit = _EXPLICIT_ID.search(text)
    if explicit:
        return explicit[1]
    plain = re.sub(r"\[([^\]]*)\]\[[^\]]*\]|\[([^\]]*)\]\([^)]*\)", lambda m: m[1] or m[2] or "", text)
    plain = re.sub(r"<[^>]+>|[`*]", "", plain)
    return slugify(plain, "-")


def page_shape(text: str) -> PageShape:
    """Scan one page: headings and anchors outside code, macros, fenced blocks."""
    shape = PageShape()
    shape.front_matter, text = split_front_matter(text)
    fence: str | None = None
    info, body = "", list[str]()
    for line in text.splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence, info, body = match[2], match[3].strip(), []
            continue
        if fence is not None:
            if line.strip().startswith(fence) and line.strip() == fence[0] * len(line.strip()):
                if info.startswith("mermaid"):
                    shape.mermaid_blocks += 1
                else:
                    shape.code_blocks.append(info + "\n" + "\n".join(body))
                fence = None
            else:
                body.append(line)
            continue
        shape.macros += _MACRO.findall(line)
        heading = _HEADING.match(line)
        if heading:
            shape.headings.append((len(heading[1]), heading_id(heading[2])))
        else:
            shape.anchors += _EXPLICIT_ID.findall(line)
    return shape


def split_front_matter(text: str) -> tuple[str, str]:
    """(the page's opening ``---`` YAML block or "", the rest)."""
    if not text.startswith("---\n"):
        return "", text
    end = text.index("\n---\n", 3) + len("\n---\n")
    return text[:end], text[end:]


def problems(english: Path) -> list[str]:
    """Why the Chinese page of ``english`` is missing, stale or out of shape (empty: in step)."""
    name = english.relative_to(DOCS).as_posix()
    chinese = chinese_page(english)
    if not chinese.exists():
        return [f"{name}: no Chinese page {chinese.name}"]
    text = chinese.read_text(encoding="utf-8")
    found = []
    stamp = STAMP.search(text)
    if stamp is None:
        found.append(f"{chinese.name}: no stamp (run: python scripts/docs_i18n.py stamp {chinese.relative_to(DOCS.parent)})")
    elif stamp[1] != source_hash(english):
        found.append(f"{name} changed after {chinese.name} was translated: bring the translation up to date, "
                     "then stamp it")
    elif stamp[2] != translation_hash(text):
        found.append(f"{chinese.name} changed after it was stamped, and {name} did not: check that it still says "
                     "what the English page says, then stamp it")
    en, zh = page_shape(english.read_text(encoding="utf-8")), page_shape(text)
    for what in ("front_matter", "headings", "anchors", "macros", "code_blocks", "mermaid_blocks"):
        if getattr(en, what) != getattr(zh, what):
            found.append(f"{chinese.name}: its {what.replace('_', ' ')} differ from {name}'s: "
                         f"{_first_difference(getattr(en, what), getattr(zh, what))}")
    return found


def _first_difference(english: object, chinese: object) -> str:
    if not isinstance(english, list) or not isinstance(chinese, list):
        return f"English {english!r}, Chinese {chinese!r}"
    for index, (a, b) in enumerate(zip(english, chinese, strict=False)):
        if a != b:
            return f"item {index}: English {a!r}, Chinese {b!r}"
    return f"English has {len(english)}, Chinese {len(chinese)}"


def stamp(chinese: Path) -> None:
    """Record both pages' current hashes in the Chinese page's stamp line."""
    english = chinese.with_name(chinese.name.removesuffix(ZH_SUFFIX) + ".md")
    text = STAMP.sub("", chinese.read_text(encoding="utf-8"))
    line = (f"<!-- i18n: translated from sha256 {source_hash(english)} of the English page; "
            f"this page {translation_hash(text)} -->\n")
    front, rest = split_front_matter(text)  # the stamp goes after any front matter, which must come first
    chinese.write_text(front + line + rest, encoding="utf-8")


def main(argv: list[str]) -> int:
    command, *paths = argv or ["check"]
    if command == "check":
        found = [problem for page in english_pages() for problem in problems(page)]
        print("\n".join(found) if found else f"{len(english_pages())} pages: both editions in step")
        return 1 if found else 0
    if command == "stamp":
        for path in paths:
            stamp(Path(path).resolve())
        return 0
    if command == "headings":
        for path in paths:
            for level, anchor in page_shape(Path(path).read_text(encoding="utf-8")).headings:
                print(f"{'#' * level} {{#{anchor}}}")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
