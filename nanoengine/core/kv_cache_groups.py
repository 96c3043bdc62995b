"""Hybrid models: which layers form a KV cache group, and how the groups share memory.

Chapter 4 (KV cache manager; hybrid models). Qwen3.5 mixes full-attention
layers, whose K/V grow with the sequence, with Gated DeltaNet layers, which
hold one recurrent state of fixed size per request. As in vLLM, both live in
*one* block pool:

1. **Groups of equal size.** Each kind's layers are cut into groups of
   ``group_size`` layers (6 attention + 18 DeltaNet layers: one attention
   group, three state groups of 6), each with its own block table per request.
2. **Shared tensors.** The worker allocates ``group_size`` tensors of
   ``num_blocks`` pages; layer ``j`` of every group uses tensor ``j``. A block
   id is held by one group at a time, so layers sharing a tensor never touch
   the same page, and any free block can serve any group.
3. **One page size.** An attention page (``block_size`` tokens of K and V) must
   then be as large as a state page: the attention block size is raised, in
   steps of 16 tokens (vLLM's kernel alignment), until a page holds a state,
   and the state page is padded up to it.

Sliding-window layers (Gemma 3's local layers beside its global ones) keep K
and V pages exactly like full-attention layers, at the same block size; they
form groups of their own all the same, because their manager frees the blocks
that leave the window (``SlidingWindowManager``) while a full-attention
group's table keeps every block. Full-attention groups come first, then
sliding-window groups, then state groups.

The group size is vLLM's: the smaller layer count, so every group of the rarer
kind is full, unless the larger count is under 1.5 times it; then the larger,
so a near-even split is not cut into half-empty groups. A group short of
``group_size`` layers leaves its share of the last tensors unused.

vLLM 0.32 counterpart: ``vllm/v1/core/kv_cache_utils.py``
(``unify_kv_cache_spec_page_size``, ``_get_kv_cache_groups_uniform_page_size``)
and the block-size rule of ``Platform._align_hybrid_block_size`` in
``vllm/platforms/interface.py`` (``align_hybrid_block_size`` here). vLLM picks
the block size when it reads the config and the groups when it sizes the
cache; one pure function does both here, so it can run at either time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple, TypeVar

from nanoengine.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    max_num_blocks,
    num_blocks_for,
)
from nanoengine.utils.math_utils import cdiv

_Spec = TypeVar("_Spec", FullAttentionSpec, SlidingWindowSpec, MambaSpec)

# Attention block sizes are raised in steps of this many tokens: the alignment
# vLLM 0.32 keeps for its attention kernels when it enlarges a hybrid model's blocks.
ATTENTION_BLOCK_ALIGNMENT = 16
# vLLM's threshold: below this ratio of layer counts the larger count is the group size.
_NEAR_EVEN_RATIO = 1.5


class KVCacheLayout(NamedTuple):
    """The groups of a model and the arithmetic behind them (chapter 4 prints it).

    ``page_size_bytes`` is what one block id costs, as for ``FullAttentionSpec``:
    so the sizing functions (``kv_cache_sizing.py``) take either.
    """

    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    requested_block_size: int  # the attention block size asked for
    block_size: int  # the one the groups use: at least requested, big enough for a state
    attention_bytes_per_token: int  # K and V of one token in one attention layer
    state_bytes: int  # one request's state in one state layer before padding (0: none)
    page_size_per_layer: int  # block_size * attention_bytes_per_token, every group's page
    num_shared_tensors: int  # the group size

    @property
    def page_size_bytes(self) -> int:
        """What one block id costs: a page in every shared tensor."""
        return self.page_size_per_layer * self.num_shared_tensors

    @property
    def state_padding_bytes(self) -> int:
        """Bytes of each state page left unused so that it matches an attention page."""
        return self.page_size_per_layer - self.state_bytes if self.state_bytes else 0

    @property
    def num_state_groups(self) -> int:
        return sum(isinstance(group.kv_cache_spec, MambaSpec) for group in self.kv_cache_groups)

    @property
    def attention_spec(self) -> FullAttentionSpec:
        """All K/V layers of the model (full attention and sliding windows), at the agreed block size."""
        attention = [g for g in self.kv_cache_groups if isinstance(g.kv_cache_spec, FullAttentionSpec)]
        per_layer = attention[0].kv_cache_spec
        assert isinstance(per_layer, FullAttentionSpec)  # narrowed by the filter above, for mypy
        return replace(per_layer, num_layers=sum(len(g.layer_indices) for g in attention))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Block-table entries of a request of ``num_tokens`` tokens, every group counted."""
        return num_blocks_for(self.kv_cache_groups, num_tokens)

    def max_num_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The most blocks one request holds at once, every group counted."""
        return max_num_blocks(self.kv_cache_groups, max_model_len, max_num_batched_tokens)


def group_kv_cache_layers(layer_specs: Mapping[int, KVCacheSpec]) -> KVCacheLayout:
    """Split a model's layers into KV cache groups that can share one block pool.

    ``layer_specs`` maps each layer index to its own spec: a ``FullAttentionSpec``
    or ``SlidingWindowSpec`` with ``num_layers=1`` (its ``block_size`` is the one
    asked for), or a ``MambaSpec``. Every layer of a kind must have the same
    spec. K/V groups come first, full attention before sliding windows, so
    group 0 keeps K and V. A plain model comes back as one group.
    """
    full_spec, full_layers = _the_one_spec(layer_specs, FullAttentionSpec)
    sliding_spec, sliding_layers = _the_one_spec(layer_specs, SlidingWindowSpec)
    state_spec, state_layers = _the_one_spec(layer_specs, MambaSpec)
    kv_specs = [spec for spec in (full_spec, sliding_spec) if spec is not None]
    if not kv_specs:
        raise ValueError("A model needs an attention layer: its block size is the scheduler's.")
    attention_spec = kv_specs[0]
    if any(spec.num_layers != 1 for spec in kv_specs):
        raise ValueError(f"Give one spec per layer (num_layers=1), got {kv_specs}.")
    if len({(spec.block_size, replace(spec, block_size=1).page_size_per_layer) for spec in kv_specs}) > 1:
        raise ValueError(f"Full-attention and sliding-window layers must share block and page sizes, got {kv_specs}.")
    bytes_per_token = replace(attention_spec, block_size=1).page_size_per_layer
    state_bytes = state_spec.state_bytes if state_spec is not None else 0
    block_size = align_hybrid_block_size(attention_spec.block_size, bytes_per_token, state_bytes)
    kinds = [layers for layers in (full_layers, sliding_layers, state_layers) if layers]
    group_size = _group_size([len(layers) for layers in kinds])
    page_size = replace(attention_spec, block_size=block_size).page_size_per_layer
    groups = [
        KVCacheGroupSpec(layers, replace(spec, block_size=block_size))
        for spec, kind_layers in ((full_spec, full_layers), (sliding_spec, sliding_layers))
        if spec is not None
        for layers in _split(kind_layers, group_size)
    ]
    if state_spec is not None:
        padded = replace(state_spec, page_size_padded=page_size)
        groups += [KVCacheGroupSpec(layers, padded) for layers in _split(state_layers, group_size)]
    return KVCacheLayout(
        kv_cache_groups=tuple(groups),
        requested_block_size=attention_spec.block_size,
        block_size=block_size,
        attention_bytes_per_token=bytes_per_token,
        state_bytes=state_bytes,
        page_size_per_layer=page_size,
        num_shared_tensors=group_size,
    )


def align_hybrid_block_size(requested: int, attention_bytes_per_token: int, state_bytes: int) -> int:
    """The attention block size once an attention page must hold a whole state.

    ``attention_bytes_per_token`` is K and V of one token in one attention
    layer; ``state_bytes`` is one request's state in one state layer (0 when
    the model has none: then ``requested`` stands). The answer is the smallest
    multiple of ``ATTENTION_BLOCK_ALIGNMENT`` tokens whose K and V take at
    least ``state_bytes``, unless ``requested`` is larger already (vLLM keeps
    a larger block size the user asked for, and pads the state more). vLLM
    0.32 raises ``cache_config.block_size`` by this rule in
    ``Platform._align_hybrid_block_size``.
    """
    if state_bytes == 0:
        return requested
    bytes_per_step = ATTENTION_BLOCK_ALIGNMENT * attention_bytes_per_token
    return max(requested, ATTENTION_BLOCK_ALIGNMENT * cdiv(state_bytes, bytes_per_step))


def _the_one_spec(
    layer_specs: Mapping[int, KVCacheSpec], kind: type[_Spec]
) -> tuple[_Spec | None, tuple[int, ...]]:
    """The spec every layer of ``kind`` has (None if there is no such layer), and those layers in order.

    The kind is matched exactly: a ``SlidingWindowSpec`` is a ``FullAttentionSpec``
    subclass, but its layers are not full-attention layers.
    """
    layers = tuple(sorted(index for index, spec in layer_specs.items() if type(spec) is kind))
    specs = {layer_specs[index] for index in layers}
    if len(specs) > 1:
        raise ValueError(
            f"Every {kind.__name__} layer must have the same spec to form groups, "
            f"got {len(specs)}: {sorted(map(str, specs))}."
        )
    spec = specs.pop() if specs else None
    assert spec is None or isinstance(spec, kind)  # for mypy: the filter above chose them
    return spec, layers


def _group_size(layer_counts: Sequence[int]) -> int:
    """vLLM's rule: the smaller count, or the larger one when the two are nearly even."""
    smallest, largest = min(layer_counts), max(layer_counts)
    return largest if largest < _NEAR_EVEN_RATIO * smallest else smallest


def _split(layers: tuple[int, ...], group_size: int) -> list[tuple[int, ...]]:
    """Cut one kind's layers into groups of at most ``group_size``, strided as in
    vLLM so that sizes differ by one at most (13 by 5: 5, 4, 4; not 5, 5, 3).
    """
    num_groups = cdiv(len(layers), group_size)
    return [layers[i::num_groups] for i in range(num_groups)]
