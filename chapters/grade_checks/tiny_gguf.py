"""A tiny random Llama written as a GGUF file, the way llama.cpp's converter writes one; a tiny Gemma 3 too.

Exercise 2.1 (chapter 2) runs the engine on it end to end, and
``tests/test_gguf.py`` writes one file per block format with ``write_gguf``:
the q and k rows reordered for llama.cpp's RoPE (the loader must undo it), the
norms kept in float32, a tied head with no tensor of its own, every matrix in
the one block format asked for (quantized by the ``gguf`` package's numpy port
of ggml).

``write_tiny_gemma3_gguf`` writes a tiny Gemma 3 as a ``Q4_K_M`` file mixes
its formats (q and k in Q5_0, v in Q8_0, the MLP in Q4_K and Q6_K): the
``gguf`` package quantizes no K-quant, so its matrices are random blocks
(``random_blocks``), which is all a test of reading them needs.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

from chapters.grade_checks.tiny_model import tiny_llama_model_dir
from nanoengine.model_executor.layers.quantization.gguf_blocks import FORMATS, GGMLType
from nanoengine.model_executor.model_loader.gguf_loader import PER_LAYER_NAMES, TOP_LEVEL_NAMES

# Hugging Face's module names -> llama.cpp's tensor names: the loader's table, turned round.
GGUF_NAMES = {hf: gguf for gguf, hf in (TOP_LEVEL_NAMES | PER_LAYER_NAMES).items()}


# Where each format's float16 scales sit in a block (byte offsets; the rest are integers).
SCALE_OFFSETS = {GGMLType.Q8_0: (0,), GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,),
                 GGMLType.Q4_K: (0, 2), GGMLType.Q6_K: (208,)}


def random_blocks(qtype: GGMLType, rows: int, cols: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks whose float16 scales lie in [scale / 2, scale]."""
    fmt = FORMATS[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // fmt.numbers, fmt.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.uniform(0.5, 1.0, size=blocks.shape[:2]) * scale).astype(np.float16)  # [rows, blocks]
        blocks[..., offset:offset + 2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def llamacpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: within a head, row j * d/2 + i goes to row 2i + j."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, -1).transpose(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``."""
    stem = hf_name.removesuffix(".weight")
    if stem.startswith("model.layers."):
        layer, part = stem.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{GGUF_NAMES[part]}.weight"
    return f"{GGUF_NAMES[stem]}.weight"


def write_gguf(model_dir: str, target: Path, qtype: GGMLType) -> Path:
    """A Llama folder's weights as the GGUF ``target``, its matrices in ``qtype``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = GGUFWriter(str(target), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        name = gguf_name(name)
        if ".attn_q." in name or ".attn_k." in name:
            tensor = llamacpp_rows(tensor, heads if ".attn_q." in name else kv_heads)
        data = tensor.float().numpy()
        if data.ndim == 1:  # norms stay float32, as llama.cpp keeps them
            writer.add_tensor(name, data)
        else:
            kind = GGMLQuantizationType(int(qtype))
            writer.add_tensor(name, quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@functools.cache
def tiny_gguf_file(qtype: GGMLType) -> str:
    """The grader's tiny Llama (2 KV heads) as one GGUF in ``qtype``, its config.json beside it,
    written once per process into a temporary folder removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix=f"nanoengine-tiny-gguf-{qtype.name}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    source = tiny_llama_model_dir(2)
    shutil.copy(Path(source) / "config.json", folder / "config.json")
    return str(write_gguf(source, folder / f"tiny.{qtype.name}.gguf", qtype))


def write_tiny_gemma3_gguf(target: Path, sliding_window: int = 8) -> Path:
    """A tiny random Gemma 3 (6 layers: 5 local, 1 global; hidden 256, vocabulary 512) as the GGUF ``target``.

    Its matrices are random blocks in a ``Q4_K_M`` file's mix, the norms float32 around 1 (llama.cpp
    stores Gemma's norms as 1 + w), the head tied to a Q8_0 embedding. The scales keep the
    activations of every layer of the order of 1, so greedy tokens are not all ties.
    """
    hidden, heads, kv_heads, head_dim, intermediate, layers, vocab = 256, 2, 1, 128, 512, 6, 512
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(target), "gemma3")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(sliding_window)
    writer.add_vocab_size(vocab)

    def matrix(name: str, qtype: GGMLType, rows: int, cols: int, scale: float) -> None:
        kind = GGMLQuantizationType(int(qtype))
        writer.add_tensor(name, random_blocks(qtype, rows, cols, scale, rng), raw_dtype=kind)

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1 + rng.uniform(-0.3, 0.3, size)).astype(np.float32))

    matrix("token_embd.weight", GGMLType.Q8_0, vocab, hidden, 3e-4)
    norm("output_norm.weight", hidden)
    for layer in range(layers):
        block = f"blk.{layer}"
        matrix(f"{block}.attn_q.weight", GGMLType.Q5_0, heads * head_dim, hidden, 4e-3)
        matrix(f"{block}.attn_k.weight", GGMLType.Q5_0, kv_heads * head_dim, hidden, 4e-3)
        matrix(f"{block}.attn_v.weight", GGMLType.Q8_0, kv_heads * head_dim, hidden, 5e-4)
        matrix(f"{block}.attn_output.weight", GGMLType.Q4_K, hidden, heads * head_dim, 2e-4)
        matrix(f"{block}.ffn_gate.weight", GGMLType.Q4_K, intermediate, hidden, 2e-4)
        matrix(f"{block}.ffn_up.weight", GGMLType.Q4_K, intermediate, hidden, 2e-4)
        matrix(f"{block}.ffn_down.weight", GGMLType.Q6_K, hidden, intermediate, 2e-4)
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(f"{block}.{name}.weight", hidden)
        for name in ("attn_q_norm", "attn_k_norm"):
            norm(f"{block}.{name}.weight", head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
