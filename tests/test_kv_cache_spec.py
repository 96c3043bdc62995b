"""A KV cache spec without weights (nanoengine/worker/kv_cache_spec.py).

A model built on the meta device must describe the same KV cache as the
engine's loaded model: the same spec for a plain model, the same groups and
unified block size for a hybrid one. Chapter 2's Llama-against-Qwen3.5 table
rests on it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nanoengine import LLM
from nanoengine.core.kv_cache_groups import group_kv_cache_layers
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from nanoengine.worker.kv_cache_spec import kv_cache_spec, meta_model

MAX_MODEL_LEN = 128
BLOCK_SIZE = 16


def _engine(model: str) -> LLM:
    return LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               kv_cache_memory_bytes=1 << 22)


def _weightless_spec(llm: LLM) -> FullAttentionSpec | dict[int, KVCacheSpec]:
    model_config = llm.llm_engine.engine_config.model_config
    model = meta_model(model_config.hf_config, torch.float32)
    assert all(p.device.type == "meta" for p in model.parameters())  # no memory, no values
    return kv_cache_spec(model, model_config, BLOCK_SIZE, torch.float32, MAX_MODEL_LEN)


def test_a_plain_models_meta_spec_is_the_engines(tiny_llama: str) -> None:
    llm = _engine(tiny_llama)
    spec = _weightless_spec(llm)
    assert isinstance(spec, FullAttentionSpec)
    assert spec == llm.llm_engine.engine_core.get_engine_core().kv_cache_config.spec


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5-alt"])
def test_a_hybrid_models_meta_spec_groups_as_the_engines(
    tiny_model_factory: Callable[..., str], arch: str
) -> None:
    llm = _engine(tiny_model_factory(arch))
    spec = _weightless_spec(llm)
    assert isinstance(spec, dict)
    engine_config = llm.llm_engine.engine_core.get_engine_core().kv_cache_config
    layout = group_kv_cache_layers(spec)
    assert layout.kv_cache_groups == engine_config.kv_cache_groups
    assert layout.block_size == engine_config.block_size
