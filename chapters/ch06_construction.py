"""Chapter 6 -- what ``LLM(...)`` does before the first token: construction, timed.

``LLM(...)`` ends in the worker's four steps, ``init_device`` -> ``load_model``
-> ``determine_available_memory`` -> ``initialize_from_config`` (then
``compile_or_warm_up_model``, which captures CUDA graphs on a GPU). The third is
the one that matters for serving: a profiling forward pass at
``max_num_batched_tokens`` measures the peak memory of a full step, and what is
left of the budget becomes the KV cache, which fixes how many requests fit at
once (chapter 2). This walkthrough shows:

1. each construction step, timed, on a real engine;
2. the memory breakdown, from what the engine measured (``memory_report_of``);
3. the dtype: which one ``dtype="auto"`` picked on this CPU and why, and fp32
   against bf16 side by side -- weights, KV bytes per token and per block, and
   the blocks, tokens and concurrency each buys at this engine's KV budget (the
   engine's own dtype measured, the other computed from its parameter count and
   its KV spec, with no second engine);
4. how the knob that sets the budget changes the block count and concurrency
   -- computed with the engine's own sizing functions, and checked once
   against a second real engine;
5. the error a budget too small for one ``max_model_len`` request gets.

    python -m chapters.ch06_construction [--model DIR] [--max-model-len N] [--dtype D]

With ``--tensor-parallel-size N`` (N > 1) it runs chapter 6's
tensor-parallelism part instead: the executor, the N worker processes, each
rank's weight slices and the collectives of every step
(``chapters/ch06_tensor_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from rich.table import Table

from chapters._common import DEFAULT_MODEL, base_parser, console, construction_table, timed
from chapters.ch06_tensor_parallel import TensorParallelResult
from chapters.ch06_tensor_parallel import run as run_tensor_parallel
from nanoengine import LLM
from nanoengine.core.kv_cache_sizing import get_kv_cache_config, max_concurrency, num_blocks_from_budget
from nanoengine.engine.arg_utils import resolve_dtype
from nanoengine.instruments.memory_report import MemoryReport, memory_report_of, memory_table
from nanoengine.instruments.step_timing import time_construction
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.platforms.cpu import cpu_bf16_features
from nanoengine.utils.mem_utils import format_bytes
from nanoengine.worker.worker import available_ram_bytes

CPU_FRACTIONS = (0.01, 0.05, 0.1, 0.2)
GPU_UTILIZATIONS = (0.5, 0.7, 0.9)
H200_BYTES = 141 * 10**9  # an H200's memory, for the what-if table
COMPARED_DTYPES = ("float32", "bfloat16")


@dataclass
class DtypeRow:
    """One dtype's memory: its weights, and what the engine's KV budget buys in it."""

    dtype: str
    element_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int
    token_capacity: int  # tokens of KV the blocks hold, the null block left out
    max_concurrency: float
    measured: bool  # the engine's own dtype (measured), else computed


@dataclass
class Ch06Result:
    timings: dict[str, float]
    num_blocks: int
    max_concurrency: float
    device: str
    engine_dtype: str  # what dtype= resolved to ("auto" -> bfloat16 or float32 on a CPU)
    dtype_rows: list[DtypeRow]  # fp32 then bf16, at this engine's KV budget
    kv_budget_bytes: int  # that budget
    # (knob value, KV bytes, blocks, concurrency) for each CPU fraction tried
    cpu_rows: list[tuple[float, int, int, float]]
    rebuilt_blocks: int  # blocks of a second engine built with one of those budgets
    predicted_blocks: int  # what the table predicted for it
    too_small_message: str


def _report(llm: LLM) -> MemoryReport:
    report = memory_report_of(llm.llm_engine.engine_core.get_engine_core())
    if report is None:
        raise RuntimeError("the engine kept no memory report")
    return report


def auto_dtype_reason(device: str) -> str:
    """What ``dtype="auto"`` becomes on this device, and the hardware fact that decides it."""
    if device != "cpu":
        return f'dtype="auto" on {device} -> {resolve_dtype("auto", device)}'
    features = cpu_bf16_features()
    why = "bf16 matmuls run fast here" if features.fast_bf16 else "a bf16 matmul would widen to fp32 first: slower"
    return f'dtype="auto" on this CPU -> {resolve_dtype("auto", device)}: the CPU has {features.describe()} ({why})'


def dtype_rows(llm: LLM, report: MemoryReport, max_model_len: int) -> list[DtypeRow]:
    """fp32 and bf16 at the KV budget this engine got.

    The engine's own dtype is measured: the weights it holds, the blocks it
    allocated. The other is computed with the same objects at another element
    size: the weight bytes scaled by the element size (the same tensors,
    including any packed copy such as a tied LM head's), and the KV spec with
    ``dtype_size`` swapped, through the block division the engine itself uses.
    """
    engine_dtype = llm.llm_engine.engine_config.model_config.dtype
    engine_element_bytes = torch.tensor([], dtype=getattr(torch, engine_dtype)).element_size()
    budget = report.profile.kv_cache_bytes
    rows = []
    for dtype in COMPARED_DTYPES:
        element_bytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
        measured = dtype == engine_dtype
        spec = replace(report.kv_cache_config.spec, dtype_size=element_bytes)
        config = report.kv_cache_config if measured else KVCacheConfig(num_blocks_from_budget(budget, spec), spec)
        rows.append(
            DtypeRow(
                dtype=dtype,
                element_bytes=element_bytes,
                weights_bytes=report.profile.weights_bytes * element_bytes // engine_element_bytes,
                kv_bytes_per_token=spec.page_size_bytes // spec.block_size,
                kv_bytes_per_block=spec.page_size_bytes,
                num_blocks=config.num_blocks,
                token_capacity=(config.num_blocks - 1) * spec.block_size,  # minus the null block
                max_concurrency=max_concurrency(config, max_model_len),
                measured=measured,
            )
        )
    return rows


def dtype_table(rows: list[DtypeRow], budget: int, max_model_len: int, auto_choice: str) -> Table:
    """The rows side by side; "(auto)" marks the dtype ``dtype="auto"`` picks here."""
    table = Table(title=f"fp32 against bf16 at this engine's KV budget of {format_bytes(budget)}")
    columns = ("dtype", "bytes/number", "weights", "KV/token", "KV/block", "blocks", "tokens",
               f"requests of {max_model_len} at once", "how")
    for column in columns:
        table.add_column(column, justify="left" if column in ("dtype", "how") else "right")
    for row in rows:
        table.add_row(
            row.dtype + (" (auto)" if row.dtype == auto_choice else ""),
            str(row.element_bytes),
            format_bytes(row.weights_bytes),
            format_bytes(row.kv_bytes_per_token),
            format_bytes(row.kv_bytes_per_block),
            str(row.num_blocks),
            str(row.token_capacity),
            f"{row.max_concurrency:.1f}",
            "measured" if row.measured else "computed",
        )
    table.caption = (
        "measured: this engine's weights and blocks. computed: its parameter count and KV spec at the other "
        "bytes/number.\ntokens = (blocks - 1, the null block) x block size."
    )
    return table


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


def main(argv: list[str] | None = None) -> Ch06Result | TensorParallelResult:
    parser = base_parser(__doc__ or "", __name__)
    # None: 2048 for construction, 256 for the tensor-parallel walkthrough, whose
    # prompts are short and whose N ranks each run the profiling pass of a whole budget.
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="auto", choices=("auto", *COMPARED_DTYPES))
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="N > 1: the tensor-parallelism walkthrough on N worker processes")
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                        help="who starts the N workers (default: vLLM's rule, 'mp' on one machine)")
    args = parser.parse_args(argv)
    default_length = 2048 if args.tensor_parallel_size == 1 else 256
    args.max_model_len = args.max_model_len or default_length
    args.max_num_batched_tokens = args.max_num_batched_tokens or default_length
    engine_kwargs = {
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "dtype": args.dtype,
    }
    if args.tensor_parallel_size > 1:
        return run_tensor_parallel(args.model, args.tensor_parallel_size, args.distributed_executor_backend,
                                   args.max_tokens, engine_kwargs, DEFAULT_MODEL)

    with time_construction() as steps:
        llm, seconds = timed(lambda: LLM(args.model, **engine_kwargs))
    console.rule("1. LLM(...) construction, step by step")
    console.print(construction_table(llm, steps))
    console.print(f"LLM(...) took {seconds:.2f} s in all (tokenizer and config reading included)")

    console.rule("2. The memory breakdown determine_available_memory measured")
    report = _report(llm)
    console.print(memory_table(report))

    console.rule("3. The dtype: what auto picked, and what fp32 and bf16 cost")
    device = llm.llm_engine.engine_config.device_config.device
    console.print(auto_dtype_reason(device))
    console.print(f"this engine: dtype={args.dtype!r} -> {llm.llm_engine.engine_config.model_config.dtype}")
    rows_by_dtype = dtype_rows(llm, report, args.max_model_len)
    console.print(dtype_table(rows_by_dtype, report.profile.kv_cache_bytes, args.max_model_len, resolve_dtype("auto", device)))

    console.rule("4. The budget knob -> blocks -> concurrency")
    rows = cpu_knob_rows(report, args.max_model_len)
    console.print(knob_table(rows, args.max_model_len))
    console.print(gpu_what_if_table(report, args.max_model_len))
    # Check the table against reality: a second engine with an explicit budget.
    _, budget, predicted, _ = rows[0]
    second = LLM(args.model, kv_cache_memory_bytes=budget, **engine_kwargs)
    rebuilt = _report(second).num_blocks
    console.print(f"a real engine with kv_cache_memory_bytes={budget}: {rebuilt} blocks (table: {predicted})")

    console.rule("5. A budget too small for one max_model_len request")
    try:
        LLM(args.model, kv_cache_memory_bytes=report.kv_cache_config.spec.page_size_bytes, **engine_kwargs)
        message = ""
    except ValueError as error:
        message = str(error)
        console.print(f"[red]ValueError[/red]: {message}")
    return Ch06Result(
        timings=dict(steps),
        num_blocks=report.num_blocks,
        max_concurrency=report.max_concurrency,
        device=device,
        engine_dtype=llm.llm_engine.engine_config.model_config.dtype,
        dtype_rows=rows_by_dtype,
        kv_budget_bytes=report.profile.kv_cache_bytes,
        cpu_rows=rows,
        rebuilt_blocks=rebuilt,
        predicted_blocks=predicted,
        too_small_message=message,
    )


if __name__ == "__main__":
    main()
