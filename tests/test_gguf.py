"""GGUF weights kept as blocks (issue 49, first part): formats, kernels, loading, and the engine's tokens.

The tiny random Llama is written as a GGUF file here, the way llama.cpp's
converter writes one (q/k rows reordered for its RoPE, the norms in float32,
a tied head with no tensor of its own), one file per block format. Hugging
Face transformers reads the same file and dequantizes it: its greedy tokens
are what the engine must give on the torch reference path and on the C++
path (float activations); llama.cpp's GEMV (activations rounded to 8 bits,
``NANOENGINE_GGUF_ACTIVATIONS=q8``) must stay within a stated distance of its
logits. The kernel tests are named ``gguf_kernel`` so
that ``test_kernel_isa.py`` runs them again on the AVX2 build.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from chapters.grade_checks.tiny_gguf import random_blocks, write_gguf, write_tiny_gemma3_gguf
from nanoengine import LLM, SamplingParams
from nanoengine._custom_ops import cpu_ops_available, load_cpu_ops
from nanoengine.model_executor.layers.quantization import gguf as gguf_method
from nanoengine.model_executor.layers.quantization.gguf_blocks import (
    FORMATS,
    GGMLType,
    dequantize_blocks,
    row_bytes,
    to_q8_0,
)
from nanoengine.renderers.hf import TokensPrompt

# The formats the gguf package quantizes (one tiny Llama GGUF each); it reads all of FORMATS.
KEPT = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1]
K_QUANTS = [GGMLType.Q4_K, GGMLType.Q6_K]
needs_kernels = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels did not build here")


def some_blocks(qtype: GGMLType, rows: int) -> tuple[torch.Tensor, int]:
    """(uint8 blocks [rows, row_bytes], cols): quantized by the gguf package where it can, else random.
    Columns: 6 blocks of 32, or 3 super-blocks of 256 for a K-quant."""
    cols = 768 if qtype in K_QUANTS else 192
    if qtype in K_QUANTS:
        return torch.from_numpy(random_blocks(qtype, rows, cols, 1e-3, np.random.default_rng(0))), cols
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return torch.from_numpy(quants.quantize(x, GGMLQuantizationType(int(qtype)))), cols


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_the_reference_dequantizer_reads_blocks_as_ggml_does(qtype: GGMLType) -> None:
    blocks, cols = some_blocks(qtype, 5)
    assert blocks.shape == (5, row_bytes(qtype, cols))
    expected = quants.dequantize(blocks.numpy(), GGMLQuantizationType(int(qtype)))  # gguf's numpy port of ggml
    assert torch.equal(dequantize_blocks(blocks, qtype), torch.from_numpy(expected))


@needs_kernels
@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_gguf_kernel_dequantize_and_linear_against_the_reference(qtype: GGMLType) -> None:
    """The C++ dequantizer exactly; the float GEMV to float32 rounding of the float product of the
    same weight, the Q8 GEMV (Q8_0, Q4_0, Q4_1) within 1% of it (its activations are rounded to 8
    bits per block), for 1 to 17 rows and a bias."""
    ops = load_cpu_ops()
    blocks, cols = some_blocks(qtype, 200)
    reference = dequantize_blocks(blocks, qtype)  # [200, cols]
    assert torch.equal(ops.gguf_dequantize(blocks, int(qtype), cols), reference)
    bias = torch.randn(200)
    for rows in (1, 3, 8, 9, 17):  # one pass, several passes of 8 rows
        x = torch.randn(rows, cols)
        expected = torch.nn.functional.linear(x, reference, bias)
        torch.testing.assert_close(ops.gguf_linear(x, blocks, int(qtype), bias, cols), expected,
                                   rtol=1e-5, atol=1e-6 * expected.abs().max().item())
        if qtype in gguf_method.Q8_GEMV_FORMATS:
            got = ops.gguf_linear_q8(x, blocks, int(qtype), bias, cols)
            assert ((got - expected).norm() / expected.norm()).item() < 0.01, rows
    if qtype not in gguf_method.Q8_GEMV_FORMATS:
        with pytest.raises(RuntimeError, match="the 8-bit-activation GEMV takes Q8_0"):
            ops.gguf_linear_q8(torch.randn(1, cols), blocks, int(qtype), None, cols)
    fewer = cols - FORMATS[qtype].numbers  # one block fewer than the rows hold
    for gemv in (ops.gguf_linear, ops.gguf_linear_q8):
        with pytest.raises(RuntimeError, match="qweight rows hold"):
            gemv(torch.randn(1, fewer), blocks, int(qtype), None, fewer)
    with pytest.raises(RuntimeError, match=f"holds whole blocks of {FORMATS[qtype].numbers} numbers; cols = "):
        ops.gguf_linear(torch.randn(1, cols + 16), blocks, int(qtype), None, cols + 16)
    with pytest.raises(RuntimeError, match="GGML type 7 is not a block format kept here"):
        ops.gguf_dequantize(blocks, 7, cols)  # Q5_1


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_fused_parts_of_other_formats_become_q8_0(qtype: GGMLType) -> None:
    """Exactly from Q4_0 and Q5_0 (and Q8_0 itself); from the others within ~half a Q8_0 step
    (max|x| / 127 of its block of 32, its float16 scale rounding a little more)."""
    blocks, _ = some_blocks(qtype, 16)
    before = dequantize_blocks(blocks, qtype)  # [16, cols]
    after = dequantize_blocks(to_q8_0(blocks, qtype), GGMLType.Q8_0)
    if qtype in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0):
        assert torch.equal(after, before)
    else:
        step = before.reshape(16, -1, 32).abs().amax(dim=-1, keepdim=True) / 127  # [16, blocks, 1]
        assert ((after - before).reshape(16, -1, 32).abs() / step).max().item() < 0.55


def test_the_gemv_activations_are_named_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gguf_method.gemv_activations() == "float32"  # the default: the reference's products
    monkeypatch.setenv(gguf_method.ACTIVATIONS_ENV, "q8")
    assert gguf_method.GGUFLinearMethod(GGMLType.Q4_1).activations == "q8"
    monkeypatch.setenv(gguf_method.ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match=r"NANOENGINE_GGUF_ACTIVATIONS='int4': expected one of float32, q8"):
        gguf_method.GGUFLinearMethod(GGMLType.Q4_1)


# ------------------------------------------------------------------ a tiny GGUF Llama
@pytest.fixture(scope="module")
def gguf_dir(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the tiny Llama's config and tokenizer, and one GGUF per kept format."""
    folder = tmp_path_factory.mktemp("tiny-gguf")
    for item in Path(tiny_llama).iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
    for qtype in KEPT:
        write_gguf(tiny_llama, folder / f"tiny.{qtype.name}.gguf", qtype)
    return folder


