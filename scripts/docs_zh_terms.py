"""Check the Chinese text of the project against the glossary's rejected words.

The glossary (``docs/glossary.md``) ends with a table of words the Chinese
edition does not use, each with what to write instead:

    | 不写 | 写作 | why |
    | 块（模块除外） | block; a piece of a prompt is a chunk ... | ... |

A first cell names one word or several (``令牌、词元``), and may name the
compounds in which the word is fine (``（模块除外）``: 模块, module, holds 块).
This script finds every use of those words in the Chinese pages
(``docs/**/*.zh.md``, the rejected-words table of the Chinese glossary left
out), in the navigation's Chinese titles (``mkdocs.yml``) and in the Chinese
strings of the walkthroughs and the grader (``chapters/``). It also finds a
line break between two Chinese characters inside a paragraph of a Chinese page:
Markdown renders that break as a space.

    python scripts/docs_zh_terms.py        # every problem, file:line; exit 1 if any

``make test`` runs both checks (tests/test_docs_zh_terms.py). Chapter: none (a
tool of the docs site); vLLM 0.32 counterpart: none.
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
# The heading of the glossary's table of rejected words, in each edition.
REJECTED_TABLE_EN = "## Words the Chinese edition does not use"
REJECTED_TABLE_ID = "{#words-the-chinese-edition-does-not-use}"
_FIRST_CELL = re.compile(r"(?P<words>[^（]+)(?:（(?P<allowed>.+)除外）)?")
# Han characters, and the full-width punctuation that sits between them.
HAN = "\u4e00-\u9fff"
CJK = HAN + "\u3000-\u303f\uff00-\uffef"
_HAN_CHAR = re.compile(f"[{HAN}]")
# Lines that open a Markdown block of their own: a break before them is no break inside a paragraph.
_BLOCK_START = re.compile(r"\s*(#|[-*+] |\d+[.)] |\||>|```|~~~|<|\{\{|!!!|\?\?\?|---)")


@dataclass(frozen=True)
class RejectedWord:
    """One word the Chinese edition does not use: what to write instead, and where it may stay."""

    word: str
    instead: str
    allowed_in: tuple[str, ...] = ()

    def uses_in(self, text: str) -> Iterator[int]:
        """Each index of ``text`` where the word is used, outside the allowed compounds."""
        for match in re.finditer(re.escape(self.word), text):
            if not any(self._inside(compound, text, match.start()) for compound in self.allowed_in):
                yield match.start()

    def _inside(self, compound: str, text: str, at: int) -> bool:
        offset = compound.find(self.word)
        while offset != -1:
            if text[at - offset: at - offset + len(compound)] == compound:
                return True
            offset = compound.find(self.word, offset + 1)
        return False


@dataclass(frozen=True)
class Problem:
    path: Path
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.what}"


def rejected_words(glossary: Path = GLOSSARY) -> list[RejectedWord]:
    """The glossary's table of rejected words, one entry per word."""
    lines = glossary.read_text(encoding="utf-8").splitlines()
    if REJECTED_TABLE_EN not in lines:
        raise LookupError(f"{glossary} has no section {REJECTED_TABLE_EN!r}")
    found = []
    for line in lines[lines.index(REJECTED_TABLE_EN) + 1:]:
        if line.startswith("#"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or set(cells[0]) <= {"-"} or cells[0] == "不写":
            continue
        first = _FIRST_CELL.fullmatch(cells[0])
        if first is None:
            raise ValueError(f"{glossary}: cannot read the rejected word(s) {cells[0]!r}")
        allowed = tuple(first["allowed"].split("、")) if first["allowed"] else ()
        found += [RejectedWord(word.strip(), cells[1], allowed) for word in first["words"].split("、")]
    return found


def chinese_sources() -> list[Path]:
    """Every file whose Chinese text must follow the glossary."""
    pages = sorted((ROOT / "docs").rglob("*.zh.md"))
    code = sorted((ROOT / "chapters").rglob("*.py"))
    return [*pages, ROOT / "mkdocs.yml", *code]


def _lines_to_check(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line that may hold Chinese prose; the rejected-words
    table of the Chinese glossary is left out, since it must name the words."""
    skipping = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith("#"):
            skipping = REJECTED_TABLE_ID in line
        if not skipping and _HAN_CHAR.search(line):
            yield number, line


def term_problems(words: list[RejectedWord] | None = None, paths: list[Path] | None = None) -> list[Problem]:
    """Each use of a rejected word, with what the glossary writes instead."""
    words = rejected_words() if words is None else words
    found = []
    for path in chinese_sources() if paths is None else paths:
        for number, line in _lines_to_check(path):
            for word in words:
                for _ in word.uses_in(line):
                    found.append(Problem(path, number, f"{word.word!r}: write {word.instead}"))
    return found


def line_break_problems(paths: list[Path] | None = None) -> list[Problem]:
    """Each line break between two Chinese characters inside a paragraph of a Chinese page."""
    found = []
    for path in sorted((ROOT / "docs").rglob("*.zh.md")) if paths is None else paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        in_fence = False
        for number, (line, following) in enumerate(itertools.pairwise(lines), start=1):
            if line.lstrip().startswith(("```", "~~~")):
                in_fence = not in_fence
            if in_fence or not line.strip() or not following.strip() or _BLOCK_START.match(following):
                continue
            if re.search(f"[{CJK}]$", line.rstrip()) and re.match(f"[{CJK}]", following.strip()):
                found.append(Problem(path, number, "a paragraph goes on in the next line: join the two lines "
                                                   "(the break would show as a space between two characters)"))
    return found


def main() -> int:
    found = term_problems() + line_break_problems()
    print("\n".join(map(str, found)) if found else "the Chinese text follows the glossary")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
