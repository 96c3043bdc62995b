"""What one KV cache block costs, how the layers share the cache, and how many blocks the engine got.

Chapter 4 (KV cache manager; hybrid models) and chapter 6 (``determine_available_memory``).
vLLM 0.32 counterpart: ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``,
``SlidingWindowSpec``, ``MambaSpec``, ``KVCacheGroupSpec``, ``KVCacheTensor``,
``KVCacheConfig``).

The worker reports a spec (the shape of one block); the engine divides the memory
budget by what one block costs and hands the result to both sides: the scheduler's
KV cache manager counts blocks, the worker allocates the tensors.

A layer keeps one of three kinds of per-request memory:

* full attention (``FullAttentionSpec``): K and V of every token so far, so a
  request's memory grows with its length, one block per ``block_size`` tokens;
* sliding-window attention (``SlidingWindowSpec``): the same pages, but a token
  only looks at the last ``sliding_window`` tokens (itself included), so the
  blocks that fall out of every later token's window can be given back: a
  request's memory stops growing once it is longer than the window;
* a recurrent state (``MambaSpec``: Mamba, or the Gated DeltaNet "linear
  attention" of Qwen3.5): a fixed number of bytes, however long the request.

A plain model has one *KV cache group*: all its layers share one block table per
request. A hybrid model splits its layers into groups of equal size, each of one
kind and with a block table of its own; ``core/kv_cache_groups.py`` explains how
the groups share memory and ``group_kv_cache_layers`` builds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from nanoengine.utils.math_utils import cdiv

# The KV cache group the KV connectors (chapter 10) move. Block ids travel as one
# list per group (vLLM's ``tuple[list[int], ...]``). A plain model has one
# group, holding all its layers; a hybrid model's K/V groups come first
# (``group_kv_cache_layers``), full attention before sliding windows, so group 0
# keeps K and V in every model: full attention, or a sliding window when every
# layer has one (Mistral).
FULL_ATTENTION_GROUP = 0


@dataclass(frozen=True)
class FullAttentionSpec:
    """The KV layout of ``num_layers`` full-attention layers of a decoder-only model."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_size: int  # bytes per element: 4 for fp32, 2 for bf16/fp16
    num_layers: int

    @property
    def page_size_per_layer(self) -> int:
        """Bytes of one block in one layer: K and V, each [block_size, num_kv_heads, head_dim]."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block across all ``num_layers`` layers."""
        return self.page_size_per_layer * self.num_layers

    def num_blocks_for(self, num_tokens: int) -> int:
        """Entries of the block table of a request of ``num_tokens`` tokens: one per ``block_size`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request can hold at once: all of the longest one's.

        vLLM's ``max_memory_usage_bytes``, counted in blocks (every group's page
        is the same size, so blocks are what the sizing adds up).
        """
        return self.num_blocks_for(max_model_len)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full attention's pages, for layers whose tokens see only the last ``sliding_window`` tokens.

    The window counts the token itself, as in HF transformers and vLLM: the
    token at position ``p`` reads keys ``p - sliding_window + 1 .. p``. The
    block table keeps one entry per ``block_size`` tokens, as for full
    attention, but entries wholly before every later token's window hold the
    null block instead of a real one (``SlidingWindowManager``).

    vLLM derives both specs from one ``AttentionSpec``; here a sliding spec *is*
    a full-attention spec plus a window, since the pages are the same: code
    that only lays out K/V pages treats both alike, and only the manager that
    decides which blocks a request keeps tells them apart.
    """

    sliding_window: int

    def __post_init__(self) -> None:
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {self.sliding_window}.")

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request holds at once: a window plus one step's tokens.

        A step that computes ``n`` tokens needs the ``sliding_window - 1`` keys
        before its first one and slots for all ``n``. Those tokens straddle
        block boundaries, hence one block more than they fill. Never more than
        full attention would hold. vLLM 0.32 sizes ``SlidingWindowSpec`` the same way.
        """
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return min(cdiv(num_tokens, self.block_size) + 1, self.num_blocks_for(max_model_len))


