"""Rotary position embedding (RoPE), neox / "rotate half" layout, with Llama 3 scaling.

Chapter 7 (where a token's position enters the model).
vLLM 0.32 counterpart: ``vllm/model_executor/layers/rotary_embedding/``
(``get_rope``, ``base.py`` ``RotaryEmbedding``, ``llama3_rope.py``
``Llama3RotaryEmbedding``).

RoPE rotates each (x_i, x_{i + d/2}) pair of a query/key head by the angle
``position * inv_freq[i]``. Attention scores then depend only on the *distance*
between two positions, which is why a paged KV cache can store keys already
rotated and never touch them again.

Positions come in explicitly, one per token. That is the whole trick that lets a
flattened batch mix requests at different offsets: token t of the batch is
rotated by ``positions[t]``, whatever request it belongs to.

*Partial* rotary (``partial_rotary_factor`` < 1, Qwen3.5: 0.25) rotates only
the first ``rotary_dim`` dims of each head, pairing i with i + rotary_dim/2; the
remaining dims pass through unrotated and carry no position at all.

vLLM precomputes a cos/sin table up to ``max_position_embeddings``. The plain
torch path here computes cos and sin for just this step's positions instead (no
table to size); the C++ CPU kernel (``use_cpu_kernels``) reads a table, built
once. Both are taken in fp32 as HF does, then cast to the activation dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from nanoengine._custom_ops import load_cpu_ops
from nanoengine.model_executor.custom_op import CustomOp
from nanoengine.transformers_utils.config import trained_context_len

# rope_type values this module implements; "default" is plain RoPE.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RotaryEmbedding(CustomOp):
    """Applies RoPE to flattened query and key heads given per-token positions."""

    inv_freq: torch.Tensor  # [rotary_dim // 2] fp32, registered as a buffer

    def __init__(
        self, head_dim: int, inv_freq: torch.Tensor, max_positions: int = 2048, rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}.")
        if inv_freq.shape != (rotary_dim // 2,):
            raise ValueError(
                f"inv_freq must have rotary_dim // 2 = {rotary_dim // 2} entries, got {tuple(inv_freq.shape)}."
            )
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        # Not persistent: it is derived from the config, never read from a checkpoint
        # (some old checkpoints do carry it; the loader skips those entries).
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_positions = max_positions
        # [max_positions, head_dim] (cos | sin), built only for the C++ kernel.
        self.cos_sin_cache: torch.Tensor | None = None

    def prepare_cpu_kernels(self) -> None:
        # The kernel rotates whole heads (it reads head_dim as both the head
        # stride and the rotated width), so partial rotary keeps the torch path:
        # with no table, forward never calls the kernel.
        if self.rotary_dim == self.head_dim:
            self.cos_sin_cache = cos_sin_table(self.max_positions, tuple(self.inv_freq.tolist()))

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens]; query [num_tokens, num_heads * head_dim];
        key [num_tokens, num_kv_heads * head_dim]. Returns both rotated, same shapes.

        With ``use_cpu_kernels`` one C++ call rotates both *in place* (they are
        fresh projection outputs) from the precomputed table, and returns them.
        """
        if self.use_cpu_kernels and self.cos_sin_cache is not None:
            load_cpu_ops().rotary_embedding(positions.long(), query, key, self.cos_sin_cache, self.head_dim)
            return query, key
        # [num_tokens, rotary_dim // 2] angles, in fp32 whatever the model dtype
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        # [num_tokens, 1, rotary_dim // 2]: the middle axis broadcasts over heads
        cos = angles.cos().to(query.dtype)[:, None, :]
        sin = angles.sin().to(query.dtype)[:, None, :]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # [num_tokens, heads * head_dim] -> [num_tokens, heads, head_dim]
        heads = x.unflatten(-1, (-1, self.head_dim))
        # Partial rotary: only the leading rotary_dim dims of each head turn
        # (rest is empty when rotary_dim == head_dim).
        rot, rest = heads.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        # Neox layout: element i pairs with element i + rotary_dim/2 (HF's rotate_half),
        # not with its neighbour i + 1 (the original GPT-J layout).
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
        return rotated.flatten(-2)


@functools.cache
def cos_sin_table(max_positions: int, inv_freq: tuple[float, ...]) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos then sin of ``position * inv_freq``.

    vLLM's ``cos_sin_cache``. The angles are the same fp32 products the
    per-step path computes, so the table's entries are bit-identical to it.
    Cached by value: every layer of a model shares one table.
    """
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * torch.tensor(inv_freq)[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """[rotary_dim // 2] fp32: theta^(-2i / rotary_dim), the original RoPE frequencies
    (rotary_dim is the head size unless the rotary is partial)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's context extension: slow down only the low frequencies.

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor``
    are kept (they encode local order); those longer than ``... / low_freq_factor``
    are divided by ``factor`` (stretched to cover the longer context); the band in
    between blends the two linearly in 1 / wavelength.
    """
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])

    wavelen = 2 * math.pi / inv_freq
    high_freq_wavelen = old_context_len / high_freq_factor
    low_freq_wavelen = old_context_len / low_freq_factor
    # 0 at the low-frequency edge of the band, 1 at its high-frequency edge
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelen < high_freq_wavelen,
        inv_freq,
        torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended),
    )


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE settings of a config as one dict with ``rope_theta`` and ``rope_type``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs have
    ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict whose type
    key may still be spelled ``"type"``. A model whose layer kinds rotate
    differently (Gemma 3: local layers at theta 10,000, global ones at
    1,000,000) keeps one such dict per kind, under the ``layer_type`` names.
    """
    params = dict(
        getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    )
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def get_rope(head_dim: int, hf_config: Any, layer_type: str | None = None) -> RotaryEmbedding:
    """Build the RotaryEmbedding a config asks for (for layers of ``layer_type``,
    where the kinds differ); ValueError for unsupported kinds."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type '{rope_type}' is not supported by nanoengine. "
            f"Supported: {list(SUPPORTED_ROPE_TYPES)}."
        )
    # HF truncates head_dim * factor to an int, and so does vLLM.
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    inv_freq = default_inv_freq(rotary_dim, float(params["rope_theta"]))
    if rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, params)
    elif rope_type == "linear":
        # Positions stretched by the factor: every frequency divided by it.
        inv_freq = inv_freq / float(params["factor"])
    return RotaryEmbedding(head_dim, inv_freq, trained_context_len(hf_config), rotary_dim)
