"""The CPU fast paths against their plain-torch references, in fp32 and in bf16.

* ``attention_backend="cpu"``: C++ kernels (``nanoengine/csrc/cpu/``) that write
  K/V into their slots and run decode attention over the blocks in place; they
  must give what the torch reference backend gives, step after step, on a
  garbage-filled shuffled cache, for the head sizes the kernel specialises (64,
  128) and for any other (the generic path). The same build's RMSNorm, RoPE and
  SiLU-and-mul kernels must give what the layers' plain torch code gives.
* and two things asked of the OS: the KV cache stays on 4 KiB pages, and every
  worker call runs on the one forward thread.
* ``linear_backend="onednn"`` and ``"cpu"``: weights prepacked for oneDNN or
  for nanoengine's C++ GEMM must give ``F.linear``'s result, layer by layer and
  as whole-model logits; the bf16 GEMM, kernel by kernel (AMX, AVX-512 BF16),
  the exact product rounded once.

Every kernel takes fp32 or bf16 and, in bf16, widens to fp32 and rounds once on
write; so the bf16 tests compare with bf16 tolerances and, where the kernel's
promise is that single rounding, with fp32's answer on the same inputs.
They live here, parametrized over the dtype, rather than in a file of their own:
each bf16 test is the fp32 test's promise at another precision.
"""

from __future__ import annotations

import copy
import itertools
import sys
import threading
import warnings
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bf16_checks import (
    BF16_ONE_ULP,
    BF16_RTOL,
    GreedyRun,
    Tolerance,
    check_logprobs_close,
    engine_greedy_runs,
)
from test_attention_ref import (
    NUM_BLOCKS,
    ROUNDED_ONCE,
    WINDOW_STEPS,
    forget_skipped_blocks,
    garbage_cache,
    make_sequences,
    run_against_reference,
)
from transformers import AutoConfig

from nanoengine import _custom_ops
from nanoengine._custom_ops import cpu_ops_available, load_cpu_ops
from nanoengine.attention.backends.cpu_attn import CPUAttentionImpl
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl, gather_kv, write_to_kv_cache
from nanoengine.attention.selector import resolve_backend_name
from nanoengine.model_executor.custom_op import CustomOp, enable_cpu_kernels
from nanoengine.model_executor.layers.activation import SiluAndMul
from nanoengine.model_executor.layers.cpu_linear import (
    bf16_gemm_kernels,
    cpu_linear,
    onednn_available,
    onednn_supports,
    pack_cpu_weight,
    resolve_linear_backend,
)
from nanoengine.model_executor.layers.layernorm import RMSNorm
from nanoengine.model_executor.layers.linear import QKVParallelLinear
from nanoengine.model_executor.layers.rotary_embedding import RotaryEmbedding, default_inv_freq
from nanoengine.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from nanoengine.model_executor.model_loader import get_model
from nanoengine.platforms.cpu import cpu_bf16_features, kernel_isa
from nanoengine.worker.page_advice import advise_no_huge_pages

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="no C++ compiler for the CPU kernels")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---- attention ----------------------------------------------------------------

# Every kernel reads and writes fp32 or bf16 (bf16 widened to fp32 inside).
DTYPES = [torch.float32, torch.bfloat16]
over_dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])


@over_dtypes
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_prefill_then_decodes_match_reference(num_kv_heads: int, dtype: torch.dtype) -> None:
    """A prefill and three decode steps of the cpu backend give the reference's outputs and cache."""
    seqs = make_sequences([9, 12, 6], num_heads=4, num_kv_heads=num_kv_heads, dtype=dtype)
    cache = garbage_cache(num_kv_heads, dtype=dtype)
    caches = (cache.clone(), cache.clone())
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 5), (1, 7), (2, 3)], caches)
    for _ in range(3):  # decodes crossing block boundaries (block size 4), all in the C++ kernel
        decodes = [(0, 1), (1, 1), (2, 1)]
        run_against_reference(CPUAttentionImpl(), seqs, decodes, caches, rounded_once=dtype == torch.bfloat16)


