"""Read a GGUF file (llama.cpp's one-file checkpoint): its weights as blocks, under Hugging Face's names.

Chapter 6 (where the weights of ``LLM(...)`` come from). vLLM 0.32
counterpart: none (0.32 reads no GGUF file; earlier releases had a
``GGUFModelLoader``); the weights reach ``load_weights`` as a stream of
(name, tensor) pairs, the way ``vllm/model_executor/model_loader/weight_utils.py``
streams safetensors.

A GGUF file holds metadata (the architecture, the shapes, the tokenizer) and
tensors named llama.cpp's way: ``blk.3.attn_q.weight`` is Hugging Face's
``model.layers.3.self_attn.q_proj.weight``. ``GGUFCheckpoint`` maps the names
and yields each weight as the model's ``load_weights`` wants it: a float
tensor for the float ones (norms), the raw blocks -- uint8 [rows, row_bytes],
straight from the memory-mapped file -- for the quantized ones, which the
layers keep as they are (``layers/quantization/gguf.py``).

Two architectures are read, each with its own table of names: ``llama``
(SmolLM2, Llama) and ``gemma3`` (Gemma 3's text model, whose layers have four
norms and a q/k norm). Each takes one fix on the way in.

A Llama's q and k projections: llama.cpp's converter reorders the
rows of a Llama's q and k projections within each head, to suit its own RoPE
(it rotates adjacent pairs, (0, 1), (2, 3) ...; Hugging Face rotates the two
halves of a head, (0, d/2), (1, d/2 + 1) ...). The reader undoes it by
reordering whole rows, which works as well on a matrix of blocks as on floats:
a row of blocks is one output feature. E.g. one head of 4 rows, stored as
[r0, r2, r1, r3], comes back as [r0, r1, r2, r3].

A Gemma 3's norms: Hugging Face's ``GemmaRMSNorm`` scales by ``1 + w``, and
llama.cpp's converter stores ``1 + w`` so that its plain RMSNorm can scale by
it; the reader takes the 1 back off (e.g. a stored 16.0 is Hugging Face's 15.0).

Weights may be F32, F16, BF16, or any block format of ``gguf_blocks.FORMATS``
(Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K). Anything else is refused, naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nanoengine.model_executor.layers.quantization.gguf import GGUFConfig
from nanoengine.model_executor.layers.quantization.gguf_blocks import FORMATS, GGMLType, to_q8_0

# GGUF's architecture name -> the Hugging Face class nanoengine runs it with.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# Float types a GGUF tensor may have (loaded as torch tensors of the model's dtype).
FLOAT_TYPES = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
# llama.cpp's tensor names -> Hugging Face's module names, outside and inside a layer.
TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PER_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3's layer: the same projections, a norm on each side of attention and of
# the MLP (llama.cpp's ffn_norm is the one before the MLP), and q/k norms.
GEMMA3_PER_LAYER_NAMES = PER_LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
LAYER_NAMES = {"llama": PER_LAYER_NAMES, "gemma3": GEMMA3_PER_LAYER_NAMES}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if (match := _LAYER_TENSOR.fullmatch(gguf_name)) is not None:
        layer, part, kind = match.groups()
        names = LAYER_NAMES[architecture]
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{TOP_LEVEL_NAMES[stem]}.{kind}" if stem in TOP_LEVEL_NAMES else None


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows within each head (see the module docstring).

    [heads * head_dim, ...]: within a head, row 2i + j (j in 0, 1) goes to row j * head_dim / 2 + i.
    """
    half = rows.shape[0] // num_heads // 2
    shaped = rows.reshape(num_heads, half, 2, *rows.shape[1:])  # [heads, head_dim / 2, 2, ...]
    return shaped.transpose(1, 2).reshape(rows.shape)


