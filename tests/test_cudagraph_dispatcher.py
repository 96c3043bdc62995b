"""CUDA-graph dispatch and padding, checked on CPU (the replay itself needs a GPU).

The decisions (graph or eager, which padded size, one warning per fallback kind)
are pure logic. The padding is checked where it matters: a padded decode batch
run eagerly through the Triton backend (in Triton's interpreter) gives the same
logits on the real rows as the unpadded batch, and writes no KV for the padding.
The Triton backend is also run end to end in the engine against the torch backend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.attention.backends.triton_attn import TritonAttentionImpl
from nanoengine.attention.layer import bind_kv_cache, set_attention_impl
from nanoengine.model_executor.model_loader import get_model
from nanoengine.sampling_params import SamplingParams as Params
from nanoengine.transformers_utils.config import get_hf_config
from nanoengine.worker.cudagraph_dispatcher import (
    CudagraphDispatcher,
    default_capture_sizes,
    pad_decode_inputs,
)
from nanoengine.worker.input_batch import CachedRequestState, LayerGroups, prepare_inputs


def test_default_ladder_is_fine_then_coarse_and_capped() -> None:
    assert default_capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(256)[-3:] == [240, 248, 256]


def test_dispatch_pads_up_and_falls_back_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    dispatcher = CudagraphDispatcher([1, 2, 4, 8], max_blocks_per_req=4)
    assert dispatcher.dispatch(3, 3, 2).padded_batch_size == 4
    assert dispatcher.dispatch(8, 8, 4).use_graph
    assert not dispatcher.dispatch(3, 10, 2).use_graph  # a prefill in the step
    with caplog.at_level(logging.WARNING):
        big = dispatcher.dispatch(9, 9, 1)
        dispatcher.dispatch(12, 12, 1)
        wide = dispatcher.dispatch(2, 2, 5)
        dispatcher.dispatch(2, 2, 6)
    assert not big.use_graph and big.padded_batch_size == 9 and "largest captured size 8" in big.reason
    assert not wide.use_graph and "width 5" in wide.reason
    assert len([r for r in caplog.records if "fallback" in r.message]) == 2
    off = CudagraphDispatcher([1, 2], max_blocks_per_req=4, enabled=False).dispatch(1, 1, 1)
    assert not off.use_graph and "off" in off.reason
    with pytest.raises(ValueError, match="positive"):
        CudagraphDispatcher([0, 2], max_blocks_per_req=4)


def test_padded_decode_batch_matches_unpadded(tiny_llama: str) -> None:
    torch.manual_seed(0)
    model = get_model(tiny_llama, get_hf_config(tiny_llama), torch.float32, torch.device("cpu"))
    set_attention_impl(model, TritonAttentionImpl())
    block_size, num_blocks = 4, 12
    hf = get_hf_config(tiny_llama)
    shape = (2, num_blocks, block_size, hf.num_key_value_heads, hf.hidden_size // hf.num_attention_heads)
    caches = [torch.zeros(shape) for _ in range(hf.num_hidden_layers)]
    bind_kv_cache(model, caches)
    params = Params(temperature=0.0, max_tokens=4)
    states = [
        CachedRequestState("a", [5, 6, 7, 8, 9], 5, params, ([1, 2],), 0),
        CachedRequestState("b", [10, 11, 12], 3, params, ([3],), 0),
        CachedRequestState("c", [13, 14, 15, 16, 17, 18], 6, params, ([4, 5],), 0),
    ]
    # Prefill all but the last token of each, then decode that token.
    with torch.inference_mode():
        model(*_step(states, [len(s.token_ids) - 1 for s in states], block_size))
        for s in states:
            s.num_computed_tokens = len(s.token_ids) - 1
        before = [c.clone() for c in caches]
        ids, pos, md, inputs = _step_inputs(states, [1, 1, 1], block_size)
        eager = model.compute_logits(model(ids, pos, md))
        after_eager = [c.clone() for c in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        padded = pad_decode_inputs(inputs, padded_size=8, block_table_width=6)
        assert padded.input_ids.shape == (8,) and padded.attn_metadata.block_table.shape == (8, 6)
        assert padded.attn_metadata.slot_mapping[3:].tolist() == [-1] * 5
        logits = model.compute_logits(model(padded.input_ids, padded.positions, padded.attn_metadata))
    torch.testing.assert_close(logits[:3], eager, atol=1e-5, rtol=1e-5)
    for cache, want, old in zip(caches, after_eager, before):
        # Same K/V for the real rows (up to matmul rounding at another batch
        # size), and the padding rows wrote nothing: not into the null block 0,
        # not into the last slot (where a slot of -1 would land if used as an index).
        torch.testing.assert_close(cache, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache[:, 0], old[:, 0]) and torch.equal(cache[:, -1], old[:, -1])
    with pytest.raises(ValueError, match="pure decode batch"):
        pad_decode_inputs(inputs, padded_size=2, block_table_width=6)


def _step_inputs(states: list[CachedRequestState], num: list[int], block_size: int):  # type: ignore[no-untyped-def]
    inputs = prepare_inputs(states, num, block_size, torch.device("cpu"), LayerGroups())
    return inputs.input_ids, inputs.positions, inputs.attn_metadata, inputs


def _step(states: list[CachedRequestState], num: list[int], block_size: int):  # type: ignore[no-untyped-def]
    return _step_inputs(states, num, block_size)[:3]


def test_engine_with_triton_backend_matches_torch_backend(tiny_model_factory: Callable[..., str]) -> None:
    path = tiny_model_factory("qwen3", tie=False)
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13] * 11)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, max_num_batched_tokens=8, block_size=4, max_model_len=64,
                  num_gpu_blocks_override=40)
        runner = llm.llm_engine.engine_core.get_engine_core().model_executor.driver_worker.model_runner
        assert runner.attention_backend == backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]