@over_dtypes
def test_chunked_prefill_and_mixed_batch_match_reference(dtype: torch.dtype) -> None:
    """Chunked prefills and a decode mixed with prefills in one batch give the reference's outputs."""
    seqs = make_sequences([10, 5, 6], num_heads=4, num_kv_heads=2, dtype=dtype)
    cache = garbage_cache(2, dtype=dtype)
    caches = (cache.clone(), cache.clone())
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 3), (2, 3)], caches)
    # decode of request 2 mixed with request 0's second chunk and request 1's prompt
    run_against_reference(CPUAttentionImpl(), seqs, [(2, 1), (0, 6), (1, 4)], caches)


@over_dtypes
@pytest.mark.parametrize("head_dim", [64, 36])
@pytest.mark.parametrize("sliding_window", [1, 5, 8, 64])
def test_sliding_window_attention_matches_reference(head_dim: int, sliding_window: int, dtype: torch.dtype) -> None:
    """Decode and tiled prefill (head_dim 64; 36 takes the reference's prefill) in a
    sliding window give the reference's outputs, although the blocks before each
    window point at another request's garbage: the kernels never read them."""
    seqs = make_sequences([33, 24, 12], num_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    cache = garbage_cache(2, head_dim, dtype=dtype, num_blocks=NUM_BLOCKS + 1)
    caches = (cache.clone(), cache.clone())
    for steps in WINDOW_STEPS:
        run_against_reference(CPUAttentionImpl(), seqs, steps, caches, sliding_window=sliding_window)
        forget_skipped_blocks(seqs, sliding_window, foreign_block=NUM_BLOCKS)


@over_dtypes
def test_sliding_window_prefill_across_key_and_query_blocks(dtype: torch.dtype) -> None:
    """A window of 150 over prompts longer than the prefill kernel's key and query
    blocks (128 each): rows start their window mid-block, in different key blocks."""
    seqs = make_sequences([321, 132], 9, 3, 64, dtype=dtype, num_blocks=120)
    cache = garbage_cache(3, 64, dtype=dtype, num_blocks=121)
    caches = (cache.clone(), cache.clone())
    for steps in ([(0, 150)], [(0, 170), (1, 131)], [(0, 1), (1, 1)]):
        run_against_reference(CPUAttentionImpl(), seqs, steps, caches, dtype == torch.bfloat16, sliding_window=150)
        forget_skipped_blocks(seqs, 150, foreign_block=120)


# 1, 3 and 9 query heads per KV head (GQA), as the kernels group query heads by KV head.
HEAD_GROUPS = [(4, 4), (9, 3), (9, 1)]


@over_dtypes
@pytest.mark.parametrize("head_dim", [64, 128, 36])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_GROUPS)
def test_prefill_kernel_tiles_chunks_and_mixed_batches(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """64 and 128 take the tiled C++ prefill; 36 the reference in every variant.

    A variant's score tile is two vectors of keys (32 keys with AVX-512, 16 with
    AVX2, 8 with 4-lane vectors) and head_dim must be a multiple of it; 36 is
    a multiple of none.
    """
    # 23 and 37-token prefills: several 12-row tiles and 32-key score chunks per
    # request; the second step decodes request 1, continues request 0 from a
    # cached context of 23 tokens, and prefills request 2.
    seqs = make_sequences([40, 38, 20], num_heads, num_kv_heads, head_dim, dtype=dtype)
    cache = garbage_cache(num_kv_heads, head_dim, dtype=dtype)
    caches = (cache.clone(), cache.clone())
    in_kernel = load_cpu_ops().paged_prefill_supports(head_dim)
    assert in_kernel == (head_dim % 32 == 0)
    # Every row in a C++ kernel (decode, tiled prefill): bf16 rows are rounded once.
    rounded_once = in_kernel and dtype == torch.bfloat16
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 23), (1, 37)], caches, rounded_once)
    run_against_reference(CPUAttentionImpl(), seqs, [(1, 1), (0, 17), (2, 20)], caches, rounded_once)


