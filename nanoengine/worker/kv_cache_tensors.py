"""From raw page buffers to the tensors each layer reads: paged K/V, or a state.

Chapter 4 (how a hybrid model's layers share one pool of pages) and chapter 6
(``initialize_kv_cache``). vLLM 0.32 counterpart: ``GPUModelRunner`` in
``vllm/v1/worker/gpu_model_runner.py`` (``_allocate_kv_cache_tensors``,
``_reshape_kv_cache_tensors`` and ``_update_hybrid_attention_mamba_layout``).

A model with full attention only gives every layer a cache of its own,
[2, num_blocks, block_size, Hkv, D]: all K blocks, then all V blocks. A hybrid
model (Qwen3.5: Gated DeltaNet layers beside full-attention ones) cannot afford
that: its layers are split into groups of equal size, and layer j of *every*
group shares one buffer of ``num_blocks`` pages. A block id belongs to one
group at a time, so page ``b`` of the buffer is either K/V rows of an attention
layer or the recurrent state of a state layer, never both.

Sharing pages fixes two things about the layout:

* **A page is one block of every kind.** The attention view puts the K rows of
  block ``b`` and its V rows side by side in page ``b`` ([num_blocks, 2, ...],
  transposed back to the usual [2, num_blocks, ...] shape), where a cache of its
  own keeps all K blocks before all V blocks. The K half then has a block
  stride of twice a half page; the attention kernels take that stride.
* **A state layer's states lie one after another in its page**: the conv
  state, then the recurrent (SSM) state, each viewed as [num_blocks, *shape].
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from nanoengine.attention.layer import Attention, bind_kv_cache
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec
from nanoengine.model_executor.layers.mamba.gdn import GatedDeltaNetAttention, bind_mamba_state
from nanoengine.worker.input_batch import LayerGroups
from nanoengine.worker.page_advice import advise_no_huge_pages


def allocate_kv_caches(
    spec: FullAttentionSpec, num_blocks: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per
    full-attention layer of ``spec`` (the target model's, or a draft model's).

    Zero-filled, so stale slots hold zeros rather than NaN garbage. On CPU
    the zeros come from numpy's calloc: the OS hands out zeroed pages lazily,
    so an untouched block costs neither RAM nor time (``torch.zeros`` would
    memset every page up front: seconds for a few GiB). The pages are kept
    at 4 KiB (``page_advice.py``): a first write then never stalls a step.
    """
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    # Same-width integer storage viewed as the model dtype (numpy has no bf16).
    storage = {2: np.uint16, 4: np.uint32}[spec.dtype_size]
    caches = [torch.from_numpy(np.zeros(shape, dtype=storage)).view(dtype) for _ in range(spec.num_layers)]
    for cache in caches:
        advise_no_huge_pages(cache)
    return caches


def new_page_buffer(num_blocks: int, page_size_bytes: int, device: torch.device) -> torch.Tensor:
    """Zeroed bytes for ``num_blocks`` pages, [num_blocks, page_size_bytes] uint8.

    Zeros matter for attention (a never-written slot must be finite, see
    ``torch_ref.py``); state layers start a request from zeros themselves.
    """
    return torch.zeros((num_blocks, page_size_bytes), dtype=torch.uint8, device=device)


