"""The CPU fast paths against their plain-torch references.

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
  as whole-model logits.
"""

from __future__ import annotations

import copy
import sys
import threading
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_attention_ref import garbage_cache, make_sequences, run_against_reference
from transformers import AutoConfig

from nanoengine import _custom_ops
from nanoengine._custom_ops import cpu_ops_available, load_cpu_ops
from nanoengine.attention.backends.cpu_attn import CPUAttentionImpl
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl, gather_kv, write_to_kv_cache
from nanoengine.attention.selector import resolve_backend_name
from nanoengine.model_executor.custom_op import CustomOp, enable_cpu_kernels
from nanoengine.model_executor.layers.activation import SiluAndMul
from nanoengine.model_executor.layers.cpu_linear import cpu_linear, onednn_available, resolve_linear_backend
from nanoengine.model_executor.layers.layernorm import RMSNorm
from nanoengine.model_executor.layers.linear import QKVLinear
from nanoengine.model_executor.layers.rotary_embedding import RotaryEmbedding, default_inv_freq
from nanoengine.model_executor.layers.vocab_embedding import LMHead, VocabEmbedding
from nanoengine.model_executor.model_loader import get_model
from nanoengine.worker.page_advice import advise_no_huge_pages

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="no C++ compiler for the CPU kernels")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---- attention -------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_prefill_then_decodes_match_reference(num_kv_heads: int) -> None:
    seqs = make_sequences([9, 12, 6], num_heads=4, num_kv_heads=num_kv_heads)
    cache = garbage_cache(num_kv_heads)
    caches = (cache.clone(), cache.clone())
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 5), (1, 7), (2, 3)], caches)
    for _ in range(3):  # decodes crossing block boundaries (block size 4)
        run_against_reference(CPUAttentionImpl(), seqs, [(0, 1), (1, 1), (2, 1)], caches)


def test_chunked_prefill_and_mixed_batch_match_reference() -> None:
    seqs = make_sequences([10, 5, 6], num_heads=4, num_kv_heads=2)
    cache = garbage_cache(2)
    caches = (cache.clone(), cache.clone())
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 3), (2, 3)], caches)
    # decode of request 2 mixed with request 0's second chunk and request 1's prompt
    run_against_reference(CPUAttentionImpl(), seqs, [(2, 1), (0, 6), (1, 4)], caches)


@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_prefill_kernel_tiles_chunks_and_mixed_batches(
    head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    """64 and 128 take the tiled C++ prefill, 40 (not a multiple of 32) the reference."""
    # 23 and 37-token prefills: several 12-row tiles and 32-key score chunks per
    # request; the second step decodes request 1, continues request 0 from a
    # cached context of 23 tokens, and prefills request 2.
    seqs = make_sequences([40, 38, 20], num_heads, num_kv_heads, head_dim)
    cache = garbage_cache(num_kv_heads, head_dim)
    caches = (cache.clone(), cache.clone())
    run_against_reference(CPUAttentionImpl(), seqs, [(0, 23), (1, 37)], caches)
    run_against_reference(CPUAttentionImpl(), seqs, [(1, 1), (0, 17), (2, 20)], caches)
    assert load_cpu_ops().paged_prefill_supports(head_dim) == (head_dim % 32 == 0)


@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_decode_kernel_specialised_head_sizes(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """64 and 128 take the compile-time-sized path, 40 the generic one."""
    num_blocks, block_size = 80, 16
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    # one token, exactly one block, one past it, many blocks, a few
    seq_lens = torch.tensor([1, 16, 17, 200, 33], dtype=torch.int32)
    table = torch.randperm(num_blocks - 1)[: 5 * 13].view(5, 13).int() + 1
    query = torch.randn(5, num_heads, head_dim)
    out = torch.empty_like(query)
    load_cpu_ops().paged_decode_attention(out, query, cache[0], cache[1], table, seq_lens, head_dim**-0.5)
    for b, length in enumerate(seq_lens.tolist()):
        keys = gather_kv(cache[0], table[b])[:length]  # [len, Hkv, D]
        values = gather_kv(cache[1], table[b])[:length]
        want = F.scaled_dot_product_attention(
            query[b][:, None],
            keys.transpose(0, 1),
            values.transpose(0, 1),
            scale=head_dim**-0.5,
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-4)


def test_write_kernel_matches_reference_and_skips_padding() -> None:
    cache = garbage_cache(2)
    qkv = torch.randn(5, 3 * 2 * 8)  # k and v are strided views of one projection row
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, 17, -1, 40, 159])
    want = cache.clone()
    write_to_kv_cache(key[slots >= 0], value[slots >= 0], want, slots[slots >= 0])
    load_cpu_ops().reshape_and_cache(key, value, cache[0], cache[1], slots)
    assert torch.equal(cache, want)