PROMPTS = [[5 + i, 17, 33, 40, 41, 42, 50, 61 + i] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_model(gguf: Path) -> torch.nn.Module:
    """Hugging Face transformers' model of the same file, dequantized to float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                                 min_new_tokens=GREEDY.max_tokens, pad_token_id=0)
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def divergences_are_near_ties(model: torch.nn.Module, got: list[list[int]], expected: list[list[int]],
                              tolerance: float) -> list[str]:
    """Where the engine's tokens first leave HF's, HF's own logits must rate the engine's token
    within ``tolerance`` of the logit range below its top one: a near tie that 8-bit activations
    may flip. The sequences that do not diverge pass as they are."""
    problems = []
    with torch.inference_mode():
        for prompt, ours, theirs in zip(PROMPTS, got, expected):
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if first is None:
                continue
            logits = model(torch.tensor([prompt + theirs[:first]])).logits[0, -1]  # [vocab]
            gap = (logits[theirs[first]] - logits[ours[first]]).item() / (logits.max() - logits.min()).item()
            if gap > tolerance:
                problems.append(f"prompt {prompt}: token {first} is {ours[first]}, HF's {theirs[first]} "
                                f"leads it by {gap:.1%} of the logit range")
    return problems


def engine_greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_the_engine_on_a_gguf_gives_hugging_faces_tokens(gguf_dir: Path, qtype: GGMLType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch reference path (blocks dequantized, float products) and the C++ path against HF
    on the same file: the same greedy tokens. llama.cpp's GEMV (Q4_1 only: it is the same code
    for each format) rounds activations to 8 bits: where its tokens leave HF's, HF's logits must
    show a near tie (within 2% of the logit range)."""
    gguf = gguf_dir / f"tiny.{qtype.name}.gguf"
    model = hf_model(gguf)
    expected = hf_greedy(model)
    with gguf_method.torch_reference_only():
        reference = LLM(str(gguf), dtype="float32", max_model_len=64, attention_backend="torch")
        runner = reference.llm_engine.engine_core.get_engine_core().model_executor.driver_worker.model_runner
        assert runner.model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.uint8  # the blocks are kept
        assert engine_greedy(reference) == expected
    if not cpu_ops_available():
        return
    assert engine_greedy(LLM(str(gguf), dtype="float32", max_model_len=64)) == expected
    if qtype == GGMLType.Q4_1:
        monkeypatch.setenv(gguf_method.ACTIVATIONS_ENV, "q8")
        q8 = LLM(str(gguf), dtype="float32", max_model_len=64)
        assert divergences_are_near_ties(model, engine_greedy(q8), expected, tolerance=0.02) == []


def test_a_gemma3_gguf_in_a_q4_k_m_mix_gives_hugging_faces_tokens(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Gemma 3 in a Q4_K_M file's mix of formats (Q5_0, Q8_0, Q4_K, Q6_K; its q, k and v
    fused, so kept in Q8_0), no config.json beside it: the engine reads the config from the
    metadata, takes the norms' 1 off, and gives transformers' greedy tokens on the torch
    reference path and on the C++ path, with prompts longer than the local layers' window."""
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gemma3_gguf(tmp_path / "tiny-gemma3.gguf", sliding_window=8)
    model = hf_model(gguf)
    expected = hf_greedy(model)
    assert len({tuple(tokens) for tokens in expected}) > 1  # not one token everywhere
    llms = [LLM(str(gguf), dtype="float32", max_model_len=64, skip_tokenizer_init=True)]
    runner = llms[0].llm_engine.engine_core.get_engine_core().model_executor.driver_worker.model_runner
    attention = runner.model.model.layers[0].self_attn
    assert (attention.attn.sliding_window, runner.model.model.layers[5].self_attn.attn.sliding_window) == (8, None)
    assert attention.qkv_proj.weight.shape == (512, row_bytes(GGMLType.Q8_0, 256))  # q, k from Q5_0 to Q8_0
    assert attention.o_proj.quant_method.qtype == GGMLType.Q4_K
    with gguf_method.torch_reference_only():
        assert engine_greedy(llms[0]) == expected
    if cpu_ops_available():
        assert engine_greedy(llms[0]) == expected
    # A folder whose only weights are one GGUF (as prepare_model.py leaves gemma-3-270m) needs no flag.
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(next((tmp_path / "cache" / "gguf").glob("tiny-gemma3-*/config.json")), folder)
    shutil.copy(gguf, folder)
    model_config = LLM(str(folder), dtype="float32", max_model_len=64,
                       skip_tokenizer_init=True).llm_engine.engine_config.model_config
    assert (model_config.quantization, model_config.gguf_file) == ("gguf", str(folder / gguf.name))


def test_quantization_gguf_on_a_folder_reads_its_one_gguf(gguf_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "one"
    shutil.copytree(gguf_dir, folder)
    for extra in ("Q8_0", "Q4_0"):
        (folder / f"tiny.{extra}.gguf").unlink()
    llm = LLM(str(folder), quantization="gguf", dtype="float32", max_model_len=64)
    assert llm.llm_engine.engine_config.model_config.gguf_file == str(folder / "tiny.Q4_1.gguf")
    with pytest.raises(ValueError, match=r"needs exactly one \.gguf file .* 3 \.gguf files"):
        LLM(str(gguf_dir), quantization="gguf")


def test_a_gguf_alone_gets_its_config_from_its_metadata(gguf_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """No config.json beside the file: the config comes from the GGUF (kept in the cache once),
    and the engine gives the tokens it gives with the folder's config."""
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path / "cache"))
    alone = tmp_path / "alone" / "tiny.gguf"
    alone.parent.mkdir()
    shutil.copy(gguf_dir / "tiny.Q8_0.gguf", alone)
    from_metadata = LLM(str(alone), dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    from_folder = LLM(str(gguf_dir / "tiny.Q8_0.gguf"), dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    assert engine_greedy(from_metadata) == engine_greedy(from_folder)
    assert list((tmp_path / "cache" / "gguf").glob("tiny-*/config.json"))


def test_a_truncated_or_foreign_gguf_is_refused_by_name(gguf_dir: Path, tmp_path: Path) -> None:
    whole = (gguf_dir / "tiny.Q8_0.gguf").read_bytes()
    cut = tmp_path / "cut" / "tiny.gguf"
    cut.parent.mkdir()
    for item in gguf_dir.glob("*.json"):
        shutil.copy(item, cut.parent / item.name)
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"tiny\.gguf is not a readable GGUF file \(truncated"):
        LLM(str(cut), dtype="float32", max_model_len=64)
    foreign = cut.parent / "foreign.gguf"
    writer = GGUFWriter(str(foreign), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported; supported: llama"):
        LLM(str(foreign), dtype="float32", max_model_len=64)
