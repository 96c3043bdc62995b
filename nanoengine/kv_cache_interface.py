"""What one KV cache block costs and how many the engine got.

Chapter 4 (KV cache manager) and chapter 6 (``determine_available_memory``).
vLLM 0.32 counterpart: ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``,
``KVCacheConfig``).

The worker reports a spec (the shape of one block); the engine divides the memory
budget by the spec's page size and hands the result to both sides: the scheduler's
KV cache manager counts blocks, the worker allocates the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

# The KV cache group whose block tables paged attention reads. Block ids travel
# as one list per group (vLLM's ``tuple[list[int], ...]``); every model
# nanoengine serves has one group, group 0, holding all its layers.
FULL_ATTENTION_GROUP = 0


@dataclass(frozen=True)
class FullAttentionSpec:
    """The KV layout of every layer of a decoder-only model with full attention."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_size: int  # bytes per element: 4 for fp32, 2 for bf16/fp16
    num_layers: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block across all layers: K and V, each
        [block_size, num_kv_heads, head_dim], per layer.
        """
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_size
        return per_layer * self.num_layers


@dataclass(frozen=True)
class KVCacheConfig:
    """The decision of chapter 6: this many blocks of this spec."""

    num_blocks: int
    spec: FullAttentionSpec

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.spec.page_size_bytes