def test_auto_backend_is_cpu_here_and_falls_back_when_the_build_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend_name("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="float32"):
        resolve_backend_name("cpu", torch.device("cpu"), torch.bfloat16)

    def broken_build() -> None:
        raise OSError("no compiler here")

    monkeypatch.setattr(_custom_ops, "load_cpu_ops", broken_build)
    cpu_ops_available.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend_name("auto", torch.device("cpu")) == "torch"
        assert any("no compiler here" in str(w.message) for w in caught)
        with pytest.raises(ValueError, match="failed to build"):
            resolve_backend_name("cpu", torch.device("cpu"))
    finally:
        cpu_ops_available.cache_clear()


def test_engine_uses_cpu_kernels_by_default_and_matches_torch_backend(tiny_llama: str) -> None:
    from nanoengine import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 23, 40)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for backend in ("auto", "torch"):
        llm = LLM(tiny_llama, attention_backend=backend, block_size=4, max_model_len=128)
        runner = llm.llm_engine.engine_core.get_engine_core().model_executor.driver_worker.model_runner
        ops = [m for m in runner.model.modules() if isinstance(m, CustomOp)]
        assert ops and all(op.use_cpu_kernels == (runner.attention_backend == "cpu") for op in ops)
        outputs[runner.attention_backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert set(outputs) == {"cpu", "torch"}
    assert outputs["cpu"] == outputs["torch"]


# ---- decoder-layer kernels (CustomOp) --------------------------------------


def cpu_twin(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``layer`` switched to its C++ kernel."""
    twin = copy.deepcopy(layer)
    assert enable_cpu_kernels(twin) == 1
    return twin


@pytest.mark.parametrize("shape", [(7, 576), (3, 5, 64)])
def test_rms_norm_kernel_matches_torch(shape: tuple[int, ...]) -> None:
    norm = RMSNorm(shape[-1], eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    fast = cpu_twin(norm)
    x = torch.randn(shape) * 3
    torch.testing.assert_close(fast(x), norm(x), atol=1e-5, rtol=1e-5)
    wide = torch.randn(shape[0], 2 * shape[-1])[:, : shape[-1]]  # a strided view, as q/k norms get
    torch.testing.assert_close(fast(wide), norm(wide), atol=1e-5, rtol=1e-5)
    residual = torch.randn(7, 576)
    x = torch.randn(7, 576)
    norm576 = RMSNorm(576)
    want_out, want_residual = norm576.forward_with_residual(x.clone(), residual.clone())
    got_out, got_residual = cpu_twin(norm576).forward_with_residual(x.clone(), residual.clone())
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)  # one add, same rounding
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)


def test_rope_kernel_matches_torch_and_rotates_in_place() -> None:
    rope = RotaryEmbedding(64, default_inv_freq(64, 10000.0), max_positions=4096)
    fast = cpu_twin(rope)
    assert fast.cos_sin_cache is not None and fast.cos_sin_cache.shape == (4096, 64)
    positions = torch.tensor([0, 1, 17, 4095, 300])
    qkv = torch.randn(5, (9 + 3 + 3) * 64)  # q and k are strided views, as the model passes them
    q, k = qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64]
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = fast(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated where it lies
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside the RoPE table"):
        fast(torch.tensor([4096]), torch.randn(1, 64), torch.randn(1, 64))


def test_silu_and_mul_kernel_matches_torch() -> None:
    act = SiluAndMul()
    x = torch.randn(6, 2 * 1536) * 4
    torch.testing.assert_close(cpu_twin(act)(x), act(x), atol=1e-5, rtol=1e-5)


# ---- linear ----------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
# Both packed paths; "cpu" is nanoengine's GEMM (the module needs its kernels anyway).
PACKED_BACKENDS = [pytest.param("onednn", marks=needs_onednn), "cpu"]


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 13, 64])
def test_packed_linear_matches_f_linear(backend: str, bias: bool, rows: int) -> None:
    # 80 output columns: two full 32-column panels of the C++ GEMM and a partial
    # one; 13 rows: a full 12-row register tile and a 1-row tail.
    layer = QKVLinear(hidden_size=48, head_dim=8, num_heads=6, num_kv_heads=2, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 48)
    want = layer(x)
    layer.pack(backend)
    assert layer.packed and backend in layer.extra_repr()
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
    assert layer(x[:, None, :]).shape == (rows, 1, 48 + 2 * 16)  # any leading dims
    torch.testing.assert_close(layer(x.t().contiguous().t()), want, atol=1e-4, rtol=1e-5)  # strided rows


def test_cpu_gemm_large_products_cross_its_row_blocks() -> None:
    # K = 1536 makes a row block 36 rows (256 KB of x), so 100 rows take three
    # blocks: the outer loop of packed_linear, not only its tiles, is exercised.
    weight, x = torch.randn(70, 1536), torch.randn(100, 1536)
    packed = load_cpu_ops().pack_linear_weight(weight)
    assert packed.shape == (3, 1536, 32)
    torch.testing.assert_close(cpu_linear(x, packed, None, 70), x @ weight.t(), atol=1e-3, rtol=1e-5)
    with pytest.raises(RuntimeError, match="must share K"):
        cpu_linear(torch.randn(2, 1535), packed, None, 70)


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
def test_tied_lm_head_packs_its_own_copy(backend: str) -> None:
    embedding = VocabEmbedding(100, 16)
    torch.nn.init.normal_(embedding.weight)
    head = LMHead(100, 16, tied_to=embedding)
    hidden = torch.randn(3, 16)
    want = head(hidden)
    plain = embedding.weight.detach().clone()
    head.pack(backend)
    assert head.weight is not embedding.weight and torch.equal(embedding.weight, plain)
    torch.testing.assert_close(head(hidden), want, atol=1e-4, rtol=1e-5)


@needs_onednn
def test_resolve_linear_backend() -> None:
    cpu = torch.device("cpu")
    wide = load_cpu_ops().packed_linear_has_wide_vectors()
    assert resolve_linear_backend("auto", cpu, torch.float32) == ("cpu" if wide else "onednn")
    assert resolve_linear_backend("auto", cpu, torch.bfloat16) == "onednn"
    assert resolve_linear_backend("auto", cpu, torch.float16) == "torch"
    assert resolve_linear_backend("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ValueError, match="float16"):
        resolve_linear_backend("onednn", cpu, torch.float16)
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_linear_backend("cpu", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        resolve_linear_backend("mkl", cpu, torch.float32)


@pytest.mark.parametrize("backend", PACKED_BACKENDS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_model_logits_match_torch_model(
    backend: str, family: str, tiny_model_factory: Callable[..., str]
) -> None:
    path = tiny_model_factory(family)
    config = AutoConfig.from_pretrained(path)
    models = {
        name: get_model(path, config, torch.float32, torch.device("cpu"), name) for name in ("torch", backend)
    }
    hidden = torch.randn(5, config.hidden_size)
    logits = {name: model.compute_logits(hidden) for name, model in models.items()}
    torch.testing.assert_close(logits[backend], logits["torch"], atol=1e-4, rtol=1e-5)
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
    for line in open("/proc/self/smaps", encoding="ascii"):
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
    thread = executor.collective_rpc(threading.current_thread)
    assert thread is not threading.main_thread() and thread.name.startswith("nanoengine-forward")
    assert executor.collective_rpc(lambda a, b: a + b, 2, 3) == 5
