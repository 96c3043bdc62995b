"""``--lang zh``: every walkthrough heading has a Chinese form, in the glossary's terms.

The headings are found in the walkthroughs' source (each ``console.rule`` and
each trace table's title), so a new heading without a Chinese form fails here.
"""

from __future__ import annotations

import ast
import io
import re
from pathlib import Path

import pytest

import chapters._common
from chapters import ch05_skeleton
from chapters._common import ChapterConsole, base_parser, console
from chapters.i18n import chinese_heading, glossary_terms, introductions, term

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def _sample(node: ast.expr) -> str | None:
    """A heading literal as the walkthrough would print it (each {value} filled with 7)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(part.value) if isinstance(part, ast.Constant) else "7" for part in node.values)
    return None


def walkthrough_headings() -> list[tuple[str, str]]:
    """(file, heading) for every console.rule(...) and trace_table(..., title=...) in the walkthroughs."""
    found = []
    for path in sorted(CHAPTERS.glob("c*.py")) + sorted(CHAPTERS.glob("ex*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            if node.func.attr == "rule" and node.args:
                heading = _sample(node.args[0])
            elif node.func.attr == "to_table" or getattr(node.func, "id", None) == "trace_table":
                heading = next((_sample(k.value) for k in node.keywords if k.arg == "title"), None)
            else:
                continue
            if heading:
                found.append((path.name, heading))
    return found


def test_every_walkthrough_heading_has_a_chinese_form() -> None:
    headings = walkthrough_headings()
    assert len(headings) >= 30, headings
    missing = [f"{name}: {heading!r}" for name, heading in headings if chinese_heading(heading) is None]
    assert not missing, "headings with no Chinese form in chapters/i18n.py:\n" + "\n".join(missing)


def test_numbers_in_a_heading_are_kept() -> None:
    assert chinese_heading("6. Tensor parallelism: Qwen/Qwen3-0.6B on 2 ranks") == (
        "6. 张量并行：Qwen/Qwen3-0.6B 跑在 2 个 rank（进程）上")
    assert chinese_heading("2. 12 blocks of 4 tokens: preemption and recompute") == (
        "2. 12 个 block，每个 4 个 token：抢占与重计算")
    assert chinese_heading("a heading nobody wrote") is None


def test_terms_come_from_the_glossary() -> None:
    terms = glossary_terms()
    assert terms["preemption"] == "抢占" and terms["kv cache manager"] == "KV cache 管理器"
    assert terms["column-parallel"] == "列并行" and terms["all-gather"] == "all-gather"  # rows with two terms
    assert terms["token"] == "token" and terms["rank"] == "rank（进程）"  # the notes keep token in English
    with pytest.raises(KeyError, match="no Chinese term for 'warp drive'"):
        term("warp drive")
    # Every walkthrough's introduction was built from those terms.
    assert {name.removeprefix("chapters.") for name in introductions()} >= {
        "ch01_quickstart", "ch02_batching", "ch03_scheduler", "ch04_kv_cache", "ch05_skeleton",
        "ch06_construction", "ch07_generate", "ch08_serving",
    }


def test_ch05_in_chinese_keeps_its_english_output(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        ch05_skeleton.main(["--model", tiny_llama, "--no-generate", "--lang", "zh"])
    finally:
        console.language = "en"
    out = capsys.readouterr().out
    assert "第 5 章：引擎骨架" in out  # the introduction
    assert "地图 1：LLM(...) 在准备什么" in out and "print(llm)：分层地图" in out  # headings
    assert "LLMEngine" in out and "EngineCore" in out  # the tree itself stays as the code names it


def _text_of(panel_output: str) -> str:
    """What a panel printed, with its borders and line breaks taken out."""
    return re.sub(r"[\s│╭╮╰╯─]", "", panel_output)


@pytest.mark.parametrize("module", sorted(introductions()))
def test_each_introduction_is_printed_whole_on_a_narrow_terminal(module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 80 columns ``--lang zh`` wraps the introduction instead of cutting it off."""
    narrow = ChapterConsole(width=80, record=True, file=io.StringIO())
    monkeypatch.setattr(chapters._common, "console", narrow)
    parser = base_parser("", module)
    parser.parse_args(["--lang", "zh"])
    printed = narrow.export_text()
    assert max(len(line) for line in printed.splitlines()) <= 80
    assert _text_of(introductions()[module]) in _text_of(printed)


def test_the_notes_chinese_prompts_get_a_note_on_an_english_only_model(capsys: pytest.CaptureFixture[str]) -> None:
    from chapters._common import note_on_chinese_prompts

    note_on_chinese_prompts("SmolLM2-135M-Instruct")
    assert "trained on English text" in capsys.readouterr().out
    console.language = "zh"
    try:
        note_on_chinese_prompts("/models/SmolLM2-135M-Instruct")
    finally:
        console.language = "en"
    assert "只用英文文本训练过" in _text_of(capsys.readouterr().out)
    note_on_chinese_prompts("/tmp/tiny-llama")  # a model the note does not describe: nothing said
    assert capsys.readouterr().out == ""
