"""The CUDA checks of chapter 7 in one run: kernels, CUDA graphs, speed (needs a GPU).

Run through ``scripts/gpu_check.sh`` (``PYTHONPATH=. python scripts/gpu_check.py``).
Prints every figure, in this order:

1. Triton paged attention vs the torch reference (fp32 and bf16; a mixed batch
   of prefill chunks over cached blocks and decodes): max abs error;
2. for each model shape (random weights from a config, so nothing is
   downloaded): SmolLM2-135M and a 1B Llama --
   a. greedy tokens with CUDA graphs vs ``enforce_eager`` (must be equal),
   b. decode step latency at batch 1, graphs vs eager (engine step and the
      model forward alone), and the speed-up,
   c. throughput at batch 256 (256 prompts x 128 tokens, 128 new tokens each)
      vs HF ``generate`` on the same weights, bf16.

Targets from the issue: decode step at batch 1 <= 0.5 ms with graphs and >= 3x
eager; >= 20k tok/s at batch 256 on an H200 (SmolLM2-135M shape).
vLLM 0.32 counterpart: ``benchmarks/`` (``vllm bench latency`` / ``throughput``).
"""

from __future__ import annotations

import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from nanoengine import LLM, SamplingParams
from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl
from nanoengine.attention.backends.triton_attn import TritonAttentionImpl
from nanoengine.executor.uniproc_executor import UniProcExecutor
from nanoengine.instruments.memory_report import memory_report_of
from nanoengine.instruments.method_taps import tap
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.worker.input_batch import StepInputs

SHAPES: dict[str, dict[str, Any]] = {
    "SmolLM2-135M": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                         "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True},
    "Llama-1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
}


def kernel_errors() -> None:
    """Triton vs reference on a mixed batch: 2 decodes, a chunk over cache, a fresh prompt."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        heads, kv_heads, dim, block, num_blocks = 8, 2, 64, 16, 64
        cache = torch.randn(2, num_blocks, block, kv_heads, dim, device="cuda", dtype=dtype)
        computed, new = [40, 17, 33, 0], [1, 1, 20, 37]
        tables = torch.randperm(num_blocks - 1, device="cuda")[:4 * 5].view(4, 5).int() + 1
        qsl, seq_lens, slots = [0], [], []
        for row, (c, n) in enumerate(zip(computed, new)):
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            slots += [int(tables[row, p // block]) * block + p % block for p in range(c, c + n)]
        t = qsl[-1]
        md = AttentionMetadata(t, 4, 2, torch.tensor(qsl, device="cuda", dtype=torch.int32),
                               torch.tensor(seq_lens, device="cuda", dtype=torch.int32), tables,
                               torch.tensor(slots, device="cuda"), qsl, seq_lens)
        q = torch.randn(t, heads, dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(t, kv_heads, dim, device="cuda", dtype=dtype) for _ in range(2))
        for window in (None, 24):  # full attention, and a sliding window (chapter 4) shorter than most rows
            ref = TorchRefAttentionImpl().forward(q, k, v, cache.clone(), md, dim**-0.5, window)
            got = TritonAttentionImpl().forward(q, k, v, cache.clone(), md, dim**-0.5, window)
            error = (got.float() - ref.float()).abs().max().item()
            print(f"[kernel] {dtype}, sliding_window={window}: max |triton - reference| = {error:.3e}")


def make_model(name: str, root: Path) -> str:
    path = root / name
    # The tests' toy BPE tokenizer (imported by name: the tests are not a typed package).
    tokenizer = importlib.import_module("tests.tiny_models").train_tokenizer()
    config = LlamaConfig(**SHAPES[name], max_position_embeddings=4096, rms_norm_eps=1e-5,
                         bos_token_id=0, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def prompts(count: int, length: int, vocab: int) -> list[TokensPrompt]:
    generator = torch.Generator().manual_seed(count)
    return [{"prompt_token_ids": torch.randint(3, vocab, (length,), generator=generator).tolist()} for _ in range(count)]


def engine(path: str, eager: bool, max_num_seqs: int) -> LLM:
    return LLM(path, enforce_eager=eager, max_num_seqs=max_num_seqs, max_model_len=1024,
               gpu_memory_utilization=0.35, enable_prefix_caching=False)


def decode_latency(llm: LLM) -> tuple[float, float]:
    """(median engine step ms, median model-forward ms) of a batch-1 decode."""
    engine_ = llm.llm_engine
    executor = engine_.engine_core.get_engine_core().model_executor
    assert isinstance(executor, UniProcExecutor), "the check reads the worker in this process (one rank)"
    runner = executor.driver_worker.model_runner
    assert runner is not None  # the worker built it in init_device
    seen: list[StepInputs] = []  # every forward pass's inputs, read through a tap
    tap(runner, "_forward", before=lambda inputs, *_: seen.append(inputs))
    engine_.add_rendered_request("lat", engine_.renderer.render_prompt(prompts(1, 32, 300)[0]),
                                 SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False))
    steps: list[float] = []
    while engine_.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine_.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
    inputs = seen[-1]  # the last batch-1 decode step
    forward: list[float] = []
    for _ in range(50):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            runner._forward(inputs)
        torch.cuda.synchronize()
        forward.append(time.perf_counter() - start)
    return statistics.median(steps[2:]) * 1e3, statistics.median(forward[5:]) * 1e3


def check_shape(name: str, root: Path) -> None:
    path = make_model(name, root)
    vocab = SHAPES[name]["vocab_size"]
    batch = prompts(8, 40, vocab)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    results, latency = {}, {}
    for eager in (True, False):
        llm = engine(path, eager, 256)
        results[eager] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        latency[eager] = decode_latency(llm)
        if not eager:
            work = prompts(256, 128, vocab)
            llm.generate(work[:8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(work, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False), use_tqdm=False)
            torch.cuda.synchronize()
            ours = 256 * 128 / (time.perf_counter() - start)
            report = memory_report_of(llm.llm_engine.engine_core.get_engine_core())
            assert report is not None  # LLM(...) profiled memory while building the engine
            print(f"[{name}] memory: " + "; ".join(f"{item}={size}" for item, size, _ in report.rows()))
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(results[True], results[False]))
    print(f"[{name}] graphs vs eager greedy: {same}/{len(batch)} requests identical")
    (eager_step, eager_fwd), (graph_step, graph_fwd) = latency[True], latency[False]
    print(f"[{name}] batch-1 decode: engine step {graph_step:.3f} ms graphs vs {eager_step:.3f} ms eager "
          f"({eager_step / graph_step:.1f}x); forward {graph_fwd:.3f} ms vs {eager_fwd:.3f} ms ({eager_fwd / graph_fwd:.1f}x)")
    hf: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts(256, 128, vocab)], device="cuda")
    with torch.inference_mode():
        hf.generate(ids[:8], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
    theirs = 256 * 128 / (time.perf_counter() - start)
    print(f"[{name}] batch 256 x 128 new tokens: nanoengine {ours:.0f} tok/s, HF generate {theirs:.0f} tok/s "
          f"({ours / theirs:.1f}x)")
    del hf
    torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; skipped")
        return 0
    print(f"gpu_check on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    kernel_errors()
    with tempfile.TemporaryDirectory() as root:
        for name in SHAPES:
            check_shape(name, Path(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
