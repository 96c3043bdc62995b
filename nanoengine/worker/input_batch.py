"""The worker's own copy of each running request, and one step's flattened inputs.

Chapter 7 (``generate(...)``) follows a SchedulerOutput through here: the model
runner keeps a ``CachedRequestState`` per request (so a decode step needs only
ids and new blocks), and ``prepare_inputs`` flattens all scheduled tokens of all
requests into one batch with positions, slot mapping, block tables and query
start offsets -- the data paged attention needs.
vLLM 0.32 counterpart: ``vllm/v1/worker/gpu_input_batch.py`` (``CachedRequestState``,
``InputBatch``) and ``GPUModelRunner._prepare_inputs`` in
``vllm/v1/worker/gpu_model_runner.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.logprobs import LogprobsLists
from nanoengine.sample.metadata import SamplingMetadata
from nanoengine.sample.penalties import PenaltyInputs, pad_token_ids
from nanoengine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker remembers about one request between steps."""

    req_id: str
    # Prompt, then every token this worker sampled -- under async scheduling
    # (chapter 7) including the latest, which the scheduler has not seen yet
    # and schedules as a placeholder: the next decode reads its input here.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # One block table per KV cache group, in group order (vLLM's shape).
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # A private random stream for seeded requests, kept across preemption so a
    # resumed request continues the same stream instead of restarting it.
    generator: torch.Generator | None = None
    # prompt_logprobs (chapter 8, worker/prompt_logprobs.py): the rows scored by
    # the prefill chunks so far, and whether they were sent. Like the generator,
    # the flag outlives preemption: a resumed request must not send them again.
    prompt_logprobs_rows: LogprobsLists = field(default_factory=LogprobsLists.empty)
    prompt_logprobs_sent: bool = False
    # Chapter 9, with a draft model: how many of token_ids the draft model has
    # written KV for. A request sent anew (resumed after preemption) gets a
    # fresh state, so its draft KV is rebuilt from the first token.
    num_draft_computed_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """What the penalties count: every token this worker sampled, the latest included."""
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class StepInputs:
    """One step's model inputs, all on the device, plus bookkeeping for sampling."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    # Rows of the hidden states whose logits are needed: the last scheduled token
    # of each request that reaches the end of its known tokens this step, and
    # (chapter 9) the position before each of its drafts: k + 1 rows for k drafts.
    logits_indices: torch.Tensor  # [num_sampling_reqs + num_drafts] int64
    sampling_req_ids: list[str] = field(default_factory=list)


def order_decodes_first(
    num_scheduled_tokens: dict[str, int], spec_decode_tokens: dict[str, list[int]] | None = None
) -> list[str]:
    """Decodes first, then prefills, each group in scheduler order.

    A decode is one query token, or (chapter 9) one plus the drafts it
    verifies: ``prepare_inputs`` splits a verification into one-token decode
    queries. The attention backend can then run all decodes as one uniform
    batch; vLLM's ``reorder_batch`` makes the same promise to its backends
    (its threshold is ``1 + num_speculative_tokens`` query tokens).
    """
    spec = spec_decode_tokens or {}
    decodes = [rid for rid, n in num_scheduled_tokens.items() if n == 1 + len(spec.get(rid, ()))]
    prefills = [rid for rid, n in num_scheduled_tokens.items() if n != 1 + len(spec.get(rid, ()))]
    return decodes + prefills


def compute_slot_mapping(
    block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The flat KV-cache slot of every scheduled token.

    Token t belongs to request ``req_indices[t]`` and sits at ``positions[t]`` in
    that request's sequence. Its logical block is ``position // block_size``; the
    block table turns that into a physical block id, and the slot is
    ``block_id * block_size + position % block_size``.
    """
    # [num_tokens] physical block id of each token
    block_ids = block_table[req_indices, positions // block_size].to(torch.int64)
    return block_ids * block_size + positions % block_size


def build_block_table(states: list[CachedRequestState], kv_cache_group_id: int) -> torch.Tensor:
    """[num_reqs, max_blocks] int32: group ``kv_cache_group_id``'s block table of
    each request, padded with 0 (padding is never read: every query's keys stop
    at its own seq_len).
    """
    tables = [state.block_ids[kv_cache_group_id] for state in states]
    width = max((len(ids) for ids in tables), default=0)
    table = torch.zeros((len(states), max(width, 1)), dtype=torch.int32)
    for row, ids in enumerate(tables):
        if ids:
            table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return table


@dataclass(frozen=True)
class LayerGroups:
    """Which KV cache groups a model's layers read (chapter 4: hybrid models).

    ``attention``: the groups that keep K and V (full attention, sliding
    windows), whose block tables and slot mappings paged attention reads, in
    ``AttentionMetadata.for_kv_group`` order. ``states``: the state groups of a
    hybrid model's linear-attention layers, in ``state_indices`` row order
    (none for a model with attention only).
    """

    attention: tuple[int, ...] = (0,)
    states: tuple[int, ...] = ()


def state_slots(states: list[CachedRequestState], state_groups: tuple[int, ...]) -> torch.Tensor | None:
    """[num_state_groups, num_reqs] int64: each request's state block in each state group.

    A state group gives a request one block whatever its length (the
    coordinator's state manager), so its table's last entry is the slot.
    """
    if not state_groups:
        return None
    return torch.tensor([[s.block_ids[g][-1] for s in states] for g in state_groups], dtype=torch.int64)


def prepare_inputs(
    states: list[CachedRequestState],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
    groups: LayerGroups,
    spec_token_ids: list[list[int]] | None = None,
) -> StepInputs:
    """Flatten one step: for request i, tokens ``[computed_i, computed_i + n_i)``.

    ``states`` and ``num_scheduled`` are parallel and already in batch order;
    ``num_computed_tokens`` is read *before* this step's tokens are counted.
    ``spec_token_ids`` (chapter 9, parallel too) are drafts scheduled after a
    request's known tokens: they are inputs like any other token, and each
    needs the logits of the position before it, to be verified. For attention
    such a request is ``k + 1`` decode queries, query ``j`` reading the keys
    up to its own position: every K and V of the step is written before any
    is read, so this is exact, and the decode kernel (cheaper than the prefill
    kernel for so few queries) runs them with the plain decodes.
    The block tables and slot mappings come from the K/V groups
    ``groups.attention`` (the first one's in ``block_table`` and
    ``slot_mapping``); a hybrid model's state layers get their slots from
    ``groups.states``.
    """
    query_start_loc = [0]
    seq_lens: list[int] = []
    input_ids: list[int] = []
    positions: list[int] = []
    req_indices: list[int] = []
    logits_indices: list[int] = []
    sampling_req_ids: list[str] = []
    # The request of each attention query (one per request, one per token of a verification).
    query_rows: list[int] = []
    drafts_per_row = spec_token_ids if spec_token_ids is not None else [[] for _ in states]
    for row, (state, n, drafts) in enumerate(zip(states, num_scheduled, drafts_per_row)):
        start = state.num_computed_tokens
        tokens = state.token_ids + drafts if drafts else state.token_ids
        input_ids.extend(tokens[start : start + n])
        positions.extend(range(start, start + n))
        req_indices.extend([row] * n)
        # A verification's tokens attend as separate decodes; others as one query.
        query_ends = range(start + 1, start + n + 1) if drafts else (start + n,)
        for end in query_ends:
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + (1 if drafts else n))
            query_rows.append(row)
        # A chunk that stops short of the known tokens is a partial prefill:
        # its logits would predict a token we already have, so none are taken.
        if start + n == len(tokens):
            last = query_start_loc[-1] - 1
            logits_indices.extend(range(last - len(drafts), last + 1))
            sampling_req_ids.append(state.req_id)

    slots = state_slots(states, groups.states)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    req_indices_t = torch.tensor(req_indices, dtype=torch.int64)
    block_tables, slot_mappings = [], []
    for group in groups.attention:
        table = build_block_table(states, group)
        slot_mappings.append(compute_slot_mapping(table, req_indices_t, positions_t, block_size).to(device))
        if len(query_rows) > len(states):  # verifications: one block-table row per query
            table = table[torch.tensor(query_rows)]
        block_tables.append(table.to(device))
    # Requests arrive decodes first, so the decodes are the leading run of one-token queries.
    query_lens = [end - begin for begin, end in itertools.pairwise(query_start_loc)]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    attn_metadata = AttentionMetadata(
        num_actual_tokens=len(input_ids),
        num_reqs=len(query_rows),
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_tables[0],
        slot_mapping=slot_mappings[0],
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        state_indices=None if slots is None else slots.to(device),
        kv_group_block_tables=tuple(block_tables) if len(block_tables) > 1 else (),
        kv_group_slot_mappings=tuple(slot_mappings) if len(slot_mappings) > 1 else (),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=positions_t.to(device),
        attn_metadata=attn_metadata,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sampling_req_ids=sampling_req_ids,
    )


