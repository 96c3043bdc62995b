"""The chapter 2, 6 and 7 walkthroughs run end to end on a tiny model and show what they claim."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chapters import ch02_batching, ch06_construction, ch07_generate
from nanoengine import LLM
from nanoengine.engine.arg_utils import resolve_dtype
from nanoengine.model_executor.layers.cpu_linear import resolve_linear_backend


def test_ch02_measures_every_batch_size_and_the_crossovers(
    tiny_llama: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "ch02.png"
    result = ch02_batching.main(
        ["--model", tiny_llama, "--batch-sizes", "1,4", "--steps", "3", "--prompt-len", "8", "--plot", str(plot)]
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
    assert "Memory-bound or compute-bound" in capsys.readouterr().out


def test_ch06_breakdown_dtypes_knobs_and_too_small_error(tiny_llama: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = ch06_construction.main(["--model", tiny_llama, "--max-model-len", "128", "--max-num-batched-tokens", "128"])
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
    report = other.llm_engine.engine_core.get_engine_core().memory_report
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
