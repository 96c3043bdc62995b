"""``--lang zh``: the walkthroughs' headings and introductions in Chinese, in the glossary's terms.

Every walkthrough's output stays English (tables, numbers, the engine's own
words); with ``--lang zh`` its section headings and a short introduction of
what it shows are printed in Chinese, for readers of the Chinese edition of
the docs and of the study notes. Each technical term comes from the glossary
page (``docs/glossary.md``, its first column), the one place that fixes a
term's translation for the docs of both languages and for these headings:
``term("preemption")`` is whatever the glossary says, and a term the glossary
lacks is a KeyError, not a guess.

Headings are matched by pattern, so a heading with a number in it
(``"6. Tensor parallelism: M on 2 ranks"``) keeps its number;
``tests/test_walkthrough_i18n.py`` checks that every heading a walkthrough
prints has a Chinese form. vLLM 0.32 counterpart: none.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

GLOSSARY = Path(__file__).resolve().parents[1] / "docs" / "glossary.md"
_MARKUP = re.compile(r"\*\*|\{#[\w-]+\}|`")


@functools.cache
def glossary_terms() -> dict[str, str]:
    """English term (lower case) -> the notes' Chinese term, read from the glossary's table.

    A row ``| 全规约 / 全收集 | **all-reduce** / **all-gather**: ... |`` gives
    two pairs; one English term beside several Chinese ones takes the first.
    The English term is the second cell up to its colon, without markup or a
    parenthesised note.
    """
    terms = {}
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("中文 (notes)", "---") or set(cells[0]) <= {"-"}:
            continue
        chinese = [part.strip() for part in cells[0].replace("（本项目用语）", "").split(" / ")]
        english = _MARKUP.sub("", cells[1].split(":")[0])
        english_terms = [re.sub(r"\s*\(.*?\)", "", part).strip().lower() for part in english.split(" / ")]
        if len(english_terms) == 1 and chinese[0]:
            terms[english_terms[0]] = chinese[0]  # "显存分析 / 内存探测": the first is the term
        elif len(chinese) == len(english_terms) and all(chinese):
            terms.update(zip(english_terms, chinese, strict=True))
    return terms


def term(english: str) -> str:
    """The glossary's Chinese for ``english``; KeyError naming it when the glossary has none."""
    terms = glossary_terms()
    if english.lower() not in terms:
        raise KeyError(f"the glossary (docs/glossary.md) has no Chinese term for {english!r}")
    return terms[english.lower()]


