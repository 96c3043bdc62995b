"""The Chinese text follows the glossary (scripts/docs_zh_terms.py).

The glossary's last table names the words the Chinese edition does not use (秩
for rank, 令牌 for token, 块 for block ...). No Chinese page, navigation title,
walkthrough string or grader string may use them, and no paragraph of a
Chinese page may break its line between two Chinese characters. The rendered
site is checked for the same space in tests/test_docs_site.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import docs_zh_terms
from docs_zh_terms import RejectedWord


def test_no_chinese_text_uses_a_rejected_word() -> None:
    found = docs_zh_terms.term_problems()
    assert not found, f"{len(found)} uses of words the glossary rejects:\n" + "\n".join(map(str, found[:60]))


def test_no_chinese_paragraph_breaks_its_line_between_two_characters() -> None:
    found = docs_zh_terms.line_break_problems()
    assert not found, "\n".join(map(str, found[:60]))


def test_the_glossary_rejects_the_translations_the_issue_found() -> None:
    words = {word.word: word for word in docs_zh_terms.rejected_words()}
    for rejected in ("秩", "令牌", "KV 缓存", "块", "解码", "批大小", "CUDA 图", "语法", "预填充"):
        assert rejected in words, rejected
    assert words["秩"].instead == "rank（进程）" and words["语法"].instead == "文法"
    assert words["块"].allowed_in == ("模块",)


def test_a_rejected_word_is_found_outside_its_allowed_compounds() -> None:
    block = RejectedWord("块", "block", ("模块",))
    assert list(block.uses_in("这个模块把块交给请求")) == [5]
    decode = RejectedWord("解码", "decode", ("投机解码", "贪心解码"))
    assert list(decode.uses_in("投机解码和贪心解码都不算，解码阶段才算")) == [13]


def test_problems_name_the_file_the_line_and_the_word_to_write(tmp_path: Path) -> None:
    page = Path(docs_zh_terms.ROOT / "docs" / "a-test-page.zh.md")
    problem = docs_zh_terms.Problem(page, 3, "'令牌': write token")
    assert str(problem) == "docs/a-test-page.zh.md:3: '令牌': write token"
    text = tmp_path / "page.zh.md"
    text.write_text("# 标题 {#t}\n\n每个令牌都\n占一个槽位。\n\n- 列表项\n- 第二项\n", encoding="utf-8")
    uses = docs_zh_terms.term_problems([RejectedWord("令牌", "token")], [text])
    assert [(p.line, p.what) for p in uses] == [(3, "'令牌': write token")]
    breaks = docs_zh_terms.line_break_problems([text])
    assert [p.line for p in breaks] == [3]  # the two list items are blocks of their own
