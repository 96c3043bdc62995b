"""The Chinese edition stays in step with the English one (scripts/docs_i18n.py).

Every English page has a Chinese page whose stamp records the English page it
was translated from, and its own hash when stamped; both share headings (levels and ids), anchors, the
macros that compute excerpts, and every code block. A change to an English
page fails here until its translation is brought up to date and stamped.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from mkdocs_config import load_mkdocs_config, nav_pages

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import docs_i18n


def test_every_english_page_has_a_chinese_page_in_step() -> None:
    found = [problem for page in docs_i18n.english_pages() for problem in docs_i18n.problems(page)]
    assert not found, "\n".join(found)
    assert len(docs_i18n.english_pages()) >= 28  # home, 8 chapters, 4 reference pages, 16 exercise pages


def _chinese_nav_titles() -> dict[str, str]:
    """Page path -> its title in the Chinese navigation (mkdocs.yml's nav_translations)."""
    config = load_mkdocs_config()
    (i18n,) = [plugin["i18n"] for plugin in config["plugins"] if isinstance(plugin, dict) and "i18n" in plugin]
    (chinese,) = [language for language in i18n["languages"] if language["locale"] == "zh"]
    return {path: chinese["nav_translations"].get(title, title)
            for title, path in nav_pages(config["nav"]) if title is not None}


def test_an_exercise_has_one_chinese_title_in_the_nav_and_on_its_page() -> None:
    """The Chinese navigation names each exercise with its page's own title (code marks left out)."""
    titles = _chinese_nav_titles()
    exercises = sorted(path for path in titles if path.startswith("exercises/") and path != "exercises/index.md")
    assert len(exercises) >= 16
    for path in exercises:
        number = Path(path).stem
        heading = (docs_i18n.DOCS / path.replace(".md", docs_i18n.ZH_SUFFIX)).read_text(encoding="utf-8")
        page_title = re.search(rf"^# 练习 {re.escape(number)} · (.+?) \{{#", heading, re.MULTILINE)
        assert page_title is not None, f"{path}: its Chinese page has no heading '# 练习 {number} · ...'"
        assert titles[path] == f"{number} {page_title[1].replace('`', '')}", path


ENGLISH = """# Chapter 9 · A page

Text with `code` and {{ code("nanoengine.llm") }}.

## One step

```bash
python -m chapters.ch09
```

| term | **scheduler**{#scheduler} |
"""
CHINESE = """# 第 9 章 · 一页 {#chapter-9-a-page}

含 `code` 的文字，{{ code("nanoengine.llm") }}。

## 一步 {#one-step}

```bash
python -m chapters.ch09
```

| 术语 | **scheduler**{#scheduler} |
"""


@pytest.fixture
def docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(docs_i18n, "DOCS", tmp_path)
    (tmp_path / "page.md").write_text(ENGLISH, encoding="utf-8")
    (tmp_path / "page.zh.md").write_text(CHINESE, encoding="utf-8")
    docs_i18n.stamp(tmp_path / "page.zh.md")
    return tmp_path


def test_a_stamped_translation_of_the_same_shape_passes(docs: Path) -> None:
    assert docs_i18n.problems(docs / "page.md") == []
    assert (docs / "page.zh.md").read_text(encoding="utf-8").startswith("<!-- i18n: translated from sha256 ")
    # Stamping again changes nothing: the page's own hash leaves the stamp line out.
    before = (docs / "page.zh.md").read_text(encoding="utf-8")
    docs_i18n.stamp(docs / "page.zh.md")
    assert (docs / "page.zh.md").read_text(encoding="utf-8") == before


@pytest.mark.parametrize(
    ("english_edit", "chinese_edit", "message"),
    [
        (("Text with", "Text, now changed, with"), None, "changed after page.zh.md was translated"),
        (None, ("含 `code` 的文字", "含 `code` 的文字，又加了一句"), "page.zh.md changed after it was stamped"),
        (None, ("{#one-step}", "{#a-step}"), "headings differ"),
        (None, ('{{ code("nanoengine.llm") }}', ""), "macros differ"),
        (None, ("python -m chapters.ch09", "python -m chapters.ch08"), "code blocks differ"),
        (None, ("{#scheduler}", ""), "anchors differ"),
    ],
    ids=["english-changed", "chinese-changed", "heading-id", "macro", "code-block", "anchor"],
)
def test_drift_is_named(
    docs: Path, english_edit: tuple[str, str] | None, chinese_edit: tuple[str, str] | None, message: str
) -> None:
    for name, edit in (("page.md", english_edit), ("page.zh.md", chinese_edit)):
        if edit is not None:
            path = docs / name
            path.write_text(path.read_text(encoding="utf-8").replace(*edit), encoding="utf-8")
    found = docs_i18n.problems(docs / "page.md")
    assert any(message in problem for problem in found), found


def test_a_missing_translation_is_named(docs: Path) -> None:
    (docs / "page.zh.md").unlink()
    assert docs_i18n.problems(docs / "page.md") == ["page.md: no Chinese page page.zh.md"]