def attention_view(
    pages: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """[2, num_blocks, block_size, Hkv, D] over ``pages``, K and V of a block in one page.

    ``pages`` [num_blocks, page_bytes] uint8; the attention rows take the first
    2 * block_size * Hkv * D elements of each page (page-size unification may
    have made the page a little larger than that).
    """
    num_blocks = pages.shape[0]
    rows = _typed_slice(pages, 0, 2 * block_size * num_kv_heads * head_dim, dtype)
    # [num_blocks, 2, bs, Hkv, D] -> [2, num_blocks, bs, Hkv, D]: the shape every
    # backend expects; only the stride of the block dim differs from a private cache.
    return rows.view(num_blocks, 2, block_size, num_kv_heads, head_dim).transpose(0, 1)


def state_views(
    pages: torch.Tensor, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """One [num_blocks, *shape] view per state shape, packed one after another in each page.

    For a Gated DeltaNet layer: (conv state [conv_dim, kernel - 1], recurrent
    state [v_heads, k_dim, v_dim]).
    """
    num_blocks = pages.shape[0]
    views: list[torch.Tensor] = []
    offset = 0  # in elements of dtype
    for shape in shapes:
        numel = math.prod(shape)
        views.append(_typed_slice(pages, offset, numel, dtype).view(num_blocks, *shape))
        offset += numel
    return tuple(views)


def _typed_slice(pages: torch.Tensor, start: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements [start, start + numel) of every page as ``dtype``: [num_blocks, numel]."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    end_byte = (start + numel) * itemsize
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] % itemsize:
        raise ValueError(
            f"pages must be [num_blocks, page_bytes] uint8 with page_bytes a multiple of {itemsize}; "
            f"got {tuple(pages.shape)} {pages.dtype}."
        )
    if end_byte > pages.shape[1]:
        raise ValueError(f"A page of {pages.shape[1]} bytes cannot hold {end_byte} bytes of {dtype} views.")
    # Reinterpret whole pages first (a view of the last, contiguous dim), then cut.
    return pages.view(dtype)[:, start : start + numel]


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers (full or sliding), in layer order (what ``bind_kv_cache`` binds)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def state_layers(model: nn.Module) -> list[GatedDeltaNetAttention]:
    """The model's state layers (Gated DeltaNet), in layer order (what ``bind_mamba_state`` binds)."""
    return [m for m in model.modules() if isinstance(m, GatedDeltaNetAttention)]


def private_states(
    model: nn.Module, num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (conv, recurrent) states of ``num_slots`` slots for each state layer.

    For the profile run, which needs states before any page exists: one
    request per slot, nothing shared.
    """
    states: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in state_layers(model):
        conv_shape, ssm_shape = layer.get_state_shape()
        states.append(
            (
                torch.zeros((num_slots, *conv_shape), dtype=dtype, device=device),
                torch.zeros((num_slots, *ssm_shape), dtype=dtype, device=device),
            )
        )
    return states


def release_states(model: nn.Module) -> None:
    """Drop every state layer's tensors (the profile run's temporary ones)."""
    for layer in state_layers(model):
        layer.conv_state = layer.ssm_state = torch.empty(0)


def bind_shared_pages(
    model: nn.Module, kv_cache_config: KVCacheConfig, dtype: torch.dtype, device: torch.device
) -> tuple[LayerGroups, list[torch.Tensor]]:
    """Allocate a hybrid model's shared page buffers and bind every layer's view of them.

    Layer ``layer_indices[j]`` of each KV cache group uses buffer ``j``
    (``KVCacheConfig.kv_cache_tensors``). Returns which groups the layers
    read, and the buffers (whose bytes are the whole KV cache).
    """
    groups = kv_cache_config.kv_cache_groups
    attention = kv_cache_config.attention_group_ids
    states = tuple(g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, MambaSpec))
    buffers = [
        new_page_buffer(kv_cache_config.num_blocks, kv_cache_config.page_size_per_layer, device)
        for _ in range(kv_cache_config.num_shared_tensors)
    ]
    caches: dict[int, torch.Tensor] = {}
    kv_group_of_layer: dict[int, int] = {}  # layer index -> position of its group in `attention`
    layer_states: dict[int, tuple[tuple[torch.Tensor, ...], int]] = {}
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        for j, layer_index in enumerate(group.layer_indices):
            if isinstance(spec, FullAttentionSpec):  # full attention or a sliding window
                caches[layer_index] = attention_view(
                    buffers[j], spec.block_size, spec.num_kv_heads, spec.head_dim, dtype
                )
                kv_group_of_layer[layer_index] = attention.index(g)
            else:
                layer_states[layer_index] = (state_views(buffers[j], spec.shapes, dtype), states.index(g))
    # Modules come in layer order; so do the sorted layer indices of each kind.
    bind_kv_cache(model, [caches[i] for i in sorted(caches)])
    for layer, layer_index in zip(attention_layers(model), sorted(caches), strict=True):
        layer.kv_group_index = kv_group_of_layer[layer_index]
    ordered = [layer_states[i] for i in sorted(layer_states)]
    bind_mamba_state(model, [(views[0], views[1]) for views, _ in ordered], [row for _, row in ordered])
    return LayerGroups(attention=attention, states=states), buffers
