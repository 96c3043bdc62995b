"""Chapter 6 -- what ``LLM(...)`` does before the first token: construction, timed.

``LLM(...)`` ends in the worker's four steps, ``init_device`` -> ``load_model``
-> ``determine_available_memory`` -> ``initialize_from_config`` (then
``compile_or_warm_up_model``, which captures CUDA graphs on a GPU). The third is
the one that matters for serving: a profiling forward pass at
``max_num_batched_tokens`` measures the peak memory of a full step, and what is
left of the budget becomes the KV cache, which fixes how many requests fit at
once (chapter 2). This walkthrough shows:

1. each construction step, timed, on a real engine;
2. the memory breakdown the engine kept (``engine_core.memory_report``);
3. how the knob that sets the budget changes the block count and concurrency
   -- computed with the engine's own sizing functions, and checked once
   against a second real engine;
4. the error a budget too small for one ``max_model_len`` request gets.

    python -m chapters.ch06_construction [--model DIR] [--max-model-len N]
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from chapters._common import base_parser, console, construction_table, timed
from nanoengine import LLM
from nanoengine.core.kv_cache_sizing import get_kv_cache_config, max_concurrency
from nanoengine.utils.mem_utils import format_bytes
from nanoengine.worker.memory_report import MemoryReport, memory_table
from nanoengine.worker.worker import available_ram_bytes

CPU_FRACTIONS = (0.01, 0.05, 0.1, 0.2)
GPU_UTILIZATIONS = (0.5, 0.7, 0.9)
H200_BYTES = 141 * 10**9  # an H200's memory, for the what-if table


@dataclass
class Ch06Result:
    timings: dict[str, float]
    num_blocks: int
    max_concurrency: float
    # (knob value, KV bytes, blocks, concurrency) for each CPU fraction tried
    cpu_rows: list[tuple[float, int, int, float]]
    rebuilt_blocks: int  # blocks of a second engine built with one of those budgets
    predicted_blocks: int  # what the table predicted for it
    too_small_message: str


def _report(llm: LLM) -> MemoryReport:
    report = llm.llm_engine.engine_core.get_engine_core().memory_report
    if report is None:
        raise RuntimeError("the engine kept no memory report")
    return report


def cpu_knob_rows(report: MemoryReport, max_model_len: int) -> list[tuple[float, int, int, float]]:
    """The CPU budget for each ``cpu_kv_cache_fraction``, through the engine's sizing code."""
    spec = report.kv_cache_config.spec
    available = available_ram_bytes()
    rows = []
    for fraction in CPU_FRACTIONS:
        budget = min(int(available * fraction), 4 << 30)  # the default cpu_kv_cache_max_bytes cap
        config = get_kv_cache_config(spec, budget, max_model_len)
        rows.append((fraction, budget, config.num_blocks, max_concurrency(config, max_model_len)))
    return rows


def knob_table(rows: list[tuple[float, int, int, float]], max_model_len: int) -> Table:
    table = Table(title=f"cpu_kv_cache_fraction of {format_bytes(available_ram_bytes())} available RAM")
    for column in ("fraction", "KV budget", "blocks", f"requests of {max_model_len} tokens at once"):
        table.add_column(column, justify="right")
    for fraction, budget, blocks, concurrency in rows:
        table.add_row(f"{fraction:.2f}", format_bytes(budget), str(blocks), f"{concurrency:.1f}")
    return table


def gpu_what_if_table(report: MemoryReport, max_model_len: int) -> Table:
    """The GPU rule on an H200, with this model's weights and measured activations."""
    profile, spec = report.profile, report.kv_cache_config.spec
    table = Table(title="What-if: gpu_memory_utilization on a 141 GB H200 (this profile's numbers)")
    for column in ("utilization", "engine budget", "KV cache", "blocks", f"requests of {max_model_len}"):
        table.add_column(column, justify="right")
    for utilization in GPU_UTILIZATIONS:
        allowed = int(H200_BYTES * utilization)
        kv_bytes = max(allowed - profile.weights_bytes - profile.peak_activation_bytes, 0)
        config = get_kv_cache_config(spec, kv_bytes, max_model_len)
        table.add_row(
            f"{utilization:.1f}",
            format_bytes(allowed),
            format_bytes(kv_bytes),
            str(config.num_blocks),
            f"{max_concurrency(config, max_model_len):.0f}",
        )
    table.caption = "KV = utilization x total - weights - peak activations (- non-torch memory on a real GPU)"
    return table


def main(argv: list[str] | None = None) -> Ch06Result:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    engine_kwargs = {"max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens}

    llm, seconds = timed(lambda: LLM(args.model, **engine_kwargs))
    console.rule("1. LLM(...) construction, step by step")
    console.print(construction_table(llm))
    console.print(f"LLM(...) took {seconds:.2f} s in all (tokenizer and config reading included)")

    console.rule("2. The memory breakdown determine_available_memory measured")
    report = _report(llm)
    console.print(memory_table(report))

    console.rule("3. The budget knob -> blocks -> concurrency")
    rows = cpu_knob_rows(report, args.max_model_len)
    console.print(knob_table(rows, args.max_model_len))
    console.print(gpu_what_if_table(report, args.max_model_len))
    # Check the table against reality: a second engine with an explicit budget.
    _, budget, predicted, _ = rows[0]
    second = LLM(args.model, kv_cache_memory_bytes=budget, **engine_kwargs)
    rebuilt = _report(second).num_blocks
    console.print(f"a real engine with kv_cache_memory_bytes={budget}: {rebuilt} blocks (table: {predicted})")

    console.rule("4. A budget too small for one max_model_len request")
    try:
        LLM(args.model, kv_cache_memory_bytes=report.kv_cache_config.spec.page_size_bytes, **engine_kwargs)
        message = ""
    except ValueError as error:
        message = str(error)
        console.print(f"[red]ValueError[/red]: {message}")
    return Ch06Result(
        timings=dict(llm.llm_engine.engine_core.get_engine_core().startup_timings),
        num_blocks=report.num_blocks,
        max_concurrency=report.max_concurrency,
        cpu_rows=rows,
        rebuilt_blocks=rebuilt,
        predicted_blocks=predicted,
        too_small_message=message,
    )


if __name__ == "__main__":
    main()
