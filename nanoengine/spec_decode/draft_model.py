"""DraftModelProposer: a second, smaller model guesses the next k tokens.

Chapter 9. The n-gram proposer can only guess text that already occurred; a
draft model guesses any text, at the price of running a model. It reads the
same tokens as the target (same tokenizer, same vocabulary) and keeps its own
KV cache, laid out in the *same blocks*: a request's block table addresses
both, so the KV cache manager allocates once for two models (the block's
bytes include the draft's layers, see ``kv_cache_layers_needed``).

One proposal, after the target sampled, for each request that did:

1. catch up: run the draft over the request's tokens it has not seen yet --
   the whole prompt the first time, afterwards the tokens the last step kept
   (accepted drafts and the target's own token) -- and take the argmax of its
   last position: draft 1;
2. then k - 1 one-token steps, each feeding the previous guess: drafts 2..k.

Step 2 writes the draft's KV for its own guesses at positions past the known
tokens: the scheduler reserves those slots (``num_lookahead_tokens`` = k), and
the next catch-up overwrites them with the tokens that were really kept. So the
draft's KV below a request's ``num_draft_computed_tokens`` (kept in the
worker's ``CachedRequestState``) always belongs to real tokens.

Drafts are greedy (argmax), so each is "certain" for the rejection sampler,
as an n-gram draft is. A request the worker receives anew (first schedule, or
resumed after preemption) starts its draft KV from zero: the prefix cache
shares the target's blocks, not a promise that the draft's half was written.

vLLM 0.32 counterpart: ``vllm/v1/spec_decode/draft_model.py``
(``DraftModelProposer``, built on ``SpecDecodeBaseProposer.propose`` in
``llm_base_proposer.py``), which shares the target's KV cache groups the same way.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
from torch import nn

from nanoengine.attention.layer import bind_kv_cache, set_attention_impl
from nanoengine.attention.selector import get_attention_impl
from nanoengine.config import EngineConfig, ModelConfig
from nanoengine.kv_cache_interface import FullAttentionSpec
from nanoengine.model_executor import model_loader
from nanoengine.model_executor.custom_op import enable_cpu_kernels
from nanoengine.model_executor.models.registry import CausalLM
from nanoengine.transformers_utils.config import get_hf_config, resolve_model_path
from nanoengine.utils.math_utils import cdiv
from nanoengine.worker.input_batch import CachedRequestState, LayerGroups, prepare_inputs
from nanoengine.worker.kv_cache_spec import attention_spec
from nanoengine.worker.kv_cache_tensors import allocate_kv_caches


def draft_model_config(engine_config: EngineConfig) -> ModelConfig:
    """The target's ModelConfig with the draft's name, folder and shape.

    Same dtype, seed, backends and load format as the target: the draft
    runs in the same worker, through the same kernels.
    """
    spec = engine_config.speculative_config
    assert spec is not None and spec.model is not None
    target = engine_config.model_config
    path = resolve_model_path(spec.model, target.load_format)
    # The draft's own float weights: a GGUF target's file is not the draft's.
    return dataclasses.replace(target, model=spec.model, model_path=path, hf_config=get_hf_config(path),
                               quantization=None, gguf_file=None)


class DraftModelProposer:
    """Owns the draft model and its KV cache; proposes k greedy tokens per request."""

    def __init__(self, engine_config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        spec = engine_config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.max_model_len = engine_config.scheduler_config.max_model_len
        self.model_config = draft_model_config(engine_config)
        self.device = device
        self.dtype = dtype
        self.model: nn.Module | None = None
        self.block_size = engine_config.cache_config.block_size

    # ---- construction (the target's runner calls these beside its own) -----

    def load_model(self, linear_backend: str, attention_backend: str) -> None:
        config = self.model_config
        model = model_loader.get_model(
            config.model_path, config.hf_config, self.dtype, self.device, linear_backend,
            load_format=config.load_format, seed=config.seed,
        )
        assert isinstance(model, nn.Module), type(model)
        set_attention_impl(model, get_attention_impl(attention_backend))
        if attention_backend == "cpu":
            enable_cpu_kernels(model)
        self.model = model

    def kv_cache_layers_needed(self, target: FullAttentionSpec) -> int:
        """Target-sized layers whose bytes cover the draft's KV per block.

        The engine sizes the KV cache from one spec; reporting the target's
        layers plus these makes every block pay for both models. Rounded up,
        so a draft with narrower K/V heads than the target's reserves a little
        more than it uses.
        """
        draft = attention_spec(self.model_config, target.block_size, self.dtype)
        return cdiv(draft.page_size_bytes, target.page_size_per_layer)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The draft's own K/V tensors, as many blocks as the target's, bound to its layers."""
        self.block_size = block_size
        spec = attention_spec(self.model_config, block_size, self.dtype)
        bind_kv_cache(self._model_module(), allocate_kv_caches(spec, num_blocks, self.dtype, self.device))

    # ---- proposing ----------------------------------------------------------

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> list[list[int]]:
        """Up to k drafts per request (fewer near ``max_model_len``; none at it)."""
        rooms = [min(self.k, self.max_model_len - len(state.token_ids) - 1) for state in states]
        active = [i for i, room in enumerate(rooms) if room > 0]
        drafts: list[list[int]] = [[] for _ in states]
        if not active:
            return drafts
        # 1. Catch up on the unseen real tokens; the last position guesses draft 1.
        views = []
        for i in active:
            state = states[i]
            views.append(dataclasses.replace(state, num_computed_tokens=state.num_draft_computed_tokens))
            state.num_draft_computed_tokens = len(state.token_ids)
        guesses = self._greedy_step(views, [len(view.token_ids) - view.num_computed_tokens for view in views])
        # 2. One token at a time: each guess is the next step's input.
        for step in range(max(rooms[i] for i in active)):
            for view_index, i in enumerate(active):
                if step < rooms[i]:
                    drafts[i].append(guesses[view_index])
            still = [(view_index, i) for view_index, i in enumerate(active) if step + 1 < rooms[i]]
            if not still:
                break
            views = [
                dataclasses.replace(
                    states[i],
                    token_ids=states[i].token_ids + drafts[i],
                    num_computed_tokens=len(states[i].token_ids) + len(drafts[i]) - 1,
                )
                for _, i in still
            ]
            next_guesses = self._greedy_step(views, [1] * len(views))
            active = [i for _, i in still]
            guesses = next_guesses
        return drafts

    def _greedy_step(self, views: list[CachedRequestState], num_tokens: list[int]) -> list[int]:
        """One draft forward pass over ``num_tokens[i]`` tokens of each view; the argmax
        of each view's last position. Writes the draft's KV for those tokens."""
        inputs = prepare_inputs(views, num_tokens, self.block_size, self.device, LayerGroups())
        model = cast(CausalLM, self._model_module())
        hidden = model(inputs.input_ids, inputs.positions, inputs.attn_metadata)  # [num_tokens, hidden]
        logits = model.compute_logits(hidden[inputs.logits_indices])  # [num_views, vocab]
        return [int(token) for token in logits.argmax(dim=-1).tolist()]

    def _model_module(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("DraftModelProposer.load_model() must run before the draft model is used.")
        return self.model
