"""A tiny random Llama written as a GGUF file, the way llama.cpp's converter writes one.

Exercise 2.1 (chapter 2) runs the engine on it end to end, and
``tests/test_gguf.py`` writes one file per block format with ``write_gguf``:
the q and k rows reordered for llama.cpp's RoPE (the loader must undo it), the
norms kept in float32, a tied head with no tensor of its own, every matrix in
the one block format asked for (quantized by the ``gguf`` package's numpy port
of ggml).

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

from chapters.grade_checks.tiny_model import tiny_llama_model_dir
from nanoengine.model_executor.layers.quantization.gguf_blocks import GGMLType
from nanoengine.model_executor.model_loader.gguf_loader import PER_LAYER_NAMES, TOP_LEVEL_NAMES

# Hugging Face's module names -> llama.cpp's tensor names: the loader's table, turned round.
GGUF_NAMES = {hf: gguf for gguf, hf in (TOP_LEVEL_NAMES | PER_LAYER_NAMES).items()}


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
