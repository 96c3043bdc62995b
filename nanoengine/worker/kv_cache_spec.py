"""A model's KV cache spec, read off its config and its layers, weights or no weights.

Chapter 6 (``get_kv_cache_spec``, the step between ``determine_available_memory``
and the block count); chapter 2 uses the same code to compare the KV cache of a
Llama-shaped model with a Qwen3.5-shaped one without building either engine.
vLLM 0.32 counterpart: ``GPUModelRunner.get_kv_cache_spec`` in
``vllm/v1/worker/gpu_model_runner.py``, which asks every attention and Mamba
layer for its own spec (``get_kv_cache_spec`` on the layer classes).

The spec needs the layers' *shapes*, never their values: the number of K/V
heads and their size come from the config, a Gated DeltaNet layer's state
shapes from the layer itself (``get_state_shape``). So a model built on
PyTorch's ``meta`` device -- tensors with a shape and a dtype and no memory,
built in a fraction of a second -- answers as well as a loaded one does
(``meta_model``). The model runner calls ``kv_cache_spec`` on its loaded model;
a walkthrough may call it on a meta model of any config.

Under tensor parallelism each rank caches only its own KV heads
(``kv_heads_per_rank``: an equal share, or one replicated head when there are
fewer KV heads than ranks), so each worker reports the spec of its slice; the
engine core, which sees one spec for all ranks, sizes the cache from it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoengine.config import ModelConfig
from nanoengine.distributed.parallel_state import get_tensor_model_parallel_world_size
from nanoengine.distributed.utils import kv_heads_per_rank
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from nanoengine.model_executor.model_loader.loader import construct_model
from nanoengine.model_executor.models.registry import get_model_class
from nanoengine.worker.kv_cache_tensors import state_layers

# The layer kinds that keep K and V in paged blocks (the others keep a state).
KV_LAYER_TYPES = ("full_attention", "sliding_attention")


def attention_spec(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int | None = None
) -> FullAttentionSpec:
    """The K/V layout of the attention layers, full or sliding (all layers, but
    in a model with state layers) on one rank of ``tp_size`` (default: this
    process's tensor-parallel size).

    A model whose every layer has the same window (Mistral) gets a
    ``SlidingWindowSpec``: one group, whose manager gives back the blocks that
    leave the window.
    """
    tp_size = get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=kv_heads_per_rank(model_config.num_kv_heads, tp_size),
        head_dim=model_config.head_dim,
        dtype_size=torch.tensor([], dtype=dtype).element_size(),
        num_layers=sum(kind in KV_LAYER_TYPES for kind in model_config.layer_types),
    )
    window = model_config.sliding_window
    if set(model_config.layer_types) == {"sliding_attention"} and window is not None:
        return SlidingWindowSpec(**vars(spec), sliding_window=window)
    return spec


def kv_cache_spec(
    model: nn.Module, model_config: ModelConfig, block_size: int, dtype: torch.dtype, max_model_len: int
) -> FullAttentionSpec | dict[int, KVCacheSpec]:
    """What the KV cache of ``model`` is made of.

    A plain model: one spec for all its layers (a ``SlidingWindowSpec`` if
    every layer has the window). A hybrid model: one spec per layer index, as
    vLLM's workers report it -- a ``FullAttentionSpec`` or ``SlidingWindowSpec``
    of one layer, or a ``MambaSpec`` holding a state layer's state shapes, whose
    one block stands for a whole request (``block_size`` = ``max_model_len``).
    The engine core groups them (``core/kv_cache_groups.py``).
    """
    attention = attention_spec(model_config, block_size, dtype)
    if not model_config.is_hybrid:
        return attention
    one_layer = replace(attention, num_layers=1)
    states = iter(state_layers(model))
    specs: dict[int, KVCacheSpec] = {}
    for index, kind in enumerate(model_config.layer_types):
        if kind == "full_attention":
            specs[index] = one_layer
        elif kind == "sliding_attention":
            assert model_config.sliding_window is not None  # a sliding layer implies a window
            specs[index] = SlidingWindowSpec(**vars(one_layer), sliding_window=model_config.sliding_window)
        else:
            shapes = next(states).get_state_shape()
            specs[index] = MambaSpec(shapes, attention.dtype_size, block_size=max_model_len)
    return specs


def meta_model(hf_config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The model class of ``hf_config`` built on the meta device: every parameter
    has its real shape and dtype, and none holds memory or values.

    Enough to count parameters and to ask ``kv_cache_spec``; not to run.
    """
    model = construct_model(get_model_class(hf_config), hf_config, dtype, torch.device("meta"))
    assert isinstance(model, nn.Module), type(model)  # every registered class is one
    return model