class GGUFCheckpoint:
    """An opened GGUF file: its architecture, and its tensors under Hugging Face's names."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except Exception as error:
            raise ValueError(f"{self.path} is not a readable GGUF file (truncated, or not GGUF at all): "
                             f"{type(error).__name__}: {error}") from error
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"{self.path.name}: GGUF architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}.")
        self.tensors = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name, self.architecture)
            if name is None:
                raise ValueError(f"{self.path.name}: tensor {tensor.name!r} has no place in a "
                                 f"{ARCHITECTURES[self.architecture]}.")
            self.tensors[name] = tensor
            self._check_type(tensor)

    def field(self, key: str) -> Any:
        """One metadata value (a string or a number), e.g. ``llama.attention.head_count``."""
        field = self.reader.fields.get(key)
        if field is None:
            raise ValueError(f"{self.path.name} has no metadata key {key!r}.")
        value = field.parts[field.data[0]]
        return bytes(value).decode() if value.dtype == np.uint8 else value.item()

    def _check_type(self, tensor: Any) -> None:
        kind = int(tensor.tensor_type)
        if kind not in {*FORMATS, *FLOAT_TYPES}:
            kept = ", ".join(t.name for t in (*FLOAT_TYPES, *FORMATS))
            raise ValueError(f"{self.path.name}: tensor {tensor.name!r} is {tensor.tensor_type.name}, a GGML type "
                             f"nanoengine does not keep; it keeps {kept}.")

    def weight_types(self) -> dict[str, GGMLType]:
        """Hugging Face name -> GGML type of every tensor in the file."""
        return {name: GGMLType(int(tensor.tensor_type)) for name, tensor in self.tensors.items()}

    def weights(self, to_q8: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) of every weight: blocks as uint8 [rows, row_bytes], floats as floats;
        the weights named in ``to_q8`` as Q8_0 blocks (``gguf_config`` says which)."""
        heads = int(self.field(f"{self.architecture}.attention.head_count"))
        kv_heads = int(self.field(f"{self.architecture}.attention.head_count_kv"))
        for name, tensor in self.tensors.items():
            kind = GGMLType(int(tensor.tensor_type))
            data = torch.from_numpy(np.array(tensor.data))  # a copy: the memory-mapped file is read-only
            if kind in FLOAT_TYPES:
                data = data.view(FLOAT_TYPES[kind])
            if self.architecture == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                data = unpermute_rows(data, heads if ".q_proj." in name else kv_heads)
            if self.architecture == "gemma3" and name.endswith("norm.weight"):
                data = data - 1  # stored as 1 + w (see the module docstring)
            if name in to_q8:
                data = to_q8_0(data, kind if kind in FORMATS else None)
            yield name, data


def gguf_config(checkpoint: GGUFCheckpoint, model: nn.Module, tie_word_embeddings: bool) -> GGUFConfig:
    """The quantization config of ``model`` loaded from ``checkpoint``: each weight's GGML type.

    A tied LM head has no tensor of its own in the file (llama.cpp writes
    ``output.weight`` only when it differs from the embedding): it multiplies
    by the embedding's blocks, so it takes the embedding's type. A fused
    parameter whose parts differ in type (a ``Q4_K_M`` file's q and k in Q5_0,
    its v in Q8_0) keeps all of them in Q8_0: the config records them in
    ``to_q8``, and ``GGUFCheckpoint.weights(to_q8)`` converts them
    (``gguf_blocks.to_q8_0``; exact from Q5_0 and Q4_0).
    """
    from nanoengine.model_executor.models.llama import to_checkpoint_names

    types = checkpoint.weight_types()
    if tie_word_embeddings and "lm_head.weight" not in types and "model.embed_tokens.weight" in types:
        types["lm_head.weight"] = types["model.embed_tokens.weight"]
    names = {name: to_checkpoint_names(name) for name, _ in model.named_parameters(remove_duplicate=False)}
    mixed = {part for parts in names.values() if len({types.get(p) for p in parts} - {None}) > 1 for part in parts}
    return GGUFConfig(types | dict.fromkeys(mixed, GGMLType.Q8_0), names, to_q8=frozenset(mixed))
