"""The chapter 2, 6 and 7 walkthroughs run end to end on a tiny model and show what they claim."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from chapters import ch02_batching, ch06_construction, ch07_generate
from nanoengine import LLM
from nanoengine.engine.arg_utils import resolve_dtype
from nanoengine.instruments.memory_report import memory_report_of
from nanoengine.model_executor.layers.cpu_linear import resolve_linear_backend


def test_ch02_measures_every_batch_size_and_the_crossovers(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "ch02.png"
    result = ch02_batching.main(
        # A 512-wide roofline: 1/64 of the default's work, which on a CPU without bf16
        # dot products costs minutes in bf16.
        ["--model", tiny_llama, "--batch-sizes", "1,4", "--steps", "3", "--prompt-len", "8", "--plot", str(plot),
         "--roofline-size", "512"]
    )
    assert [p.batch_size for p in result.points] == [1, 4]
    assert all(p.step_ms > 0 and p.tok_per_s > 0 for p in result.points)
    assert result.roofline.gflops > 0 and result.bandwidth_gb_s > 0
    # Both rooflines are measured side by side, and the shares use the engine's own dtype.
    assert set(result.rooflines) == {"float32", "bfloat16"}, result.rooflines
    assert result.roofline is result.rooflines[result.dtype]
    assert set(result.cpu_crossover_batch) == {"float32", "bfloat16"}
    # H200 bf16: 989e12 * 2 / (2 * 4.8e12) ~ 206 requests before decode is compute-bound.
    assert round(result.gpu_crossover_batch) == 206
    assert result.plot_path == str(plot) and plot.exists()
    # Section 4 in the engine's dtype: the twin keeps K and V in all 24 layers, the hybrid in 6.
    twin, hybrid = result.layer_mix
    element_bytes = torch.tensor([], dtype=getattr(torch, result.dtype)).element_size()
    assert twin.kv_bytes_per_token == 2 * 24 * 2 * 256 * element_bytes == 4 * hybrid.kv_bytes_per_token
    out = capsys.readouterr().out
    assert "Memory-bound or compute-bound" in out
    assert "Llama against Qwen3.5" in out and "hybrid / Llama" in out


def test_ch02_llama_twin_against_qwen3_5() -> None:
    """Issue 15: the same sizes, only the layer mix differs; 8 GiB of fp32 KV cache."""
    twin, hybrid = ch02_batching.layer_mix_rows("float32", block_size=16)
    config = ch02_batching.llama_twin_config(ch02_batching.hybrid_config())
    shape = (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert shape == (24, 8, 2, 256)
    hidden, ffn, heads, kv_heads, head_dim = config.hidden_size, config.intermediate_size, 8, 2, 256
    # Llama's parameters: a tied embedding, then per layer q, k, v, o, the gated FFN and two norms; a final norm.
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * ffn + 2 * hidden
    assert twin.num_parameters == config.vocab_size * hidden + 24 * per_layer + hidden
    assert 0.8 < twin.num_parameters / hybrid.num_parameters < 1  # of similar size
    # K and V, every layer, 2 KV heads of 256, 4 bytes: 96 KiB a token; the hybrid's 6 layers a quarter.
    assert twin.kv_bytes_per_token == 2 * 24 * kv_heads * head_dim * 4 == 98_304
    assert hybrid.kv_bytes_per_token == 98_304 // 4
    assert (twin.state_bytes, twin.num_state_blocks, twin.block_size) == (0, 0, 16)
    # Three state groups of 6 layers: 3 blocks per request, each a page in 6 tensors of 288 tokens.
    assert (hybrid.num_state_blocks, hybrid.block_size) == (3, 288)
    assert hybrid.state_bytes_held == 3 * 6 * 288 * 2 * 2 * 256 * 4 > hybrid.state_bytes
    assert hybrid.blocks_per_request == {4096: 15 + 3, 32768: 114 + 3}
    ratios = [hybrid.concurrency[n] / twin.concurrency[n] for n in ch02_batching.CONTEXT_LENGTHS]
    # More requests fit either way; the fixed state blocks cost most at short context, and at
    # 32k the ratio nears, but stays under, the 4x of the bytes per token.
    assert 1 < ratios[0] < ratios[1] < 4
    assert hybrid.concurrency[32768] > twin.concurrency[32768]


def test_ch02_docs_quote_what_the_table_prints_in_bf16() -> None:
    """docs/chapters/ch02.md copies the bf16 rows: they must still be what the code gives."""
    page = (Path(__file__).parents[1] / "docs" / "chapters" / "ch02.md").read_text(encoding="utf-8")
    for row in ch02_batching.layer_mix_rows("bfloat16", block_size=16):
        concurrency = " | ".join(f"{row.concurrency[n]:.1f}" for n in ch02_batching.CONTEXT_LENGTHS)
        assert f"| {row.block_size} | {row.num_blocks} | {concurrency} |" in page, row


def test_ch06_breakdown_dtypes_knobs_and_too_small_error(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = ch06_construction.main(["--model", tiny_llama, "--max-model-len", "128", "--max-num-batched-tokens", "128"])
    assert isinstance(result, ch06_construction.Ch06Result)
    assert list(result.timings)[:3] == ["init_device + load_model", "determine_available_memory", "initialize_from_config"]
    assert result.num_blocks > 1 and result.max_concurrency > 1
    _check_bf16_halves_the_bytes(result, tiny_llama)
    blocks = [row[2] for row in result.cpu_rows]
    assert blocks == sorted(blocks) and blocks[0] < blocks[-1]  # a larger fraction buys more blocks
    assert result.rebuilt_blocks == result.predicted_blocks  # the table predicts a real engine
    assert "bytes missing" in result.too_small_message and "Memory profile: weights" in result.too_small_message
    out = capsys.readouterr().out
    assert "peak activations" in out and "max concurrency" in out and "H200" in out
    assert f'dtype="auto" on {"this CPU" if result.device == "cpu" else result.device} -> ' in out
    assert "fp32 against bf16" in out


def _check_bf16_halves_the_bytes(result: ch06_construction.Ch06Result, model: str) -> None:
    """Issue 14: bf16 halves the weights and the KV bytes, so the same budget holds twice the tokens."""
    assert result.engine_dtype == resolve_dtype("auto", result.device)  # what dtype="auto" promised
    fp32, bf16 = result.dtype_rows
    assert (fp32.dtype, bf16.dtype) == ("float32", "bfloat16")
    assert [row.measured for row in result.dtype_rows] == [row.dtype == result.engine_dtype for row in result.dtype_rows]
    assert fp32.weights_bytes == 2 * bf16.weights_bytes
    assert fp32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token
    assert fp32.kv_bytes_per_block == 2 * bf16.kv_bytes_per_block
    # The same bytes: twice the blocks, give or take the floor of one division.
    assert bf16.num_blocks - 2 * fp32.num_blocks in (0, 1)
    # Tokens leave out the null block, which costs fp32 twice the bytes: bf16 holds 2x plus 1 or 2 blocks.
    block_size = fp32.kv_bytes_per_block // fp32.kv_bytes_per_token
    assert (bf16.token_capacity - 2 * fp32.token_capacity) // block_size in (1, 2)
    assert bf16.max_concurrency >= 2 * fp32.max_concurrency
    # The computed row is what a real engine of the other dtype gets at the same budget.
    computed = next(row for row in result.dtype_rows if not row.measured)
    other = LLM(model, dtype=computed.dtype, max_model_len=128, max_num_batched_tokens=128,
                kv_cache_memory_bytes=result.kv_budget_bytes)
    report = memory_report_of(other.llm_engine.engine_core.get_engine_core())
    assert report is not None
    assert report.num_blocks == computed.num_blocks
    # The computed weights are the measured engine's tensors at the other element size. A
    # packed matmul path keeps its own copy of a tied LM head; where "auto" packs one dtype
    # and not the other (bf16 on an AVX2-only CPU), the other engine holds one copy less.
    backends = [resolve_linear_backend("auto", torch.device(result.device), getattr(torch, dtype))
                for dtype in (result.engine_dtype, computed.dtype)]
    if backends[0] == backends[1]:
        assert report.profile.weights_bytes == computed.weights_bytes
    else:
        assert report.profile.weights_bytes < computed.weights_bytes


def test_ch07_steps_dispatcher_and_padded_graph_path(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = ch07_generate.main(["--model", tiny_llama, "--max-tokens", "3", "--steps", "2", "--max-num-seqs", "8"])
    first = result.steps[0]
    assert sorted(first.num_scheduled) == ["req-0", "req-1", "req-2"] and len(first.input_ids) > 3
    decodes = [s for s in result.steps if s.num_scheduled and set(s.num_scheduled.values()) == {1}]
    assert decodes and all(len(s.sampled) == len(s.num_scheduled) for s in decodes)
    assert result.decisions["3 decodes"] == len(decodes)
    assert result.padded_size == 4 and result.padded_max_abs_diff < 1e-4
    assert result.async_same_tokens and 0 < result.async_overlapped < result.async_steps
    out = capsys.readouterr().out
    assert "attention metadata" in out and "padded to the graph of 4" in out
    assert "scheduled while the previous step ran" in out


def test_ch06_quantized_loads_one_model_each_way_and_counts_its_blocks(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder with float weights and a Q4_1 GGUF beside them: every way measured (bf16 only where the
    CPU multiplies it fast), the GGUF engine's weights counted by kind and format, summing to what it
    keeps; a folder with only the GGUF skips the float ways, saying why."""
    from chapters import ch06_quantized
    from chapters.grade_checks.tiny_gguf import write_gguf
    from nanoengine.model_executor.layers.quantization.gguf_blocks import GGMLType
    from nanoengine.platforms.cpu import cpu_bf16_features

    both = tmp_path / "both"
    shutil.copytree(tiny_llama, both)
    write_gguf(tiny_llama, both / "tiny.Q4_1.gguf", GGMLType.Q4_1)
    result = ch06_quantized.main(["--model", str(both), "--tokens", "4"])
    ways = {way.name: way for way in result.ways}
    fast_bf16 = cpu_bf16_features().fast_bf16
    assert [name for name, way in ways.items() if not way.skipped] == (
        ["float32", "bfloat16", "GGUF blocks, bf16 around", "GGUF blocks"] if fast_bf16 else ["float32", "GGUF blocks"])
    assert all(way.decode_tokens_per_s > 0 and way.prefill_tokens_per_s > 0 and len(way.tokens) == 4
               for way in ways.values() if not way.skipped)
    assert sum(group.bytes for group in result.groups) == ways["GGUF blocks"].weights_bytes
    matrices = next(g for g in result.groups if g.kind == "layer matrices")
    assert (matrices.storage, matrices.bytes * 8 / matrices.numbers) == ("Q4_1 blocks", 5.0)
    assert ways["GGUF blocks"].weights_bytes < ways["float32"].weights_bytes / 3
    out = capsys.readouterr().out
    assert "2. The quantized model's memory, by kind and format" in out and "Q4_1 blocks" in out

    only_gguf = tmp_path / "only-gguf"
    only_gguf.mkdir()
    for item in both.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, only_gguf / item.name)
    result = ch06_quantized.run(str(only_gguf), tokens=2)
    assert [way.skipped.startswith("the folder has no float checkpoint") for way in result.ways[:2]] == [True, True]
    assert result.ways[-1].name == "GGUF blocks" and not result.ways[-1].skipped
