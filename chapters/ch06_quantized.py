"""Chapter 6 -- one model loaded three ways (float32, bf16, GGUF blocks): what each keeps, how fast each runs.

The prepared SmolLM2 folder holds the same weights twice: ``model.safetensors``
(the Q4_1 values made float32) and the ``.gguf`` they came from. So
``LLM(...)`` can build the same model three ways, and the differences are the
ways' alone:

* ``dtype="float32"``: 4 bytes a weight, the reference;
* ``dtype="bfloat16"``: 2 bytes a weight, where the CPU multiplies bf16 fast
  (avx512_bf16 or AMX; elsewhere a bf16 product widens to fp32 first and is
  slower, so the walkthrough says so and skips it);
* ``quantization="gguf"``: the file's blocks kept as they are, about 5 bits a
  weight (chapter 2's GGUF section has the formats and kernels); where bf16 is
  fast, a fourth row keeps the blocks and runs the rest in bf16 (what
  ``dtype="auto"`` gives there): the decode GEMV is the same, the prefill's
  dequantized weights go through a bf16 matmul.

For each it prints how long ``init_device + load_model`` took, the bytes of weights the
engine keeps, batch-1 decode and prefill tokens/s (medians), and whether its
greedy tokens are float32's. Then the quantized engine's weights, counted by
kind (layer matrices, embedding, LM head, norms) and by format: the memory
breakdown of a quantized model. One engine at a time: a second engine alive
in the process would slow the first (chapter 7, OpenMP pools).

    python -m chapters.ch06_quantized [--model NAME] [--tokens N]

vLLM 0.32 counterpart: none (vLLM logs "Model loading took ... GiB" per
engine, ``vllm/v1/worker/gpu_model_runner.py``; it has no side-by-side).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from chapters._common import DEFAULT_MODEL, base_parser, console, engine_parts
from nanoengine import LLM, SamplingParams
from nanoengine.inputs import TokensPrompt
from nanoengine.instruments.step_timing import time_construction
from nanoengine.platforms.cpu import cpu_bf16_features
from nanoengine.transformers_utils.config import resolve_model_path
from nanoengine.utils.mem_utils import format_bytes

PREFILL_TOKENS = 256
REPEATS = 3


@dataclass
class Way:
    """One way of loading the model, measured; ``skipped`` says why it was not, when it was not."""

    name: str
    load_seconds: float = 0.0
    weights_bytes: int = 0
    decode_tokens_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    tokens: tuple[int, ...] = ()
    skipped: str = ""


@dataclass
class WeightGroup:
    """Weights of one kind kept in one storage: how many numbers, and their bytes."""

    kind: str  # "layer matrices", "embedding", "LM head", "norms"
    storage: str  # "Q4_1 blocks", "float32", ...
    numbers: int
    bytes: int


@dataclass
class Ch06QuantizedResult:
    ways: list[Way]
    groups: list[WeightGroup]  # the GGUF engine's weights


def median_seconds(llm: LLM, prompt: list[int], params: SamplingParams) -> float:
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(way: Way, llm: LLM, tokens: int, load_seconds: float) -> None:
    """Fill ``way`` from a built engine: its weights, its speeds, its greedy tokens."""
    _, runner = engine_parts(llm)
    vocab = llm.llm_engine.engine_config.model_config.hf_config.vocab_size
    prompt = [(31 * j) % (vocab - 400) + 300 for j in range(PREFILL_TOKENS)]  # ordinary token ids
    decode = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    way.load_seconds = load_seconds
    way.weights_bytes = runner.weights_bytes()
    way.decode_tokens_per_s = tokens / median_seconds(llm, prompt[:8], decode)
    way.prefill_tokens_per_s = PREFILL_TOKENS / median_seconds(llm, prompt, SamplingParams(max_tokens=1))
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt[:8])], decode, use_tqdm=False)
    way.tokens = tuple(out[0].outputs[0].token_ids)


def weight_groups(llm: LLM) -> list[WeightGroup]:
    """The engine's parameters (a shared one once), by kind and by how they are stored."""
    _, runner = engine_parts(llm)
    model = runner.get_model()
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        method = getattr(module, "quant_method", None)
        qtype = getattr(method, "qtype", None)
        storage = f"{qtype.name} blocks" if qtype is not None else str(param.dtype).removeprefix("torch.")
        numbers = getattr(method, "cols", 0) * param.shape[0] if qtype is not None else param.numel()
        kind = ("embedding" if "embed_tokens" in name else "LM head" if "lm_head" in name
                else "norms" if param.dim() == 1 else "layer matrices")
        totals[kind, storage][0] += numbers
        totals[kind, storage][1] += param.numel() * param.element_size()
    return [WeightGroup(kind, storage, n, b) for (kind, storage), (n, b) in sorted(totals.items())]


