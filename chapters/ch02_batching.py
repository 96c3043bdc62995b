"""Chapter 2 -- batch size: why serving many requests at once is (almost) free, until it isn't.

A decode step reads every weight once, whatever the batch size, and does
2 FLOPs per weight *per request*. So the cost of a step is the larger of
"read the weights" (memory-bound, flat in the batch size) and "do the math"
(compute-bound, linear in it). This walkthrough measures, on a real engine:

1. per-step decode latency and decode throughput for a ladder of batch sizes
   (a plot too, if matplotlib is installed);
2. the machine's limits -- the GEMM roofline in fp32 and in bf16, side by
   side, and the copy bandwidth -- and from them the batch size where decode
   turns from memory-bound into compute-bound, here in each dtype and on an
   H200 in bf16 (from its data-sheet figures);
3. the share of the GEMM roofline (in the engine's dtype) each batch size reaches.

The largest batch the KV cache can hold is chapter 6's result
(``engine_core.memory_report.max_concurrency``).

    python -m chapters.ch02_batching [--model DIR] [--batch-sizes 1,4,16,32] [--plot out.png]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from rich.table import Table

from chapters._common import base_parser, console
from chapters.roofline_math import (
    Roofline,
    attention_flops,
    describe_matmul_paths,
    matmul_flops_per_token,
    measure_gemm_roofline,
    measure_memory_bandwidth,
)
from nanoengine import LLM, SamplingParams
from nanoengine.platforms.cpu import cpu_bf16_features
from nanoengine.renderers.hf import TokensPrompt

# The two dtypes whose rooflines are measured, and what one weight costs to read in each.
BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2}
# H200 data-sheet figures: dense bf16 tensor-core FLOP/s and HBM3e bandwidth.
H200_BF16_FLOPS = 989e12
H200_BYTES_PER_S = 4.8e12


@dataclass
class BatchPoint:
    batch_size: int
    step_ms: float  # median decode step
    tok_per_s: float  # batch_size / step time
    gflops: float  # model FLOP/s achieved, in GFLOP/s


@dataclass
class Ch02Result:
    points: list[BatchPoint]
    roofline: Roofline  # in the engine's dtype: what the shares are taken against
    rooflines: dict[str, Roofline]  # "float32" and "bfloat16", measured side by side
    bandwidth_gb_s: float
    dtype: str  # the engine's dtype ("auto" resolved)
    cpu_crossover_batch: dict[str, float]  # by dtype: batch where decode becomes compute-bound here
    gpu_crossover_batch: float  # the same for bf16 on an H200
    plot_path: str | None


def measure_decode(llm: LLM, batch_size: int, prompt_len: int, steps: int) -> float:
    """Median seconds of a decode step with ``batch_size`` requests running."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch_size):
        # Distinct prompts: the prefix cache must not turn the batch into one request.
        prompt: TokensPrompt = {"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(prompt_len)]}
        engine.add_rendered_request(f"b{batch_size}-{i}", engine.renderer.render_prompt(prompt), params)
    durations: list[float] = []
    while engine.has_unfinished_requests():
        core = engine.engine_core.get_engine_core()
        running = len(core.scheduler.running)
        start = time.perf_counter()
        engine.step()
        # Only full decode steps: every request in, none prefilling.
        if running == batch_size and core.scheduler.running and not core.scheduler.waiting:
            durations.append(time.perf_counter() - start)
    return statistics.median(durations[1:] or durations)


def crossover_batch(flops_per_s: float, bytes_per_s: float, bytes_per_weight: int) -> float:
    """Batch size where a decode step's math time equals its weight-reading time.

    Per weight: ``bytes_per_weight`` bytes read once, 2 FLOPs per request. So
    math/memory = (2 b / flops) / (bytes_per_weight / bandwidth) = 1 at
    b = flops * bytes_per_weight / (2 * bandwidth).
    """
    return flops_per_s * bytes_per_weight / (2 * bytes_per_s)


def points_table(points: list[BatchPoint], roofline: Roofline) -> Table:
    table = Table(title="Decode step vs batch size (measured)")
    for column in ("batch", "step ms", "decode tok/s", "model GFLOP/s", "roofline share"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(
            str(p.batch_size), f"{p.step_ms:.1f}", f"{p.tok_per_s:.1f}", f"{p.gflops:.1f}",
            f"{p.gflops / roofline.gflops:.0%}",
        )
    return table


def save_plot(points: list[BatchPoint], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("matplotlib is not installed (pip install -e '.[plot]'): no plot")
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = [p.batch_size for p in points]
    left.plot(sizes, [p.step_ms for p in points], marker="o")
    left.set(xlabel="batch size", ylabel="decode step (ms)", title="latency per step")
    right.plot(sizes, [p.tok_per_s for p in points], marker="o")
    right.set(xlabel="batch size", ylabel="tokens / s", title="decode throughput")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Ch02Result:
    parser = base_parser(__doc__ or "")
    parser.add_argument("--batch-sizes", default="1,4,16,32", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured per batch size")
    parser.add_argument("--plot", default=None, help="write the latency/throughput plot here (PNG)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]

    console.rule("1. The machine's limits")
    rooflines = {dtype: measure_gemm_roofline(dtype=dtype) for dtype in BYTES_PER_WEIGHT}
    bandwidth = measure_memory_bandwidth()
    for dtype, measured in rooflines.items():
        console.print(f"{dtype} GEMM roofline {measured.gflops:.1f} GFLOP/s ({describe_matmul_paths(measured)})")
    console.print(f"copy bandwidth {bandwidth:.1f} GB/s; this CPU has {cpu_bf16_features().describe()}")

    llm = LLM(args.model, max_num_seqs=max(sizes), max_model_len=args.prompt_len + args.steps + 8,
              enable_prefix_caching=False)
    model_config = llm.llm_engine.engine_config.model_config
    hf_config, dtype = model_config.hf_config, model_config.dtype
    roofline = rooflines[dtype]
    console.print(f"the engine runs in {dtype} (dtype='auto'): shares below are of the {dtype} roofline")
    console.rule("2. Decode latency and throughput vs batch size")
    points = []
    for size in sizes:
        seconds = measure_decode(llm, size, args.prompt_len, args.steps)
        context = args.prompt_len + args.steps / 2
        flops = size * (matmul_flops_per_token(hf_config) + attention_flops(hf_config, context))
        points.append(BatchPoint(size, seconds * 1e3, size / seconds, flops / seconds / 1e9))
    console.print(points_table(points, roofline))
    plot = save_plot(points, args.plot) if args.plot else None

    console.rule("3. Memory-bound or compute-bound?")
    cpu_cross = {
        name: crossover_batch(measured.gflops * 1e9, bandwidth * 1e9, BYTES_PER_WEIGHT[name])
        for name, measured in rooflines.items()
    }
    gpu_cross = crossover_batch(H200_BF16_FLOPS, H200_BYTES_PER_S, 2)
    here = "; ".join(
        f"{name} ({BYTES_PER_WEIGHT[name]} bytes/weight) at batch ~{cross:.0f}" for name, cross in cpu_cross.items()
    )
    console.print(
        f"Here, reading the weights costs as much as the math: {here}. Above that a decode step is "
        f"compute-bound: its time grows with the batch and tok/s flattens near the GEMM roofline. bf16 "
        f"halves the bytes per weight and, with bf16 dot products, raises the roofline, so both limits move.\n"
        f"H200 (bf16, 2 bytes/weight, {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s, {H200_BYTES_PER_S / 1e12:.1f} TB/s): "
        f"the crossover is at batch ~{gpu_cross:.0f}. Below it a decode step costs about the same "
        "for 1 request or 100 -- memory-bound -- so batching is nearly free throughput, and the KV "
        "cache size (chapter 6) is what limits it."
    )
    return Ch02Result(points, roofline, rooflines, bandwidth, dtype, cpu_cross, gpu_cross, plot)


if __name__ == "__main__":
    main()
