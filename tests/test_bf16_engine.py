"""bf16 through the whole engine: close to HF transformers, chosen by dtype="auto", half the bytes.

* Greedy decoding in bf16 is compared with HF's bf16 model the way vLLM compares
  reduced-precision runs (``check_logprobs_close``, tests/bf16_checks.py): the
  two may part ways at a near tie, never at a confident choice. fp32 stays
  token-exact (tests/test_engine_parity.py, tests/test_logprobs.py).
* dtype="auto" on a CPU is bf16 exactly where the CPU has bf16 dot products
  (nanoengine/platforms/cpu.py); bf16 asked for on a CPU without them still
  runs (oneDNN or F.linear), with one warning in the log.
* A bf16 engine holds its weights and KV cache in half the bytes: the same KV
  budget buys twice the blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from bf16_checks import GreedyRun, check_logprobs_close, engine_greedy_runs
from hf_reference import HFGreedy
from transformers import AutoTokenizer

from nanoengine import LLM, SamplingParams
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.instruments.memory_report import memory_report_of
from nanoengine.model_executor.layers import cpu_linear
from nanoengine.model_executor.layers.cpu_linear import onednn_supports, resolve_linear_backend
from nanoengine.platforms import cpu as cpu_platform
from nanoengine.platforms.cpu import CpuBf16Features, warn_slow_bf16_once

# ---- check_logprobs_close itself ----------------------------------------------------

_SAME = GreedyRun([5, 6, 7], [{5: -0.1, 9: -2.0}, {6: -0.2}, {7: -0.3}])
# Parts from _SAME at position 1 on a near tie (each side's token in the other's top-k);
# what follows the divergence is not compared.
_NEAR_TIE = GreedyRun([5, 9, 1], [{5: -0.1}, {9: -0.6, 6: -0.8}, {1: -0.1}])
_SAME_NEAR_TIE = GreedyRun([5, 6, 7], [{5: -0.1}, {6: -0.6, 9: -0.8}, {7: -0.3}])
# Parts at position 1 with a token the other side does not rank in its top-k.
_CONFIDENT_OTHER = GreedyRun([5, 4, 7], [{5: -0.1}, {4: -0.01, 6: -5.0}, {7: -0.3}])
_SHORT = GreedyRun([5, 6], [{5: -0.1}, {6: -0.2}])


@pytest.mark.parametrize(
    "runs_0,runs_1,error",
    [
        ([_SAME, _SAME], [_SAME, _SAME], None),
        ([_SAME, _SAME_NEAR_TIE], [_SAME, _NEAR_TIE], None),
        # planted: side 1's token 4 is not in side 0's top-k at prompt 1, position 1
        ([_SAME, _SAME_NEAR_TIE], [_SAME, _CONFIDENT_OTHER], r"prompt 1, position 1: .* chose 6, .* chose 4"),
        # planted the other way round: side 0's token 6 is missing from side 1's top-k
        ([_SAME_NEAR_TIE], [GreedyRun([5, 9, 1], [{5: -0.1}, {9: -0.1, 4: -3.0}, {1: -0.1}])], "no near tie"),
        ([_SAME], [_SHORT], "prompt 0: a has 3 tokens, b 2"),
        ([_SAME], [_SAME, _SAME], "a has 1 prompts, b 2"),
    ],
    ids=[
        "identical",
        "near-tie",
        "planted-mismatch",
        "planted-mismatch-reversed",
        "truncated",
        "prompt-count",
    ],
)
def test_check_logprobs_close_passes_near_ties_and_catches_planted_mismatches(
    runs_0: list[GreedyRun], runs_1: list[GreedyRun], error: str | None
) -> None:
    """The helper accepts identical runs and a divergence at a near tie, and fails, naming
    prompt and position, on a divergence to a token outside the other side's top-k,
    on a run cut short, and on a different number of prompts."""
    if error is None:
        check_logprobs_close(runs_0, runs_1, "a", "b")
    else:
        with pytest.raises(AssertionError, match=error):
            check_logprobs_close(runs_0, runs_1, "a", "b")


# ---- bf16 greedy decoding against HF's bf16 model --------------------------------------

NUM_TOKENS = 20
TOP_K = 5
TINY_PROMPT_LENGTHS = (5, 17, 30, 9)
# Two prompts, a short and a longer one: HF's bf16 reference runs one prompt at
# a time and, on a CPU without bf16 dot products, takes ~10 s each.
SMOLLM2_TEXTS = ["Hello", "Write a Python function that reverses a list."]


@pytest.fixture(
    params=[
        "tiny-llama",
        "tiny-qwen3",
        pytest.param("smollm2", marks=pytest.mark.default_model),
    ]
)
def model_and_prompts(
    request: pytest.FixtureRequest, tiny_model_factory: Callable[..., str]
) -> tuple[str, list[list[int]]]:
    """(model path, token-id prompts): tiny random Llama and Qwen3 models (four prompts), and SmolLM2 (two)."""
    if request.param == "smollm2":
        path: str = request.getfixturevalue("default_model_path")
        tokenizer = AutoTokenizer.from_pretrained(path)
        return path, [tokenizer.encode(text) for text in SMOLLM2_TEXTS]
    path = tiny_model_factory(request.param.removeprefix("tiny-"), tie=request.param == "tiny-llama")
    generator = torch.Generator().manual_seed(0)
    return path, [torch.randint(3, 300, (n,), generator=generator).tolist() for n in TINY_PROMPT_LENGTHS]


def test_bf16_greedy_is_close_to_hf_bf16(model_and_prompts: tuple[str, list[list[int]]]) -> None:
    """nanoengine in bf16 with its CPU fast paths (the defaults) and HF transformers in bf16
    pick the same greedy tokens up to near ties: where they first differ, each side's token
    is in the other's top-5 logprobs."""
    path, prompts = model_and_prompts
    # max_num_batched_tokens=256: every prompt still fits in one step, and the start-up
    # profiling pass is 8x smaller than at the default 2048 tokens.
    llm = LLM(path, dtype="bfloat16", max_model_len=256, max_num_batched_tokens=256, kv_cache_memory_bytes=1 << 24)
    runner = llm.llm_engine.engine_core.get_engine_core().model_executor.driver_worker.model_runner
    assert runner.dtype == torch.bfloat16 and runner.attention_backend == "cpu", (
        f"not the bf16 CPU path: {runner.dtype}, attention {runner.attention_backend}"
    )
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=TOP_K, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine_runs = engine_greedy_runs(outputs)
    reference = HFGreedy(path, dtype=torch.bfloat16)
    hf_runs = [reference.generate_with_logprobs(p, NUM_TOKENS, TOP_K) for p in prompts]
    check_logprobs_close(engine_runs, hf_runs, "nanoengine bf16", "HF bf16")