@functools.cache
def headings() -> list[tuple[re.Pattern[str], str]]:
    """(English heading as a pattern, Chinese heading); ``{0}``, ``{1}`` take the pattern's groups."""
    t = term
    pairs = [
        # chapter 1
        (r"generate\(\.\.\.\) output", "generate(...) 的输出"),
        (r"Two lines, two jobs", "两行代码，两件事"),
        # chapter 2
        (r"1\. The machine's limits", "1. 这台机器的极限"),
        (r"2\. Decode latency and throughput vs batch size", f"2. {t('decode')}延迟与吞吐量随{t('batch size')}的变化"),
        (r"3\. Memory-bound or compute-bound\?", "3. 受内存带宽所限，还是受算力所限？"),
        (r"4\. The memory bound: KV bytes per token, Llama against Qwen3\.5",
         "4. 内存这道限制：每个令牌的 KV 字节数，Llama 对比 Qwen3.5"),
        # chapter 3 (its sections are the trace tables' titles)
        (r"1\+2\. budget (\d+) tokens/step: chunked prefill, mixed steps",
         f"1+2. {t('token budget')}每步 {{0}} 个令牌：{t('chunked prefill')}与混合步骤"),
        (r"3\. priority policy: the urgent request preempts the running one",
         f"3. 优先级策略：紧急的请求{t('preemption')}正在运行的请求"),
        # chapter 4
        (r"2\. (\d+) blocks of (\d+) tokens: preemption and recompute",
         f"2. {{0}} 个{t('block')}、每块 {{1}} 个令牌：{t('preemption')}与{t('recompute')}"),
        (r"4\. one page size for every group: this engine's arithmetic",
         f"4. 每个{t('KV cache group')}用同一个{t('page')}大小：本引擎的算术"),
        # chapter 5
        (r"what changed", "有什么变化"),
        (r"map 1 -- LLM\(\.\.\.\) prepares \((.+) s\)", "地图 1 —— LLM(...) 做的准备（{0} 秒）"),
        (r"print\(llm\): the layered map, computed from live objects", "print(llm)：分层的地图，由运行中的对象算出"),
        (r"print\(llm\.llm_engine\.engine_core\): the subtree below the client",
         "print(llm.llm_engine.engine_core)：客户端之下的子树"),
        (r"map 2 -- generate\(\.\.\.\) runs: the engine loop at work", f"地图 2 —— generate(...) 运行：工作中的{t('engine loop')}"),
        (r"the 12 states, reached by real requests", "12 种状态，由真实请求一一走到"),
        # chapter 6
        (r"1\. LLM\(\.\.\.\) construction, step by step", "1. LLM(...) 的构造，一步一步"),
        (r"2\. The memory breakdown determine_available_memory measured",
         f"2. determine_available_memory 测得的内存分解（{t('memory profiling')}）"),
        (r"3\. The dtype: what auto picked, and what fp32 and bf16 cost",
         f"3. {t('dtype')}：auto 选了什么，fp32 与 bf16 各占多少"),
        (r"4\. The budget knob -> blocks -> concurrency", f"4. 预算旋钮 -> {t('block')} -> 并发请求数"),
        (r"5\. A budget too small for one max_model_len request", "5. 装不下一个 max_model_len 请求的预算"),
        (r"6\. Tensor parallelism: (.+) on (\d+) ranks", f"6. {t('tensor parallelism')}：{{0}} 跑在 {{1}} 个{t('rank')}上"),
        (r"6\.1 The worker processes", "6.1 工作进程"),
        (r"6\.2 Every weight, and each rank's slice of it", f"6.2 每个权重，以及每个{t('rank')}分到的切片"),
        (r"6\.3 The collectives of each step", f"6.3 每一步的{t('all-reduce')}与{t('all-gather')}"),
        # chapter 7
        (r"1-5\. The engine loop, unrolled \(a 64-token budget: long prompts are chunked\)",
         f"1-5. 展开的{t('engine loop')}（{t('token budget')}为 64：长提示被切块，即{t('chunked prefill')}）"),
        (r"CUDA-graph dispatcher, simulated for this run on a CUDA ladder", "CUDA 图分发器：在一组 CUDA 批大小档位上模拟本次运行"),
        (r"The path up to replay: pad a decode step, run it with the Triton backend",
         f"直到重放的路径：把一个{t('decode')}步骤补齐，用 Triton 后端运行"),
        (r"6\. Async scheduling: step N\+1 is scheduled while step N runs",
         f"6. {t('async scheduling')}：第 N 步运行时就调度第 N+1 步"),
        # chapter 8
        (r"starting AsyncLLM: the engine core gets a process of its own",
         f"启动 AsyncLLM：引擎核心有了自己的进程（{t('engine core process')}）"),
        (r"1\. processes and threads", "1. 进程与线程"),
        (r"2\. the component tree, across the process boundary", "2. 跨越进程边界的组件树"),
        (r"3\. one answer, streamed as server-sent events", "3. 一个回答，以服务器推送事件（SSE）流式返回"),
        (r"4\. that request's messages, in time order", "4. 这个请求的消息，按时间先后"),
        (r"5\. a client that hangs up", "5. 中途挂断的客户端"),
        # chapter 9
        (r"1\. One request, step by step: drafts, verdicts, the roll-back",
         f"1. 一个请求，一步一步：{t('draft')}、判定与回退"),
        (r"2\. The KV blocks around a rejection", f"2. 一次拒绝前后的 KV {t('block')}"),
        (r"3\. Acceptance per position and the mean acceptance length",
         f"3. 各位置的{t('acceptance rate')}与{t('mean acceptance length')}"),
        (r"4\. Speed: the same prompts with and without speculation",
         f"4. 速度：同样的提示，开与不开{t('speculative decoding')}"),
        # exercise 1.1's walkthrough
        (r"run_to_completion: add_request once, step\(\) until finished", "run_to_completion：add_request 一次，再 step() 直到完成"),
    ]
    return [(re.compile(pattern), chinese) for pattern, chinese in pairs]


