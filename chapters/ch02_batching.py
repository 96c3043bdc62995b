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
3. the share of the GEMM roofline (in the engine's dtype) each batch size reaches;
4. what bounds the batch from the memory side: KV bytes per token, and how
   many requests of 4k and of 32k tokens fit in 8 GiB of KV cache, for the
   hybrid Qwen3.5-0.8B (18 Gated DeltaNet + 6 full-attention layers) against
   its Llama twin (the same sizes, every layer full attention) -- computed
   with the engine's own spec, grouping and sizing functions on weightless
   (meta-device) models.

The largest batch this engine's KV cache can hold is chapter 6's result
(``memory_report_of(engine_core).max_concurrency``, nanoengine/instruments/memory_report.py).

    python -m chapters.ch02_batching [--model DIR] [--batch-sizes 1,4,16,32] [--plot out.png]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from rich.table import Table
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

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
from nanoengine.config import ModelConfig
from nanoengine.core.kv_cache_groups import group_kv_cache_layers
from nanoengine.core.kv_cache_sizing import as_layout, get_kv_cache_config, max_concurrency
from nanoengine.kv_cache_interface import FullAttentionSpec
from nanoengine.platforms.cpu import cpu_bf16_features
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.transformers_utils.dummy_configs import BUILTIN_CONFIGS
from nanoengine.utils.mem_utils import format_bytes
from nanoengine.worker.kv_cache_spec import kv_cache_spec, meta_model

# The two dtypes whose rooflines are measured, and what one weight costs to read in each.
BYTES_PER_WEIGHT = {"float32": 4, "bfloat16": 2}
# H200 data-sheet figures: dense bf16 tensor-core FLOP/s and HBM3e bandwidth.
H200_BF16_FLOPS = 989e12
H200_BYTES_PER_S = 4.8e12
# Section 4: the notes' hybrid model, and its Llama twin, which copies these
# keys of its config -- every size but the layer mix.
HYBRID_MODEL = "Qwen/Qwen3.5-0.8B"
TWIN_KEYS = (
    "hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings",
)
KV_BUDGET_BYTES = 8 << 30  # a round 8 GiB of KV cache, the same for both models
CONTEXT_LENGTHS = (4096, 32768)  # max_model_len of the two concurrency columns


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
    layer_mix: list[LayerMixRow]  # Llama twin, then Qwen3.5-0.8B, in the engine's dtype


@dataclass
class LayerMixRow:
    """One model's KV cache, from its spec: per token, per request, and what a budget holds."""

    model: str
    num_parameters: int  # a tied embedding counted once
    num_attention_layers: int  # full attention: K and V of every token
    num_state_layers: int  # Gated DeltaNet: one fixed-size state per request
    kv_bytes_per_token: int  # K and V of one token in all full-attention layers
    state_bytes: int  # one request's states in all state layers, unpadded (0: none)
    num_state_blocks: int  # blocks a request holds for its states, whatever its length: one per state group
    state_bytes_held: int  # what those blocks take in the pool, each padded to a page
    block_size: int  # tokens per attention block once the groups agree on one
    num_blocks: int  # blocks the budget buys
    blocks_per_request: dict[int, int]  # max_model_len -> blocks one such request holds, state blocks included
    concurrency: dict[int, float]  # max_model_len -> requests of that length at once


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


def hybrid_config() -> PretrainedConfig:
    """Qwen3.5-0.8B's text config, as nanoengine ships it for ``load_format="dummy"``."""
    config = dict(BUILTIN_CONFIGS[HYBRID_MODEL].config)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def llama_twin_config(hybrid: PretrainedConfig) -> LlamaConfig:
    """A Llama with the hybrid's sizes (``TWIN_KEYS``) whose every layer is full attention."""
    return LlamaConfig(architectures=["LlamaForCausalLM"], **{key: getattr(hybrid, key) for key in TWIN_KEYS})


def layer_mix_row(name: str, hf_config: PretrainedConfig, dtype: str, block_size: int, budget: int) -> LayerMixRow:
    """The KV cache of ``hf_config`` through the engine's own steps, without weights.

    The worker's spec (``kv_cache_spec``) on a meta-device model, the core's
    grouping (one group for a plain model, unified pages for a hybrid), and
    the block count and concurrency ``get_kv_cache_config`` and
    ``max_concurrency`` give at ``budget`` bytes. A state block stands for
    ``max_model_len`` tokens, so the spec is asked again for each length.
    """
    torch_dtype = getattr(torch, dtype)
    model = meta_model(hf_config, torch_dtype)
    blocks_per_request, concurrency = {}, {}
    for max_model_len in CONTEXT_LENGTHS:
        model_config = ModelConfig(model=name, model_path="", hf_config=hf_config, max_model_len=max_model_len,
                                   dtype=dtype)
        spec = kv_cache_spec(model, model_config, block_size, torch_dtype, max_model_len)
        layout = as_layout(spec) if isinstance(spec, FullAttentionSpec) else group_kv_cache_layers(spec)
        config = get_kv_cache_config(layout, budget, max_model_len)
        blocks_per_request[max_model_len] = config.num_blocks_for(max_model_len)
        concurrency[max_model_len] = max_concurrency(config, max_model_len)
    # Pages, block size and block count do not depend on the length: the last loop's serve for all.
    attention = layout.attention_spec
    num_state_layers = len(model_config.layer_types) - attention.num_layers
    return LayerMixRow(
        model=name,
        num_parameters=sum(p.numel() for p in model.parameters()),
        num_attention_layers=attention.num_layers,
        num_state_layers=num_state_layers,
        kv_bytes_per_token=attention.page_size_bytes // attention.block_size,
        state_bytes=layout.state_bytes * num_state_layers,
        num_state_blocks=layout.num_state_groups,
        state_bytes_held=layout.num_state_groups * layout.page_size_bytes,
        block_size=layout.block_size,
        num_blocks=config.num_blocks,
        blocks_per_request=blocks_per_request,
        concurrency=concurrency,
    )


def layer_mix_rows(dtype: str, block_size: int, budget: int = KV_BUDGET_BYTES) -> list[LayerMixRow]:
    """The Llama twin, then Qwen3.5-0.8B: same sizes, different layer mix."""
    hybrid = hybrid_config()
    return [
        layer_mix_row("Llama twin", llama_twin_config(hybrid), dtype, block_size, budget),
        layer_mix_row(HYBRID_MODEL.split("/")[-1], hybrid, dtype, block_size, budget),
    ]


def layer_mix_table(rows: list[LayerMixRow], dtype: str, budget: int) -> Table:
    """The rows, and a last row with the hybrid's concurrency over the twin's."""
    table = Table(title=f"KV cache of two models of one size: {format_bytes(budget)} of KV in {dtype}")
    lengths = [f"requests of {n} at once" for n in CONTEXT_LENGTHS]
    columns = ("model", "full + DeltaNet layers", "parameters", "KV/token", "state/request", "held as",
               "block size", "blocks", *lengths)
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in rows:
        table.add_row(
            row.model, f"{row.num_attention_layers} + {row.num_state_layers}", f"{row.num_parameters / 1e6:.0f} M",
            format_bytes(row.kv_bytes_per_token), format_bytes(row.state_bytes),
            format_bytes(row.state_bytes_held), str(row.block_size), str(row.num_blocks),
            *(f"{row.concurrency[n]:.1f}" for n in CONTEXT_LENGTHS),
        )
    twin, hybrid = rows
    ratios = (f"{hybrid.concurrency[n] / twin.concurrency[n]:.2f}x" for n in CONTEXT_LENGTHS)
    table.add_row("hybrid / Llama", "", "", f"{hybrid.kv_bytes_per_token / twin.kv_bytes_per_token:.2f}x",
                  "", "", "", "", *ratios)
    table.caption = (
        "KV/token: K and V of one token, all full-attention layers. state/request: the Gated DeltaNet states "
        "(their shapes are assumed values of the built-in config); held as: the state blocks a request holds, "
        "each padded to an attention page.\nblocks and requests: get_kv_cache_config and max_concurrency, "
        "the null block left out."
    )
    return table


def layer_mix_summary(rows: list[LayerMixRow], requested_block_size: int) -> str:
    """Why the hybrid's advantage is below its per-token factor, and smaller at short context."""
    twin, hybrid = rows
    num_layers = hybrid.num_attention_layers + hybrid.num_state_layers
    held = " and ".join(f"{hybrid.blocks_per_request[n]} blocks at {n} tokens" for n in CONTEXT_LENGTHS)
    return (
        f"Only {hybrid.num_attention_layers} of the hybrid's {num_layers} layers keep K and V, so a token costs it "
        f"{twin.kv_bytes_per_token / hybrid.kv_bytes_per_token:.0f}x fewer bytes. But each of its requests also "
        f"holds {hybrid.num_state_blocks} state blocks however short it is ({format_bytes(hybrid.state_bytes)} of state, "
        f"padded to {format_bytes(hybrid.state_bytes_held)} so that each is a whole page), and its attention blocks "
        f"hold {hybrid.block_size} tokens (raised from {requested_block_size} so that a page holds a state), so "
        f"the last one is partly empty. A request holds {held}: the fixed cost weighs more at short context, and "
        "the advantage nears the per-token factor as the context grows."
    )


def main(argv: list[str] | None = None) -> Ch02Result:
    parser = base_parser(__doc__ or "", __name__)
    parser.add_argument("--batch-sizes", default="1,4,16,32", help="comma-separated decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured per batch size")
    parser.add_argument("--plot", default=None, help="write the latency/throughput plot here (PNG)")
    parser.add_argument("--roofline-size", type=int, default=2048,
                        help="side of the square matmuls that measure the roofline (smaller: faster, less exact)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",")]

    console.rule("1. The machine's limits")
    rooflines = {dtype: measure_gemm_roofline(args.roofline_size, dtype=dtype) for dtype in BYTES_PER_WEIGHT}
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

    console.rule("4. The memory bound: KV bytes per token, Llama against Qwen3.5")
    block_size = llm.llm_engine.engine_config.cache_config.block_size
    mix = layer_mix_rows(dtype, block_size)
    console.print(layer_mix_table(mix, dtype, KV_BUDGET_BYTES))
    console.print(layer_mix_summary(mix, block_size))
    return Ch02Result(points, roofline, rooflines, bandwidth, dtype, cpu_cross, gpu_cross, plot, mix)


if __name__ == "__main__":
    main()
