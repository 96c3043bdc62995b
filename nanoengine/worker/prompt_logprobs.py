"""Prompt logprobs on the worker: which positions score a prompt token, collected over prefill chunks.

Chapter 8 (the OpenAI API's ``prompt_logprobs``, and ``echo``). An engine step
normally computes logits only where a token is sampled: the last position of
each request. A request with ``prompt_logprobs`` also needs them at its prompt
positions, since the logits at position ``p`` score prompt token ``p + 1``; only
such requests pay for those extra rows. Every prompt position must run through
the model, so these requests skip prefix-cache hits
(``Request.skip_reading_prefix_cache``, as in vLLM). The rows of each prefill
chunk are appended to the request's ``CachedRequestState``, and the whole list
leaves with the step that samples the first token, as in vLLM.

vLLM 0.32 counterpart: ``GPUModelRunner._get_prompt_logprobs_dict`` in
``vllm/v1/worker/gpu_model_runner.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoengine.logprobs import LogprobsLists
from nanoengine.sample.sampler import compute_logprobs, gather_logprobs
from nanoengine.worker.input_batch import CachedRequestState


@dataclass
class PromptLogprobTargets:
    """One step's prompt positions to score, grouped by request in batch order."""

    req_ids: list[str]
    first_positions: list[int]  # each request's first scored position this step
    num_rows: list[int]  # how many positions each request scores
    hidden_rows: torch.Tensor  # [total] int64: rows of this step's hidden states
    token_ids: torch.Tensor  # [total] int64: the prompt token each row scores


def wants_prompt_logprobs(state: CachedRequestState) -> bool:
    return state.sampling_params.prompt_logprobs is not None and not state.prompt_logprobs_sent


def find_prompt_logprob_targets(
    states: list[CachedRequestState], num_scheduled: list[int], query_start_loc: list[int]
) -> PromptLogprobTargets | None:
    """The positions this step computes that score a prompt token; None if there are none.

    Read before ``num_computed_tokens`` counts this step. ``query_start_loc[i]``
    is the first hidden-state row of ``states[i]``.
    """
    targets = PromptLogprobTargets([], [], [], torch.empty(0), torch.empty(0))
    hidden_rows: list[int] = []
    token_ids: list[int] = []
    for state, n, first_row in zip(states, num_scheduled, query_start_loc):
        start = state.num_computed_tokens
        # The last prompt position samples the first output token instead.
        end = min(start + n, state.num_prompt_tokens - 1)
        if not wants_prompt_logprobs(state) or end <= start:
            continue
        targets.req_ids.append(state.req_id)
        targets.first_positions.append(start)
        targets.num_rows.append(end - start)
        hidden_rows.extend(range(first_row, first_row + end - start))
        token_ids.extend(state.token_ids[start + 1 : end + 1])
    if not targets.req_ids:
        return None
    targets.hidden_rows = torch.tensor(hidden_rows, dtype=torch.int64)
    targets.token_ids = torch.tensor(token_ids, dtype=torch.int64)
    return targets


def collect_prompt_logprobs(
    requests: dict[str, CachedRequestState], targets: PromptLogprobTargets, logits: torch.Tensor
) -> None:
    """Score ``targets`` from their logits [total, V]; append each request's rows."""
    target_states = [requests[req_id] for req_id in targets.req_ids]
    most = max(_num_prompt_logprobs(state) for state in target_states)
    tensors = gather_logprobs(compute_logprobs(logits), most, targets.token_ids.to(logits.device))
    row = 0
    for state, first_position, n in zip(target_states, targets.first_positions, targets.num_rows):
        # A request resumed after preemption recomputes its prompt from position 0.
        if first_position == 0:
            state.prompt_logprobs_rows = LogprobsLists.empty()
        if len(state.prompt_logprobs_rows) != first_position:
            raise RuntimeError(
                f"{state.req_id!r}: prompt logprobs collected for {len(state.prompt_logprobs_rows)} positions, "
                f"but this chunk starts at position {first_position}."
            )
        state.prompt_logprobs_rows.extend(tensors.tolists(row, row + n, _num_prompt_logprobs(state)))
        row += n


def take_finished_prompt_logprobs(sampling_states: list[CachedRequestState]) -> dict[str, LogprobsLists]:
    """Collected rows of the requests whose prompt is done (they sample this step).

    Each request's rows leave once: a request resumed after preemption computes
    its prompt again, but its prompt logprobs were already sent.
    """
    finished: dict[str, LogprobsLists] = {}
    for state in sampling_states:
        if wants_prompt_logprobs(state):
            finished[state.req_id] = state.prompt_logprobs_rows
            state.prompt_logprobs_rows = LogprobsLists.empty()
            state.prompt_logprobs_sent = True
    return finished


def _num_prompt_logprobs(state: CachedRequestState) -> int:
    return state.sampling_params.prompt_logprobs or 0