def make_sampling_metadata(
    states: list[CachedRequestState], vocab: int, default_generator: torch.Generator | None
) -> SamplingMetadata:
    """Gather per-request options into per-row tensors for the sampler: row i is ``states[i]``.

    A request verifying drafts (chapter 9) has one row per scored position:
    the model runner passes copies of its state extended by the drafts before
    each position, so penalties and ``min_tokens`` see the tokens that would
    precede it. (vLLM's ``InputBatch._make_sampling_metadata``.)
    """
    params = [s.sampling_params for s in states]
    greedy = [p.greedy for p in params]
    return SamplingMetadata(
        temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
        top_p=torch.tensor([p.top_p for p in params]),
        top_k=torch.tensor([vocab if p.top_k < 1 else p.top_k for p in params]),
        greedy_mask=torch.tensor(greedy, dtype=torch.bool),
        all_greedy=all(greedy),
        no_top_p=all(p.top_p >= 1.0 for p in params),
        no_top_k=all(p.top_k < 1 for p in params),
        generators={row: s.generator for row, s in enumerate(states) if s.generator is not None},
        # min_tokens: the stop ids (EOS included) are forbidden until enough
        # tokens exist, so the request cannot end too early.
        banned_token_ids={
            row: sorted(s.sampling_params.all_stop_token_ids)
            for row, s in enumerate(states)
            if s.num_output_tokens < s.sampling_params.min_tokens and s.sampling_params.all_stop_token_ids
        },
        default_generator=default_generator,
        logit_bias={row: p.logit_bias for row, p in enumerate(params) if p.logit_bias},
        penalties=_penalty_inputs(states, vocab),
        min_p=torch.tensor([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None,
        max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
    )


def _penalty_inputs(states: list[CachedRequestState], vocab_size: int) -> PenaltyInputs | None:
    """The penalties' per-row inputs, or None when every row's penalties are neutral."""
    params = [s.sampling_params for s in states]
    if all(_has_neutral_penalties(p) for p in params):
        return None
    return PenaltyInputs(
        prompt_token_ids=pad_token_ids([s.prompt_token_ids for s in states], pad_id=vocab_size),
        output_token_ids=pad_token_ids([s.output_token_ids for s in states], pad_id=vocab_size),
        presence_penalties=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
    )


def _has_neutral_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
    )
