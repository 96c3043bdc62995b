"""The Attention module models call: paged KV cache in, attention output out.

Chapter 7 (the forward pass over a paged KV cache); chapter 6 explains where the
cache tensors come from (``initialize_kv_cache`` binds them here).
vLLM 0.32 counterpart: ``vllm/model_executor/layers/attention/attention.py``
(``Attention``), with ``bind_kv_cache`` from ``vllm/v1/worker/utils.py``.

The layer owns no weights. It holds a reference to its slice of the KV cache
(``kv_cache``, bound after the memory profile decided how many blocks fit) and
delegates the work to a backend implementation (``impl``): the torch reference
backend by default, a faster kernel where one is available. A model never sees
block tables or slot ids; it only passes the step's ``AttentionMetadata`` through.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl


class AttentionImpl(Protocol):
    """What a backend provides: write this step's K/V, then attend.

    Shapes: query [T, Hq, D]; key/value [T, Hkv, D]; kv_cache
    [2, num_blocks, block_size, Hkv, D]; returns [T, Hq, D]. ``sliding_window``:
    how many keys back each query reads, itself included (None: every key).
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...


class Attention(nn.Module):
    """Multi-head / grouped-query attention over this layer's paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        impl: AttentionImpl | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})."
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # A local layer (Mistral, Gemma 3) reads only its last sliding_window keys;
        # its KV cache group gives back the blocks before them (chapter 4).
        self.sliding_window = sliding_window
        # Which K/V group's block table this layer reads (AttentionMetadata.for_kv_group):
        # 0 but in a model with several K/V groups, where binding the cache sets it.
        self.kv_group_index = 0
        # The backend is swappable per layer (e.g. a Triton kernel on CUDA): the
        # model code above never changes, only who does the arithmetic.
        self.impl: AttentionImpl = impl if impl is not None else TorchRefAttentionImpl()
        # A plain attribute, not a buffer: the cache is not part of the model's
        # state_dict, and model.to(...) must not copy gigabytes of it.
        # [2, num_blocks, block_size, num_kv_heads, head_dim] once bound.
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """query [T, Hq * D]; key/value [T, Hkv * D] (already rotated) -> [T, Hq * D]."""
        if attn_metadata is None:
            raise ValueError(
                "Attention needs AttentionMetadata (slot mapping, block table, seq lens) "
                "to read and write the paged KV cache; got None."
            )
        if self.kv_cache.dim() != 5:
            raise RuntimeError(
                "This Attention layer has no KV cache yet; call bind_kv_cache(model, kv_caches) first."
            )
        # Models think in flat [T, heads * head_dim] rows (that is what the linear
        # layers produce); backends want the heads split out, as the cache stores them.
        out = self.impl.forward(
            query.unflatten(-1, (self.num_heads, self.head_dim)),
            key.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            value.unflatten(-1, (self.num_kv_heads, self.head_dim)),
            self.kv_cache,
            attn_metadata.for_kv_group(self.kv_group_index),
            self.scale,
            self.sliding_window,
        )
        return out.flatten(-2)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window is not None else ""
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{window}"


def set_attention_impl(model: nn.Module, impl: AttentionImpl) -> int:
    """Hand every Attention layer of ``model`` the same backend; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        layer.impl = impl
    return len(layers)


def bind_kv_cache(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Give each Attention layer of ``model``, in layer order, its cache tensor."""
    # modules() walks submodules in registration order, i.e. layer 0 first, which
    # is the order the runner allocated the caches in (one per decoder layer).
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise ValueError(
            f"The model has {len(layers)} Attention layers but {len(kv_caches)} KV cache tensors were given."
        )
    for layer, cache in zip(layers, kv_caches):
        layer.kv_cache = cache