@dataclass(frozen=True)
class MambaSpec:
    """The recurrent state one layer keeps per request: fixed bytes, whatever its length.

    vLLM's name covers every state-space or linear-attention layer. ``shapes``
    lists one request's state tensors in one layer; for Gated DeltaNet they
    are the causal convolution's window ``(conv_dim, conv_kernel - 1)`` and the
    recurrent matrix ``(num_v_heads, head_k_dim, head_v_dim)``.

    ``block_size`` is how many tokens one state block stands for. Without
    prefix caching vLLM sets it to ``max_model_len``, so that a request of any
    length holds exactly one block; nanoengine does the same (``MambaManager``
    checks it). ``page_size_padded`` is the page once padded up to the
    attention page (``group_kv_cache_layers``), None before.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype_size: int
    block_size: int
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        if self.page_size_padded is not None and self.page_size_padded < self.state_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the state "
                f"it must hold ({self.state_bytes} bytes)."
            )

    @property
    def state_bytes(self) -> int:
        """One request's state in one layer, before padding."""
        return sum(math.prod(shape) for shape in self.shapes) * self.dtype_size

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (one request's state) in one layer, padding included."""
        return self.page_size_padded if self.page_size_padded is not None else self.state_bytes

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds: one, once it has a token."""
        return cdiv(num_tokens, self.block_size)

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """One block, whatever the request's length."""
        return self.num_blocks_for(max_model_len)


# SlidingWindowSpec is a FullAttentionSpec, so the union names it only for the reader.
KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table per request, and the spec of each of them.

    ``kv_cache_spec`` describes *one* layer of the group (a ``FullAttentionSpec``
    or ``SlidingWindowSpec`` with ``num_layers=1``, or a ``MambaSpec``); layer ``layer_indices[j]`` keeps
    its pages in shared tensor ``j`` (see ``KVCacheConfig.kv_cache_tensors``).
    """

    layer_indices: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


class KVCacheTensor(NamedTuple):
    """One tensor the worker allocates, and the layers that keep their pages in it.

    The layers in ``shared_by`` belong to different groups, so a block id is
    in use by one of them at a time: they never write the same page.
    """

    size: int  # bytes: num_blocks pages of page_size_per_layer
    shared_by: tuple[int, ...]  # layer indices, one per group that has a j-th layer


def num_blocks_for(groups: tuple[KVCacheGroupSpec, ...], num_tokens: int) -> int:
    """Block-table entries of a request of ``num_tokens`` tokens over all its tables."""
    return sum(group.kv_cache_spec.num_blocks_for(num_tokens) for group in groups)


def max_num_blocks(groups: tuple[KVCacheGroupSpec, ...], max_model_len: int, max_num_batched_tokens: int) -> int:
    """The most blocks one request holds at once over all its tables (a sliding
    window's group holds a bounded number, see ``SlidingWindowSpec.max_num_blocks``).
    """
    return sum(group.kv_cache_spec.max_num_blocks(max_model_len, max_num_batched_tokens) for group in groups)


@dataclass(frozen=True)
class KVCacheConfig:
    """The decision of chapter 6: this many blocks, and the groups that share them.

    ``KVCacheConfig(num_blocks=..., spec=...)`` is a plain model: one group of
    all ``spec.num_layers`` layers, each in a tensor of its own, and one block id
    costs ``spec.page_size_bytes`` (K and V of ``block_size`` tokens, every layer).

    ``spec`` may be a ``SlidingWindowSpec``: a model whose every layer has the
    same window (Mistral) is a plain model too.

    A hybrid model passes its ``kv_cache_groups`` too (``group_kv_cache_layers``
    builds both); ``spec`` then stands for all its K/V layers (full attention
    and sliding windows alike) at the block size the groups agreed on. One block id costs ``bytes_per_block``: a
    page in each of the ``num_shared_tensors`` shared tensors, whichever group
    holds it, since each group's ``j``-th layer uses tensor ``j``.
    """

    num_blocks: int
    spec: FullAttentionSpec
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = ()

    def __post_init__(self) -> None:
        if not self.kv_cache_groups:
            one_layer = replace(self.spec, num_layers=1)
            every_layer = KVCacheGroupSpec(tuple(range(self.spec.num_layers)), one_layer)
            # A frozen dataclass sets its own derived fields through object.__setattr__.
            object.__setattr__(self, "kv_cache_groups", (every_layer,))
        page_sizes = {group.kv_cache_spec.page_size_bytes for group in self.kv_cache_groups}
        if len(page_sizes) != 1:
            raise ValueError(
                f"Every KV cache group needs the same page size per layer to share the cache, "
                f"got {sorted(page_sizes)} bytes (build the groups with group_kv_cache_layers)."
            )
        block_sizes = {self.kv_cache_groups[i].kv_cache_spec.block_size for i in self.attention_group_ids}
        if block_sizes != {self.spec.block_size}:
            raise ValueError(
                f"The K/V groups have block sizes {sorted(block_sizes)}, "
                f"spec.block_size is {self.spec.block_size}."
            )

    @property
    def block_size(self) -> int:
        """Tokens per block of the K/V groups: the scheduler's block size."""
        return self.spec.block_size

    @property
    def attention_group_ids(self) -> tuple[int, ...]:
        """The groups that keep K and V: full attention, then sliding windows
        (they come first; ``FULL_ATTENTION_GROUP`` is one).
        """
        groups = self.kv_cache_groups
        return tuple(i for i, group in enumerate(groups) if isinstance(group.kv_cache_spec, FullAttentionSpec))

    @property
    def num_state_groups(self) -> int:
        """Groups that keep recurrent states rather than K and V (0: a plain model)."""
        return sum(isinstance(group.kv_cache_spec, MambaSpec) for group in self.kv_cache_groups)

    @property
    def page_size_per_layer(self) -> int:
        """Bytes one block id takes in one shared tensor (the same for every group)."""
        return self.kv_cache_groups[0].kv_cache_spec.page_size_bytes

    @property
    def num_shared_tensors(self) -> int:
        """How many tensors the worker allocates: the layer count of the largest group."""
        return max(len(group.layer_indices) for group in self.kv_cache_groups)

    @property
    def bytes_per_block(self) -> int:
        """What one block id costs: a page in every shared tensor."""
        return self.page_size_per_layer * self.num_shared_tensors

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def kv_cache_tensors(self) -> tuple[KVCacheTensor, ...]:
        """Tensor ``j`` and the ``j``-th layer of every group that has one."""
        size = self.num_blocks * self.page_size_per_layer
        groups = self.kv_cache_groups
        return tuple(
            KVCacheTensor(size, tuple(g.layer_indices[j] for g in groups if j < len(g.layer_indices)))
            for j in range(self.num_shared_tensors)
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        """Block-table entries of a request of ``num_tokens`` tokens, every group counted."""
        return num_blocks_for(self.kv_cache_groups, num_tokens)

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request holds at once, every group counted."""
        return max_num_blocks(self.kv_cache_groups, max_model_len, max_num_batched_tokens)
