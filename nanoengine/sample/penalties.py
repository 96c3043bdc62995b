"""Repetition, frequency and presence penalties on one step's logits.

Chapter 8 (the OpenAI API's sampling options). Per row:

* repetition (Hugging Face / CTRL semantics): every token seen in the prompt
  or the output so far has its logit divided by the penalty if positive and
  multiplied by it otherwise, so a penalty above 1 always makes it less likely;
* frequency (OpenAI): ``logit -= frequency_penalty * count`` for each token, by
  how often it occurs in the output so far (the prompt does not count);
* presence (OpenAI): ``logit -= presence_penalty`` once for every token that
  occurs in the output at all.

The neutral values (1, 0, 0) leave a row's logits exactly as they were.
vLLM 0.32 counterpart: ``vllm/v1/sample/ops/penalties.py`` (``apply_all_penalties``)
and ``apply_penalties`` in ``vllm/model_executor/layers/utils.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass
class PenaltyInputs:
    """What the penalties read, one row per sampling request.

    Token lists are padded to a rectangle with ``vocab_size``, an id no real
    token has: it lands in an extra count column that is then dropped.
    """

    prompt_token_ids: torch.Tensor  # [N, max_prompt_len] int64
    output_token_ids: torch.Tensor  # [N, max_output_len] int64
    presence_penalties: torch.Tensor  # [N] float32, 0 = off
    frequency_penalties: torch.Tensor  # [N] float32, 0 = off
    repetition_penalties: torch.Tensor  # [N] float32, 1 = off


def pad_token_ids(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    """Ragged token lists -> [N, longest] int64, short rows filled with ``pad_id``."""
    width = max((len(row) for row in rows), default=0)
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.int64).reshape(
        len(rows), width
    )


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] padded ids -> [N, vocab_size] occurrences of each token in each row."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]  # drop the padding id's column


def apply_penalties(logits: torch.Tensor, inputs: PenaltyInputs) -> torch.Tensor:
    """A penalized copy of logits [N, V], all rows at once."""
    vocab_size = logits.shape[-1]
    device = logits.device
    output_counts = token_counts(inputs.output_token_ids.to(device), vocab_size)  # [N, V]
    in_output = output_counts > 0
    seen = in_output | (token_counts(inputs.prompt_token_ids.to(device), vocab_size) > 0)
    repetition = inputs.repetition_penalties.to(device=device, dtype=logits.dtype).unsqueeze(-1)  # [N, 1]
    # [N, V]: the row's penalty where the token was seen, 1.0 (no change) elsewhere.
    factor = torch.where(seen, repetition, torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    frequency = inputs.frequency_penalties.to(device=device, dtype=logits.dtype).unsqueeze(-1)
    presence = inputs.presence_penalties.to(device=device, dtype=logits.dtype).unsqueeze(-1)
    return logits - frequency * output_counts.to(logits.dtype) - presence * in_output.to(logits.dtype)


def apply_penalties_reference(logits: torch.Tensor, inputs: PenaltyInputs) -> torch.Tensor:
    """``apply_penalties`` one row and one token at a time, as the definitions read."""
    vocab_size = logits.shape[-1]
    result = logits.clone()
    for row in range(logits.shape[0]):
        prompt = [t for t in inputs.prompt_token_ids[row].tolist() if t != vocab_size]
        output = [t for t in inputs.output_token_ids[row].tolist() if t != vocab_size]
        repetition = float(inputs.repetition_penalties[row])
        for token in set(prompt) | set(output):
            value = float(result[row, token])
            result[row, token] = value / repetition if value > 0 else value * repetition
        for token, count in Counter(output).items():
            result[row, token] -= float(inputs.frequency_penalties[row]) * count
            result[row, token] -= float(inputs.presence_penalties[row])
    return result