@over_dtypes
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_prefill_kernel_online_softmax_across_key_and_query_blocks(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """Prompts longer than the kernel's blocks (128 keys, 128 query tokens a work item):
    a 300-token prompt, then a 170-token chunk after 150 cached tokens beside a fresh
    prompt of 131, so rows rescale their running sums as later key blocks raise their
    maximum, and work items start mid-prompt and mid-block."""
    seqs = make_sequences([320, 131], num_heads, num_kv_heads, 64, dtype=dtype, num_blocks=120)
    cache = garbage_cache(num_kv_heads, 64, dtype=dtype, num_blocks=120)
    caches = (cache.clone(), cache.clone())
    rounded_once = dtype == torch.bfloat16
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 150)], caches, rounded_once)
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 170), (1, 131)], caches, rounded_once)


@over_dtypes
@pytest.mark.parametrize("head_dim", [64, 128, 36])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_GROUPS)
def test_decode_kernel_specialised_head_sizes(
    head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """64 and 128 take the compile-time-sized path, 40 the generic one; each gives fp32
    SDPA over the same (widened) cache, to one rounding of the output in bf16."""
    num_blocks, block_size = 80, 16
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    # one token, exactly one block, one past it, many blocks, a few
    seq_lens = torch.tensor([1, 16, 17, 200, 33], dtype=torch.int32)
    table = torch.randperm(num_blocks - 1)[: 5 * 13].view(5, 13).int() + 1
    query = torch.randn(5, num_heads, head_dim).to(dtype)
    out = torch.empty_like(query)
    load_cpu_ops().paged_decode_attention(out, query, cache[0], cache[1], table, seq_lens, head_dim**-0.5, 0)
    for b, length in enumerate(seq_lens.tolist()):
        keys = gather_kv(cache[0], table[b])[:length].float()  # [len, Hkv, D]
        values = gather_kv(cache[1], table[b])[:length].float()
        want = F.scaled_dot_product_attention(
            query[b][:, None].float(),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            scale=head_dim**-0.5,
            enable_gqa=True,
        )[:, 0]
        if dtype == torch.float32:
            torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-4)
        else:  # fp32 inside, one rounding on write
            torch.testing.assert_close(out[b].float(), want, **ROUNDED_ONCE)


@over_dtypes
def test_write_kernel_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    """reshape_and_cache copies each K/V row to its slot bit for bit; slot -1 (padding) writes nothing."""
    cache = garbage_cache(2, dtype=dtype)
    qkv = torch.randn(5, 3 * 2 * 8).to(dtype)  # k and v are strided views of one projection row
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, 17, -1, 40, 159])
    want = cache.clone()
    write_to_kv_cache(key[slots >= 0], value[slots >= 0], want, slots[slots >= 0])
    load_cpu_ops().reshape_and_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, want)


