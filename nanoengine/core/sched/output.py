"""The two messages of one engine step: what to run, and what came out.

``Scheduler.schedule()`` builds a ``SchedulerOutput``; the worker's model runner
turns it into tensors and answers with a ``ModelRunnerOutput``, which
``Scheduler.update_from_output()`` folds back into the requests. Chapter 7 follows
one step through both. vLLM 0.32 counterparts: ``vllm/v1/core/sched/output.py``
(``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``, ``GrammarOutput``)
and ``vllm/v1/outputs.py`` (``ModelRunnerOutput``, ``KVConnectorOutput``).

The split between "new" and "cached" requests is the V1 trick for cheap steps:
the worker keeps its own copy of each running request, so a decode step only
sends the request id and any newly allocated block ids, not the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nanoengine.distributed.kv_transfer import KVConnectorMetadata
from nanoengine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Everything the worker needs the first time it sees a request.

    A request resumed after preemption is sent again as new (its KV was thrown
    away), with ``token_ids`` holding the prompt *and* the tokens generated so far.
    """

    req_id: str
    token_ids: list[int]  # prompt, plus earlier outputs for a resumed request
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # The request's whole block table so far, one list per KV cache group.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)


@dataclass
class CachedRequestData:
    """Running requests the worker already knows: only the deltas travel.
    The lists are parallel, one entry per request.
    """

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to each request's tables this step: one list per KV
    # cache group, in group order (empty lists = none).
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Output tokens each request has, counting those a step in flight is still
    # sampling (async scheduling's placeholders, chapter 7). The worker appends
    # every token it samples, so its copy holds exactly this many: the ones the
    # scheduler has not seen yet are inputs only the worker knows.
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan: which requests run and how many tokens each."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (a prefill chunk, or 1 for decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended since the last step: the worker drops its copy.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: the worker drops its copy too.
    preempted_req_ids: set[str] = field(default_factory=set)
    # KV blocks the worker's connector loads or saves this step (chapter 5).
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Speculative decoding (chapter 9): req_id -> the drafts scheduled after its
    # last known token. They are counted in num_scheduled_tokens (1 + drafts).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class GrammarOutput:
    """Token masks from structured output, applied by the sampler (chapter 5/7).

    ``bitmask`` is whatever the structured-output backend produces, one row per
    request in ``structured_output_request_ids`` order.
    """

    structured_output_request_ids: list[str]
    bitmask: Any
