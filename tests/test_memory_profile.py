"""Chapter 6's memory profile: what is measured on CPU, what the engine keeps, what it says.

The profiling pass's peak is measured from the process's peak RSS on CPU; the
engine keeps the profile (``memory_profile``) and the KV cache it sized, the
instruments turn them into chapter 6's report, and the engine logs vLLM's
start-up lines only at INFO level, so LLM construction stays quiet by default.
"""

from __future__ import annotations

import logging
import mmap

import pytest
import torch
from rich.console import Console

from nanoengine import LLM
from nanoengine.attention.selector import resolve_backend_name
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.instruments.memory_report import memory_report_of, memory_table
from nanoengine.instruments.step_timing import time_construction
from nanoengine.worker.memory_probe import PeakMemoryProbe


def test_cpu_probe_sees_a_large_temporary_allocation() -> None:
    # Fresh pages from the kernel: a torch/malloc allocation could be served from
    # memory an earlier test freed but the process kept resident, which the probe
    # (by design, see its docstring) does not count.
    with PeakMemoryProbe(torch.device("cpu")) as probe:
        block = mmap.mmap(-1, 64 << 20)
        block.write(b"\1" * (64 << 20))  # 64 MiB, every page touched
    # Still alive when the probe reads VmHWM, so the kernel's lazily synced RSS
    # counters have certainly caught up with it.
    assert len(block) == 64 << 20
    assert probe.peak_growth_bytes >= 60 << 20
    assert "RSS" in probe.method


def test_engine_keeps_the_breakdown_and_is_quiet_by_default(
    tiny_llama: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING), time_construction() as steps:
        # fp32 named (4 bytes a weight below); tests/test_bf16_engine.py checks bf16 halves it.
        llm = LLM(
            tiny_llama,
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=4 << 20,
        )
    assert not caplog.records
    core = llm.llm_engine.engine_core.get_engine_core()
    report = memory_report_of(core)
    assert report is not None and report.profile.device == "cpu"
    profile = report.profile
    assert profile.weights_bytes == sum(p.numel() * 4 for p in core.model_executor.driver_worker.model_runner.model.parameters())
    assert profile.peak_activation_bytes >= 0 and profile.kv_cache_bytes == 4 << 20
    assert profile.total_budget_bytes == profile.weights_bytes + profile.peak_activation_bytes + (4 << 20)
    assert report.num_blocks == core.kv_cache_config.num_blocks
    assert report.token_capacity == (report.num_blocks - 1) * report.kv_cache_config.block_size
    # The CPU's default 128-token blocks: one max_model_len=128 request takes one block.
    assert report.kv_cache_config.block_size == 128
    assert report.max_concurrency == pytest.approx(report.num_blocks - 1)
    assert list(steps) == [
        "init_device + load_model", "determine_available_memory", "initialize_from_config", "compile_or_warm_up_model"
    ]
    console = Console(width=140, record=True, color_system=None)
    with console.capture() as capture:
        console.print(memory_table(report))
    text = capture.get()
    assert "peak activations" in text and "max concurrency" in text and "CUDA graphs" not in text


def test_memory_and_kv_cache_size_are_logged_at_info(tiny_llama: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nanoengine.engine.core"):
        LLM(tiny_llama, max_model_len=128, max_num_batched_tokens=128, kv_cache_memory_bytes=2 << 20)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Memory profile: weights") for m in messages), messages
    assert any("Maximum concurrency for 128 tokens per request" in m for m in messages), messages


def test_too_small_budget_names_the_missing_bytes_and_the_profile(tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="bytes missing") as err:
        LLM(tiny_llama, max_model_len=256, max_num_batched_tokens=256, kv_cache_memory_bytes=1024)
    message = str(err.value)
    assert "kv_cache_memory_bytes" in message and "Memory profile: weights" in message


def test_backend_choice_and_bad_values(tiny_llama: str) -> None:
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"  # the C++ kernels build here
    assert resolve_backend_name("auto", torch.device("cpu"), torch.bfloat16) == "cpu"
    assert resolve_backend_name("auto", torch.device("cpu"), torch.float16) == "torch"
    assert resolve_backend_name("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend_name("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend must be"):
        LLM(tiny_llama, attention_backend="flash")
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        LLM(tiny_llama, cudagraph_capture_sizes=[0, 4])


def test_block_size_defaults_to_128_on_cpu_and_keeps_an_explicit_choice(tiny_llama: str) -> None:
    assert EngineArgs(model=tiny_llama, device="cpu").create_engine_config().cache_config.block_size == 128
    explicit = EngineArgs(model=tiny_llama, device="cpu", block_size=32).create_engine_config()
    assert explicit.cache_config.block_size == 32