def test_auto_backend_is_cpu_here_and_falls_back_when_the_build_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernels serve fp32 and bf16 where they build; any other dtype, or a failed
    build, gets the torch reference (with the build's error in a warning)."""
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend_name("auto", torch.device("cpu"), torch.bfloat16) == "cpu"
    assert resolve_backend_name("cpu", torch.device("cpu"), torch.bfloat16) == "cpu"
    assert resolve_backend_name("auto", torch.device("cpu"), torch.float16) == "torch"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        resolve_backend_name("cpu", torch.device("cpu"), torch.float16)

    def broken_build() -> None:
        raise OSError("no compiler here")

    monkeypatch.setattr(_custom_ops, "load_cpu_ops", broken_build)
    cpu_ops_available.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
            # The linear layers fall back too (an ARM laptop whose compiler refuses the flags):
            # oneDNN's prepacked matmul where torch has it, else F.linear.
            fallback = "onednn" if onednn_supports(torch.float32) else "torch"
            assert resolve_linear_backend("auto", torch.device("cpu"), torch.float32) == fallback
        assert any("no compiler here" in str(w.message) for w in caught)
        with pytest.raises(ValueError, match="failed to build"):
            resolve_backend_name("cpu", torch.device("cpu"))
    finally:
        cpu_ops_available.cache_clear()


@over_dtypes
def test_engine_uses_cpu_kernels_by_default_and_matches_torch_backend(
    tiny_llama: str, dtype: torch.dtype
) -> None:
    """A tiny model run end to end with every CPU fast path (the defaults) against
    attention_backend="torch", linear_backend="torch": the same greedy tokens in fp32;
    in bf16, where the two round differently, tokens that differ only at near ties
    (check_logprobs_close)."""
    from nanoengine import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    dtype_name = str(dtype).removeprefix("torch.")
    runs: dict[str, list[GreedyRun]] = {}
    for backend in ("auto", "torch"):
        llm = LLM(
            tiny_llama,
            dtype=dtype_name,
            attention_backend=backend,
            linear_backend=backend,
            block_size=4,
            max_model_len=128,
        )
        runner = llm.llm_engine.engine_core.get_engine_core().model_executor.driver_worker.model_runner
        assert runner.dtype == dtype
        ops = [m for m in runner.model.modules() if isinstance(m, CustomOp)]
        assert ops and all(op.use_cpu_kernels == (runner.attention_backend == "cpu") for op in ops)
        if backend == "auto":
            # A packed matmul path exists for fp32 everywhere; for bf16 an AVX2-only CPU
            # has none, and "auto" then rightly keeps F.linear.
            fastest_linear = resolve_linear_backend("auto", torch.device("cpu"), dtype)
            assert dtype == torch.bfloat16 or fastest_linear != "torch"
            assert runner.attention_backend == "cpu" and runner.linear_backend == fastest_linear, (
                f"not the fast paths: {runner.attention_backend=}, {runner.linear_backend=}"
            )
        runs[runner.attention_backend] = engine_greedy_runs(llm.generate(prompts, params, use_tqdm=False))
    assert set(runs) == {"cpu", "torch"}
    if dtype == torch.float32:
        assert [r.token_ids for r in runs["cpu"]] == [r.token_ids for r in runs["torch"]]
    else:
        check_logprobs_close(runs["cpu"], runs["torch"], "cpu fast paths", "torch reference")


# ---- decoder-layer kernels (CustomOp) --------------------------------------


LayerT = TypeVar("LayerT", bound=torch.nn.Module)


def cpu_twin(layer: LayerT) -> LayerT:
    """A copy of ``layer`` switched to its C++ kernel."""
    twin = copy.deepcopy(layer)
    assert enable_cpu_kernels(twin) == 1
    return twin


# The layers' plain torch code in bf16 rounds after every op; the kernels widen
# to fp32 and round once on write. Against the former: a few bf16 steps apart.
# Against the fp32 code on the same (widened) inputs, rounded to bf16 once:
# one step at most (what "rounded once on write" means).
LAYER_TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": BF16_RTOL},
}


def assert_rounded_once(got: torch.Tensor, fp32_answer: torch.Tensor) -> None:
    """A bf16 kernel output is fp32 math on the widened inputs, rounded to bf16 once."""
    assert got.dtype == torch.bfloat16, got.dtype
    torch.testing.assert_close(got.float(), fp32_answer.float(), atol=1e-6, rtol=BF16_ONE_ULP)


