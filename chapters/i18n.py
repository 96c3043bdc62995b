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
    """English term (lower case) -> the Chinese edition's term, read from the glossary's tables.

    A row ``| 列并行 / 行并行 | ours | **column-parallel** / **row-parallel** layer: ... |``
    gives two pairs; one English term beside several Chinese ones takes the
    first. The English term is the third cell up to its colon, without markup
    or a parenthesised note; the second cell says whether the term is the
    notes' or this site's. The table of rejected words is not read.
    """
    terms = {}
    for line in GLOSSARY.read_text(encoding="utf-8").splitlines():
        if line.startswith("## Words the Chinese edition does not use"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] == "中文" or set(cells[0]) <= {"-"}:
            continue
        chinese = [part.strip() for part in cells[0].split(" / ")]
        english = _MARKUP.sub("", cells[2].split(":")[0])
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
        (r"Two lines, two jobs", "两行代码，管两件事"),
        # chapter 2
        (r"1\. The machine's limits", "1. 这台机器的上限"),
        (r"2\. Decode latency and throughput vs batch size", f"2. {t('batch size')} 变大时，{t('decode')} 的延迟和吞吐量"),
        (r"3\. Memory-bound or compute-bound\?", "3. 卡在内存带宽，还是卡在算力？"),
        (r"4\. The memory bound: KV bytes per token, Llama against Qwen3\.5",
         f"4. 内存这道坎：每个 {t('token')} 的 KV 字节数，Llama 和 Qwen3.5 比一比"),
        # chapter 3 (its sections are the trace tables' titles)
        (r"1\+2\. budget (\d+) tokens/step: chunked prefill, mixed steps",
         f"1+2. 每步预算 {{0}} 个 {t('token')}：{t('chunked prefill')}，以及 {t('prefill')} 和 {t('decode')} 同在一步"),
        (r"3\. priority policy: the urgent request preempts the running one",
         f"3. 优先级策略：急的请求{t('preemption')}正在跑的请求"),
        # chapter 4
        (r"2\. (\d+) blocks of (\d+) tokens: preemption and recompute",
         f"2. {{0}} 个 {t('block')}，每个 {{1}} 个 {t('token')}：{t('preemption')}与{t('recompute')}"),
        (r"4\. one page size for every group: this engine's arithmetic",
         f"4. 所有 {t('kv cache group')}共用一个 page size：本引擎怎么算"),
        # chapter 5
        (r"what changed", "变了什么"),
        (r"map 1 -- LLM\(\.\.\.\) prepares \((.+) s\)", "地图 1：LLM(...) 在准备什么（{0} 秒）"),
        (r"print\(llm\): the layered map, computed from live objects", "print(llm)：分层地图，从运行中的对象算出来"),
        (r"print\(llm\.llm_engine\.engine_core\): the subtree below the client",
         "print(llm.llm_engine.engine_core)：客户端下面的那棵子树"),
        (r"map 2 -- generate\(\.\.\.\) runs: the engine loop at work", f"地图 2：generate(...) 在跑什么——{t('engine loop')}"),
        (r"the 12 states, reached by real requests", "真实请求走过的 12 个状态"),
        # chapter 6
        (r"1\. LLM\(\.\.\.\) construction, step by step", "1. LLM(...) 的构造，一步一步看"),
        (r"2\. The memory breakdown determine_available_memory measured",
         f"2. determine_available_memory 量出来的内存账（{t('memory profiling')}）"),
        (r"3\. The dtype: what auto picked, and what fp32 and bf16 cost",
         f"3. {t('dtype')}：auto 选了哪个，fp32 和 bf16 各占多少"),
        (r"4\. The budget knob -> blocks -> concurrency", f"4. 预算旋钮 -> {t('block')} 数 -> 并发请求数"),
        (r"5\. A budget too small for one max_model_len request", "5. 预算小到装不下一个 max_model_len 的请求"),
        (r"6\. Tensor parallelism: (.+) on (\d+) ranks", f"6. {t('tensor parallelism')}：{{0}} 跑在 {{1}} 个 {t('rank')}上"),
        (r"6\.1 The worker processes", f"6.1 {t('worker')} 进程"),
        (r"6\.2 Every weight, and each rank's slice of it", "6.2 每个权重，以及每个 rank 分到的切片"),
        (r"1\. One model, three ways: load, weights, speed", "1. 同一个模型，三种加载方式：加载、权重、速度"),
        (r"2\. The quantized model's memory, by kind and format", "2. 量化模型的内存，按种类和格式分"),
        (r"6\.3 The collectives of each step", f"6.3 每一步的集合通信：{t('all-reduce')} 与 {t('all-gather')}"),
        # chapter 7
        (r"1-5\. The engine loop, unrolled \(a 64-token budget: long prompts are chunked\)",
         f"1-5. 把{t('engine loop')}摊开来看（{t('token budget')}为 64：长 {t('prompt')} 走 {t('chunked prefill')}）"),
        (r"CUDA-graph dispatcher, simulated for this run on a CUDA ladder",
         f"{t('cuda graph')} 分发器：按 CUDA 上的那组 batch size 档位，模拟这次运行"),
        (r"The path up to replay: pad a decode step, run it with the Triton backend",
         f"走到重放为止：把一步 {t('decode')} 补齐，用 Triton 后端跑"),
        (r"6\. Async scheduling: step N\+1 is scheduled while step N runs",
         f"6. {t('async scheduling')}：第 N 步还在跑，第 N+1 步已经调度好"),
        # chapter 8
        (r"starting AsyncLLM: the engine core gets a process of its own",
         f"启动 AsyncLLM：{t('engine core')}有了自己的进程（{t('engine core process')}）"),
        (r"1\. processes and threads", "1. 进程和线程"),
        (r"2\. the component tree, across the process boundary", "2. 跨进程的组件树"),
        (r"3\. one answer, streamed as server-sent events", f"3. 一个回答，以 {t('server-sent events')} 流式返回"),
        (r"4\. that request's messages, in time order", "4. 这个请求的消息，按时间排开"),
        (r"5\. a client that hangs up", "5. 半路挂断的客户端"),
        # chapter 9
        (r"1\. One request, step by step: drafts, verdicts, the roll-back",
         f"1. 一个请求，一步一步看：{t('draft')}、判定和回退"),
        (r"2\. The KV blocks around a rejection", f"2. 一次拒绝前后的 KV {t('block')}"),
        (r"3\. Acceptance per position and the mean acceptance length",
         f"3. 每个位置的{t('acceptance rate')}，以及{t('mean acceptance length')}"),
        (r"4\. Speed: the same prompts with and without speculation",
         f"4. 速度：同一批 {t('prompt')}，开和不开{t('speculative decoding')}"),
        # chapter 10
        (r"starting a prefill engine, a decode engine and the proxy",
         f"启动一个 {t('prefill engine')}、一个 {t('decode engine')}和{t('proxy')}"),
        (r"1\. processes and ports", "1. 进程和端口"),
        (r"2\. one completion through the proxy", f"2. 经过{t('proxy')}的一次补全"),
        (r"3\. that request on both engines", "3. 这个请求在两个引擎上各做了什么"),
        (r"4\. what crossed the network", "4. 网络上传了什么"),
        (r"5\. a prompt that starts like the first", f"5. 开头和第一个一样的 {t('prompt')}"),
        (r"6\. a prefill whose consumer never comes", f"6. 一次没有 {t('decode engine')}来读的 {t('prefill')}"),
        # exercise 1.1's walkthrough
        (r"run_to_completion: add_request once, step\(\) until finished",
         "run_to_completion：add_request 一次，然后一直 step() 到请求完成"),
    ]
    return [(re.compile(pattern), spaced(chinese)) for pattern, chinese in pairs]


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
    texts = {
        "chapters.ch01_quickstart": (
            f"第 1 章：两行代码跑通引擎。LLM(...) 负责准备，generate(...) 驱动{t('engine loop')}；"
            f"然后看三个角色——{t('engine loop')}、{t('scheduler')}、{t('KV cache manager')}——各自在哪里。"
        ),
        "chapters.ch02_batching": (
            f"第 2 章：{t('batch size')}。先量这台机器的算力和内存带宽，再量 {t('decode')} 一步的延迟和吞吐量"
            f"怎样随 {t('batch size')} 变化，看它什么时候从卡在带宽变成卡在算力；"
            f"最后比一比 Llama 和 Qwen3.5 每个 {t('token')} 要存多少 KV 字节。"
        ),
        "chapters.ch03_scheduler": (
            f"第 3 章：{t('scheduler')}。每一步按 {t('token budget')}分配 {t('token')}：{t('chunked prefill')}，"
            f"{t('prefill')} 和 {t('decode')} 同在一步，以及优先级策略下的{t('preemption')}。"
        ),
        "chapters.ch04_kv_cache": (
            f"第 4 章：{t('KV cache manager')}。共享的 {t('block')}、{t('prefix cache')}命中、"
            f"{t('preemption')}与{t('recompute')}、LRU 驱逐；{t('hybrid model')}的几个 {t('KV cache group')}"
            f"共用一个 {t('block pool')}。"
        ),
        "chapters.ch05_skeleton": (
            f"第 5 章：引擎骨架。两张地图：LLM(...) 构造出的分层对象树，和 generate(...) 运行时的{t('engine loop')}；"
            "再看真实请求走过的 12 个状态。"
        ),
        "chapters.ch06_construction": (
            f"第 6 章：LLM(...) 的构造，逐步计时；{t('memory profiling')}之后剩下的内存给 {t('KV cache')}，"
            f"它决定能同时服务多少请求。加 --tensor-parallel-size N 时改看{t('tensor parallelism')}："
            f"{t('executor')}、每个 {t('rank')}分到的权重切片、每一步的 {t('all-reduce')}。"
        ),
        "chapters.ch06_quantized": (
            f"第 6 章：同一个模型的三种加载方式——float32、bf16（CPU 有快速 bf16 指令时）和 GGUF {t('block')}——"
            f"各自的加载时间、权重字节数、batch 1 的 {t('decode')} 和 {t('prefill')} 速度；"
            "再按种类和格式数一数量化模型留在内存里的权重。"
        ),
        "chapters.ch07_generate": (
            f"第 7 章：generate(...) 与{t('engine loop')}。把一步拆成几个阶段，模拟 {t('CUDA Graph')} 的分发，"
            f"再拿{t('async scheduling')}和同步的循环比一比。"
        ),
        "chapters.ch08_serving": (
            f"第 8 章：{t('online serving')}。服务器和{t('engine core process')}：进程和线程、跨进程的组件树、"
            f"一次流式回答的消息时间线，以及客户端挂断后，{t('engine core')}怎样中止这个请求。"
        ),
        "chapters.ch09_spec_decode": (
            f"第 9 章：{t('speculative decoding')}。{t('draft')}的接受与拒绝、num_computed_tokens 怎样回退、"
            f"拒绝前后的 KV {t('block')}、{t('acceptance rate')}；最后比较开和不开的速度。"
        ),
        "chapters.ch10_disaggregated": (
            f"第 10 章：{t('disaggregated prefill and decode')}。一个 {t('prefill engine')}、一个 {t('decode engine')}，"
            f"前面一个{t('proxy')}；{t('KV connector')}把 KV {t('block')}经 TCP 从一个{t('engine core process')}送到另一个。"
            f"看一个请求在两边各走过哪些步（WAITING_FOR_REMOTE_KVS、先留着再释放的 {t('block')}）、传了多少字节、"
            f"{t('prefix cache')}命中的 {t('block')}不再传，以及没人来读时 {t('block')}怎样到期释放。"
        ),
        "chapters.ex01_engine_by_hand": "练习 1.1：不用 generate(...)，自己 add_request，再反复 step()，直到请求完成。",
    }
    return {module: spaced(text) for module, text in texts.items()}


_HAN_THEN_LATIN = re.compile(r"(?<=[\u4e00-\u9fff])(?=[A-Za-z0-9(])")
_LATIN_THEN_HAN = re.compile(r"(?<=[A-Za-z0-9)])(?=[\u4e00-\u9fff])")


def spaced(text: str) -> str:
    """``text`` with one space between a Chinese character and a Latin letter or digit
    beside it, as the Chinese pages write them ("KV cache 管理器", "第 3 章")."""
    return _LATIN_THEN_HAN.sub(" ", _HAN_THEN_LATIN.sub(" ", text))