def build(name: str, model: str, tokens: int, dtype: str, quantization: str | None = None) -> tuple[Way, LLM]:
    with time_construction() as steps:
        llm = LLM(model, dtype=dtype, quantization=quantization, max_model_len=512, enable_prefix_caching=False)
    way = Way(name)
    measure(way, llm, tokens, steps["init_device + load_model"])
    return way, llm


def run(model: str, tokens: int) -> Ch06QuantizedResult:
    has_floats = any(Path(resolve_model_path(model)).glob("*.safetensors"))
    features = cpu_bf16_features()
    ways: list[Way] = []
    for name, dtype in (("float32", "float32"), ("bfloat16", "bfloat16")):
        if not has_floats:
            ways.append(Way(name, skipped="the folder has no float checkpoint, only its GGUF"))
        elif dtype == "bfloat16" and not features.fast_bf16:
            ways.append(Way(name, skipped=f"this CPU has {features.describe()}: a bf16 product widens to fp32"))
        else:
            way, llm = build(name, model, tokens, dtype)
            ways.append(way)
            del llm
            gc.collect()  # one engine at a time
    if features.fast_bf16:
        way, llm = build("GGUF blocks, bf16 around", model, tokens, "bfloat16", quantization="gguf")
        ways.append(way)
        del llm
        gc.collect()
    way, llm = build("GGUF blocks", model, tokens, "float32", quantization="gguf")
    ways.append(way)
    groups = weight_groups(llm)
    return Ch06QuantizedResult(ways, groups)


def ways_table(ways: list[Way]) -> Table:
    reference = ways[0].tokens
    table = Table(title="the same model, each way (batch-1 decode, one prompt; prefill of "
                        f"{PREFILL_TOKENS} tokens; medians of {REPEATS})")
    for column in ("way", "load s", "weights", "decode tok/s", "prefill tok/s", "greedy = float32's"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for way in ways:
        if way.skipped:
            table.add_row(way.name, "-", "-", "-", "-", f"skipped: {way.skipped}")
            continue
        same = "-" if not reference else "yes" if way.tokens == reference else next(
            f"from token {i}" for i, (a, b) in enumerate(zip(way.tokens, reference)) if a != b)
        table.add_row(way.name, f"{way.load_seconds:.2f}", format_bytes(way.weights_bytes),
                      f"{way.decode_tokens_per_s:.1f}", f"{way.prefill_tokens_per_s:.1f}", same)
    return table


def groups_table(groups: list[WeightGroup]) -> Table:
    table = Table(title="the GGUF engine's weights: what a quantized model keeps")
    for column in ("kind", "kept as", "numbers", "bytes", "bits a number", "as float32"):
        table.add_column(column, justify="left" if column in ("kind", "kept as") else "right")
    for group in groups:
        table.add_row(group.kind, group.storage, f"{group.numbers:,}", format_bytes(group.bytes),
                      f"{group.bytes * 8 / group.numbers:.2f}", format_bytes(4 * group.numbers))
    total_bytes, total_numbers = sum(g.bytes for g in groups), sum(g.numbers for g in groups)
    table.add_row("all", "", f"{total_numbers:,}", format_bytes(total_bytes),
                  f"{total_bytes * 8 / total_numbers:.2f}", format_bytes(4 * total_numbers))
    return table


def main(argv: list[str] | None = None) -> Ch06QuantizedResult:
    parser = base_parser(__doc__ or "", __name__)
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the batch-1 decode")
    args = parser.parse_args(argv)
    console.rule("1. One model, three ways: load, weights, speed")
    result = run(args.model or DEFAULT_MODEL, args.tokens)
    console.print(ways_table(result.ways))
    console.rule("2. The quantized model's memory, by kind and format")
    console.print(groups_table(result.groups))
    console.note(
        "A tied LM head multiplies by the embedding's blocks: it keeps no copy of its own here, where the "
        "float32 engine keeps a packed one for the CPU matmul (chapter 7), the difference between its weights "
        "and the 'as float32' total.",
        "绑定的 LM head 直接拿 embedding 的 block 相乘：这里它没有自己的副本；float32 引擎则为 CPU 上的矩阵乘法"
        "另存一份打包过的副本（第 7 章），那正是它的权重和「as float32」合计之差。",
    )
    return result


if __name__ == "__main__":
    main()