# ---- dtype="auto" and a CPU without bf16 kernels -------------------------------------


@pytest.mark.parametrize(
    "features,expected",
    [
        (CpuBf16Features(avx512_bf16=False, amx_bf16=False), "float32"),
        (CpuBf16Features(avx512_bf16=True, amx_bf16=False), "bfloat16"),
        (CpuBf16Features(avx512_bf16=True, amx_bf16=True), "bfloat16"),
    ],
    ids=["no-bf16", "avx512_bf16", "amx"],
)
def test_auto_dtype_on_cpu_is_bf16_only_with_bf16_dot_products(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch, features: CpuBf16Features, expected: str
) -> None:
    """dtype="auto" on a CPU resolves to bfloat16 where the CPU reports avx512_bf16 or AMX,
    float32 elsewhere; a dtype the user names is kept whatever the CPU."""
    monkeypatch.setattr(cpu_platform, "cpu_bf16_features", lambda: features)

    def resolved(dtype: str) -> str:
        config = EngineArgs(model=tiny_llama, device="cpu", dtype=dtype).create_engine_config()
        return str(config.model_config.dtype)

    assert resolved("auto") == expected
    assert resolved("float32") == "float32" and resolved("bfloat16") == "bfloat16"


@pytest.fixture
def no_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process sees a CPU with neither avx512_bf16 nor AMX, and no bf16 GEMM kernel;
    the once-only warning is reset before and after."""

    def no_bf16() -> CpuBf16Features:
        return CpuBf16Features(avx512_bf16=False, amx_bf16=False)

    # cpu_linear imported cpu_bf16_features by name: both references are this CPU's.
    monkeypatch.setattr(cpu_platform, "cpu_bf16_features", no_bf16)
    monkeypatch.setattr(cpu_linear, "cpu_bf16_features", no_bf16)
    monkeypatch.setattr(cpu_linear, "bf16_gemm_kernels", lambda: ())
    warn_slow_bf16_once.cache_clear()
    yield
    warn_slow_bf16_once.cache_clear()


def test_bf16_without_bf16_kernels_falls_back_and_warns_once(
    no_bf16_cpu: None, caplog: pytest.LogCaptureFixture
) -> None:
    """On a CPU without bf16 dot products, linear_backend="auto" in bf16 is oneDNN (or
    F.linear without oneDNN), never nanoengine's GEMM; the log says once that bf16 is slow
    there; asking for the "cpu" GEMM says what the CPU lacks."""
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="nanoengine.platforms.cpu"):
        picks = [resolve_linear_backend("auto", cpu, torch.bfloat16) for _ in range(3)]
    assert picks == ["onednn" if onednn_supports(torch.bfloat16) else "torch"] * 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "nanoengine.platforms.cpu"]
    assert len(warnings) == 1, warnings
    assert "no bf16 dot-product instructions" in warnings[0] and "float32" in warnings[0]
    with pytest.raises(ValueError, match="no bf16 dot-product instructions here"):
        resolve_linear_backend("cpu", cpu, torch.bfloat16)
    assert resolve_linear_backend("auto", cpu, torch.float32) != "torch"  # fp32 is not affected


# ---- memory -----------------------------------------------------------------------------


def test_bf16_halves_weights_and_doubles_kv_blocks(tiny_llama: str) -> None:
    """At the same kv_cache_memory_bytes a bf16 engine gets twice the KV blocks of an fp32
    one (each block is half the bytes), and its weights take half the bytes. Both keep plain
    weights (linear_backend="torch"): where "auto" packs one dtype and not the other (bf16 on
    an AVX2-only CPU), a packed tied LM head's own copy would be counted on one side only."""
    reports: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(
            tiny_llama, dtype=dtype, max_model_len=128, kv_cache_memory_bytes=4 << 20, linear_backend="torch"
        )
        core = llm.llm_engine.engine_core.get_engine_core()
        runner = core.model_executor.driver_worker.model_runner
        assert {cache.dtype for cache in runner.kv_caches} == {getattr(torch, dtype)}
        report = memory_report_of(core)
        assert report is not None
        reports[dtype] = report
    fp32, bf16 = reports["float32"], reports["bfloat16"]
    # 4 MiB is a whole number of fp32 blocks, so exactly twice as many bf16 ones fit.
    assert (4 << 20) % fp32.kv_cache_config.spec.page_size_bytes == 0
    assert bf16.num_blocks == 2 * fp32.num_blocks, (bf16.num_blocks, fp32.num_blocks)
    assert 2 * bf16.profile.weights_bytes == fp32.profile.weights_bytes, (
        bf16.profile.weights_bytes,
        fp32.profile.weights_bytes,
    )
