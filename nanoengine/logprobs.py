"""Logprobs as the user gets them, and as they travel from the worker to the front end.

Chapter 8 (online serving): the OpenAI API's ``logprobs`` and ``top_logprobs``
are these. The sampler computes them as tensors (``compute_logprobs`` and
``gather_logprobs`` in nanoengine/sample/sampler.py); the model runner turns
each request's rows into a ``LogprobsLists`` of plain lists, which crosses the
engine core's socket as msgpack; the front end (nanoengine/engine/logprobs.py)
makes them into one ``{token id: Logprob}`` dict per position. No torch here:
the scheduler handles these lists too.

vLLM 0.32 counterparts: ``vllm/logprobs.py`` (``Logprob``, ``PromptLogprobs``,
``SampleLogprobs``) and ``LogprobsLists`` in ``vllm/v1/outputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One candidate token at one position: its log probability, rank and text."""

    logprob: float
    # 1 = the model's most likely token at this position.
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token and the top candidates.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (no token precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class LogprobsLists:
    """Logprobs of consecutive positions of one request, as plain lists.

    Row ``i`` is one position: ``logprob_token_ids[i]`` is ``[chosen id, top-1 id,
    ..., top-k id]`` with the matching ``logprobs[i]``; the chosen id is the
    sampled token (or, for prompt logprobs, the prompt's next token), and
    ``sampled_token_ranks[i]`` its rank among the whole vocabulary.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]

    @classmethod
    def empty(cls) -> LogprobsLists:
        return cls([], [], [])

    def __len__(self) -> int:
        return len(self.sampled_token_ranks)

    def slice(self, start: int, end: int) -> LogprobsLists:
        """Rows ``[start, end)``: the positions whose tokens a request kept."""
        return LogprobsLists(
            self.logprob_token_ids[start:end], self.logprobs[start:end], self.sampled_token_ranks[start:end]
        )

    def extend(self, other: LogprobsLists) -> None:
        """Append ``other``'s rows (the next prefill chunk's prompt positions)."""
        self.logprob_token_ids.extend(other.logprob_token_ids)
        self.logprobs.extend(other.logprobs)
        self.sampled_token_ranks.extend(other.sampled_token_ranks)
