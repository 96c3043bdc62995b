"""Logprobs from the model's raw logits: log_softmax, the top candidates, the chosen token's rank.

Chapter 8 (online serving: the OpenAI API's ``logprobs``). They are computed
from the logits as the model produced them, before logit_bias, penalties,
temperature or any filter (vLLM's default ``logprobs_mode="raw_logprobs"``):
they describe the model, not the sampling options. The same code scores prompt
tokens (``prompt_logprobs``), with the prompt's next token as the chosen one.

vLLM 0.32 counterpart: ``Sampler.compute_logprobs`` and ``Sampler.gather_logprobs``
in ``vllm/v1/sample/sampler.py``; ``LogprobsTensors`` in ``vllm/v1/outputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoengine.logprobs import LogprobsLists


@dataclass
class LogprobsTensors:
    """Per row: the chosen token, then the top ``k``, with their logprobs."""

    logprob_token_ids: torch.Tensor  # [N, 1 + k] int64: chosen id, then top-1 .. top-k
    logprobs: torch.Tensor  # [N, 1 + k] float32, same order
    selected_token_ranks: torch.Tensor  # [N] int64: rank of the chosen id, 1 = most likely

    def tolists(self, start: int, end: int, num_logprobs: int) -> LogprobsLists:
        """Rows ``[start, end)`` with only the top ``num_logprobs`` candidates kept.

        The batch computes as many candidates as its most demanding row; each
        request gets back the number it asked for.
        """
        columns = slice(0, 1 + num_logprobs)
        return LogprobsLists(
            self.logprob_token_ids[start:end, columns].tolist(),
            self.logprobs[start:end, columns].tolist(),
            self.selected_token_ranks[start:end].tolist(),
        )


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 log probabilities."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """The chosen ``token_ids`` [N] and the ``num_logprobs`` most likely tokens of each row.

    A chosen token's rank counts the tokens at least as likely as it, itself
    included, so the argmax has rank 1 (ties share the worse rank, as in vLLM).
    """
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, k] each, most likely first
    chosen_ids = token_ids.to(torch.int64).unsqueeze(-1)  # [N, 1]
    chosen_logprobs = logprobs.gather(-1, chosen_ids)  # [N, 1]
    ranks = (logprobs >= chosen_logprobs).sum(dim=-1)  # [N]
    return LogprobsTensors(
        logprob_token_ids=torch.cat([chosen_ids, top_ids], dim=-1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=-1),
        selected_token_ranks=ranks,
    )


def gather_logprobs_reference(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """``gather_logprobs`` one row at a time with a full sort: the plain reference the
    tests hold the batched version to.
    """
    rows_ids: list[torch.Tensor] = []
    rows_logprobs: list[torch.Tensor] = []
    ranks: list[int] = []
    for row, token_id in zip(logprobs, token_ids.tolist()):
        order = row.argsort(descending=True)  # [V] token ids, most likely first
        top_ids = order[:num_logprobs]
        rows_ids.append(torch.cat([torch.tensor([token_id]), top_ids]))
        rows_logprobs.append(torch.cat([row[token_id : token_id + 1], row[top_ids]]))
        ranks.append(sum(1 for value in row.tolist() if value >= float(row[token_id])))
    return LogprobsTensors(torch.stack(rows_ids), torch.stack(rows_logprobs), torch.tensor(ranks))