def chinese_heading(english: str) -> str | None:
    """The Chinese form of a walkthrough heading, its numbers kept; None when there is none."""
    for pattern, chinese in headings():
        match = pattern.fullmatch(english)
        if match:
            return chinese.format(*match.groups())
    return None


@functools.cache
def introductions() -> dict[str, str]:
    """Walkthrough module -> what it shows, in Chinese (printed first with ``--lang zh``)."""
    t = term
    return {
        "chapters.ch01_quickstart": (
            f"第 1 章：用两行代码跑通引擎——LLM(...) 做好准备，generate(...) 驱动{t('engine loop')}；"
            f"再看三个角色：{t('engine loop')}、{t('scheduler')}、{t('KV cache manager')}各在哪里。"
        ),
        "chapters.ch02_batching": (
            f"第 2 章：{t('batch size')}。先测这台机器的算力与内存带宽，再测{t('decode')}一步的延迟与吞吐量"
            f"如何随{t('batch size')}变化，看何时从受带宽所限变为受算力所限；最后比较 Llama 与 Qwen3.5 每个令牌的 KV 字节数。"
        ),
        "chapters.ch03_scheduler": (
            f"第 3 章：{t('scheduler')}。每一步按{t('token budget')}分配令牌：{t('chunked prefill')}、"
            f"{t('prefill')}与{t('decode')}混在同一步，以及优先级策略下的{t('preemption')}。"
        ),
        "chapters.ch04_kv_cache": (
            f"第 4 章：{t('KV cache manager')}。共享的{t('block')}、{t('prefix cache')}命中、"
            f"{t('preemption')}与{t('recompute')}、LRU 驱逐；混合模型的多个{t('KV cache group')}共用一个{t('block pool')}。"
        ),
        "chapters.ch05_skeleton": (
            f"第 5 章：引擎骨架。两张地图：LLM(...) 构造出的分层对象树，generate(...) 运行时的{t('engine loop')}；"
            "以及真实请求走过的 12 种状态。"
        ),
        "chapters.ch06_construction": (
            f"第 6 章：LLM(...) 的构造。逐步计时，{t('memory profiling')}之后剩下的内存成为 KV 缓存，"
            f"决定能同时服务多少请求；--tensor-parallel-size N 时改看{t('tensor parallelism')}："
            f"{t('executor')}、各{t('rank')}的权重切片、每一步的{t('all-reduce')}。"
        ),
        "chapters.ch07_generate": (
            f"第 7 章：generate(...) 与{t('engine loop')}。把一步拆成各个阶段，模拟 CUDA 图分发，"
            f"再比较{t('async scheduling')}与同步循环。"
        ),
        "chapters.ch08_serving": (
            f"第 8 章：在线服务。服务器与{t('engine core process')}：进程与线程、跨进程的组件树、"
            "一次流式回答的消息时间线，以及客户端挂断时请求在引擎核心里被中止。"
        ),
        "chapters.ch09_spec_decode": (
            f"第 9 章：{t('speculative decoding')}。{t('draft')}被接受或拒绝、num_computed_tokens 的回退、"
            f"拒绝前后的 KV {t('block')}、{t('acceptance rate')}；再比较开与不开的速度。"
        ),
        "chapters.ex01_engine_by_hand": "练习 1.1：不用 generate(...)，自己 add_request 再反复 step()，直到请求完成。",
    }
