"""Per-row sampling options, gathered into tensors once per step.

Chapter 7. vLLM 0.32 counterpart: ``vllm/v1/sample/metadata.py`` (``SamplingMetadata``).

Row i of every tensor belongs to the i-th request that samples this step, so one
batch can mix greedy and random requests with different temperatures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanoengine.sample.penalties import PenaltyInputs


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float32; rows that are greedy hold 1.0
    top_p: torch.Tensor  # [num_rows] float32; 1.0 disables
    top_k: torch.Tensor  # [num_rows] int64; vocab_size disables
    greedy_mask: torch.Tensor  # [num_rows] bool; True = take argmax
    all_greedy: bool  # fast path: argmax only, no softmax at all
    no_top_p: bool  # skip the sort when no row asks for top-p
    no_top_k: bool
    # row -> generator for requests with a seed; rows without one share the
    # engine's default generator. A private generator per seeded request is what
    # makes its tokens independent of which neighbours share the batch.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # The shared stream for rows without a seed (None: torch's global generator).
    default_generator: torch.Generator | None = None
    # row -> token ids that must not be sampled yet (EOS/stop ids before min_tokens).
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # row -> {token id: bias} added to its logits (OpenAI logit_bias).
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    # None unless some row has a non-neutral penalty: the common case pays nothing.
    penalties: PenaltyInputs | None = None
    min_p: torch.Tensor | None = None  # [num_rows] float32; None: no row asks
    # The most top logprobs any row asks for; None: no row asks, no log_softmax.
    max_num_logprobs: int | None = None