@over_dtypes
@pytest.mark.parametrize("shape", [(7, 576), (3, 5, 64)])
def test_rms_norm_kernel_matches_torch(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """rms_norm (dense and strided rows) and fused_add_rms_norm give the layer's torch code;
    the fused residual add is the same single rounding, bit for bit."""
    tol = LAYER_TOLERANCE[dtype]
    norm = RMSNorm(shape[-1], eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    norm32 = copy.deepcopy(norm)
    norm.to(dtype)
    fast = cpu_twin(norm)
    x = (torch.randn(shape) * 3).to(dtype)
    torch.testing.assert_close(fast(x), norm(x), **tol)
    wide = torch.randn(shape[0], 2 * shape[-1]).to(dtype)[:, : shape[-1]]  # a strided view, as q/k norms get
    torch.testing.assert_close(fast(wide), norm(wide), **tol)
    if dtype == torch.bfloat16:
        norm32.weight.data = norm.weight.data.float()  # the same bf16 weights, widened
        assert_rounded_once(fast(x), norm32(x.float()))
        assert_rounded_once(fast(wide), norm32(wide.float()))
    residual = torch.randn(7, 576).to(dtype)
    x = torch.randn(7, 576).to(dtype)
    norm576 = RMSNorm(576).to(dtype)
    want_out, want_residual = norm576.forward_with_residual(x.clone(), residual.clone())
    got_out, got_residual = cpu_twin(norm576).forward_with_residual(x.clone(), residual.clone())
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)  # one add, same rounding
    torch.testing.assert_close(got_out, want_out, **tol)


@over_dtypes
def test_rope_kernel_matches_torch_and_rotates_in_place(dtype: torch.dtype) -> None:
    """rotary_embedding rotates q and k where they lie (strided views of one qkv row) as
    the layer's torch code does, and refuses a position past its table."""
    rope = RotaryEmbedding(64, default_inv_freq(64, 10000.0), max_positions=4096)
    fast = cpu_twin(rope)
    assert fast.cos_sin_cache is not None and fast.cos_sin_cache.shape == (4096, 64)
    positions = torch.tensor([0, 1, 17, 4095, 300])
    qkv = torch.randn(5, (9 + 3 + 3) * 64).to(dtype)  # q and k are strided views, as the model passes them
    q, k = qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64]
    want_q, want_k = rope(positions, q, k)
    want32_q, want32_k = rope(positions, q.float(), k.float())
    got_q, got_k = fast(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated where it lies
    # bf16 torch code rounds cos/sin and each product before the sum; a sum may cancel.
    tol: Tolerance = LAYER_TOLERANCE[dtype] if dtype == torch.float32 else {"atol": 3e-2, "rtol": BF16_RTOL}
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    if dtype == torch.bfloat16:
        assert_rounded_once(got_q, want32_q)
        assert_rounded_once(got_k, want32_k)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        fast(torch.tensor([4096]), torch.randn(1, 64).to(dtype), torch.randn(1, 64).to(dtype))


@over_dtypes
def test_silu_and_mul_kernel_matches_torch(dtype: torch.dtype) -> None:
    """silu_and_mul gives the layer's torch code (and, in bf16, fp32's answer rounded once)."""
    act = SiluAndMul()
    x = (torch.randn(6, 2 * 1536) * 4).to(dtype)
    got = cpu_twin(act)(x)
    torch.testing.assert_close(got, act(x), **LAYER_TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        assert_rounded_once(got, act(x.float()))


# ---- linear ----------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
# Both packed paths; "cpu" is nanoengine's GEMM (the module needs its kernels anyway).
PACKED_BACKENDS = [pytest.param("onednn", marks=needs_onednn), "cpu"]


def backend_refused(backend: str, dtype: torch.dtype) -> bool:
    """True where ``backend`` cannot run ``dtype`` on this CPU, after checking that this is
    right and that asking for it says why: nanoengine's GEMM in bf16 needs AMX or
    avx512_bf16; oneDNN in bf16 needs AVX-512 or AVX-NE-CONVERT (an AVX2-only CPU has neither)."""
    if dtype != torch.bfloat16:
        return False
    cpu = torch.device("cpu")
    if backend == "cpu" and not bf16_gemm_kernels():
        features = cpu_bf16_features()
        assert not features.fast_bf16, f"this CPU has {features.describe()}, but no bf16 GEMM kernel was built"
        with pytest.raises(ValueError, match="AMX or avx512_bf16"):
            resolve_linear_backend("cpu", cpu, torch.bfloat16)
        return True
    if backend == "onednn" and not onednn_supports(torch.bfloat16):
        # (or in a process capped at AVX2: ONEDNN_MAX_CPU_ISA=AVX2, see test_kernel_isa.py)
        assert not torch.cpu._is_avx512_supported() or kernel_isa() != "avx512", "oneDNN refuses bf16 with AVX-512"
        with pytest.raises(ValueError, match="AVX-NE-CONVERT"):
            resolve_linear_backend("onednn", cpu, torch.bfloat16)
        return True
    return False


# Packed against F.linear on the same weights; bf16: both round their output once.
LINEAR_TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": BF16_RTOL},
}


@over_dtypes
@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 13, 64])
def test_packed_linear_matches_f_linear(backend: str, bias: bool, rows: int, dtype: torch.dtype) -> None:
    """A packed linear layer gives F.linear's result, for any leading dims and strided rows."""
    if backend_refused(backend, dtype):
        return
    # 80 output columns: two full 32-column panels of the C++ GEMM and a partial
    # one; 13 rows: a full 12-row register tile and a 1-row tail. K = 48: bf16
    # panels pad it to 64.
    layer = QKVParallelLinear(hidden_size=48, head_size=8, total_num_heads=6, total_num_kv_heads=2, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    layer.to(dtype)
    x = torch.randn(rows, 48).to(dtype)
    want = layer(x)
    layer.pack(backend)
    assert layer.packed and backend in layer.extra_repr()
    tol = LINEAR_TOLERANCE[dtype]
    torch.testing.assert_close(layer(x), want, **tol)
    assert layer(x[:, None, :]).shape == (rows, 1, 48 + 2 * 16)  # any leading dims
    torch.testing.assert_close(layer(x.t().contiguous().t()), want, **tol)  # strided rows


def test_cpu_gemm_large_products_cross_its_row_blocks() -> None:
    # K = 1536 makes a row block 36 rows with AVX-512, 42 with AVX2 (256 KB of x),
    # so 100 rows take three blocks: the outer loop of packed_linear, not only its
    # tiles, is exercised. A panel is two vectors: 32 columns (AVX-512), 16 (AVX2), 8.
    weight, x = torch.randn(70, 1536), torch.randn(100, 1536)
    packed = load_cpu_ops().pack_linear_weight(weight)
    panel = 2 * load_cpu_ops().vector_lanes()
    assert packed.shape == (-(-70 // panel), 1536, panel)
    torch.testing.assert_close(cpu_linear(x, packed, None, 70), x @ weight.t(), atol=1e-3, rtol=1e-5)
    with pytest.raises(RuntimeError, match="must share K"):
        cpu_linear(torch.randn(2, 1535), packed, None, 70)


# ---- the bf16 GEMM (gemm_bf16.cpp), kernel by kernel ---------------------------

ALL_BF16_KERNELS = ("amx", "avx512_bf16")


@pytest.fixture(params=list(bf16_gemm_kernels()) or [None], ids=lambda k: k or "no-bf16-kernel")
def bf16_kernel(request: pytest.FixtureRequest) -> str | None:
    """Each bf16 GEMM kernel this CPU runs. None where it runs none: then this fixture has
    checked that the CPU reports no avx512_bf16 and that "auto" does not pick the "cpu" GEMM,
    and the test has nothing more to compare."""
    kernel: str | None = request.param
    if kernel is None:
        features = cpu_bf16_features()
        assert not features.avx512_bf16, "the CPU reports avx512_bf16, but no bf16 GEMM kernel was built"
        assert resolve_linear_backend("auto", torch.device("cpu"), torch.bfloat16) != "cpu"
    return kernel


def bf16_problem(
    rows: int, k: int, n: int, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random bf16 x [rows, k], weight [n, k] and (optionally) bias [n]."""
    x, weight = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    return x, weight, torch.randn(n).bfloat16() if bias else None


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b of bf16 operands, in fp32 (every product of two bf16 numbers is exact in fp32)."""
    out = x.float() @ weight.float().t()
    return out + bias.float() if bias is not None else out


def assert_one_bf16_rounding(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    """got (bf16) is want (fp32) rounded once to bf16: within half a bf16 step (rtol is a
    whole one), up to fp32 summation order, which grows like sqrt(k) for these sums of
    k unit-variance products."""
    assert got.dtype == torch.bfloat16, got.dtype
    torch.testing.assert_close(got.float(), want, rtol=BF16_ONE_ULP, atol=1e-4 * k**0.5)


@pytest.mark.parametrize("kernel", ALL_BF16_KERNELS)
def test_bf16_gemm_kernels_are_the_ones_the_cpu_has(kernel: str) -> None:
    """bf16_gemm_kernels() lists avx512_bf16 exactly where the CPU reports it and amx only
    where it reports amx_bf16 (the OS may still refuse AMX tile state); a kernel not
    listed is refused by name, not run."""
    features = cpu_bf16_features()
    has_instructions = features.amx_bf16 if kernel == "amx" else features.avx512_bf16
    listed = kernel in bf16_gemm_kernels()
    if kernel == "avx512_bf16":
        assert listed == has_instructions, f"CPU: {features.describe()}; kernels: {bf16_gemm_kernels()}"
    else:
        assert has_instructions or not listed, f"CPU: {features.describe()}; kernels: {bf16_gemm_kernels()}"
    x, weight, _ = bf16_problem(3, 40, 20, bias=False)
    packed = pack_cpu_weight(weight)
    if listed:
        assert cpu_linear(x, packed, None, 20, bf16_kernel=kernel).shape == (3, 20)
    else:
        with pytest.raises(RuntimeError, match=f"'{kernel}' is not available on this CPU"):
            cpu_linear(x, packed, None, 20, bf16_kernel=kernel)


# K not a multiple of 32 (50, 130: padded to 64, 160) and 64; N across partial panels.
BF16_SHAPES = [(50, 80), (130, 33), (64, 96)]


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("k,n", BF16_SHAPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 45, 300])
def test_bf16_gemm_matches_fp32_product(
    bf16_kernel: str | None, rows: int, k: int, n: int, bias: bool
) -> None:
    """cpu_linear on bf16 weights is the exact product rounded to bf16 once, and F.linear's
    bf16 result to bf16 rounding. Row counts cross AMX's 16/32-row tiles and the
    12-row AVX-512 tile, with a tail; N leaves a partial panel."""
    if bf16_kernel is None:
        return
    x, weight, b = bf16_problem(rows, k, n, bias)
    packed = pack_cpu_weight(weight)
    assert packed.shape == ((n + 31) // 32, (k + 31) // 32 * 16, 32, 2) and packed.dtype == torch.bfloat16
    got = cpu_linear(x, packed, b, n, bf16_kernel=bf16_kernel)
    assert_one_bf16_rounding(got, exact_linear(x, weight, b), k)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-4 * k**0.5, rtol=BF16_RTOL)


def test_bf16_gemm_large_products_cross_its_row_blocks(bf16_kernel: str | None) -> None:
    """700 rows x K = 1536: several outer row blocks (256 KB of x each: 64 rows on AMX,
    84 on AVX-512), each a run of tiles, and a 700 % 16 = 12-row tail."""
    if bf16_kernel is None:
        return
    x, weight, b = bf16_problem(700, 1536, 70, bias=True)
    packed = pack_cpu_weight(weight)
    assert packed.shape == (3, 768, 32, 2)
    got = cpu_linear(x, packed, b, 70, bf16_kernel=bf16_kernel)
    assert_one_bf16_rounding(got, exact_linear(x, weight, b), 1536)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_linear(torch.randn(2, 1500).bfloat16(), packed, None, 70, bf16_kernel=bf16_kernel)


@pytest.mark.parametrize("rows,k,n", [(45, 130, 33), (300, 64, 96), (700, 1536, 70)])
def test_bf16_gemm_kernels_agree(rows: int, k: int, n: int) -> None:
    """Every bf16 kernel of this CPU gives the others' answer to within one bf16 step (each
    sums in fp32 in its own order, then rounds once), and all are the exact product rounded."""
    kernels = bf16_gemm_kernels()
    assert kernels or not cpu_bf16_features().avx512_bf16, "avx512_bf16 CPU without a bf16 GEMM kernel"
    x, weight, b = bf16_problem(rows, k, n, bias=True)
    packed = pack_cpu_weight(weight)
    outs = {kernel: cpu_linear(x, packed, b, n, bf16_kernel=kernel) for kernel in kernels}
    for out in outs.values():
        assert_one_bf16_rounding(out, exact_linear(x, weight, b), k)
    for first, second in itertools.combinations(kernels, 2):

        def named(message: str, pair: str = f"{first} vs {second}") -> str:
            return f"{pair}: {message}"

        torch.testing.assert_close(
            outs[first].float(), outs[second].float(), atol=1e-4 * k**0.5, rtol=BF16_ONE_ULP, msg=named
        )


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
def test_tied_lm_head_packs_its_own_copy(backend: str) -> None:
    embedding = VocabParallelEmbedding(100, 16)
    torch.nn.init.normal_(embedding.weight)
    head = ParallelLMHead(100, 16, tied_to=embedding)
    hidden = torch.randn(3, 16)
    want = head(hidden)
    plain = embedding.weight.detach().clone()
    head.pack(backend)
    assert head.weight is not embedding.weight and torch.equal(embedding.weight, plain)
    torch.testing.assert_close(head(hidden), want, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_resolve_linear_backend() -> None:
    """ "auto" picks nanoengine's GEMM where it runs the dtype fast, oneDNN for other
    fp32/bf16, F.linear for the rest; a backend that cannot run the dtype is refused."""
    cpu = torch.device("cpu")
    tuned = kernel_isa() in ("avx512", "avx2")
    assert resolve_linear_backend("auto", cpu, torch.float32) == ("cpu" if tuned else "onednn")
    bf16_fast = bool(bf16_gemm_kernels()) and tuned
    bf16_fallback = "onednn" if onednn_supports(torch.bfloat16) else "torch"
    assert resolve_linear_backend("auto", cpu, torch.bfloat16) == ("cpu" if bf16_fast else bf16_fallback)
    assert resolve_linear_backend("auto", cpu, torch.float16) == "torch"
    assert resolve_linear_backend("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="float16"):
        resolve_linear_backend("onednn", cpu, torch.float16)
    if bf16_gemm_kernels():
        assert resolve_linear_backend("cpu", cpu, torch.bfloat16) == "cpu"
    else:
        with pytest.raises(ValueError, match="bfloat16"):
            resolve_linear_backend("cpu", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="float16"):
        resolve_linear_backend("cpu", cpu, torch.float16)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", cpu, torch.float32)


@over_dtypes
@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_model_logits_match_torch_model(
    backend: str, family: str, tiny_model_factory: Callable[..., str], dtype: torch.dtype
) -> None:
    """get_model packs every linear layer and the LM head for ``backend``; the head's logits are F.linear's."""
    if backend_refused(backend, dtype):
        return
    path = tiny_model_factory(family)
    config = AutoConfig.from_pretrained(path)
    models = {name: get_model(path, config, dtype, torch.device("cpu"), name) for name in ("torch", backend)}
    hidden = torch.randn(5, config.hidden_size).to(dtype)
    logits = {name: model.compute_logits(hidden) for name, model in models.items()}
    torch.testing.assert_close(logits[backend], logits["torch"], **LINEAR_TOLERANCE[dtype])
    packed = [m for m in models[backend].modules() if getattr(m, "packed", False)]
    assert len(packed) == 4 * config.num_hidden_layers + 1  # qkv, o, gate_up, down per layer + LM head
    # TorchRefAttentionImpl is what a model uses until the runner picks a backend.
    assert all(
        isinstance(m.impl, TorchRefAttentionImpl) for m in models[backend].modules() if hasattr(m, "impl")
    )


# ---- what the OS is asked for ------------------------------------------------


def _vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping that contains ``address`` (/proc/self/smaps)."""
    flags: list[str] = []
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    return flags


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")
def test_kv_cache_memory_opts_out_of_huge_pages() -> None:
    cache = torch.from_numpy(np.zeros(16 << 20, dtype=np.uint32)).view(torch.float32)  # 64 MiB, untouched
    assert advise_no_huge_pages(cache)
    assert "nh" in _vm_flags_of(cache.data_ptr() + (32 << 20))  # the kernel recorded MADV_NOHUGEPAGE
    assert not advise_no_huge_pages(torch.empty(0))


def test_worker_calls_run_on_the_forward_thread(tiny_llama: str) -> None:
    from nanoengine import LLM

    llm = LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    executor = llm.llm_engine.engine_core.get_engine_core().model_executor
    # A function runs as function(worker, *args); the answer is one per rank (here one).
    (thread,) = executor.collective_rpc(lambda worker: threading.current_thread())
    assert thread is not threading.main_thread() and thread.name.startswith("nanoengine-forward")
    assert executor.collective_rpc(lambda worker, a, b: a + b, args=(2, 3), unique_reply_rank=0) == 5
