"""ModelRunner: from a SchedulerOutput to sampled tokens, one forward pass per step.

Chapter 7 (``generate(...)``) is this file: update the per-request states, flatten
the scheduled tokens (worker/input_batch.py), run the model over the paged KV
cache, take logits only where a token must be sampled, sample. Chapter 6 uses its
``profile_run`` and ``initialize_kv_cache``; chapter 8 adds logprobs, and logits
at the prompt positions of requests that ask for prompt_logprobs
(worker/prompt_logprobs.py).
vLLM 0.32 counterpart: ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``:
``_update_states``, ``_prepare_inputs``, ``execute_model``, ``sample_tokens``,
``profile_run``, ``initialize_kv_cache``).

Like vLLM, a step is split in two: ``execute_model`` runs the forward pass and
keeps the logits; ``sample_tokens`` samples once the engine has the grammar
bitmask (structured output), which it computes while the forward pass runs.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from torch import nn

from nanoengine.attention.layer import bind_kv_cache, set_attention_impl
from nanoengine.attention.selector import get_attention_impl, resolve_backend_name
from nanoengine.config import EngineConfig
from nanoengine.core.sched.output import GrammarOutput, SchedulerOutput
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from nanoengine.logprobs import LogprobsLists
from nanoengine.model_executor import model_loader
from nanoengine.model_executor.custom_op import enable_cpu_kernels
from nanoengine.model_executor.layers.cpu_linear import resolve_linear_backend
from nanoengine.model_executor.layers.mamba.gdn import bind_mamba_state
from nanoengine.model_executor.models.registry import CausalLM
from nanoengine.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    KVConnectorOutput,
    LogprobsTensors,
    ModelRunnerOutput,
)
from nanoengine.sample.rejection_sampler import RejectionSampler
from nanoengine.sample.sampler import Sampler
from nanoengine.sampling_params import SamplingParams
from nanoengine.spec_decode.draft_length import DraftLengthPolicy, cap_for_batch
from nanoengine.spec_decode.draft_model import DraftModelProposer
from nanoengine.spec_decode.ngram_proposer import NgramProposer
from nanoengine.structured_output.utils import apply_grammar_bitmask
from nanoengine.utils.math_utils import cdiv
from nanoengine.worker.cudagraph_dispatcher import (
    CudagraphDispatcher,
    default_capture_sizes,
    pad_decode_inputs,
)
from nanoengine.worker.cudagraph_runner import CUDAGraphRunner
from nanoengine.worker.input_batch import (
    CachedRequestState,
    LayerGroups,
    StepInputs,
    make_sampling_metadata,
    order_decodes_first,
    prepare_inputs,
)
from nanoengine.worker.kv_cache_spec import attention_spec, kv_cache_spec
from nanoengine.worker.kv_cache_tensors import (
    allocate_kv_caches,
    attention_layers,
    bind_shared_pages,
    private_states,
    release_states,
    state_layers,
)
from nanoengine.worker.kv_connector import create_connector_worker, kv_connector_output
from nanoengine.worker.prompt_logprobs import (
    PromptLogprobTargets,
    collect_prompt_logprobs,
    find_prompt_logprob_targets,
    take_finished_prompt_logprobs,
)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The profile run's dummy requests sample nothing, but a state needs parameters.
_GREEDY_PROFILE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class _PendingSample:
    """Logits computed by execute_model, waiting for sample_tokens."""

    req_ids: list[str]  # every scheduled request, batch order
    sampling_req_ids: list[str]  # those that sample this step, logits row order
    # [num_sampling_reqs + num_drafts, vocab_size] fp32: k + 1 rows for a
    # request with k drafts (chapter 9), one for the others.
    logits: torch.Tensor
    # prompt_logprobs (chapter 8): the prompt positions scored this step, if any,
    # and their logits [num_targets, vocab_size].
    prompt_targets: PromptLogprobTargets | None = None
    prompt_logits: torch.Tensor | None = None
    # Chapter 9: the drafts each sampling request verifies (parallel to
    # sampling_req_ids); empty lists, or none at all, without speculation.
    spec_token_ids: list[list[int]] = field(default_factory=list)
    # Chapter 9: a step of decodes only (one logits row per scheduled token) is
    # timed for the draft-length policy; None for a step with a prefill chunk.
    decode_rows: int | None = None
    started: float = 0.0

    @property
    def logits_req_ids(self) -> list[str]:
        """The request of every logits row."""
        drafts = self.spec_token_ids or [[] for _ in self.sampling_req_ids]
        return [rid for rid, d in zip(self.sampling_req_ids, drafts) for _ in range(len(d) + 1)]


class ModelRunner:
    """Owns the model, the KV cache tensors and the worker's request states."""

    def __init__(self, engine_config: EngineConfig, device: torch.device, rank: int = 0) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.device = device
        self.dtype = _TORCH_DTYPES[self.model_config.dtype]
        self.block_size = engine_config.cache_config.block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        # Speculative decoding (chapter 9): who drafts, and the drafts of the
        # last step until the engine core takes them (take_draft_token_ids).
        spec = engine_config.speculative_config
        self.drafter: NgramProposer | DraftModelProposer | None = None
        if spec is not None and spec.method == "ngram":
            self.drafter = NgramProposer(spec, engine_config.scheduler_config.max_model_len)
        elif spec is not None:
            self.drafter = DraftModelProposer(engine_config, device, self.dtype)
        self.rejection_sampler = RejectionSampler()
        self._draft_token_ids: DraftTokenIds | None = None
        # Which drafts are worth verifying (None: all of them, draft_length="fixed").
        self.draft_length = (DraftLengthPolicy(spec.num_speculative_tokens)
                             if spec is not None and spec.draft_length == "adaptive" else None)
        # Requests without a seed share this stream; seeded ones get their own.
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(self.model_config.seed)
        self._pending: _PendingSample | None = None
        # Every registered model class is an nn.Module with the CausalLM methods.
        self.model: nn.Module | None = None
        # Which KV cache groups the layers read: one full-attention group, plus
        # state groups for a hybrid model (set when the KV cache is bound).
        self.layer_groups = LayerGroups()
        # The worker half of a KV connector, when this engine is part of a P/D pair
        # (chapters 5 and 10); a tensor-parallel rank moves its own slice of the blocks.
        transfer = engine_config.kv_transfer_config
        self.kv_connector = create_connector_worker(transfer, rank) if transfer is not None else None
        self.attention_backend = resolve_backend_name(self.model_config.attention_backend, device, self.dtype)
        self.linear_backend = resolve_linear_backend(self.model_config.linear_backend, device, self.dtype)
        # CUDA graphs (chapter 7): decode only, on CUDA, with the capturable
        # Triton backend, unless enforce_eager. The dispatcher exists either way
        # so every step records its decision (chapter 7 prints them on a CPU).
        # Not for a hybrid model: its Gated DeltaNet layers pick state slots and
        # fresh-or-continuing states from metadata the graph buffers do not hold
        # (vLLM captures them with Mamba metadata of its own). Nor with several
        # tensor-parallel ranks: capturing their all-reduces is not built here
        # (vLLM captures NCCL's, and its own custom all-reduce).
        # Nor with speculative decoding (chapter 9): a verification batch is
        # one-token queries too, but the captured graphs were not recorded for
        # k + 1 logits rows per request (vLLM captures "uniform decode" steps
        # of 1 + num_speculative_tokens queries per request for that).
        sched = engine_config.scheduler_config
        self.max_blocks_per_req = cdiv(sched.max_model_len, self.block_size)
        self.dispatcher = CudagraphDispatcher(
            self.model_config.cudagraph_capture_sizes or default_capture_sizes(sched.max_num_seqs),
            self.max_blocks_per_req,
            enabled=device.type == "cuda"
            and not self.model_config.enforce_eager
            and not self.model_config.is_hybrid
            and engine_config.parallel_config.world_size == 1
            and engine_config.speculative_config is None
            and self.attention_backend == "triton",
        )
        self.cudagraph_runner: CUDAGraphRunner | None = None

    # ---- construction (chapter 6) ------------------------------------------

    def load_model(self) -> None:
        model = model_loader.get_model(
            self.model_config.model_path,
            self.model_config.hf_config,
            self.dtype,
            self.device,
            self.linear_backend,
            load_format=self.model_config.load_format,
            seed=self.model_config.seed,
            gguf_file=self.model_config.gguf_file,
        )
        assert isinstance(model, nn.Module), type(model)
        self.model = model
        set_attention_impl(self.get_model(), get_attention_impl(self.attention_backend))
        if self.attention_backend == "cpu":
            # The same C++ build carries the norm, RoPE and activation kernels.
            enable_cpu_kernels(self.get_model())
        if isinstance(self.drafter, DraftModelProposer):  # chapter 9: the draft is loaded (and measured) too
            self.drafter.load_model(self.linear_backend, self.attention_backend)

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.get_model().parameters())

    def get_kv_cache_spec(self) -> FullAttentionSpec | dict[int, KVCacheSpec]:
        """What the KV cache of this model is made of (chapter 6; ``worker/kv_cache_spec.py``)."""
        max_model_len = self.engine_config.scheduler_config.max_model_len
        spec = kv_cache_spec(self.get_model(), self.model_config, self.block_size, self.dtype, max_model_len)
        if isinstance(self.drafter, DraftModelProposer) and isinstance(spec, FullAttentionSpec):
            # Chapter 9: a draft model's KV lives in the same blocks, so each
            # block's bytes cover its layers too (hybrid models are refused).
            return replace(spec, num_layers=spec.num_layers + self.drafter.kv_cache_layers_needed(spec))
        return spec

    def _allocate_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """The target model's K/V tensors (``kv_cache_tensors.allocate_kv_caches``)."""
        spec = attention_spec(self.model_config, self.block_size, self.dtype)
        return allocate_kv_caches(spec, num_blocks, self.dtype, self.device)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache the engine decided on and bind it to the layers.

        One group (full attention only): a cache of its own per layer. Several
        groups (a hybrid model): shared page buffers, each layer viewing its
        own kind of page (``kv_cache_tensors.py``); the block size is then the
        unified one, which may exceed the configured ``block_size``.
        """
        if len(kv_cache_config.kv_cache_groups) == 1:
            self.kv_caches = self._allocate_kv_caches(kv_cache_config.num_blocks)
            bind_kv_cache(self.get_model(), self.kv_caches)
            if self.kv_connector is not None:
                self.kv_connector.register_kv_caches(self.kv_caches)
            if isinstance(self.drafter, DraftModelProposer):
                self.drafter.initialize_kv_cache(kv_cache_config.num_blocks, self.block_size)
            return
        self.layer_groups, self.kv_caches = bind_shared_pages(
            self.get_model(), kv_cache_config, self.dtype, self.device
        )
        self.block_size = kv_cache_config.block_size

    def capture_model(self) -> int:
        """Record the decode CUDA graphs (if enabled); returns the bytes they took."""
        if not self.dispatcher.enabled:
            return 0
        sizes = self.dispatcher.capture_sizes
        self.cudagraph_runner = CUDAGraphRunner(
            self._model(), sizes[-1], self.max_blocks_per_req, self.device
        )
        self.cudagraph_runner.capture(sizes)
        return self.cudagraph_runner.captured_bytes

    @torch.inference_mode()
    def profile_run(self) -> float:
        """One forward pass at the largest step the scheduler may send.

        The batch has ``max_num_batched_tokens`` tokens cut into prompts of at most
        ``max_model_len``, with a temporary KV cache just big enough for it, so the
        peak memory measured afterwards includes real attention activations.
        A hybrid model's state layers get one temporary slot per prompt.
        Returns the seconds it took.
        """
        sched = self.engine_config.scheduler_config
        module = self.get_model()
        num_state_layers = len(state_layers(module))
        has_states = num_state_layers > 0
        total = sched.max_num_batched_tokens
        lengths = [min(sched.max_model_len, total - start) for start in range(0, total, sched.max_model_len)]
        states: list[CachedRequestState] = []
        next_block = 0
        for i, length in enumerate(lengths):
            num_blocks = cdiv(length, self.block_size)
            states.append(
                CachedRequestState(
                    req_id=f"profile-{i}",
                    token_ids=[0] * length,
                    num_prompt_tokens=length,
                    sampling_params=_GREEDY_PROFILE_PARAMS,
                    block_ids=(list(range(next_block, next_block + num_blocks)),)
                    + (([i],) if has_states else ()),
                    num_computed_tokens=0,
                )
            )
            next_block += num_blocks
        bind_kv_cache(module, self._allocate_kv_caches(next_block))
        groups = LayerGroups(attention=(0,), states=(1,) if has_states else ())
        if has_states:
            bind_mamba_state(
                module, private_states(module, len(states), self.dtype, self.device), [0] * num_state_layers
            )
        start_time = time.perf_counter()
        inputs = prepare_inputs(states, lengths, self.block_size, self.device, groups)
        self._forward(inputs)
        elapsed = time.perf_counter() - start_time
        # Unbind the temporary cache so its memory goes back before the budget is
        # measured; initialize_kv_cache binds the real one afterwards.
        bind_kv_cache(module, [torch.empty(0) for _ in attention_layers(module)])
        release_states(module)
        return elapsed

    # ---- one step (chapter 7) ----------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's deltas to the worker's copy of each request."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            if self.draft_length is not None:
                self.draft_length.forget(req_id)
        # Preempted requests keep their state (and random stream) but lose their
        # blocks; they come back as "new" with a fresh block table.
        for new in scheduler_output.scheduled_new_reqs:
            previous = self.requests.get(new.req_id)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=previous.generator if previous else self._make_generator(new.sampling_params.seed),
                prompt_logprobs_sent=previous.prompt_logprobs_sent if previous else False,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, num_computed, num_outputs in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_output_tokens
        ):
            state = self.requests[req_id]
            for table, new_ids in zip(state.block_ids, new_blocks, strict=True):
                table.extend(new_ids)
            state.num_computed_tokens = num_computed
            # Async scheduling (chapter 7): a decode may be scheduled before the
            # scheduler has seen the token it consumes (an output placeholder).
            # That token is the one this runner sampled for the request last
            # step and appended to token_ids, so prepare_inputs reads it there.
            # The counts must agree, or the batch would be built from the wrong
            # tokens without any error.
            if state.num_output_tokens != num_outputs:
                raise RuntimeError(
                    f"{req_id!r}: the scheduler counts {num_outputs} output tokens (placeholders "
                    f"included), the worker holds {state.num_output_tokens}."
                )

    def _make_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the forward pass; return None and leave the logits for sample_tokens."""
        started = time.perf_counter()
        self._update_states(scheduler_output)
        metadata = scheduler_output.kv_connector_metadata
        if self.kv_connector is not None:
            self.kv_connector.wait_for_finished_requests(scheduler_output.finished_req_ids)
        if self.kv_connector is not None and metadata:
            # Loads go to a thread: their requests are blocked, others run now.
            self.kv_connector.start_load_kv(metadata)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._pending = None
            return ModelRunnerOutput([], [], kv_connector_output=self._kv_connector_output())
        spec = scheduler_output.scheduled_spec_decode_tokens
        req_ids = order_decodes_first(scheduler_output.num_scheduled_tokens, spec)
        states = [self.requests[rid] for rid in req_ids]
        num_scheduled = [scheduler_output.num_scheduled_tokens[rid] for rid in req_ids]
        drafts = [spec.get(rid, []) for rid in req_ids] if spec else None
        inputs = prepare_inputs(states, num_scheduled, self.block_size, self.device, self.layer_groups, drafts)
        first_rows = [0, *itertools.accumulate(num_scheduled)]  # each request's first hidden-state row
        targets = find_prompt_logprob_targets(states, num_scheduled, first_rows)
        logits = self._forward(inputs, None if targets is None else targets.hidden_rows)
        num_rows = len(inputs.logits_indices)
        self._pending = _PendingSample(
            req_ids,
            inputs.sampling_req_ids,
            logits[:num_rows],
            targets,
            logits[num_rows:],
            [spec.get(rid, []) for rid in inputs.sampling_req_ids] if spec else [],
            num_rows if num_rows == scheduler_output.total_num_scheduled_tokens else None,
            started,
        )
        if self.kv_connector is not None and metadata:
            self.kv_connector.wait_for_save(metadata)  # the forward pass just wrote the blocks
        # The scheduler already counted these tokens as computed (optimistically);
        # the worker's copy catches up now that their KV is really written.
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
        return None

    def _forward(self, inputs: StepInputs, prompt_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states for all tokens, logits only where needed.

        Returns [num_sampling_reqs + len(prompt_rows), vocab]: the rows that
        sample, then the hidden-state rows ``prompt_rows`` that score prompt
        tokens for prompt_logprobs (none in a normal step).
        """
        rows = inputs.logits_indices
        if prompt_rows is not None:
            rows = torch.cat([rows, prompt_rows.to(rows.device)])
        md = inputs.attn_metadata
        decision = self.dispatcher.dispatch(md.num_reqs, md.num_actual_tokens, md.block_table.shape[1])
        if decision.use_graph and self.cudagraph_runner is not None:
            padded = pad_decode_inputs(inputs, decision.padded_batch_size, self.max_blocks_per_req)
            # [padded, vocab]; the padding rows' logits are simply never indexed.
            return self.cudagraph_runner.replay(padded)[rows]
        model = self._model()
        hidden = model(inputs.input_ids, inputs.positions, inputs.attn_metadata)  # [num_tokens, hidden]
        return model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample a token for each request whose prompt is fully computed.

        With drafts to verify (chapter 9) the rejection sampler decides instead,
        and a request may emit several tokens; the proposer then drafts anew.
        """
        pending = self._pending
        if pending is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self._pending = None
        states = [self.requests[rid] for rid in pending.sampling_req_ids]
        logits = pending.logits
        if grammar_output is not None:
            logits = apply_grammar_bitmask(logits, pending.logits_req_ids, grammar_output)
        if pending.prompt_targets is not None and pending.prompt_logits is not None:
            collect_prompt_logprobs(self.requests, pending.prompt_targets, pending.prompt_logits)
        if any(pending.spec_token_ids):
            emitted, logprobs = self._verify_drafts(states, pending.spec_token_ids, logits)
        else:
            metadata = make_sampling_metadata(states, self.model_config.vocab_size, self.default_generator)
            sampler_output = self.sampler(logits, metadata)
            emitted = [[token] for token in sampler_output.sampled_token_ids.tolist()]
            logprobs = _logprobs_by_request(states, sampler_output.logprobs_tensors, list(range(len(states))))
        for state, tokens in zip(states, emitted):
            state.token_ids.extend(tokens)
        if self.draft_length is not None and pending.decode_rows is not None:
            self.draft_length.observe_step(pending.decode_rows, time.perf_counter() - pending.started)
        if self.drafter is not None:
            self._draft_token_ids = self.propose_draft_token_ids(states)
        by_req = {state.req_id: tokens for state, tokens in zip(states, emitted)}
        return ModelRunnerOutput(
            req_ids=pending.req_ids,
            sampled_token_ids=[by_req.get(rid, []) for rid in pending.req_ids],
            kv_connector_output=self._kv_connector_output(),
            logprobs=logprobs,
            prompt_logprobs_dict=take_finished_prompt_logprobs(states),
        )

    def _verify_drafts(
        self, states: list[CachedRequestState], drafts: list[list[int]], logits: torch.Tensor
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """Chapter 9: keep the drafts the target agrees with, and one token of its own.

        logits: [sum(k_i + 1), V]. Row j of request i is scored as if the
        request already held its first j drafts (a copy of its state with
        them appended), so penalties and ``min_tokens`` judge each position
        as plain decoding would. The worker's count of computed tokens moves
        back over the rejected drafts, as the scheduler's does.
        """
        row_states = [
            replace(state, token_ids=state.token_ids + request_drafts[:j])
            for state, request_drafts in zip(states, drafts)
            for j in range(len(request_drafts) + 1)
        ]
        metadata = make_sampling_metadata(row_states, self.model_config.vocab_size, self.default_generator)
        generators = [state.generator or self.default_generator for state in states]
        output = self.rejection_sampler(drafts, logits, metadata, generators)
        for state, request_drafts, tokens in zip(states, drafts, output.emitted_token_ids):
            state.num_computed_tokens -= len(request_drafts) + 1 - len(tokens)
            if self.draft_length is not None and request_drafts:
                self.draft_length.observe_verified(state.req_id, len(request_drafts), len(tokens) - 1)
        counts = [len(tokens) for tokens in output.emitted_token_ids]
        logprobs = _logprobs_by_request(states, output.logprobs_tensors, output.first_rows, counts)
        return output.emitted_token_ids, logprobs

    def propose_draft_token_ids(self, states: list[CachedRequestState]) -> DraftTokenIds:
        """Chapter 9: the drafts for each request that just sampled, from its tokens so far,
        cut to the drafts worth verifying next step."""
        if isinstance(self.drafter, NgramProposer):
            drafts = self.drafter.propose([state.token_ids for state in states])
        else:
            assert self.drafter is not None
            drafts = self.drafter.propose(states)
        req_ids = [state.req_id for state in states]
        return DraftTokenIds(req_ids, self._drafts_to_verify(req_ids, drafts))

    def _drafts_to_verify(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """vLLM's batch-size table first (if set), then the draft-length policy (if adaptive)."""
        spec = self.engine_config.speculative_config
        assert spec is not None
        if spec.num_speculative_tokens_per_batch_size is not None:
            cap = cap_for_batch(spec.num_speculative_tokens_per_batch_size, len(req_ids), spec.num_speculative_tokens)
            drafts = [draft[:cap] for draft in drafts]
        if self.draft_length is None:
            return drafts
        lengths = self.draft_length.choose(req_ids, [len(draft) for draft in drafts])
        return [draft[:length] for draft, length in zip(drafts, lengths)]

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Hand over the last step's drafts once (vLLM's ``take_draft_token_ids``)."""
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts

    def _kv_connector_output(self) -> KVConnectorOutput | None:
        return None if self.kv_connector is None else kv_connector_output(self.kv_connector)

    def shutdown(self) -> None:
        """Stop the KV connector's threads and sockets (the rest is freed with the process)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def get_model(self) -> nn.Module:
        """The loaded model (vLLM's ``GPUModelRunner.get_model``)."""
        if self.model is None:
            raise RuntimeError("load_model() must run before the model is used.")
        return self.model

    def _model(self) -> CausalLM:
        """The same model, seen through the methods the runner calls on it
        (``registry.CausalLM``; mypy has no type for "both")."""
        return cast(CausalLM, self.get_model())


def _logprobs_by_request(
    states: list[CachedRequestState],
    tensors: LogprobsTensors | None,
    first_rows: list[int],
    num_rows: list[int] | None = None,
) -> dict[str, LogprobsLists]:
    """``states[i]``'s tokens are scored in rows ``first_rows[i]`` onwards, one row
    per emitted token (``num_rows[i]``, default 1); each request keeps the top it asked for.
    """
    if tensors is None:
        return {}
    counts = num_rows or [1] * len(states)
    return {
        state.req_id: tensors.tolists(first, first + count, state.sampling_params.logprobs)
        for state, first, count in zip(states, first_rows, counts)
        if state.sampling_params.logprobs is not None
    }
